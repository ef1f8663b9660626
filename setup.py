"""Only kvtrace's optional C parts live here; everything else is in pyproject.toml.

Their sources are in csrc/: the native probe core (one file per part, as their Python twins are
split; see csrc/kvtrace_native.h), the model replay backend's core (csrc/model_*.c, the twin of
kvtrace/replay/model/; see csrc/model_parts.h) and the streaming pass of load and why
(csrc/forensics_*.c, the twin of kvtrace/analysis/attributor.py and of the cache entries' SQL;
see csrc/forensics.h); csrc/containers.h holds the arrays and hash map the last two share.
``optional=True``: where no C compiler or Python headers are found the build warns and goes on,
and the pure-Python twins run (slower; see kvtrace/native.py).
"""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("kvtrace._native",
              ["csrc/module.c", "csrc/records.c", "csrc/probes.c", "csrc/probe_state.c",
               "csrc/step_buffer.c", "csrc/frames.c", "csrc/snapshot.c"],
              # rebuilt when they change; shipped in an sdist
              depends=["csrc/kvtrace_native.h", "csrc/probe_state.h"],
              optional=True),
    Extension("kvtrace._model_core",
              ["csrc/model_core.c", "csrc/model_restore.c", "csrc/model_managers.c",
               "csrc/model_pool.c", "csrc/model_records.c"],
              depends=["csrc/model_parts.h", "csrc/containers.h"], optional=True),
    Extension("kvtrace._forensics_core",
              ["csrc/forensics_core.c", "csrc/forensics_records.c", "csrc/forensics_lookup.c"],
              depends=["csrc/containers.h", "csrc/forensics.h"], optional=True),
])
