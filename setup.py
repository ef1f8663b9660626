"""Only the optional native probe core lives here; everything else is in pyproject.toml.

``optional=True``: where no C compiler or Python headers are found the build warns and goes on,
and the probes run as pure Python (slower; see kvtrace/native.py).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvtrace._native", ["kvtrace/_native.c"],
                             optional=True),
                   # The model replay backend's C twin (kvtrace/replay/model/), optional too.
                   Extension("kvtrace._model_core", ["csrc/model_core.c"], optional=True)])
