"""Whether kvtrace's optional native core (``kvtrace/_native.c``) is here and on.

``core`` is the ``kvtrace._native`` module, or None: not built (the install found no C
compiler; ``setup.py`` makes the build optional) or turned off with ``KVTRACE_NATIVE=0``. Every
native part has a Python twin, the reference, used when ``core`` is None: the probes' hot
wrappers (``probes/cache_probes.py``), a capture's per-step hand-over (``capture/hook.py``)
and the writing of record frames (``traceio.py``). Each reads ``core`` when it is set up, so
tests can switch it off around one capture.
"""

from __future__ import annotations

import os

try:
    from kvtrace import _native as built
except ImportError:
    built = None

core = built if os.environ.get("KVTRACE_NATIVE") != "0" else None
