"""Replay backends on the bundled Mooncake trace: ``vllm`` (vLLM 0.33's own KVCacheManager, the
fidelity reference) against ``model`` (kvtrace's re-implementation), per variant, in one run.

Target (issue "Fast model backend, what-if sweeps, Parquet export"): the model backend >= 20x
faster than the vllm backend per variant, with identical summaries. Checked here too: the two
record streams are equal record for record (else the first divergence is printed).

The trace is imported as ``kvtrace import mooncake`` does (the default model's geometry), or
given ready with ``--trace`` (a workload imported with other engine flags, e.g. a finer one, or
a capture), or captured mid-flight with ``--midflight``: ``kvtrace demo`` runs in the scratch
directory (a serving ``kvtrace engine``, captured from 3 s to 8 s after its start; about a
minute) and its capture is measured. ``--midflight-async`` captures the same workload on vLLM's
``AsyncScheduler`` (``kvtrace engine --async-scheduling``, which the demo does not run): the
engine serves the demo's workload at its speed and ``kvtrace capture --pid`` captures it for
5 s from 3 s after its start; its snapshot holds a step in flight, and its replays run async
(tokens in flight, ``cache_blocks`` calls). A capture that starts from a snapshot is replayed
from it, as ``kvtrace replay`` does: every backend restores the snapshot's cache and continues
the requests in flight (the restore is outside the timings, which time the replay itself).

Figures per variant and backend, median (min-max) over ``--repeats`` runs, the two backends
alternating within a repeat so both see the same machine load:

* ``cache``: kvtrace's scheduler model driving the backend, records collected in a list: what
  the backends themselves cost;
* ``summary``: time to summary, ``kvtrace replay`` writing no trace (``wall_s``; what each
  configuration of ``kvtrace sweep`` costs): on ``vllm`` the records feed ``ReplaySummary``
  one by one, the ``model`` backend counts the figures itself and makes no record;
* ``replay``: ``kvtrace replay -o DIR`` as the CLI runs it (``wall_s``): it also writes the
  replay trace and computes the summary: on ``vllm`` record by record, on ``model`` the C core
  writes the records as column batches itself and counts the summary from the same reports
  (the two traces written are compared record for record);

and two floors, measured in the same repeats, that bound what any backend can reach:

* ``scheduler``: the scheduler model alone, answered from a recording of the cache's answers
  (the ceiling of every figure: the model backend's ``replay`` writes its records in C, with no
  Python call per record);
* ``sink``: the per-record trace writer and summary in Python over the model's records (what a
  replay paid per record before the model backend wrote its batches in C, and what the ``vllm``
  backend still pays).

    .venv/bin/python benchmarks/replay_backends.py [--variant unfixed --variant fixed]
        [--repeats 3] [--mode replay]
        [--requests N | --trace TRACE | --midflight | --midflight-async] [--json]

Exit status 1 if the streams or summaries differ (the speed target is reported, not enforced).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvtrace.engine_config import derive
from kvtrace.replay.backend import open_backend
from kvtrace.replay.arrivals import arrivals_of
from kvtrace.replay.options import ReplayOptions
from kvtrace.replay.run import replay
from kvtrace.replay.scheduler import Scheduler
from kvtrace.replay.source import RunStart, read_source
from kvtrace.replay.summary import ReplaySummary
from kvtrace.traceio import TraceWriter, read_records, write_trace
from kvtrace.workloads.mooncake import import_mooncake
from kvtrace.workloads.workload import EngineShape, write_workload

TARGET = 20.0
MOONCAKE_LOG = (Path(__file__).resolve().parents[1] / "data" / "mooncake"
                / "synthetic_trace.jsonl")
BACKENDS = ("vllm", "model")
MODES = ("cache", "summary", "replay")


def import_trace(log: Path, directory: Path, num_requests: int | None) -> Path:
    """``kvtrace import mooncake LOG`` with the default engine (optionally the first N)."""
    path = directory / "mooncake.kvtrace"
    shape = EngineShape()
    write_workload(path, import_mooncake(log, shape.hash_block_size), shape)
    if num_requests:
        reader, records = read_records(path)
        kept = set(sorted(r.req for r in arrivals_of(records))[:num_requests])
        write_trace(path, reader.header, [r for r in records if r.req in kept])
    return path


def capture_demo(directory: Path) -> Path:
    """``kvtrace demo``'s capture of its serving engine, mid-flight (its start snapshot holds
    the requests in flight then)."""
    workdir = directory / "demo"
    subprocess.run([sys.executable, "-m", "kvtrace", "demo", "--workdir", str(workdir)],
                   check=True, stdout=subprocess.DEVNULL)
    return workdir / "capture.kvtrace"


def capture_async_engine(directory: Path) -> Path:
    """The demo's workload served by ``kvtrace engine --async-scheduling`` (vLLM's
    ``AsyncScheduler``) at the demo's speed, captured mid-flight by ``kvtrace capture --pid``
    for the demo's capture time, from its arm time after the start on."""
    from kvtrace.cli import demo
    from kvtrace.engine.process import EngineProcess
    from kvtrace.workloads.synth import synthesize

    workload, capture = directory / "workload.kvtrace", directory / "capture.kvtrace"
    shape = EngineShape(model=demo.DEMO_MODEL, num_gpu_blocks=demo.DEMO_POOL_BLOCKS)
    write_workload(workload, synthesize(demo.DEMO_PRESET, demo.DEMO_REQUESTS, 0,
                                        shape.hash_block_size, demo.BUSY_ENGINE), shape)
    engine = EngineProcess([str(workload), "--variant", "unfixed", "--speed",
                            str(demo.DEMO_SPEED), "--async-scheduling"],
                           {**os.environ, "KVTRACE_PLUGIN": "1"}, cwd=str(directory))
    try:
        engine.wait_ready()
        engine.send("start")
        engine.expect("kvtrace engine: running")
        time.sleep(demo.ARM_AFTER_S)
        subprocess.run([sys.executable, "-m", "kvtrace", "capture", "--pid", str(engine.pid),
                        "--duration", f"{demo.CAPTURE_S['full']:g}s", "-o", str(capture)],
                       check=True, stdout=subprocess.DEVNULL)
    finally:
        engine.stop(grace_s=10)
    return capture


class Recorder:
    """A backend wrapper that records the answers the scheduler gets (for the floor)."""

    def __init__(self, backend) -> None:
        self.backend, self.answers = backend, []
        self.num_gpu_blocks = backend.num_gpu_blocks

    def __getattr__(self, name: str):
        method = getattr(self.backend, name)

        def call(*args, **kwargs):
            answer = method(*args, **kwargs)
            self.answers.append(answer)
            return answer
        return call


class Answers:
    """A stand-in cache that replays recorded answers: the scheduler model alone."""

    def __init__(self, answers: list, num_gpu_blocks: int) -> None:
        answer = iter(answers).__next__
        self.num_gpu_blocks = num_gpu_blocks
        for name in ("new_step", "add_request", "get_computed_blocks", "allocate_slots",
                     "end_schedule", "advance", "free", "preempt", "sync_request",
                     "cache_blocks"):
            setattr(self, name, lambda *args, **kwargs: answer())


def schedule(cache, config, settings, start: RunStart) -> None:
    """The scheduler model driving ``cache`` from ``start`` (a snapshot's requests in flight)."""
    Scheduler(cache, config, settings).run(start.arrivals, None, start.in_flight, start.start_ns)


def cache_run(backend: str, config, settings, variant: str, start: RunStart,
              wrap=None) -> tuple[float, list, object]:
    """(seconds, records, the cache it drove) of the scheduler model driving ``backend``
    (``wrap``ped), started from ``start``'s snapshot if it has one."""
    records: list = []
    with open_backend(backend, config, variant, records.append, start.snapshot) as cache:
        driven = cache if wrap is None else wrap(cache)
        started = time.perf_counter()
        schedule(driven, config, settings, start)
        seconds = time.perf_counter() - started
    return seconds, records, driven


def summary_of(config, start: RunStart, records: list) -> dict:
    """The summary of a cache run, as ``kvtrace replay``'s: from its snapshot's records on."""
    summary = ReplaySummary(config)
    for record in [*(start.snapshot.records() if start.snapshot else ()), *records]:
        summary(record)
    return summary.to_dict()


def first_divergence(reference: list, replayed: list) -> str | None:
    for index, (mine, theirs) in enumerate(zip(reference, replayed)):
        if mine != theirs:
            return f"record #{index}: vllm {mine!r}, model {theirs!r}"
    if len(reference) != len(replayed):
        return f"{len(reference)} vllm records, {len(replayed)} model records"
    return None


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "runs": values}


def text(figure: dict, unit: str = "s") -> str:
    return (f"{figure['median']:.2f}{unit} ({figure['min']:.2f}-{figure['max']:.2f})"
            if unit == "s" else
            f"{figure['median']:.1f}x ({figure['min']:.1f}-{figure['max']:.1f})")


def measure_variant(variant: str, trace: Path, config, settings, start: RunStart, repeats: int,
                    outdir: Path, modes: tuple[str, ...] = MODES) -> dict:
    """Each repeat runs both backends and the floors back to back, so every ratio (and every
    ceiling) compares runs under the same machine load."""
    times: dict[str, list[float]] = {f"{mode} {backend}": [] for mode in modes
                                     for backend in BACKENDS}
    times.update(scheduler=[], sink=[])
    problems: list[str] = []
    answers = cache_run("model", config, settings, variant, start, Recorder)[2].answers
    header = read_records(trace)[0].header
    records: dict[str, list] = {}
    cache_repeats = repeats if "cache" in modes else 1  # else once, for the records
    for repeat in range(cache_repeats):
        for backend in BACKENDS:
            seconds, kept, _ = cache_run(backend, config, settings, variant, start)
            if "cache" in modes:
                times[f"cache {backend}"].append(seconds)
            records[backend] = kept if repeat == cache_repeats - 1 else []
            del kept
    divergence = first_divergence(records["vllm"], records["model"])
    if divergence:
        problems.append(f"record streams differ: {divergence}")
    summaries = {backend: summary_of(config, start, records[backend]) for backend in BACKENDS}
    if summaries["vllm"] != summaries["model"]:
        problems.append("cache-run summaries differ")
    model_records = records.pop("model")
    del records["vllm"]
    replay_summaries = {}
    for _ in range(repeats):
        for backend in BACKENDS:  # `kvtrace replay` itself, without and with the trace
            for mode, write_traces in (("summary", False), ("replay", True)):
                if mode not in modes:
                    continue
                result = replay(ReplayOptions(source=str(trace), outdir=str(outdir / backend),
                                              variants=(variant,), backend=backend,
                                              write_traces=write_traces))
                times[f"{mode} {backend}"].append(result.variants[0].wall_s)
                replay_summaries[mode, backend] = result.variants[0].summary
        started = time.perf_counter()
        schedule(Answers(answers, config.num_gpu_blocks), config, settings, start)
        times["scheduler"].append(time.perf_counter() - started)
        started = time.perf_counter()  # the per-record sink alone
        with open(os.devnull, "wb") as devnull:
            writer = TraceWriter(devnull, header)
            summary = ReplaySummary(config)
            for record in model_records:
                writer.write(record)
                summary(record)
            writer.close()
        times["sink"].append(time.perf_counter() - started)
    for (mode, backend), summary in replay_summaries.items():
        if summary != summaries["vllm"]:
            problems.append(f"`kvtrace replay` ({mode}, {backend}) differs from the cache run's "
                            "summary")
    if "replay" in modes:  # the traces both wrote, record for record
        written = [read_records(outdir / backend / f"{trace.stem}.{variant}.kvtrace")[1]
                   for backend in BACKENDS]
        divergence = first_divergence(*written)
        if divergence:
            problems.append(f"the traces `kvtrace replay -o` wrote differ: {divergence}")
        del written

    def paired(numerators: list[float], denominators: list[float]) -> dict:
        return spread([top / bottom for top, bottom in zip(numerators, denominators)])

    figures = {mode: {backend: spread(times[f"{mode} {backend}"]) for backend in BACKENDS}
               for mode in modes}
    for mode in modes:
        figures[mode]["ratio"] = paired(times[f"{mode} vllm"], times[f"{mode} model"])
    return {"variant": variant, "records": len(model_records), "figures": figures,
            "scheduler_floor": spread(times["scheduler"]), "sink_floor": spread(times["sink"]),
            "best_ratio": {mode: paired(times[f"{mode} vllm"], times["scheduler"])
                           for mode in modes},
            "summary": summaries["model"], "problems": problems}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log", type=Path, default=MOONCAKE_LOG,
                        help="Mooncake hash_ids JSONL (default: the bundled synthetic trace)")
    parser.add_argument("--variant", dest="variants", action="append",
                        help="variant to measure; repeat (default: unfixed and fixed)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=None,
                        help="only the first N requests (a quick look; the target is the full)")
    parser.add_argument("--trace", type=Path, default=None,
                        help="a workload or capture to replay instead of importing --log (a "
                        "capture from its start snapshot)")
    sources = parser.add_mutually_exclusive_group()
    sources.add_argument("--midflight", action="store_true",
                         help="capture `kvtrace demo`'s engine mid-flight (about a minute) and "
                         "replay that capture from its start snapshot")
    sources.add_argument("--midflight-async", action="store_true",
                         help="the same on vLLM's AsyncScheduler: the demo's workload served by "
                         "`kvtrace engine --async-scheduling`, captured mid-flight")
    parser.add_argument("--mode", dest="modes", action="append", choices=MODES,
                        help="a figure to measure; repeat (default: all three)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON too")
    args = parser.parse_args()
    import vllm.v1.core.kv_cache_manager  # noqa: F401 (the slow import, outside any timing)

    results = []
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        trace = (args.trace or (capture_demo(directory) if args.midflight
                                else capture_async_engine(directory) if args.midflight_async
                                else import_trace(args.log, directory, args.requests)))
        source = read_source(str(trace))  # as `kvtrace replay` reads and starts it
        config, settings = derive(source.header.config, str(trace))
        settings = source.scheduler_settings(settings)
        start = source.start(warm=True)
        snapshot = (f", {len(start.in_flight)} in flight at its start snapshot "
                    f"({len(start.snapshot.keys)} keys)" if start.snapshot else "")
        print(f"{trace.name}: {len(start.arrivals)} requests arriving{snapshot}, "
              f"{config.num_gpu_blocks} blocks, groups "
              f"{[(g.kind, g.block_size) for g in config.kv_cache_groups]}, hash unit "
              f"{config.hash_block_size}; {args.repeats} repeats", flush=True)
        for variant in args.variants or ["unfixed", "fixed"]:
            result = measure_variant(variant, trace, config, settings, start, args.repeats,
                                     directory / variant, tuple(args.modes or MODES))
            results.append(result)
            figures = result["figures"]
            print(f"\n{variant}: {result['records']} records, identical streams and summaries: "
                  f"{'yes' if not result['problems'] else 'NO'}")
            for problem in result["problems"]:
                print(f"  FAIL {problem}")
            for mode in args.modes or MODES:
                ratio = figures[mode]["ratio"]
                verdict = "PASS" if ratio["median"] >= TARGET else "FAIL"
                print(f"  {mode:7}  vllm {text(figures[mode]['vllm'])}  model "
                      f"{text(figures[mode]['model'])}  ratio {text(ratio, 'x')}  "
                      f"{verdict} (target {TARGET:.0f}x; a free cache: "
                      f"{text(result['best_ratio'][mode], 'x')})")
            print(f"  floors   scheduler model alone {text(result['scheduler_floor'])}, replay "
                  f"sink {text(result['sink_floor'])}", flush=True)
    if args.json:
        print(json.dumps(results, indent=2, default=str))
    return 1 if any(result["problems"] for result in results) else 0


if __name__ == "__main__":
    sys.exit(main())
