"""A what-if sweep at scale: 8 pool sizes x 2 variants of the bundled Mooncake trace.

The trace (data/mooncake/synthetic_trace.jsonl, 3,993 requests, 61 M prompt tokens) is
imported once with `kvtrace import mooncake` and cached beside the output; then `kvtrace sweep`
runs the grid end to end, as an operator would: a fresh process, the backend's imports, every
configuration, the outputs. Target: <= 60 s on 2 cores.

Besides the wall time it reports the configurations' own replay times (spread, and their sum:
the serial baseline the parallel run is measured against, in the same run). ``--baseline NAME``
runs the same sweep on a second backend afterwards (e.g. ``vllm``: minutes) and reports the
ratio of the two end-to-end times and whether every row's figures agree. ``--trace`` sweeps a
workload imported with other engine flags instead.

    .venv/bin/python benchmarks/sweep.py [--backend NAME] [--baseline NAME] [-j N]
        [--requests N | --trace WORKLOAD]
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

LOG = Path(__file__).resolve().parents[1] / "data" / "mooncake" / "synthetic_trace.jsonl"
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


def sweep(trace: Path, outdir: Path, backend: str | None, jobs: int | None) -> tuple[dict, float]:
    """``kvtrace sweep`` of the grid in a fresh process: (sweep.json, end-to-end seconds)."""
    command = KVTRACE + ["sweep", str(trace), "--pool-fraction", FRACTIONS,
                         "--variant", VARIANTS, "-o", str(outdir)]
    command += ["--backend", backend] if backend else []
    command += ["-j", str(jobs)] if jobs else []
    print(" ".join(command[2:]), flush=True)
    started = time.perf_counter()
    subprocess.run(command, check=True)
    wall = time.perf_counter() - started
    return json.loads((outdir / "sweep.json").read_text()), wall


def figures(rows: list[dict]) -> list[dict]:
    """Rows without their timings."""
    return [{k: v for k, v in row.items() if k != "wall_s"} for row in rows]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log", type=Path, default=LOG, help="Mooncake hash_ids JSONL")
    parser.add_argument("--requests", type=int, default=None,
                        help="only the first N requests (a quick look; the target is for all)")
    parser.add_argument("--backend", default=None, help="default: kvtrace sweep's default")
    parser.add_argument("--baseline", default=None,
                        help="a second backend to sweep afterwards, for the ratio (e.g. vllm)")
    parser.add_argument("--trace", type=Path, default=None,
                        help="a workload trace to sweep instead of importing --log")
    parser.add_argument("-j", "--jobs", type=int, default=None, help="default: the CPUs here")
    parser.add_argument("--workdir", type=Path,
                        default=Path(tempfile.gettempdir()) / "kvtrace-bench-sweep")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    trace = args.trace or workload(args.log, args.requests, args.workdir)
    result, wall = sweep(trace, args.workdir / "out", args.backend, args.jobs)
    times = [row["wall_s"] for row in result["rows"]]
    serial = sum(times)
    print(f"\nbackend {result['backend']}, {len(times)} configurations in {result['runner']}, "
          f"{os.cpu_count()} CPUs")
    print(f"per configuration (replay only): median {statistics.median(times):.1f} s, "
          f"min {min(times):.1f} s, max {max(times):.1f} s; sum {serial:.1f} s")
    print(f"sweep: {result['wall_s']:.1f} s in the runner; end to end {wall:.1f} s "
          f"(process start, imports, outputs included)")
    print(f"serial replay time / end-to-end wall = {serial / wall:.2f}x; "
          f"target <= {TARGET_S:.0f} s: {'met' if wall <= TARGET_S else 'NOT met'} "
          f"({wall / TARGET_S:.2f}x the target)", flush=True)
    if not args.baseline:
        return 0
    baseline, baseline_wall = sweep(trace, args.workdir / "baseline", args.baseline, args.jobs)
    same = figures(baseline["rows"]) == figures(result["rows"])
    print(f"\nbaseline {baseline['backend']}: end to end {baseline_wall:.1f} s, "
          f"{baseline_wall / wall:.1f}x the {result['backend']} backend's; "
          f"every row's figures identical: {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
