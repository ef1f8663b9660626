"""A trace's start snapshot, read and checked.

A capture that armed on a serving engine begins with ``state`` records (``events.SnapshotStarted``
and what follows it): the cache and the requests in flight at that moment. ``StartSnapshot``
holds them for the replay backends to rebuild (``CacheBackend.restore``) and for the scheduler
model to continue from. It is checked when read (``snapshot_checks.check_snapshot``), so a
damaged or hand-made snapshot is refused with a message, not met as an ``IndexError`` inside a
backend.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvtrace.errors import KvtraceError
from kvtrace.events import (
    BlockState,
    FreeQueueState,
    KeyCached,
    Record,
    RequestBlocksState,
    RequestQueue,
    RequestState,
    SnapshotEnded,
    SnapshotStarted,
)

class SnapshotError(KvtraceError):
    """A start snapshot that no engine could have had."""

    default_hint = ("The trace's start snapshot is damaged or was edited (a capture writes none "
                    "like it); capture again. The trace itself was not changed.")


STATE_TYPES = (SnapshotStarted, FreeQueueState, BlockState, KeyCached, RequestState,
               RequestBlocksState, SnapshotEnded)


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

    def known_hash_ids(self, state: RequestState) -> list[int]:
        """The hash ids a request in flight is known by: its units so far, then the output
        units its decode completes after the snapshot (made-up ids follow them)."""
        return [*state.hash_ids, *self.output_hash_ids.get(state.req, ())]

    def running(self) -> list[RequestState]:
        return [r for r in self.requests if r.queue == RequestQueue.RUNNING]

    def waiting(self) -> list[RequestState]:
        return [r for r in self.requests if r.queue == RequestQueue.WAITING]



def never_admitted(status: str, num_preemptions: int) -> bool:
    """Whether a request in flight at a snapshot (its ``RequestState``) was never admitted: its
    first lookup falls inside the trace, so the summaries count it as an arrival; any other was
    admitted before, and its lookups count as resumed."""
    return status == "WAITING" and not num_preemptions


def snapshot_of(records: Iterable[Record]) -> StartSnapshot | None:
    """The start snapshot at the head of ``records`` (None: the trace has none). Reads no further
    than the first call, so a whole trace can be passed. A second snapshot, or a state record
    outside one, is refused: a capture writes one snapshot, whole, before any call."""
    snapshot = None
    for record in records:
        kind = type(record)
        if record.family in ("input", "effect"):
            break  # none (an idle arm or a workload), or the end of it (or it was cut short)
        if record.family != "state":
            continue
        if snapshot is not None and snapshot.ended is not None:
            raise SnapshotError(f"the trace holds a second start snapshot (a "
                                f"{kind.__struct_config__.tag} record after snapshot_ended)")
        if kind is SnapshotStarted:
            if snapshot is not None:
                raise SnapshotError("the trace holds a second start snapshot (a "
                                    "snapshot_started record before snapshot_ended)")
            snapshot = StartSnapshot(record)
        elif snapshot is None:
            raise SnapshotError(f"the trace has a {kind.__struct_config__.tag} record before "
                                "any snapshot_started")
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
