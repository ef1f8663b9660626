"""Only the optional native probe core lives here; everything else is in pyproject.toml.

Its C sources are in csrc/, one file per part, as their Python twins are split (see
csrc/kvtrace_native.h). ``optional=True``: where no C compiler or Python headers are found the
build warns and goes on, and the probes run as pure Python (slower; see kvtrace/native.py).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "kvtrace._native",
    ["csrc/module.c", "csrc/probes.c", "csrc/step_buffer.c", "csrc/frames.c"],
    depends=["csrc/kvtrace_native.h"],  # rebuilt when it changes, and shipped in an sdist
    optional=True)])
