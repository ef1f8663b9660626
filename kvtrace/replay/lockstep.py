"""Lockstep replay: re-issue a captured trace's input records, in order, against a backend.

With the variant the engine ran, the backend's effect records must equal the captured ones one
for one; ``verify`` measures that (the fidelity check) and reports the first divergence with the
input that led to it. A trace that lost events is refused: its effects cannot be matched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from kvtrace.errors import KvtraceError
from kvtrace.events import (
    BlocksReleased,
    ComputedBlocksFound,
    EventsDropped,
    HashesExtended,
    Record,
    RequestArrived,
    RequestFinished,
    RequestPreempted,
    SlotsAllocated,
    StepStarted,
)
from kvtrace.replay.backend import CacheBackend


def replay_lockstep(records: Iterable[Record], backend: CacheBackend) -> int:
    """Re-issue every input record of ``records`` on ``backend``; return how many were issued.

    The backend reports its own records through its sink. Output hash ids a request completed
    during decode (``HashesExtended``) are declared up front so the replay hands them out as
    the request's tokens grow. Each captured ``allocate_slots`` first takes the request's
    captured progress (``CacheBackend.sync_request``) and passes vLLM's admission terms on;
    blocks the engine freed outside the cache's calls are released by id.
    """
    records = list(records)
    output_hash_ids: dict[int, list[int]] = {}
    for record in records:
        if type(record) is HashesExtended:
            output_hash_ids.setdefault(record.req, []).extend(record.hash_ids)
    num_issued = 0
    for record in records:
        kind = type(record)
        if kind is StepStarted:
            backend.new_step(record.step, record.ts_ns)
        elif kind is RequestArrived:
            backend.add_request(record.req, record.prompt_len, record.hash_ids,
                                record.max_tokens, output_hash_ids.get(record.req))
        elif kind is ComputedBlocksFound:
            backend.get_computed_blocks(record.req)
        elif kind is SlotsAllocated:
            if record.num_external_computed_tokens:
                raise KvtraceError(
                    f"request {record.req} loaded {record.num_external_computed_tokens} tokens "
                    "through a KV connector; lockstep replay has no connector",
                    "Capture without a KV connector, or use reschedule mode.")
            backend.sync_request(record.req, record.num_computed_tokens, record.num_tokens)
            backend.allocate_slots(record.req, record.num_new_tokens,
                                   record.num_new_computed_tokens, record.num_lookahead_tokens,
                                   full_sequence_must_fit=record.full_sequence_must_fit,
                                   reserved_blocks=record.reserved_blocks,
                                   has_scheduled_reqs=record.has_scheduled_reqs)
        elif kind is RequestFinished:
            backend.free(record.req, record.status)
        elif kind is RequestPreempted:
            backend.preempt(record.req)
        elif kind is BlocksReleased:
            backend.release_blocks(record.block_ids)
        else:
            continue
        num_issued += 1
    return num_issued


@dataclass(frozen=True)
class Divergence:
    """Where two effect streams first differ, with the inputs that led there."""

    index: int  # position in the effect stream
    step: int  # StepStarted.step before it in the captured trace (-1 before any)
    captured: Record | None  # None: the captured stream ended first
    replayed: Record | None  # None: the replayed stream ended first
    last_input: Record | None  # the captured input record just before the effect

    def __str__(self) -> str:
        return (f"effect #{self.index} (step {self.step}) differs: captured {self.captured!r}, "
                f"replayed {self.replayed!r}; after input {self.last_input!r}")


@dataclass(frozen=True)
class Fidelity:
    matched: int
    total: int
    first_divergence: Divergence | None

    @property
    def ratio(self) -> float:
        return self.matched / self.total if self.total else 1.0

    def __str__(self) -> str:
        line = f"{self.matched}/{self.total} effect records match ({self.ratio:.2%})"
        return line if self.first_divergence is None else f"{line}; first divergence at " \
            f"{self.first_divergence}"


def verify(captured: Iterable[Record], replayed: Iterable[Record]) -> Fidelity:
    """Compare the effect records of two streams position by position.

    ``captured`` may be a ``TraceReader``: a closing record that counts dropped events refuses
    the comparison, as does an ``EventsDropped`` record in either stream.
    """
    captured_effects, contexts = _effects(captured, "captured")
    replayed_effects, _ = _effects(replayed, "replayed")
    total = max(len(captured_effects), len(replayed_effects))
    matched = sum(a == b for a, b in zip(captured_effects, replayed_effects))
    first = None
    for index in range(total):
        mine = captured_effects[index] if index < len(captured_effects) else None
        theirs = replayed_effects[index] if index < len(replayed_effects) else None
        if mine != theirs:
            step, last_input = contexts[min(index, len(contexts) - 1)] if contexts else (-1, None)
            first = Divergence(index, step, mine, theirs, last_input)
            break
    return Fidelity(matched, total, first)


def _effects(stream: Iterable[Record], name: str) -> tuple[list[Record], list[tuple]]:
    """The effect records of ``stream`` and, for each, (step, last input record) before it."""
    effects, contexts = [], []
    step, last_input = -1, None
    for record in stream:
        if type(record) is EventsDropped:
            raise _dropped_error(name, record.count)
        family = record.family
        if family == "effect":
            effects.append(record)
            contexts.append((step, last_input))
        elif family == "input":
            last_input = record
            if type(record) is StepStarted:
                step = record.step
    num_dropped = getattr(stream, "num_dropped", 0)
    if num_dropped:
        raise _dropped_error(name, num_dropped)
    return effects, contexts


def _dropped_error(name: str, count: int) -> KvtraceError:
    return KvtraceError(
        f"the {name} trace dropped {count} events; its effects cannot be compared one for one",
        "Capture again with a larger buffer (fewer drops), or compare without --verify.")
