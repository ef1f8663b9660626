"""kvtrace's own model of vLLM 0.33's hybrid prefix cache: the ``model`` replay backend.

Two twins with one behaviour: ``ModelBackend`` (pure Python, the reference) and
``NativeModelBackend`` (the same on the optional C core, ``csrc/model_core.c``).
``open_model_backend`` is the registered factory: the C twin where it is built and on.
"""

from kvtrace.events import EngineConfig
from kvtrace.replay.backend import CacheBackend, RecordSink
from kvtrace.replay.model import native
from kvtrace.replay.model.backend import ModelBackend
from kvtrace.replay.model.native import NativeModelBackend

__all__ = ["ModelBackend", "NativeModelBackend", "open_model_backend"]


def open_model_backend(config: EngineConfig, variant: str, sink: RecordSink) -> CacheBackend:
    """The model backend on ``config`` under ``variant``: native when ``native.core`` is on."""
    if native.core is not None:
        return NativeModelBackend(config, variant, sink)
    return ModelBackend(config, variant, sink)
