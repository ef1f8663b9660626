"""The model backend on its C twin (``csrc/model_core.c``), when it is built and on.

``core`` is the ``kvtrace._model_core`` module, or None: not built (``setup.py`` makes the build
optional: no C compiler) or turned off with ``KVTRACE_NATIVE=0``. ``NativeModelBackend`` checks
and derives everything in Python, as the pure-Python ``ModelBackend`` does (the same functions),
and leaves the cache itself to the C core, a start snapshot's state included; the checkpoint
decision stays the shared Python table (the core calls ``Variant.checkpoint_action``). Counting
a summary, the core makes no record and keeps the counters in C (``_counts()``, in the shape of
``reports.Counts``); given a trace writer as well, it writes the records' column batches itself
(``TraceWriter.write_batch``).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import msgspec

from kvtrace import events
from kvtrace.engine_config import check_added_request, validate
from kvtrace.errors import KvtraceError
from kvtrace.events import EngineConfig
from kvtrace.replay import variants
from kvtrace.replay.backend import RecordSink
from kvtrace.replay.model.backend import (
    CachePlan,
    check_release,
    check_vllm_accepts,
)
from kvtrace.replay.model.reports import Counts
from kvtrace.replay.snapshot import SnapshotError, never_admitted
from kvtrace.replay.variants import get_variant
from kvtrace.replay.vllm_backend import UNLIMITED_MODEL_LEN
from kvtrace.traceio import TraceWriter

if TYPE_CHECKING:
    from kvtrace.replay.summary import ReplaySummary
    from kvtrace.replay.snapshot import StartSnapshot

try:
    from kvtrace import _model_core as built
except ImportError:
    built = None

core = built if os.environ.get("KVTRACE_NATIVE") != "0" else None


def _configure(module) -> None:
    """Hand the core the record types and enum members it makes records of."""
    objects = {cls.__name__: cls for cls in events.RECORD_TYPES}
    objects["CheckpointFacts"] = variants.CheckpointFacts
    objects["KvtraceError"] = KvtraceError
    objects["SnapshotError"] = SnapshotError
    for enum_type in (events.StoreKind, events.RemoveReason, events.CheckpointClass,
                      events.FinishStatus, variants.CheckpointAction):
        objects.update(enum_type.__members__)
    module.configure(objects)


class RequestCounters:
    """A request's live counters, as the ``vllm`` backend's ``request()`` hands out."""

    __slots__ = ("_backend", "_req")

    def __init__(self, backend: NativeModelBackend, req: int) -> None:
        self._backend, self._req = backend, req

    @property
    def num_tokens(self) -> int:
        return self._backend._request_counters(self._req)[0]

    @property
    def num_computed_tokens(self) -> int:
        return self._backend._request_counters(self._req)[1]

    @property
    def num_prompt_tokens(self) -> int:
        return self._backend._request_counters(self._req)[2]


if built is not None:
    _configure(built)

    class NativeModelBackend(built.ModelCore):
        """``CacheBackend`` on the C twin of the model (see module docstring)."""

        backend_name = "model"

        def __init__(self, config: EngineConfig, variant: str, sink: RecordSink | None = None,
                     summary: ReplaySummary | None = None,
                     writer: TraceWriter | None = None) -> None:
            """As ``ModelBackend``: records to ``sink``, or counted into ``summary``; with
            ``writer`` too, the core also writes the records to it as column batches, in C
            (the summary then counts the very reports the batches hold)."""
            if (sink is None) == (summary is None):
                raise TypeError("a model backend reports to a sink or counts into a summary")
            validate(config)
            check_vllm_accepts(config)
            self.config = config
            self.summary = summary
            self.variant = get_variant(variant)
            self.num_gpu_blocks = config.num_gpu_blocks
            plan = CachePlan.of(config)
            groups = [(group.kind == "mamba", group.block_size,
                       group.num_prefill_checkpoint_blocks, group.prefill_checkpoint_alignment)
                      for group in config.kv_cache_groups]
            specs = [(is_mamba, block_size, tuple(ids))
                     for (is_mamba, block_size), ids in plan.spec_groups]
            super().__init__(sink, self.variant, config.num_gpu_blocks, config.hash_block_size,
                             config.scheduler_block_size,
                             config.max_model_len or UNLIMITED_MODEL_LEN,
                             config.retention_interval, config.enable_caching, plan.hybrid,
                             plan.partial_hits, plan.alignment, plan.simple_hybrid, groups,
                             specs, *((writer.write_batch, writer.batch_size) if writer else ()))

        def add_request(self, req: int, prompt_len: int, hash_ids: list[int], max_tokens: int,
                        output_hash_ids: list[int] | None = None) -> None:
            check_added_request(self.config, req, prompt_len, hash_ids, max_tokens,
                                self._knows(req))
            self._add(req, prompt_len, max(1, max_tokens), [*hash_ids, *(output_hash_ids or ())])

        def _knows(self, req: int) -> bool:
            try:
                self._request_counters(req)
            except KeyError:
                return False
            return True

        def release_blocks(self, block_ids: list[int]) -> None:
            check_release(block_ids, self.num_gpu_blocks, self._ref_count)
            self._release(block_ids)

        def restore(self, snapshot: StartSnapshot) -> None:
            """As ``ModelBackend.restore``, in the core (``csrc/model_restore.c``): the
            snapshot's records handed over as tuples, each request with its known hash ids, its
            tokens in a step in flight and whether it was ever admitted (what a counting core's
            figures start from)."""
            astuple = msgspec.structs.astuple
            self._restore(
                [(state.req, state.prompt_len, max(1, state.max_tokens),
                  snapshot.known_hash_ids(state), len(state.hash_ids), state.num_tokens,
                  state.num_computed_tokens, state.shared_prefix_boundary,
                  state.num_in_flight_tokens,
                  never_admitted(state.status, state.num_preemptions))
                 for state in snapshot.requests],
                [astuple(block) for block in snapshot.blocks],
                [astuple(key) for key in snapshot.keys], snapshot.free_queue,
                [astuple(table) for table in snapshot.request_blocks])

        def request(self, req: int) -> RequestCounters:
            """A request's counters (``num_tokens``, ``num_computed_tokens``...)."""
            self._request_counters(req)  # KeyError for an unknown one
            return RequestCounters(self, req)

        def close(self) -> None:
            super().close()
            if self.summary is not None:
                Counts(*self._counts()).fill(self.summary)

        def __enter__(self) -> NativeModelBackend:
            return self

        def __exit__(self, *exc: object) -> None:
            self.close()
else:
    NativeModelBackend = None  # type: ignore[assignment,misc]
