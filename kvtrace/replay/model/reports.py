"""Where the model's reports go: records for a sink, or counters for a summary-only replay.

The pool, managers and coordinator report every effect as ``out.report(Kind, *fields)`` (the
fields of the ``kvtrace.events`` record ``Kind``). ``Records`` turns each report into its
record, in order, for the backend to hand to its sink. ``Tally`` makes no record: it counts
what ``ReplaySummary`` (``kvtrace.replay.summary``) would count over those records, as the
reports are made, for a replay that writes no trace (``kvtrace sweep``, ``write_traces=False``).
``Counts`` is what either twin hands over in the end: the C core counts the same figures in C
(``csrc/model_records.c``) and returns them in this shape.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtrace.events import (
    BlockRemoved,
    BlockState,
    BlockStored,
    BlockTouched,
    CheckpointSuppressed,
    ComputedBlocksFound,
    RemoveReason,
    RequestArrived,
    RequestPreempted,
    RequestState,
    SlotsAllocated,
    StaleKeyLeft,
    StoreKind,
)
from kvtrace.replay.snapshot import never_admitted

if TYPE_CHECKING:
    from kvtrace.replay.summary import ReplaySummary


class Records(list):
    """Reports as records, in the order the sink gets them."""

    def mark(self) -> int:
        """Where the records of what follows start (``report_at`` puts one in front of them)."""
        return len(self)

    def report(self, kind: type, *fields: object) -> None:
        self.append(kind(*fields))

    def report_at(self, index: int, kind: type, *fields: object) -> None:
        self.insert(index, kind(*fields))


@dataclass
class Counts:
    """``ReplaySummary``'s figures of a replay, as a counting backend hands them over: by
    request, the prompt length of its first arrival; removals by ``RemoveReason``; per
    KV-cache group, hit blocks, stores by ``StoreKind`` and LRU evictions."""

    prompt_tokens: dict[int, int]
    hit_tokens: int
    resumed_hit_tokens: int
    removed: list[int]
    checkpoints_suppressed: int
    stale_key_hazards: int
    preemptions: int
    hit_blocks: list[int]
    stored: list[list[int]]
    evicted: list[int]

    def fill(self, summary: ReplaySummary) -> None:
        """Set ``summary``'s figures to these: what it counts from the records the replay
        would have made (its ``to_dict`` reads the same)."""
        summary.prompt_tokens = dict(self.prompt_tokens)
        summary.hit_tokens = self.hit_tokens
        summary.resumed_hit_tokens = self.resumed_hit_tokens
        summary.evictions = Counter({RemoveReason(reason).name.lower(): count
                                     for reason, count in enumerate(self.removed) if count})
        summary.checkpoints_published = sum(kinds[StoreKind.CHECKPOINT] for kinds in self.stored)
        summary.checkpoints_suppressed = self.checkpoints_suppressed
        summary.stale_key_hazards = self.stale_key_hazards
        summary.preemptions = self.preemptions
        summary.hit_blocks = Counter({group: count for group, count in enumerate(self.hit_blocks)
                                      if count})
        summary.stored = {
            group: Counter({StoreKind(kind).name.lower(): count
                            for kind, count in enumerate(kinds) if count})
            for group, kinds in enumerate(self.stored) if any(kinds)}
        summary.evicted = Counter({group: count for group, count in enumerate(self.evicted)
                                   if count})


class Tally(Counts):
    """Reports counted as ``ReplaySummary`` counts their records; no record is made.

    A touched block counts for the group of the last key stored on it; a lookup's hit counts
    once its request's ``allocate_slots`` succeeds, for the first admission (``hit_tokens``) or
    a resumption (``resumed_hit_tokens``). Only the position of ``report_at`` is ignored:
    nothing counted depends on where a ``SlotsAllocated`` stands among its call's effects."""

    def __init__(self, num_blocks: int, num_groups: int) -> None:
        super().__init__({}, 0, 0, [0] * len(RemoveReason), 0, 0, 0, [0] * num_groups,
                         [[0] * len(StoreKind) for _ in range(num_groups)], [0] * num_groups)
        self.block_group = [-1] * num_blocks
        self.lookups: dict[int, int] = {}  # req -> the hit of its last lookup
        self.admitted: set[int] = set()
        self.counters = {
            BlockStored: self.block_stored, BlockRemoved: self.block_removed,
            BlockTouched: self.block_touched, ComputedBlocksFound: self.computed_blocks_found,
            SlotsAllocated: self.slots_allocated, RequestArrived: self.request_arrived,
            RequestPreempted: self.request_preempted,
            CheckpointSuppressed: self.checkpoint_suppressed, StaleKeyLeft: self.stale_key_left,
            RequestState: self.request_state, BlockState: self.block_state}

    def mark(self) -> int:
        return 0

    def report(self, kind: type, *fields: object) -> None:
        count = self.counters.get(kind)
        if count is not None:
            count(*fields)

    def report_at(self, index: int, kind: type, *fields: object) -> None:
        self.report(kind, *fields)

    def block_stored(self, block: int, hash_id: int, group: int, num_tokens: int,
                     kind: StoreKind, req: int) -> None:
        self.block_group[block] = group
        self.stored[group][kind] += 1

    def block_removed(self, block: int, hash_id: int, group: int, num_tokens: int,
                      reason: RemoveReason) -> None:
        self.removed[reason] += 1
        if reason == RemoveReason.LRU_REUSE:
            self.evicted[group] += 1

    def block_touched(self, block: int, req: int) -> None:
        group = self.block_group[block]
        if group >= 0:
            self.hit_blocks[group] += 1

    def computed_blocks_found(self, req: int, num_hit_tokens: int, junction: int) -> None:
        self.lookups[req] = num_hit_tokens

    def slots_allocated(self, req: int, num_new_tokens: int, num_computed_tokens: int,
                        num_new_computed_tokens: int, num_lookahead_tokens: int,
                        num_external_computed_tokens: int, num_tokens: int, success: bool,
                        *admission_terms: object) -> None:
        if success and req in self.lookups:
            hit = self.lookups.pop(req)
            if req in self.admitted:
                self.resumed_hit_tokens += hit
            else:
                self.admitted.add(req)
                self.hit_tokens += hit

    def request_arrived(self, req: int, prompt_len: int, *fields: object) -> None:
        self.prompt_tokens.setdefault(req, prompt_len)

    def request_state(self, req: int, queue: int, status: str, prompt_len: int,
                      *fields: object) -> None:
        """A request in flight at a start snapshot: never admitted yet, it counts as an
        arrival; else its first admission was before (``ReplaySummary`` alike)."""
        if never_admitted(status, fields[4]):  # fields[4]: num_preemptions
            self.prompt_tokens.setdefault(req, prompt_len)
        else:
            self.admitted.add(req)

    def block_state(self, block: int, ref_cnt: int, hash_id: int, group: int,
                    num_tokens: int) -> None:
        if hash_id >= 0:
            self.block_group[block] = group

    def request_preempted(self, req: int) -> None:
        self.preemptions += 1

    def checkpoint_suppressed(self, *fields: object) -> None:
        self.checkpoints_suppressed += 1

    def stale_key_left(self, *fields: object) -> None:
        self.stale_key_hazards += 1
