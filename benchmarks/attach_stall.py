"""How long getting kvtrace's hook into a serving engine without the plugin stops it.

For each method and each of ``--attaches`` rounds: a fresh engine starts serving; 3 s later
``kvtrace capture --method M --duration 2s`` attaches, arms, captures and disarms, while a
sampler (``kvtrace.capture.stalls``) reads every engine thread's state about every
millisecond. Per attach it reports the longest stretch in which some engine thread stood in a
ptrace or signal stop, and for kvtrace's own injector also the time it held the main thread by
its own clock (which includes its two calls running in the engine: an upper bound on what the
main thread lost). Each method's canary is proven once before the rounds (its verdict is
cached), since the canary never touches the engine. Reported: median and longest over the
rounds.

The engine is a ``kvtrace engine`` (plugin off, the demo's busy documents workload at --speed
30), or with ``--vllm-serve PYTHON [--model DIR]`` a real ``vllm serve`` (the tests' own,
``tests/real_server.py``: kvtrace installed in that environment, its plugin off; prefix caching
on, vLLM's defaults otherwise; ``scripts/bootstrap`` makes ``.venv-vllm-serve`` and its tiny
model) with four client threads on 127.0.0.1 sending completions of shared-prefix prompts
(token ids), whose latencies around the attach are reported too (p50, p99, the longest;
against the same clients before the attach).

    .venv/bin/python benchmarks/attach_stall.py [--method ptrace --method lldb] [--attaches 10]
        [--vllm-serve .venv-vllm-serve/bin/python [--model DIR]] [--json]
"""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

from kvtrace.capture.stalls import StallSampler
from kvtrace.cli.demo import BUSY_ENGINE
from kvtrace.engine.process import EngineProcess
from kvtrace.workloads.synth import synthesize
from kvtrace.workloads.workload import EngineShape, write_workload

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from real_server import TINY_MODEL, VllmServe  # noqa: E402 (the tests' own server)

HELD = re.compile(r"KVTRACE_HELD_MS: ([0-9.]+)")
VIA = re.compile(r"capturing pid \d+ \([^)]*\) via (\S+)")


class KvtraceEngine:
    """A serving ``kvtrace engine``, plugin off."""

    def __init__(self, workload: Path) -> None:
        self.engine = EngineProcess([str(workload), "--variant", "unfixed", "--speed", "30"],
                                    {"KVTRACE_PLUGIN": "0", "PATH": "/usr/bin:/bin"})
        self.engine.wait_ready()
        self.engine.send("start")
        self.engine.expect("kvtrace engine: running")
        self.pid = self.engine_core = self.engine.pid
        self.latencies: list[tuple[float, float]] = []

    def stop(self) -> None:
        self.engine.stop()


def latency_figures(latencies: list[tuple[float, float]], since: float, until: float) -> dict:
    """p50, p99 and the longest of the requests that were in flight in [since, until]."""
    seen = sorted(latency for started, latency in latencies
                  if started <= until and started + latency >= since)
    if not seen:
        return {}
    return {"requests": len(seen), "p50_ms": 1000 * seen[len(seen) // 2],
            "p99_ms": 1000 * seen[min(len(seen) - 1, int(len(seen) * 0.99))],
            "max_ms": 1000 * seen[-1]}


def attach_once(start_engine, method: str, directory: Path) -> dict:
    """One engine, one attach by ``method``: the stalls it saw and what the capture said."""
    engine = start_engine()
    try:
        time.sleep(3)
        before = time.monotonic()
        with StallSampler(engine.engine_core) as sampler:
            result = subprocess.run(
                [sys.executable, "-m", "kvtrace", "-v", "capture", "--pid", str(engine.pid),
                 "--method", method, "--duration", "2s", "-o", str(directory / "x.kvtrace")],
                capture_output=True, text=True, timeout=600, cwd="/")
        after = time.monotonic()
        if result.returncode != 0:
            raise SystemExit(f"capture --method {method} failed: {result.stderr[-2000:]}")
        time.sleep(2)  # requests in flight during the attach finish
        via = VIA.search(result.stderr)
        held = HELD.search(result.stderr)
        return {"longest_stop_ms": sampler.stalls.longest_s * 1000,
                "stretches": len(sampler.stalls.stretches),
                "sample_gap_ms": sampler.stalls.longest_gap_s * 1000,
                "held_ms": float(held.group(1)) if held else None,
                "via": via.group(1) if via else None,
                "clients_before": latency_figures(engine.latencies, before - 10, before),
                "clients_during": latency_figures(engine.latencies, before, after)}
    finally:
        engine.stop()


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


@click.command()
@click.option("--method", "methods", multiple=True, default=("ptrace", "lldb"),
              show_default=True)
@click.option("--attaches", type=click.IntRange(min=1), default=10, show_default=True)
@click.option("--vllm-serve", "serve_python", metavar="PYTHON",
              help="Attach to a real vllm serve run by this Python (kvtrace installed there).")
@click.option("--model", help="With --vllm-serve: the model directory it serves (default: the "
                               "tiny model scripts/bootstrap builds).")
@click.option("--json", "as_json", is_flag=True)
def main(methods, attaches, serve_python, model, as_json) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        if serve_python:
            def start_engine():
                return VllmServe(serve_python, model or TINY_MODEL, plugin=False).serve()
        else:
            shape = EngineShape()
            workload = directory / "documents.kvtrace"
            write_workload(workload, synthesize("documents", 600, 0, shape.hash_block_size,
                                                BUSY_ENGINE), shape)

            def start_engine():
                return KvtraceEngine(workload)
        results = {}
        for method in methods:
            rounds = [attach_once(start_engine, method, directory) for _ in range(attaches)]
            assert all(r["via"] == method for r in rounds), rounds
            results[method] = {
                "attaches": attaches,
                "longest_stop_ms": summary([r["longest_stop_ms"] for r in rounds]),
                "held_ms": (summary([r["held_ms"] for r in rounds])
                            if all(r["held_ms"] is not None for r in rounds) else None),
                "sample_gap_ms_max": max(r["sample_gap_ms"] for r in rounds),
                "client_p99_ms": {
                    when: summary([r[f"clients_{when}"]["p99_ms"] for r in rounds])
                    for when in ("before", "during")
                    if all(r[f"clients_{when}"] for r in rounds)},
                "rounds": rounds}
    if as_json:
        print(json.dumps(results, indent=2))
        return
    print(f"{'method':8} {'attaches':>8} {'longest stop, median':>21} {'longest':>9} "
          f"{'held (own clock), median':>25} {'longest':>9}")
    for method, figures in results.items():
        stop, held = figures["longest_stop_ms"], figures["held_ms"]
        print(f"{method:8} {figures['attaches']:>8} {stop['median']:>18.1f} ms "
              f"{stop['max']:>6.1f} ms "
              + (f"{held['median']:>22.2f} ms {held['max']:>6.2f} ms" if held else
                 f"{'-':>25} {'-':>9}"))
        for when, p99 in figures["client_p99_ms"].items():
            print(f"  client p99 {when} the attach: median {p99['median']:.0f} ms "
                  f"({p99['min']:.0f}-{p99['max']:.0f})")


if __name__ == "__main__":
    main()
