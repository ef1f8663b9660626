"""The interface every replay backend implements, and how the driver picks one by name.

A backend owns one prefix cache built from an ``EngineConfig`` under one checkpoint variant,
and reports everything through a ``RecordSink``: the *input* records for the calls it is
given and the *effect* records the cache produced, in the trace schema (``kvtrace.events``).
Drivers (the scheduler model, lockstep replay) call it in the order a vLLM scheduler would;
``CacheBackend`` is everything they call, so a second backend plugs in by implementing it and
adding a line to ``BACKENDS``, without touching the driver.

A replay that writes no trace wants only its ``ReplaySummary``: ``open_counting_backend`` gives
it a backend that counts the summary's figures itself and makes no record, where the backend
can (``COUNTING_BACKENDS``); any other backend feeds the summary its records. A replay that
writes its trace and nothing else gets ``open_writing_backend``: the backend writes the records
and counts the summary itself where it can (``WRITING_BACKENDS``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Callable, Protocol, TypeVar

from kvtrace.errors import KvtraceError
from kvtrace.events import EngineConfig, FinishStatus, Record

if TYPE_CHECKING:
    from kvtrace.replay.summary import ReplaySummary
    from kvtrace.replay.snapshot import StartSnapshot
    from kvtrace.traceio import TraceWriter

RecordSink = Callable[[Record], None]


class CacheBackend(Protocol):
    num_gpu_blocks: int

    def new_step(self, step: int, ts_ns: int) -> None:
        """Start a scheduler step (``KVCacheManager.new_step_starts``)."""

    def add_request(self, req: int, prompt_len: int, hash_ids: list[int], max_tokens: int,
                    output_hash_ids: list[int] | None = None) -> None:
        """Make a request known. ``hash_ids`` cover the prompt's full hash units;
        ``output_hash_ids`` (optional) name the units decode will complete, so that a later
        turn's prompt can share them; missing ones get fresh ids."""

    def get_computed_blocks(self, req: int) -> tuple[int, int]:
        """Prefix lookup for a waiting request: (num_hit_tokens, shared_prefix_boundary)."""

    def allocate_slots(self, req: int, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       num_lookahead_tokens: int = 0, *, full_sequence_must_fit: bool = False,
                       reserved_blocks: int = 0, has_scheduled_reqs: bool = False) -> bool:
        """``KVCacheManager.allocate_slots``; False when the pool cannot fit the chunk (or, with
        ``full_sequence_must_fit``, the request's whole sequence so far).
        ``num_new_computed_tokens`` > 0 only on the first allocation after a lookup;
        ``reserved_blocks`` and ``has_scheduled_reqs`` are vLLM's admission terms (lockstep
        passes the captured ones)."""

    def end_schedule(self) -> None:
        """The step's allocations are made: release what vLLM's ``schedule()`` releases then
        (the retained ends of the step's copy-on-write block copies)."""

    def advance(self, req: int, num_tokens: int) -> None:
        """The scheduled tokens were computed: ``num_computed_tokens += num_tokens``; past the
        prompt, each computed token appends an output token (completing hash units)."""

    def cache_blocks(self, req: int, num_tokens_to_cache: int) -> None:
        """``KVCacheManager.cache_blocks``: key the request's blocks up to
        ``num_tokens_to_cache`` tokens, as vLLM's scheduler asks when a step's output arrives
        after the next step was scheduled (async scheduling, speculative decoding)."""

    def free(self, req: int, status: FinishStatus = FinishStatus.FINISHED) -> None:
        """The request finished or was aborted: release its blocks."""

    def preempt(self, req: int) -> None:
        """Free the request's blocks and reset it to wait again (recompute on resume)."""

    def num_free_blocks(self) -> int:
        """Blocks in the free queue (cached-evictable ones included)."""

    # Lockstep replay re-issues a capture's calls; it also needs these two (and the scheduler
    # model of an async engine, ``sync_request``).

    def sync_request(self, req: int, num_computed_tokens: int, num_tokens: int,
                     num_in_flight_tokens: int = 0) -> None:
        """Set a request's progress to captured values: computed tokens, output tokens
        appended until it holds ``num_tokens``, and its tokens in steps still in flight (async
        scheduling). The rescheduled replay of an async engine keeps it with these too."""

    def release_blocks(self, block_ids: list[int]) -> None:
        """Free blocks by id, as the engine did outside the cache manager's calls."""

    def restore(self, snapshot: StartSnapshot) -> None:
        """Take a capture's start snapshot as the cache's state (a new backend only): its pool,
        and its requests in flight with their blocks. ``open_backend`` calls it."""

    def close(self) -> None:
        """Release what the backend holds (the probes it armed)."""

    def __enter__(self) -> CacheBackend: ...

    def __exit__(self, *exc: object) -> None: ...


Hit = TypeVar("Hit")


def take_pending_hit(pending_hits: dict[int, tuple[Hit | None, int]], req: int,
                     num_new_computed_tokens: int) -> Hit | None:
    """The blocks a request's last lookup found, for the allocation that uses them. Both backends
    keep ``get_computed_blocks``' result until then, as vLLM's scheduler does, and a computed
    count the lookup did not find is a caller's bug, not a cache state."""
    if num_new_computed_tokens <= 0:
        return None
    hits, num_hit_tokens = pending_hits.pop(req, (None, 0))
    if num_hit_tokens != num_new_computed_tokens:
        raise KvtraceError(
            f"request {req}: allocate_slots with {num_new_computed_tokens} computed "
            f"tokens, but its last lookup found {num_hit_tokens}",
            "Call get_computed_blocks first and pass its hit (or 0).")
    return hits


def tokens_to_sync(req: int, num_tokens_held: int, num_tokens: int) -> int:
    """The output tokens a request must append to hold a captured ``num_tokens`` (lockstep's
    ``sync_request``); holding more than the trace says means the trace contradicts itself."""
    if num_tokens < num_tokens_held:
        raise KvtraceError(
            f"request {req} holds {num_tokens_held} tokens, the trace says {num_tokens}",
            "The trace's inputs are inconsistent; was it edited?")
    return num_tokens - num_tokens_held


BackendFactory = Callable[..., CacheBackend]

# Backend name -> "module:factory" of (config, variant, sink, snapshot=None): a backend that
# implements ``CacheBackend``, started from ``snapshot`` when one is given (imported on first
# use: the vllm backend imports vLLM).
BACKENDS: dict[str, str] = {
    "vllm": "kvtrace.replay.vllm_backend:open_vllm_backend",
    "model": "kvtrace.replay.model:open_model_backend",
}
# Backends that can count a ``ReplaySummary``'s figures themselves, making no record: name ->
# "module:factory" of (config, variant, summary, snapshot=None), a backend that sets the
# figures on close.
COUNTING_BACKENDS: dict[str, str] = {
    "model": "kvtrace.replay.model:open_counting_model_backend",
}
# Backends that can write a replay's trace themselves (and count its summary from what they
# write): name -> "module:factory" of (config, variant, writer, summary).
WRITING_BACKENDS: dict[str, str] = {
    "model": "kvtrace.replay.model:open_writing_model_backend",
}


def _factory(location: str):
    module_name, _, name = location.partition(":")
    return getattr(importlib.import_module(module_name), name)


def open_backend(name: str, config: EngineConfig, variant: str, sink: RecordSink,
                 snapshot: StartSnapshot | None = None) -> CacheBackend:
    """A new backend ``name`` on ``config`` under ``variant``, reporting to ``sink``, holding
    ``snapshot``'s state when one is given."""
    factory: BackendFactory = _factory(BACKENDS[name])
    return factory(config, variant, sink, snapshot)


def open_writing_backend(name: str, config: EngineConfig, variant: str, writer: TraceWriter,
                         summary: ReplaySummary,
                         snapshot: StartSnapshot | None = None) -> CacheBackend:
    """A new backend ``name`` whose replay is written to ``writer`` and counted into
    ``summary``: by the backend itself where it can, else record by record through both."""
    if name in WRITING_BACKENDS:
        return _factory(WRITING_BACKENDS[name])(config, variant, writer, summary, snapshot)

    def sink(record: Record) -> None:
        writer.write(record)
        summary(record)
    return open_backend(name, config, variant, sink, snapshot)


def open_counting_backend(name: str, config: EngineConfig, variant: str,
                          summary: ReplaySummary,
                          snapshot: StartSnapshot | None = None) -> CacheBackend:
    """A new backend ``name`` whose replay only feeds ``summary``: counted by the backend
    itself where it can (the summary holds the figures once the backend is closed), else the
    summary is its record sink."""
    if name in COUNTING_BACKENDS:
        factory: BackendFactory = _factory(COUNTING_BACKENDS[name])
        return factory(config, variant, summary, snapshot)
    return open_backend(name, config, variant, summary, snapshot)


def started(backend: CacheBackend, snapshot: StartSnapshot | None) -> CacheBackend:
    """``backend`` holding ``snapshot``'s state (closed again if that fails)."""
    if snapshot is not None:
        try:
            backend.restore(snapshot)
        except BaseException:
            backend.close()
            raise
    return backend
