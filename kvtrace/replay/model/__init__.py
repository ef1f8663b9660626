"""kvtrace's own model of vLLM 0.33's hybrid prefix cache: the ``model`` replay backend.

Two twins with one behaviour: ``ModelBackend`` (pure Python, the reference) and
``NativeModelBackend`` (the same on the optional C core, ``csrc/model_core.c``).
``open_model_backend`` is the registered factory: the C twin where it is built and on;
``open_counting_model_backend`` the same twin counting a summary's figures, with no record;
``open_writing_model_backend`` the same writing a replay's trace and counting its summary.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtrace.events import EngineConfig
from kvtrace.replay.backend import CacheBackend, RecordSink, started
from kvtrace.replay.model import native
from kvtrace.replay.model.backend import ModelBackend
from kvtrace.replay.model.native import NativeModelBackend
from kvtrace.traceio import TraceWriter

if TYPE_CHECKING:
    from kvtrace.replay.summary import ReplaySummary
    from kvtrace.replay.snapshot import StartSnapshot

__all__ = ["ModelBackend", "NativeModelBackend", "open_counting_model_backend",
           "open_model_backend", "open_writing_model_backend"]


def _twin() -> type[ModelBackend] | type[NativeModelBackend]:
    """The C twin where it is on: for every engine, async scheduling included, and from a
    start snapshot too (``NativeModelBackend.restore``), its step in flight included."""
    return NativeModelBackend if native.core is not None else ModelBackend


def open_model_backend(config: EngineConfig, variant: str, sink: RecordSink,
                       snapshot: StartSnapshot | None = None) -> CacheBackend:
    """The model backend on ``config`` under ``variant``: native when ``native.core`` is on."""
    return started(_twin()(config, variant, sink), snapshot)


def open_counting_model_backend(config: EngineConfig, variant: str, summary: ReplaySummary,
                                snapshot: StartSnapshot | None = None) -> CacheBackend:
    """The same twin, counting ``summary``'s figures itself (set on close), no record made."""
    return started(_twin()(config, variant, summary=summary), snapshot)


def open_writing_model_backend(config: EngineConfig, variant: str, writer: TraceWriter,
                               summary: ReplaySummary,
                               snapshot: StartSnapshot | None = None) -> CacheBackend:
    """The same twin, its records written to ``writer`` and counted into ``summary``: by the C
    core as column batches, no record made in Python; by the Python twin, record by record."""
    if _twin() is NativeModelBackend:
        return started(NativeModelBackend(config, variant, summary=summary, writer=writer),
                       snapshot)
    return started(ModelBackend(config, variant,
                                lambda record: (writer.write(record), summary(record))), snapshot)
