"""How long getting kvtrace's hook into a serving engine without the plugin stops it.

For each method and each of ``--attaches`` rounds: a fresh ``kvtrace engine`` (plugin off, the
demo's busy documents workload at --speed 30) starts serving; 3 s later ``kvtrace capture
--method M --duration 2s`` attaches, arms, captures and disarms, while a sampler
(``kvtrace.capture.stalls``) reads every engine thread's state about every millisecond. Per
attach it reports the longest stretch in which some engine thread stood in a ptrace or signal
stop, and for kvtrace's own injector also the time it held the main thread by its own clock
(which includes its two calls running in the engine: an upper bound on what the main thread
lost). Each method's canary is proven once before the rounds (its verdict is cached), since
the canary never touches the engine. Reported: median and longest over the rounds.

    .venv/bin/python benchmarks/attach_stall.py [--method ptrace --method lldb] [--attaches 10]
        [--json]
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

HELD = re.compile(r"KVTRACE_HELD_MS: ([0-9.]+)")
VIA = re.compile(r"capturing pid \d+ \([^)]*\) via (\S+)")


def attach_once(workload: Path, method: str, directory: Path) -> dict:
    """One engine, one attach by ``method``: the stalls it saw and what the capture said."""
    engine = EngineProcess([str(workload), "--variant", "unfixed", "--speed", "30"],
                           {"KVTRACE_PLUGIN": "0", "PATH": "/usr/bin:/bin"})
    try:
        engine.wait_ready()
        engine.send("start")
        engine.expect("kvtrace engine: running")
        time.sleep(3)
        with StallSampler(engine.pid) as sampler:
            result = subprocess.run(
                [sys.executable, "-m", "kvtrace", "-v", "capture", "--pid", str(engine.pid),
                 "--method", method, "--duration", "2s", "-o", str(directory / "x.kvtrace")],
                capture_output=True, text=True, timeout=600, cwd="/")
        if result.returncode != 0:
            raise SystemExit(f"capture --method {method} failed: {result.stderr[-2000:]}")
        via = VIA.search(result.stderr)
        held = HELD.search(result.stderr)
        return {"longest_stop_ms": sampler.stalls.longest_s * 1000,
                "stretches": len(sampler.stalls.stretches),
                "sample_gap_ms": sampler.stalls.longest_gap_s * 1000,
                "held_ms": float(held.group(1)) if held else None,
                "via": via.group(1) if via else None}
    finally:
        engine.stop()


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


@click.command()
@click.option("--method", "methods", multiple=True, default=("ptrace", "lldb"),
              show_default=True)
@click.option("--attaches", type=click.IntRange(min=1), default=10, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def main(methods, attaches, as_json) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        shape = EngineShape()
        workload = directory / "documents.kvtrace"
        write_workload(workload, synthesize("documents", 600, 0, shape.hash_block_size,
                                            BUSY_ENGINE), shape)
        results = {}
        for method in methods:
            rounds = [attach_once(workload, method, directory) for _ in range(attaches)]
            assert all(r["via"] == method for r in rounds), rounds
            results[method] = {
                "attaches": attaches,
                "longest_stop_ms": summary([r["longest_stop_ms"] for r in rounds]),
                "held_ms": (summary([r["held_ms"] for r in rounds])
                            if all(r["held_ms"] is not None for r in rounds) else None),
                "sample_gap_ms_max": max(r["sample_gap_ms"] for r in rounds),
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


if __name__ == "__main__":
    main()
