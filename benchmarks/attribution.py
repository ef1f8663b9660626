"""Miss attribution on a real replay: the streaming pass against reading the same trace.

Give it a replay output (e.g. the Mooncake synthetic trace replayed on the real vLLM cache):

    .venv/bin/kvtrace import mooncake data/mooncake/synthetic_trace.jsonl -o m.kvtrace
    .venv/bin/kvtrace replay m.kvtrace --variant unfixed -o runs/
    .venv/bin/python benchmarks/attribution.py runs/m.unfixed.kvtrace [--repeats 3]

Each repeat reads the trace once (the baseline: ``TraceReader.batches()``, what any analysis
pays) and attributes it once; it prints CPU seconds (this process and its children only, so
that other jobs on a shared machine do not count) and wall seconds, the median with the range, and the ratio of
attribution to reading. With ``--load``, each repeat also loads the trace into a scratch DuckDB
file twice: as ``kvtrace load`` does, and with the attribution pass left out (the baseline).
Target: seconds, not minutes, for a few million records.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from unittest import mock

import msgspec


def cpu_seconds() -> float:
    """This process's CPU time and its finished children's (a large trace's attribution runs
    in a child process)."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def timed(work) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), cpu_seconds()
    work()
    return cpu_seconds() - cpu, time.perf_counter() - wall


def main() -> None:
    from kvtrace.analysis.attribution import attribute_trace
    from kvtrace.analysis.load import load_traces
    from kvtrace.traceio import TraceReader

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--load", action="store_true",
                        help="also time kvtrace load with and without the attribution pass")
    args = parser.parse_args()

    def read() -> None:
        for _ in TraceReader(args.trace).batches():
            pass

    results = {"read": [], "attribute": []} | (
        {"load without": [], "load": []} if args.load else {})
    lookups = 0
    with tempfile.TemporaryDirectory() as scratch:
        db = os.path.join(scratch, "bench.duckdb")
        for _ in range(args.repeats):
            results["read"].append(timed(read))
            traced = []
            results["attribute"].append(timed(lambda: traced.append(attribute_trace(args.trace))))
            lookups = len(traced[0].lookups)
            if args.load:
                results["load"].append(timed(lambda: load_traces([args.trace], db)))
                with mock.patch("kvtrace.analysis.load.attribution_rows",
                                lambda *_: msgspec.msgpack.encode({"rows": []})), \
                        mock.patch("kvtrace.analysis.load.PARALLEL_ATTRIBUTION_BYTES", 2**63):
                    results["load without"].append(timed(lambda: load_traces([args.trace], db)))
    reader = TraceReader(args.trace)
    for _ in reader.batches():
        pass
    print(f"{args.trace}: {reader.num_records:,} records, {lookups:,} admitted lookups, "
          f"{args.repeats} repeats")
    for name, samples in results.items():
        cpu, wall = zip(*samples)
        print(f"  {name:<10} cpu {statistics.median(cpu):6.2f} s ({min(cpu):.2f}-{max(cpu):.2f})"
              f"   wall {statistics.median(wall):6.2f} s ({min(wall):.2f}-{max(wall):.2f})")
    for name, baseline in (("attribute", "read"), ("load", "load without")):
        if baseline not in results:
            continue
        for index, clock in enumerate(("cpu", "wall")):
            ratios = [a[index] / b[index] for b, a in zip(results[baseline], results[name])]
            print(f"  ratio {name}/{baseline} ({clock}): median {statistics.median(ratios):.2f} "
                  f"({min(ratios):.2f}-{max(ratios):.2f})")
    rate = reader.num_records / statistics.median(c for c, _ in results["attribute"]) / 1e6
    print(f"  attribution: {rate:.2f} M records per CPU second")


if __name__ == "__main__":
    main()
