"""The operator side of capture: find the engine core(s), get kvtrace's hook into them, arm it.

Ways in, best first (``--method auto`` tries them in this order):

* ``plugin`` - kvtrace is installed in vLLM's environment, so its ``vllm.general_plugins`` entry
  point already started a dormant control server in each engine core. No ptrace needed.
* ``remote-exec`` - PEP 768 ``sys.remote_exec`` runs a bootstrap in the target when both sides
  run Python >= 3.14.
* ``ptrace``, ``gdb`` or ``lldb`` - for older Pythons, the first that passes its canary
  (``canary.py``: the same injection on a throw-away process of the engine's interpreter, which
  on some hosts gdb kills). ``ptrace``, kvtrace's own injector (``ptrace.py``), holds the main
  thread alone for milliseconds; a debugger stops every thread for seconds. Each schedules the
  bootstrap as a pending call, or runs it directly in a parked main thread outside the
  allocator (``inject.py``, ``debuggers.py``). The bootstrap is idempotent, so running twice
  is harmless.

Every way in ends the same: the bootstrap starts the control server (``kvtrace.capture.control``)
and the CLI arms the capture over its socket. The bootstrap reports its own failure (e.g. kvtrace
not importable in the target's Python) through a side-channel file next to the socket.

The bootstrap and its report live in the target user's private runtime directory, which is
checked first (``safe_paths``), before a canary or a debugger runs: one another user made or
opened is refused, never written to, and never a reason to fall back from the plugin to a
debugger. Both files are reached only through that directory's descriptor, without following
links; as root, the bootstrap is handed to the target's user on its descriptor.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kvtrace.attach_methods import INJECTORS
from kvtrace.capture import canary, control
from kvtrace.capture.debuggers import DEBUGGERS
from kvtrace.capture.inject import (  # noqa: F401 (is_alive and Bootstrap: the CLI's, the tests')
    BOOTSTRAP_WAIT_S,
    AttachError,
    Bootstrap,
    InjectionError,
    is_alive,
    run_in_main_thread,
)
from kvtrace.capture.messages import (
    ArmRequest,
    CaptureOptions,
    CaptureStatus,
    DisarmRequest,
    PingRequest,
    StatusRequest,
    options_from,
)
from kvtrace.capture.safe_paths import check_not_in_runtime_dir
from kvtrace.capture.stalls import StallSampler

ENGINE_CORE_TITLE = "::EngineCore"


@dataclass(frozen=True)
class WayIn:
    """How kvtrace's hook got into an engine (``method``), and why that way."""

    method: str
    why: str

    def __str__(self) -> str:
        return f"{self.method} ({self.why})"


@dataclass(frozen=True)
class Target:
    pid: int
    title: str
    uid: int

    @property
    def is_engine_core(self) -> bool:
        return ENGINE_CORE_TITLE in self.title

    @property
    def rank_suffix(self) -> str:
        """``dp0`` for ``VLLM::EngineCore_DP0``; empty for a single engine core."""
        _, _, tail = self.title.partition(ENGINE_CORE_TITLE)
        return tail.lstrip("_").lower()


def describe(pid: int) -> Target:
    """Read a process's title, owner and parent; diagnose a missing or foreign process."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        raise AttachError(f"no process with pid {pid}",
                          "Check the pid: `pgrep -af EngineCore` lists vLLM engine cores.") from None
    except PermissionError:
        raise AttachError(f"pid {pid} belongs to another user",
                          "Run kvtrace as the engine's user, or as root.") from None
    try:
        title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError as error:
        raise AttachError(f"cannot read /proc/{pid}: {error.strerror}",
                          "The process may have exited; check the pid.") from None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    uid = int(fields["Uid"].split()[0])
    if uid != os.getuid() and os.getuid() != 0:
        raise AttachError(f"pid {pid} belongs to another user (uid {uid})",
                          "Run kvtrace as the engine's user, or as root.")
    return Target(pid, title, uid)


def _children(pid: int) -> list[int]:
    children = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            children.extend(int(c) for c in task.read_text().split())
        except OSError:
            continue
    return children


def find_engine_cores(pid: int) -> list[Target]:
    """The engine core(s) behind ``pid``: itself, or its descendants titled ``VLLM::EngineCore``
    (an API-server pid has one per data-parallel rank)."""
    target = describe(pid)
    if target.is_engine_core:
        return [target]
    found, pending = [], _children(pid)
    while pending:
        child = pending.pop(0)
        try:
            info = describe(child)
        except AttachError:
            continue
        if info.is_engine_core:
            found.append(info)
        pending.extend(_children(child))
    if not found:
        raise AttachError(
            f"pid {pid} ({target.title or 'no title'}) is not a vLLM engine core and has none "
            "among its child processes",
            "Pass the vLLM API-server pid or an engine-core pid (`pgrep -af EngineCore`).")
    return sorted(found, key=lambda t: t.title)


# --- getting the hook in -----------------------------------------------------------------------


PING_TIMEOUT_S = 30.0  # how long a control server that took the connection has to answer


def _control_up(target: Target) -> bool:
    """Whether kvtrace's control server answers in ``target``. An answer that is an error
    (another kvtrace version, a refusal) is raised, not taken for "not there"; so is a server
    that took the connection and did not answer (``ControlSilentError``): it is there, and a
    debugger must not be sent into a busy engine that has it."""
    try:
        control.request(target.pid, PingRequest(), uid=target.uid, timeout_s=PING_TIMEOUT_S)
    except control.ControlSilentError:
        raise
    except control.ControlChannelError:
        return False
    return True


def _wait_for_bootstrap(target: Target, bootstrap: Bootstrap, timeout_s: float) -> bool:
    """True once the control server answers; raise what the bootstrap reported if it failed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        report = bootstrap.failure()
        if report is not None:
            _raise_bootstrap_error(target, report)
        if _control_up(target):
            return True
        if not is_alive(target.pid):
            raise InjectionError(f"pid {target.pid} exited while kvtrace was attaching",
                                 "Check the engine's log.")
        time.sleep(0.1)
    return False


def _raise_bootstrap_error(target: Target, report: dict) -> None:
    if report.get("kind") == "ModuleNotFoundError" and "kvtrace" in report.get("error", ""):
        try:
            executable = os.readlink(f"/proc/{target.pid}/exe")
        except OSError:
            executable = report.get("executable") or "unknown"
        raise AttachError(
            f"kvtrace is not importable in pid {target.pid}'s Python ({executable})",
            f"Install it into vLLM's environment ({executable} -m pip install {_kvtrace_source()}) "
            "and attach again.")
    raise AttachError(f"kvtrace failed to start in pid {target.pid}: "
                      f"{report.get('kind')}: {report.get('error')}",
                      "Run with -v to see the target's traceback.")


def _kvtrace_source() -> str:
    """Where this kvtrace is installed from (a checkout, for an editable install)."""
    import kvtrace

    return str(Path(kvtrace.__file__).resolve().parent.parent)


def _inject_remote_exec(target: Target, bootstrap: Bootstrap) -> None:
    remote_exec = getattr(sys, "remote_exec", None)
    if remote_exec is None:
        raise AttachError(
            f"--method remote-exec needs Python 3.14 or newer; kvtrace runs on "
            f"{sys.version.split()[0]}",
            "Use --method lldb or --method gdb, or the plugin (install kvtrace in vLLM's "
            "environment).")
    try:
        remote_exec(target.pid, str(bootstrap.script))
    except (OSError, RuntimeError) as error:
        raise AttachError(f"sys.remote_exec into pid {target.pid} failed: {error}",
                          "The target must run Python >= 3.14 and allow ptrace.") from None
    if not _wait_for_bootstrap(target, bootstrap, BOOTSTRAP_WAIT_S):
        raise AttachError(f"pid {target.pid} did not run the injected bootstrap",
                          "sys.remote_exec runs only when the target's main thread runs Python; "
                          "retry while the engine is serving, or use the plugin.")


def ensure_hook(target: Target, method: str, log: Callable[[str], None]) -> WayIn:
    """Make sure kvtrace's control server runs in ``target``; the way it got there, and why.
    A runtime directory or socket that fails its checks is an error here, not a reason to try
    the next way in; so is a debugger that failed its canary, unless ``method`` is auto."""
    if _control_up(target):
        if method in ("auto", "plugin"):
            return WayIn("plugin", f"kvtrace's plugin answered in pid {target.pid}")
        return WayIn("already present", "kvtrace's control server already answered; nothing "
                                        "was injected")
    if method == "plugin":
        raise AttachError(
            f"no kvtrace plugin is listening in pid {target.pid}",
            "Install kvtrace into vLLM's environment and restart vLLM (the plugin loads at "
            "start-up), or attach with --method lldb or --method gdb.")
    bootstrap = Bootstrap(target)  # its directory is checked before anything runs
    try:
        if method == "remote-exec" or (method == "auto" and hasattr(sys, "remote_exec")):
            bootstrap.write()
            _inject_remote_exec(target, bootstrap)
            return WayIn("remote-exec", "--method remote-exec" if method == "remote-exec" else
                         f"no kvtrace plugin answered in pid {target.pid}; Python "
                         f"{sys.version.split()[0]} has sys.remote_exec")
        debugger, why = _proven_debugger(target, method, log)
        bootstrap.write()
        with StallSampler(target.pid) as sampler:
            how = run_in_main_thread(
                debugger, target.pid, bootstrap.run_string,
                lambda seconds: _wait_for_bootstrap(target, bootstrap, seconds), log)
        return WayIn(debugger.name, f"{why}; the bootstrap ran by a {how}; "
                                    f"{sampler.stalls.describe()}")
    finally:
        bootstrap.close()


def _proven_debugger(target: Target, method: str, log: Callable[[str], None]):
    """The debugger to inject with, once it passed its canary, and why it was chosen: the one
    ``method`` names, or for auto the first of gdb and lldb that passes."""
    if method in DEBUGGERS:
        debugger = DEBUGGERS[method].find()
        verdict = canary.prove(debugger, target, log)
        if not verdict.passed:
            raise AttachError(f"{verdict.describe(debugger)}; kvtrace did not touch pid "
                              f"{target.pid}", OTHER_WAYS_IN[method])
        return debugger, f"--method {method}; {verdict.describe(debugger)}"
    reasons = []
    for name in INJECTORS:
        try:
            debugger = DEBUGGERS[name].find()
            verdict = canary.prove(debugger, target, log)
        except AttachError as error:
            reasons.append(f"{name}: {error}")
            continue
        reasons.append(verdict.describe(debugger))
        if verdict.passed:
            return debugger, (f"no kvtrace plugin answered in pid {target.pid}; Python "
                              f"{sys.version.split()[0]} has no sys.remote_exec; "
                              + "; ".join(reasons))
    raise AttachError(f"no debugger can safely inject here ({'; '.join(reasons)}); kvtrace did "
                      f"not touch pid {target.pid}", OTHER_WAYS_IN["auto"])


OTHER_WAYS_IN = {
    "ptrace": "Use --method lldb or --method gdb (each stops the engine for seconds), or the "
              "plugin (install kvtrace into vLLM's environment and restart vLLM).",
    "gdb": "Use --method lldb (apt-get install lldb), the plugin (install kvtrace into vLLM's "
           "environment and restart vLLM), or a newer gdb.",
    "lldb": "Use --method gdb, the plugin (install kvtrace into vLLM's environment and restart "
            "vLLM), or a newer lldb.",
    "auto": "Install kvtrace into vLLM's environment and restart vLLM (its plugin needs no "
            "debugger), or install lldb (apt-get install lldb) or a newer gdb.",
}


def arm(target: Target, options: CaptureOptions | dict) -> control.Lease:
    """Start capturing in ``target`` (options: a Struct or a dict of its fields, checked here
    and again by the engine). The capture lasts as long as the returned lease is held: close
    it after disarming (this process's end closes it too, and the engine then disarms)."""
    options = options_from(options)
    check_not_in_runtime_dir(options.path, target.uid)
    return control.Lease.take(target.pid, ArmRequest(options), uid=target.uid)


def status(target: Target) -> CaptureStatus:
    return control.request(target.pid, StatusRequest(), uid=target.uid)


def disarm(target: Target) -> CaptureStatus:
    return control.request(target.pid, DisarmRequest(), uid=target.uid)
