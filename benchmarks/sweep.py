"""A what-if sweep at scale: 8 pool sizes x 2 variants of the bundled Mooncake trace.

The trace (shared/data/mooncake/synthetic_trace.jsonl, 3,993 requests, 61 M prompt tokens) is
imported once with `kvtrace import mooncake` and cached beside the output; then `kvtrace sweep`
runs the grid end to end, as an operator would: a fresh process, the backend's imports, every
configuration, the outputs. Target: <= 60 s on 2 cores.

Besides the wall time it reports the configurations' own replay times (spread, and their sum:
the serial baseline the parallel run is measured against, in the same run).

    .venv/bin/python benchmarks/sweep.py [--backend NAME] [-j N] [--requests N]
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

LOG = Path(__file__).resolve().parents[2] / "shared" / "data" / "mooncake" / "synthetic_trace.jsonl"
FRACTIONS = "0.05,0.1,0.15,0.2,0.25,0.3,0.35,0.4"
VARIANTS = "unfixed,fixed"
TARGET_S = 60.0
KVTRACE = [sys.executable, "-m", "kvtrace"]


def workload(log: Path, requests: int | None, workdir: Path) -> Path:
    """The imported trace (the first ``requests`` lines of the log, when given), cached."""
    stem = f"mooncake-{requests or 'all'}"
    trace = workdir / f"{stem}.kvtrace"
    if trace.exists():
        return trace
    if requests:
        lines = log.read_text().splitlines(keepends=True)[:requests]
        log = workdir / f"{stem}.jsonl"
        log.write_text("".join(lines))
    subprocess.run(KVTRACE + ["import", "mooncake", str(log), "-o", str(trace)], check=True)
    return trace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log", type=Path, default=LOG, help="Mooncake hash_ids JSONL")
    parser.add_argument("--requests", type=int, default=None,
                        help="only the first N requests (a quick look; the target is for all)")
    parser.add_argument("--backend", default=None, help="default: kvtrace sweep's default")
    parser.add_argument("-j", "--jobs", type=int, default=None, help="default: the CPUs here")
    parser.add_argument("--workdir", type=Path,
                        default=Path(tempfile.gettempdir()) / "kvtrace-bench-sweep")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    trace = workload(args.log, args.requests, args.workdir)
    outdir = args.workdir / "out"
    command = KVTRACE + ["sweep", str(trace), "--pool-fraction", FRACTIONS,
                         "--variant", VARIANTS, "-o", str(outdir)]
    command += ["--backend", args.backend] if args.backend else []
    command += ["-j", str(args.jobs)] if args.jobs else []
    print(" ".join(command[2:]), flush=True)
    started = time.perf_counter()
    subprocess.run(command, check=True)
    wall = time.perf_counter() - started
    sweep = json.loads((outdir / "sweep.json").read_text())
    times = [row["wall_s"] for row in sweep["rows"]]
    serial = sum(times)
    print(f"\nbackend {sweep['backend']}, {len(times)} configurations in {sweep['runner']}, "
          f"{os.cpu_count()} CPUs")
    print(f"per configuration (replay only): median {statistics.median(times):.1f} s, "
          f"min {min(times):.1f} s, max {max(times):.1f} s; sum {serial:.1f} s")
    print(f"sweep: {sweep['wall_s']:.1f} s in the runner; end to end {wall:.1f} s "
          f"(process start, imports, outputs included)")
    print(f"serial replay time / end-to-end wall = {serial / wall:.2f}x; "
          f"target <= {TARGET_S:.0f} s: {'met' if wall <= TARGET_S else 'NOT met'} "
          f"({wall / TARGET_S:.2f}x the target)")


if __name__ == "__main__":
    main()
