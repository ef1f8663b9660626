"""Whether kvtrace's optional native core (``kvtrace._native``, C sources in ``csrc/``) is here
and on.

``core`` is the ``kvtrace._native`` module, or None: not built (the install found no C
compiler; ``setup.py`` makes the build optional), turned off with ``KVTRACE_NATIVE=0``, or
unusable (``configure`` refused the record types; ``problem`` says why). Every native part has
a Python twin, the reference, used when ``core`` is None: the probes' hot wrappers
(``probes/wrappers.py``; C in ``csrc/probes.c``), a capture's per-step hand-over
(``capture/step_buffer.py``; ``csrc/step_buffer.c``) and the writing of record frames
(``traceio/writer.py``; ``csrc/frames.c``). Each reads ``core`` when it is set up, so tests can switch it off around one
capture.
"""

from __future__ import annotations

import os
from typing import Any

try:
    from kvtrace import _native as built
except ImportError:
    built = None

core = built if os.environ.get("KVTRACE_NATIVE") != "0" else None
problem: str | None = None  # why the built core is off although it was built and not turned off


def configure(*record_types_and_constants: Any) -> None:
    """Give the built core the record types (``kvtrace.events``) and constants its probe fast
    paths use; it reads each type's field order from the type. One it cannot build by field
    name turns the core off (the Python twins run) and says why in ``problem``: this runs
    inside vLLM, so it never raises."""
    global core, problem
    if built is None:
        return
    try:
        built.configure(*record_types_and_constants)
    except Exception as error:  # whatever it is, the Python twins still work
        core, problem = None, (
            f"kvtrace's native core is off: {error}. The probes run as pure Python (slower); "
            "kvtrace/events.py and csrc/kvtrace_native.h must name the same record fields.")
