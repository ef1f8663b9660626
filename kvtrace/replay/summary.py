"""The figures of one trace (``ReplaySummary``), counted from its records.

The summary is computed from the records themselves, so it reads the same for any trace in the
schema, a live capture included; a backend that can counts the same figures itself
(``backend.open_counting_backend``).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from kvtrace.events import (
    BlockRemoved,
    BlockState,
    BlockStored,
    BlockTouched,
    CheckpointSuppressed,
    ComputedBlocksFound,
    EngineConfig,
    EventsDropped,
    Record,
    RemoveReason,
    RequestArrived,
    RequestPreempted,
    RequestState,
    SlotsAllocated,
    StaleKeyLeft,
    StoreKind,
    enum_label,
)
from kvtrace.replay.snapshot import never_admitted


class ReplaySummary:
    """Figures of one trace, fed record by record (a ``RecordSink``).

    ``hit_tokens`` counts the joint prefix hit (``ComputedBlocksFound.num_hit_tokens``) of each
    request's *first admission*: the lookup that its first successful ``allocate_slots``
    followed (a lookup retried after a failed admission is counted once, as vLLM's prefill
    stats do; hits after a preemption go to ``resumed_hit_tokens``). Per KV-cache group, a
    touched block is attributed to the group of the hash it carries (its last ``BlockStored``):
    ``hit_blocks`` are blocks taken by prefix hits, ``stored`` blocks keyed by kind, ``evicted``
    LRU reuses of keyed blocks.

    A trace that starts from a snapshot counts the requests whose first lookup falls inside
    it: those that arrive, and those the snapshot shows waiting that were never admitted. A
    request the snapshot shows running or preempted was admitted before: its lookups count as
    resumed."""

    def __init__(self, config: EngineConfig | None) -> None:
        self.group_kinds = [g.kind for g in config.kv_cache_groups] if config else []
        self.prompt_tokens: dict[int, int] = {}
        self.hit_tokens = 0
        self.resumed_hit_tokens = 0
        self.evictions: Counter = Counter()
        self.checkpoints_published = 0
        self.checkpoints_suppressed = 0
        self.stale_key_hazards = 0
        self.preemptions = 0
        self.dropped_events = 0
        self._lookups: dict[int, int] = {}
        self._admitted: set[int] = set()
        self._block_group: dict[int, int] = {}
        self.hit_blocks: Counter = Counter()
        self.stored: dict[int, Counter] = {}
        self.evicted: Counter = Counter()

    def __call__(self, record: Record) -> None:
        kind = type(record)
        if kind is BlockTouched:
            group = self._block_group.get(record.block_id)
            if group is not None:
                self.hit_blocks[group] += 1
        elif kind is BlockStored:
            self._block_group[record.block_id] = record.group
            self.stored.setdefault(record.group, Counter())[
                enum_label(StoreKind, record.kind).lower()] += 1
            self.checkpoints_published += record.kind == StoreKind.CHECKPOINT
        elif kind is BlockRemoved:
            self.evictions[enum_label(RemoveReason, record.reason).lower()] += 1
            self.evicted[record.group] += record.reason == RemoveReason.LRU_REUSE
        elif kind is ComputedBlocksFound:
            self._lookups[record.req] = record.num_hit_tokens
        elif kind is SlotsAllocated:
            if record.success and record.req in self._lookups:
                hit = self._lookups.pop(record.req)
                if record.req in self._admitted:
                    self.resumed_hit_tokens += hit
                else:
                    self._admitted.add(record.req)
                    self.hit_tokens += hit
        elif kind is RequestArrived:
            self.prompt_tokens.setdefault(record.req, record.prompt_len)
        elif kind is RequestState:
            if never_admitted(record.status, record.num_preemptions):
                self.prompt_tokens.setdefault(record.req, record.prompt_len)
            else:
                self._admitted.add(record.req)
        elif kind is BlockState:
            if record.hash_id >= 0:
                self._block_group[record.block_id] = record.group
        elif kind is RequestPreempted:
            self.preemptions += 1
        elif kind is CheckpointSuppressed:
            self.checkpoints_suppressed += 1
        elif kind is StaleKeyLeft:
            self.stale_key_hazards += 1
        elif kind is EventsDropped:
            self.dropped_events += record.count

    def to_dict(self) -> dict[str, Any]:
        prompt_tokens = sum(self.prompt_tokens.values())
        groups = sorted(set(self.hit_blocks) | set(self.stored) | set(self.evicted)
                        | set(range(len(self.group_kinds))))
        return {
            "requests": len(self.prompt_tokens),
            "prompt_tokens": prompt_tokens,
            "hit_tokens": self.hit_tokens,
            "hit_rate": self.hit_tokens / prompt_tokens if prompt_tokens else 0.0,
            "evictions": dict(sorted(self.evictions.items())),
            "checkpoints_published": self.checkpoints_published,
            "checkpoints_suppressed": self.checkpoints_suppressed,
            "stale_key_hazards": self.stale_key_hazards,
            "preemptions": self.preemptions,
            "resumed_hit_tokens": self.resumed_hit_tokens,
            "groups": {
                str(g): {
                    "kind": self.group_kinds[g] if g < len(self.group_kinds) else "",
                    "hit_blocks": self.hit_blocks[g],
                    "stored": dict(sorted(self.stored.get(g, Counter()).items())),
                    "evicted": self.evicted[g],
                }
                for g in groups
            },
        }
