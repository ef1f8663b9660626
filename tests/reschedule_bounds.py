"""How closely a rescheduled replay of a capture reproduces the capture itself (issue #29's
three bounds): the first-admission hit rate within half a point, the LRU evictions within 5%,
and the same first-admission hit for at least 95% of the requests whose first lookup falls in
the capture's window."""

from __future__ import annotations

from pathlib import Path

from kvtrace.events import BlockRemoved, ComputedBlocksFound, RemoveReason, SlotsAllocated
from kvtrace.replay.summary import ReplaySummary
from kvtrace.traceio import TraceReader

MAX_HIT_RATE_POINTS = 0.005
MAX_EVICTIONS_SHARE = 0.05
MIN_SAME_REQUESTS = 0.95


def figures(trace: Path) -> dict:
    """A trace's first-admission hit rate, LRU evictions, and each counted request's hit (the
    lookup its first successful allocation followed, as ``ReplaySummary`` counts it)."""
    reader = TraceReader(str(trace))
    summary = ReplaySummary(reader.header.config)
    lookups: dict[int, int] = {}
    hits: dict[int, int] = {}
    evictions = 0
    for record in reader:
        summary(record)
        kind = type(record)
        if kind is ComputedBlocksFound:
            lookups[record.req] = record.num_hit_tokens
        elif kind is SlotsAllocated and record.success and record.req in lookups:
            hits.setdefault(record.req, lookups.pop(record.req))
        elif kind is BlockRemoved:
            evictions += record.reason == RemoveReason.LRU_REUSE
    counted = summary.prompt_tokens  # the requests whose first lookup is in the window
    return {"hit_rate": summary.to_dict()["hit_rate"], "lru_evictions": evictions,
            "hits": {req: hit for req, hit in hits.items() if req in counted}}


def compare(captured: Path, rescheduled: Path) -> dict:
    """The three figures of ``rescheduled`` against ``captured``'s."""
    was, now = figures(captured), figures(rescheduled)
    same = sum(now["hits"].get(req) == hit for req, hit in was["hits"].items())
    return {"hit_rate": (was["hit_rate"], now["hit_rate"]),
            "lru_evictions": (was["lru_evictions"], now["lru_evictions"]),
            "same_requests": (same, len(was["hits"]))}


def assert_within_bounds(captured: Path, rescheduled: Path) -> dict:
    """Fail unless ``rescheduled`` is within the three bounds of ``captured``; the figures."""
    found = compare(captured, rescheduled)
    (was_rate, now_rate), (was_lru, now_lru), (same, total) = found.values()
    assert abs(now_rate - was_rate) <= MAX_HIT_RATE_POINTS, found
    assert abs(now_lru - was_lru) <= MAX_EVICTIONS_SHARE * was_lru, found
    assert total and same >= MIN_SAME_REQUESTS * total, found
    return found
