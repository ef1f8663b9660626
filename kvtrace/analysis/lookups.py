"""What the miss attribution says of one admitted lookup: where its query tokens went (its
segments, each with the keys its cause took and the removal that took each), and of a trace.
Both the attributor and its C core hand lookups over in these types."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from kvtrace.analysis.causes import SHORTFALL_CAUSES
from kvtrace.events import TraceHeader

NO_REQ = -1  # Removal.by_req for a removal outside any request's allocation

_SHORTFALL = frozenset(SHORTFALL_CAUSES)


class Removal(NamedTuple):
    """The removal that took a key's last copy: when, from which block, and for an LRU
    eviction, whose allocation evicted it and which transient checkpoints sat cached behind."""

    reason: int  # a RemoveReason
    seq: int
    step: int
    block_id: int
    by_req: int  # the request whose allocate_slots evicted it, NO_REQ when not inside one
    transient_behind: int
    behind: tuple[tuple[int, int, int], ...] = ()  # up to 3 (req, position, block) examples


@dataclass(frozen=True)
class LostKey:
    """A key a restriction took from the cache: ``removal`` None means it was never stored."""

    group: int
    depth_tokens: int
    hash_id: int
    removal: Removal | None


@dataclass(frozen=True)
class Segment:
    """The tokens ``start..end`` of a lookup's query that ``cause`` cost it."""

    cause: str
    start: int
    end: int
    keys: tuple[LostKey, ...] = ()  # the decisive key first; all of them when explaining

    @property
    def tokens(self) -> int:
        return self.end - self.start


@dataclass
class LookupAttribution:
    req: int
    lookup: int  # 1: first admission; 2...: resumptions after preemption
    seq: int  # of the ComputedBlocksFound
    step: int
    query_tokens: int
    ideal_tokens: int
    hit_tokens: int
    shared_prefix_boundary: int
    attention_hit: int | None  # the full-attention groups' own hit alone (less EAGLE's drop)
    mamba_hit: int | None  # the Mamba groups' own deepest state below the query's last token
    segments: list[Segment] = field(default_factory=list)
    # In flight when the capture began (its start snapshot); its lookups count on from the
    # admissions it had then, so lookup 1 is still a first admission inside the trace.
    in_flight: bool = False

    def tokens(self, cause: str) -> int:
        return sum(s.tokens for s in self.segments if s.cause == cause)

    @property
    def shortfall(self) -> int:
        return sum(s.tokens for s in self.segments if s.cause in _SHORTFALL)


@dataclass
class TraceAttribution:
    """The lookups of one trace, and how complete the trace was."""

    path: str
    header: TraceHeader
    lookups: list[LookupAttribution]
    truncated: bool = False
    dropped_events: int = 0
