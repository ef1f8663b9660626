"""Lockstep replay: re-issue a captured trace's input records, in order, against a backend.

With the variant the engine ran, the backend's effect records must equal the captured ones one
for one; ``verify`` measures that (the fidelity check) and reports the first divergence with the
input that led to it. A trace that lost events is refused: its effects cannot be matched.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from kvtrace.errors import KvtraceError
from kvtrace.events import (
    BlocksCached,
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

    ``records`` is read twice, so it must iterate anew each time (a list, or a trace re-read:
    ``replay`` never holds a capture in memory). The backend reports its own records through
    its sink. Output hash ids a request completed during decode (``HashesExtended``) are
    declared up front so the replay hands them out as the request's tokens grow. Each captured
    ``allocate_slots`` first takes the request's captured progress (``CacheBackend.sync_request``)
    and passes vLLM's admission terms on; blocks the engine freed outside the cache's calls are
    released by id.
    """
    output_hash_ids: dict[int, list[int]] = {}
    for record in records:
        if type(record) is HashesExtended:
            output_hash_ids.setdefault(record.req, []).extend(record.hash_ids)
    num_issued = 0
    for seq, record in enumerate(records):
        try:
            num_issued += _reissue(record, backend, output_hash_ids)
        except KvtraceError:
            raise
        except (LookupError, ValueError, TypeError, AssertionError, AttributeError) as error:
            # vLLM's cache met a call it could never have made: the trace is not a capture
            raise ImpossibleCallError(
                f"record {seq} ({type(record).__struct_config__.tag}) cannot be re-issued: "
                f"{type(error).__name__}: {error}") from error
    return num_issued


class ImpossibleCallError(KvtraceError):
    """A captured call the cache could never have been asked (a damaged or hand-made trace)."""

    default_hint = ("Lockstep re-issues a capture's calls as recorded; replay this trace "
                    "without --lockstep, or capture it again.")


def _reissue(record: Record, backend: CacheBackend,
             output_hash_ids: dict[int, list[int]]) -> bool:
    """Make ``record``'s call on ``backend``, if it is an input; whether it was one."""
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
        backend.sync_request(record.req, record.num_computed_tokens, record.num_tokens,
                             record.num_in_flight_tokens)
        backend.allocate_slots(record.req, record.num_new_tokens,
                               record.num_new_computed_tokens, record.num_lookahead_tokens,
                               full_sequence_must_fit=record.full_sequence_must_fit,
                               reserved_blocks=record.reserved_blocks,
                               has_scheduled_reqs=record.has_scheduled_reqs)
    elif kind is BlocksCached:
        backend.sync_request(record.req, record.num_computed_tokens, record.num_tokens)
        backend.cache_blocks(record.req, record.num_tokens_to_cache)
    elif kind is RequestFinished:
        backend.free(record.req, record.status)
    elif kind is RequestPreempted:
        backend.preempt(record.req)
    elif kind is BlocksReleased:
        backend.release_blocks(record.block_ids)
    else:
        return False
    return True


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
    cut: int = 0  # captured effects of the call a stop cut (``verify``): not compared

    @property
    def ratio(self) -> float:
        return self.matched / self.total if self.total else 1.0

    def __str__(self) -> str:
        line = f"{self.matched}/{self.total} effect records match ({self.ratio:.2%})"
        if self.cut:
            line += (f" ({self.cut} more, of a call the capture's stop cut before its input "
                     "record, not compared)")
        return line if self.first_divergence is None else f"{line}; first divergence at " \
            f"{self.first_divergence}"


def verify(captured: Iterable[Record], replayed: Iterable[Record]) -> Fidelity:
    """Compare the effect records of two streams position by position, as they stream.

    ``captured`` may be a ``TraceReader``: a closing record that counts dropped events refuses
    the comparison, as does an ``EventsDropped`` record in either stream.

    A live call's input record is written in front of its effects when the call returns, so a
    capture stopped while a call ran can end with that call's effects and no input: captured
    effects past the replayed stream's end that no input follows are counted as ``cut``, not
    compared (the replay never saw the call).
    """
    matched = total = 0
    first = None
    context: tuple[int, Record | None] = (-1, None)  # of the last captured effect seen
    past_replay: list[tuple[int, Record, tuple]] = []  # captured effects the replay lacks
    inputs = [0, 0]  # captured inputs: read in all, and read when its last effect came
    pairs = itertools.zip_longest(_effects(captured, "captured", inputs),
                                  _effects(replayed, "replayed"))
    for index, (mine, theirs) in enumerate(pairs):
        if mine is not None:
            mine, *context = mine
        if theirs is None and mine is not None:
            past_replay.append((index, mine, tuple(context)))
            continue
        theirs = theirs[0] if theirs is not None else None
        total += 1
        if mine == theirs:
            matched += 1
        elif first is None:
            first = Divergence(index, context[0], mine, theirs, context[1])
    last_input = context[1]
    cut = 0
    for index, mine, (step, before) in past_replay:
        if before is last_input and inputs[0] == inputs[1]:  # no input after it: cut
            cut += 1
            continue
        total += 1
        if first is None:
            first = Divergence(index, step, mine, None, before)
    return Fidelity(matched, total, first, cut)


def _effects(stream: Iterable[Record], name: str, inputs: list[int] | None = None
             ) -> Iterator[tuple[Record, int, Record | None]]:
    """The effect records of ``stream``, each with the step and the last input before it;
    ``inputs[0]`` counts the inputs read, ``inputs[1]`` what it was at the last effect."""
    step, last_input = -1, None
    counts = inputs if inputs is not None else [0, 0]
    for record in stream:
        if type(record) is EventsDropped:
            raise _dropped_error(name, record.count)
        family = record.family
        if family == "effect":
            counts[1] = counts[0]
            yield record, step, last_input
        elif family == "input":
            counts[0] += 1
            last_input = record
            if type(record) is StepStarted:
                step = record.step
    num_dropped = getattr(stream, "num_dropped", 0)
    if num_dropped:
        raise _dropped_error(name, num_dropped)


def _dropped_error(name: str, count: int) -> KvtraceError:
    return KvtraceError(
        f"the {name} trace dropped {count} events; its effects cannot be compared one for one",
        "Capture again with a larger buffer (fewer drops), or compare without --verify.")
