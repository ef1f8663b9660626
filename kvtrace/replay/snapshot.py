"""A trace's start snapshot, read and checked.

A capture that armed on a serving engine begins with ``state`` records (``events.SnapshotStarted``
and what follows it): the cache and the requests in flight at that moment. ``StartSnapshot``
holds them for the replay backends to rebuild (``CacheBackend.restore``) and for the scheduler
model to continue from. It is checked when read, so a damaged or hand-made snapshot is refused
with a message, not met as an ``IndexError`` inside a backend.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvtrace.errors import KvtraceError
from kvtrace.events import (
    BlockState,
    EngineConfig,
    FreeQueueState,
    KeyCached,
    Record,
    RequestBlocksState,
    RequestQueue,
    RequestState,
    SnapshotEnded,
    SnapshotStarted,
)

# vLLM's ``RequestStatus`` names of a request the scheduler holds, unfinished.
IN_FLIGHT_STATUSES = ("WAITING", "WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR", "WAITING_FOR_REMOTE_KVS",
                      "WAITING_FOR_STREAMING_REQ", "RUNNING", "PREEMPTED")
STATE_TYPES = (SnapshotStarted, FreeQueueState, BlockState, KeyCached, RequestState,
               RequestBlocksState, SnapshotEnded)


class SnapshotError(KvtraceError):
    """A start snapshot that no engine could have had."""

    default_hint = ("The trace's snapshot is damaged or was edited; capture again, or replay "
                    "the workload without it.")


@dataclass
class StartSnapshot:
    """The state records of one start snapshot, by kind, in file order."""

    started: SnapshotStarted
    free_queue: list[int] = field(default_factory=list)
    blocks: list[BlockState] = field(default_factory=list)
    keys: list[KeyCached] = field(default_factory=list)
    requests: list[RequestState] = field(default_factory=list)
    request_blocks: list[RequestBlocksState] = field(default_factory=list)
    ended: SnapshotEnded | None = None
    # The output hash units each request's decode completes after the snapshot (its
    # ``HashesExtended`` records in the trace): a replay hands them out as its tokens grow.
    output_hash_ids: dict[int, Sequence[int]] = field(default_factory=dict)

    def records(self) -> list[Record]:
        """The snapshot as records again, in the order a capture writes them."""
        return [self.started, FreeQueueState(self.free_queue), *self.blocks, *self.keys,
                *self.requests, *self.request_blocks,
                *([self.ended] if self.ended is not None else [])]

    def running(self) -> list[RequestState]:
        return [r for r in self.requests if r.queue == RequestQueue.RUNNING]

    def waiting(self) -> list[RequestState]:
        return [r for r in self.requests if r.queue == RequestQueue.WAITING]

    def check(self, config: EngineConfig, source: str) -> None:
        """Refuse what the engine of ``config`` could not hold; ``source`` names the trace."""
        num_blocks = config.num_gpu_blocks
        num_groups = len(config.kv_cache_groups)

        def refuse(what: str) -> None:
            raise SnapshotError(f"{source}: the start snapshot {what}")

        if self.ended is None:
            refuse("is incomplete (the trace was cut inside it)")
        if self.started.num_blocks != num_blocks:
            refuse(f"describes {self.started.num_blocks} blocks, the engine has {num_blocks}")

        def check_block(block_id: int, null_ok: bool = False) -> None:
            if not (0 if null_ok else 1) <= block_id < num_blocks:
                refuse(f"names block {block_id}, outside the pool of {num_blocks}")

        def check_group(group: int) -> None:
            if not 0 <= group < num_groups:
                refuse(f"names KV-cache group {group}; the engine has {num_groups}")

        if len(set(self.free_queue)) != len(self.free_queue):
            refuse("lists a block twice in the free queue")
        free = set(self.free_queue)
        for block_id in self.free_queue:
            check_block(block_id)
        held = set()
        for block in self.blocks:
            check_block(block.block_id)
            if block.ref_cnt < 0 or (block.ref_cnt > 0) == (block.block_id in free):
                refuse(f"has block {block.block_id} with {block.ref_cnt} references "
                       f"{'in' if block.block_id in free else 'outside'} the free queue")
            if block.ref_cnt:
                held.add(block.block_id)
            if block.hash_id >= 0:
                check_group(block.group)
        missing = set(range(1, num_blocks)) - free - held
        if missing:
            refuse(f"leaves block {min(missing)} neither free nor held")
        keyed = {b.block_id for b in self.blocks if b.hash_id >= 0}
        for key in self.keys:
            check_group(key.group)
            if not key.block_ids:
                refuse(f"caches hash {key.hash_id} on no block")
            for block_id in key.block_ids:
                check_block(block_id)
                if block_id not in keyed:
                    refuse(f"caches hash {key.hash_id} on block {block_id}, which has no key")
        reqs = {r.req for r in self.requests}
        if len(reqs) != len(self.requests):
            refuse("lists a request twice")
        unit = config.hash_block_size
        for request in self.requests:
            if (request.status not in IN_FLIGHT_STATUSES
                    or (request.queue == RequestQueue.RUNNING) != (request.status == "RUNNING")):
                refuse(f"has request {request.req} {request.status!r} in the "
                       f"{getattr(request.queue, 'name', request.queue)} queue")
            if not (0 < request.prompt_len <= request.num_tokens
                    and 0 <= request.num_computed_tokens <= request.num_tokens
                    and len(request.hash_ids) <= request.num_tokens // unit):
                refuse(f"has request {request.req} with inconsistent lengths")
        for state in self.request_blocks:
            if state.req not in reqs:
                refuse(f"gives blocks to request {state.req}, which it does not list")
            check_group(state.group)
            for block_id in state.block_ids:
                check_block(block_id, null_ok=True)
                if block_id and block_id not in held:
                    refuse(f"gives request {state.req} block {block_id}, which nobody holds")
            _check_fields(state, refuse)


def _check_fields(state: RequestBlocksState, refuse) -> None:
    from kvtrace.probes.snapshot import field_size

    for name, values in state.fields.items():
        size = field_size(name)
        if size is None:
            refuse(f"has unknown per-request state {name!r}")
        if len(values) != size:
            refuse(f"has {name} = {values} for request {state.req}, not {size} values")


def snapshot_of(records: Iterable[Record]) -> StartSnapshot | None:
    """The start snapshot at the head of ``records`` (None: the trace has none). Reads no further
    than its end, so a whole trace can be passed."""
    snapshot = None
    for record in records:
        kind = type(record)
        if kind is SnapshotStarted:
            if snapshot is not None:
                raise SnapshotError("the trace holds a second start snapshot")
            snapshot = StartSnapshot(record)
        elif snapshot is None:
            if record.family in ("input", "effect"):
                return None  # calls before any snapshot: an idle arm or a workload
        elif kind is FreeQueueState:
            snapshot.free_queue.extend(record.block_ids)
        elif kind is BlockState:
            snapshot.blocks.append(record)
        elif kind is KeyCached:
            snapshot.keys.append(record)
        elif kind is RequestState:
            snapshot.requests.append(record)
        elif kind is RequestBlocksState:
            snapshot.request_blocks.append(record)
        elif kind is SnapshotEnded:
            snapshot.ended = record
            return snapshot
        elif record.family in ("input", "effect"):
            break  # the snapshot was cut short
    return snapshot
