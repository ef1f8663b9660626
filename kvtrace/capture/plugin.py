"""kvtrace's vLLM plugin (entry point ``vllm.general_plugins``): a dormant capture hook.

vLLM calls ``register()`` in each of its processes as they start (``load_general_plugins``).
In an engine-core process (title ``VLLM::EngineCore...``) it starts kvtrace's private control
server and patches nothing: probes are armed only when ``kvtrace capture`` asks over the socket
(or on SIGUSR1). Elsewhere it does nothing. ``KVTRACE_PLUGIN=0`` disables it;
``KVTRACE_PLUGIN=force`` starts it in any process (an in-process ``LLM`` engine has no title).
It never raises into vLLM: a failure (e.g. a runtime directory another user made, which it
refuses) is one line on stderr naming the path, and ``kvtrace capture`` refuses that directory
too rather than falling back to another way in.
"""

from __future__ import annotations

import os
import sys

ENGINE_CORE_TITLE = "::EngineCore"


def register() -> None:
    mode = os.environ.get("KVTRACE_PLUGIN", "1")
    if mode == "0":
        return
    try:
        from kvtrace.capture.control import start_control_server
        from kvtrace.capture.live_engine import process_title

        if mode != "force" and ENGINE_CORE_TITLE not in process_title():
            return
        start_control_server()
    except Exception as error:  # noqa: BLE001 - a plugin must never break vLLM's start-up
        hint = getattr(error, "hint", "")
        print(f"kvtrace: plugin disabled in pid {os.getpid()}: {error}"
              + (f" ({hint})" if hint else ""), file=sys.stderr)
