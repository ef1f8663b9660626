"""A source trace (a workload or a capture) read once for replay: its arrivals, its start
snapshot, and what a capture tells a rescheduled replay (``Source``), and where a run of it
starts (``RunStart``).

The source is streamed, never held: a ``Source`` keeps its arrivals (hash ids as compact
arrays), and lockstep re-reads the captured calls from its file. A ``Source`` read once can
serve many runs (a sweep's).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import Any

from kvtrace.engine_config import (
    SchedulerSettings,
    check_hash_ids,
    check_possible,
    check_request,
)
from kvtrace.events import (
    EventsDropped,
    Record,
    RequestQueue,
    RequestState,
    SlotsAllocated,
    TraceHeader,
)
from kvtrace.files import file_digest, require_regular_file
from kvtrace.replay.arrivals import Arrival, InFlight, arrivals_of
from kvtrace.replay.captured import (CaptureEnds, DraftAcceptance, StepClock, StepCosts,
                                     StepFit)
from kvtrace.replay.snapshot import STATE_TYPES, StartSnapshot, snapshot_of
from kvtrace.replay.snapshot_checks import check_snapshot
from kvtrace.traceio import TraceReader


@dataclass(frozen=True)
class Source:
    """What ``replay`` keeps of a source trace, read once: its arrivals, and what the lockstep
    checks need of the rest (lockstep re-reads the captured calls from ``path``)."""

    path: str
    header: TraceHeader
    arrivals: list[Arrival]
    truncated: bool
    num_dropped: int  # the closing record's count, else the sum of the drop markers
    num_captured_calls: int  # allocate_slots records: what lockstep re-issues
    digest: str
    snapshot: StartSnapshot | None = None  # a capture that armed mid-flight starts with one
    ends: CaptureEnds | None = None  # how far a capture's requests got (a capture only)
    step_fit: StepFit | None = None  # how long the captured engine's steps took
    step_clock: StepClock | None = None  # the captured engine's steps, as a clock
    draft_acceptance: float | None = None  # a drafting engine's, as the capture shows it
    draft_answers: dict[tuple[int, int], int] = dataclasses.field(default_factory=dict)

    def scheduler_settings(self, settings: SchedulerSettings) -> SchedulerSettings:
        """``settings`` for a run of this source: a capture's arrivals join on the captured
        steps they joined (``step_clock``), else on its engine's clock with steps that cost
        what the engine's did (``step_fit``)."""
        if self.draft_acceptance is not None:
            settings = dataclasses.replace(settings, draft_acceptance=self.draft_acceptance,
                                           draft_answers=self.draft_answers)
        if self.step_clock is not None:
            return dataclasses.replace(settings, step_clock=True)
        if self.step_fit is None:
            return settings
        return dataclasses.replace(settings, step_overhead_ns=self.step_fit.overhead_ns,
                                   ns_per_token=self.step_fit.ns_per_token)

    def _on_clock(self, ts_ns: int) -> int:
        """A time of the capture on the run's clock: its step, on the step clock."""
        return ts_ns if self.step_clock is None else self.step_clock.step_of(ts_ns)

    def start(self, warm: bool) -> RunStart:
        """What a run of this source starts from. A capture that armed mid-flight starts from
        its snapshot: the cache as it was, and the requests in flight, each continuing as far
        as the capture saw it (``CaptureEnds``: to its end, or cut where the window ended).
        Not ``warm`` (a replay on another pool or retention, which the snapshot cannot
        describe): from an empty cache, the requests in flight arriving at the snapshot."""
        snapshot = self.snapshot
        arrivals = self.arrivals
        if self.step_clock is not None:
            arrivals = [dataclasses.replace(
                a, arrival_ns=self.step_clock.join_step(a.req, a.arrival_ns)) for a in arrivals]
        if snapshot is None:
            return RunStart(arrivals)
        unit = self.header.config.hash_block_size
        ends = self.ends or CaptureEnds()
        in_flight = []
        for r in snapshot.requests:
            num_prompt_units = r.prompt_len // unit
            spec = Arrival(r.req, r.prompt_len, r.hash_ids[:num_prompt_units],
                           ends.decode_length(r.req, r.prompt_len, r.num_tokens) or r.max_tokens,
                           r.arrival_ns,
                           snapshot.known_hash_ids(r)[num_prompt_units:])
            in_flight.append(InFlight(spec, r.queue == RequestQueue.RUNNING,
                                      r.num_computed_tokens, r.num_tokens,
                                      r.shared_prefix_boundary, r.num_output_placeholders,
                                      r.num_in_flight_tokens, r.num_stale_output_tokens))
        if not warm:
            at_snapshot = [dataclasses.replace(held.spec,
                                               arrival_ns=self._on_clock(snapshot.started.ts_ns))
                           for held in in_flight]
            return RunStart(sorted([*at_snapshot, *arrivals], key=lambda a: a.arrival_ns))
        return RunStart(arrivals, snapshot, in_flight, self._on_clock(snapshot.started.ts_ns))


@dataclass(frozen=True)
class RunStart:
    """Where a run starts: the arrivals to come, and the engine's state then (a snapshot's
    cache, and its requests in flight in their queues' order, at ``start_ns``)."""

    arrivals: list[Arrival]
    snapshot: StartSnapshot | None = None
    in_flight: list[InFlight] = dataclasses.field(default_factory=list)
    start_ns: int = 0


def read_header(path: str) -> TraceHeader:
    """The header alone (the records are not read), from a file replay may read again."""
    require_regular_file(path, "replay reads it more than once")
    with TraceReader(path) as reader:
        return reader.header


def read_source(path: str) -> Source:
    """Read a source once: its arrivals, its start snapshot, and (a capture) how far each of
    its requests got, each decoding as far as the capture saw it."""
    require_regular_file(path, "replay reads it more than once")
    reader = TraceReader(path)
    counts: Counter = Counter()
    state: list[Record] = []
    in_flight: set[int] = set()
    config = reader.header.config  # without one, replay refuses the source anyway
    ends, step_costs = CaptureEnds(), StepCosts()
    acceptance = DraftAcceptance(drafting=config is not None and config.num_speculative_tokens > 0)

    def counted(batches):
        for batch in batches:
            for record_type, columns in zip(batch.types, batch.columns):
                if record_type is SlotsAllocated:
                    counts["calls"] += len(columns[0])
                elif record_type is EventsDropped:
                    counts["dropped"] += sum(columns[0])
                elif record_type is RequestState:
                    in_flight.update(columns[0])
            if any(record_type in STATE_TYPES for record_type in batch.types):
                state.extend(r for r in batch.records() if r.family == "state")
            ends.add_batch(batch)
            step_costs.add_batch(batch)
            acceptance.add_batch(batch)
            yield batch

    in_flight_outputs: dict[int, Any] = {}
    arrivals = arrivals_of(counted(reader.batches()), in_flight, in_flight_outputs)
    if config is not None:
        check_possible(config)
    snapshot = snapshot_of(state)
    if snapshot is not None and config is not None:
        check_snapshot(snapshot, config, path)
        for req, output_hash_ids in in_flight_outputs.items():
            check_hash_ids(req, output_hash_ids)
        snapshot.output_hash_ids = in_flight_outputs
    if counts["calls"]:  # a capture: each request decodes as far as it was seen to
        arrivals = [dataclasses.replace(a, max_tokens=ends.decode_length(a.req, a.prompt_len)
                                        or a.max_tokens) for a in arrivals]
    for arrival in arrivals if config else ():
        check_request(arrival.req, arrival.prompt_len, arrival.max_tokens, arrival.hash_ids,
                      config.hash_block_size, config.num_hash_lookahead_tokens)
        check_hash_ids(arrival.req, arrival.output_hash_ids or ())
    return Source(path, reader.header, arrivals, reader.truncated,
                  reader.num_dropped or counts["dropped"], counts["calls"], file_digest(path),
                  snapshot, ends if counts["calls"] else None,
                  step_costs.fit() if counts["calls"] else None,
                  step_costs.clock() if counts["calls"] else None,
                  acceptance.rate() if counts["calls"] else None,
                  acceptance.answers if counts["calls"] else {})
