"""Miss attribution on a real replay: the C core's pass and the Python reference's, against
reading the same trace.

Give it a replay output (e.g. the Mooncake synthetic trace replayed on the real vLLM cache):

    .venv/bin/kvtrace import mooncake data/mooncake/synthetic_trace.jsonl -o m.kvtrace
    .venv/bin/kvtrace replay m.kvtrace --variant unfixed -o runs/
    .venv/bin/python benchmarks/attribution.py runs/m.unfixed.kvtrace [--repeats 3] [--load]

Each repeat reads the trace once (the baseline: ``TraceReader.batches()``, what any analysis
pays), then makes the streaming pass of ``kvtrace load`` on the C core (``kvtrace._forensics_core``:
the attribution, the cache entries and the record tables' rows) and the attribution on the
Python reference (``MissAttributor``, the twin without a C compiler), checking that both give
the same attribution rows. It prints CPU seconds (this process's, so
that other jobs on a shared machine do not count) and wall seconds, the median with the range,
and the ratios. With ``--load``, each repeat also loads the trace into a scratch DuckDB file
twice: as ``kvtrace load`` does, and without the attribution (the C core making the record
tables alone: the baseline).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from unittest import mock


def cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


def timed(work) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), cpu_seconds()
    work()
    return cpu_seconds() - cpu, time.perf_counter() - wall


def main() -> None:
    from kvtrace.analysis import stream
    from kvtrace.analysis.load import load_traces
    from kvtrace.traceio import TraceReader

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--load", action="store_true",
                        help="also time kvtrace load with and without the attribution")
    args = parser.parse_args()

    def read() -> None:
        for _ in TraceReader(args.trace).batches():
            pass

    def attribute(native: bool) -> list:
        reader = TraceReader(args.trace)
        attribution = stream.new_pass(reader.header, args.trace, native=native)
        for batch in reader.batches():
            attribution.feed(batch)
        attribution.finish()
        return [columns for table, columns in attribution.take_tables()
                if table == "miss_attribution"]

    def unattributed(header, path, **options):
        return stream.NativePass(None, path, keep_lookups=False, make_rows=False)

    results = {"read": [], "pass C": [], "attribute Python": []} | (
        {"load without": [], "load": []} if args.load else {})
    rows: dict[str, list] = {}
    with tempfile.TemporaryDirectory() as scratch:
        db = os.path.join(scratch, "bench.duckdb")
        for _ in range(args.repeats):
            results["read"].append(timed(read))
            results["pass C"].append(timed(lambda: rows.__setitem__("C", attribute(True))))
            results["attribute Python"].append(
                timed(lambda: rows.__setitem__("Python", attribute(False))))
            if args.load:
                results["load"].append(timed(lambda: load_traces([args.trace], db)))
                with mock.patch.object(stream, "new_pass", unattributed):
                    results["load without"].append(timed(lambda: load_traces([args.trace], db)))
    same = all(a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
               for a, b in zip(rows["C"], rows["Python"]))
    reader = TraceReader(args.trace)
    for _ in reader.batches():
        pass
    num_rows = sum(len(next(iter(columns.values()))) for columns in rows["C"])
    print(f"{args.trace}: {reader.num_records:,} records, {num_rows:,} attribution rows (the C "
          f"core and the Python reference {'equal' if same else 'DIFFERENT'}), {args.repeats} "
          "repeats")
    for name, samples in results.items():
        cpu, wall = zip(*samples)
        print(f"  {name:<17} cpu {statistics.median(cpu):6.2f} s ({min(cpu):.2f}-{max(cpu):.2f})"
              f"   wall {statistics.median(wall):6.2f} s ({min(wall):.2f}-{max(wall):.2f})")
    for name, baseline in (("pass C", "read"), ("attribute Python", "pass C"),
                           ("load", "load without")):
        if baseline not in results:
            continue
        for index, clock in enumerate(("cpu", "wall")):
            ratios = [a[index] / b[index] for b, a in zip(results[baseline], results[name])]
            print(f"  ratio {name} / {baseline} ({clock}): median "
                  f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})")
    for name in ("pass C", "attribute Python"):
        rate = reader.num_records / statistics.median(c for c, _ in results[name]) / 1e6
        print(f"  {name}: {rate:.2f} M records per CPU second")


if __name__ == "__main__":
    main()
