"""A fleet of traces loaded by ``kvtrace load`` in this process and in worker processes, in the
same run: the ratio of the two, and where a parallel load's time goes.

The fleet is ``--traces`` traces of ``--records`` records in all, made by the forensics
benchmark's generator (benchmarks/forensics.py: the default model's geometry, zipf-popular
system prompts, a transient checkpoint per request in each KDA group), one seed per trace, so
that no two are duplicates; generated once, in child processes, and cached (``--dir``).

Each round loads the fleet twice, each load in a fresh child process: serially (``load_traces``
in that process, as ``kvtrace load`` does by default) and with ``--workers`` worker processes;
the order alternates from round to round (serial first in odd rounds), since the machine's speed
drifts. A round's ratio is its serial time over its parallel time. Each load reports its wall
seconds, the CPU seconds of the process and of its workers, and, with workers, the seconds the
database spent taking the parts in (the merge, ``load._IntoDatabase``'s batches). ``--parquet``
measures ``kvtrace load --parquet`` instead: partitions, no database, no merge.

From the rounds it prints the median and range of each figure, the records per second of the
serial load, of one worker making parts (per CPU-second: a worker is one process) and of the
merge (where it ran alone), and what they project for a fleet of ``--project`` records
(default one billion): here, in proportion, and with W workers on W idle cores, each batch of
parts merged while the workers make the next (``MERGE_BATCH_RECORDS``), the merge as fast as
measured here. The projection assumes times in proportion to the records, which the runs at
larger ``--records`` check (``--records 1000000000 --rounds 1`` measures it).

    .venv/bin/python benchmarks/fleet.py [--records 10000000] [--traces 8] [--workers 2]
        [--rounds 5] [--parquet] [--dir DIR] [--project 1000000000]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def generate_fleet(directory: str, records: int, traces: int) -> list[str]:
    """The fleet's traces, generated where missing (two at a time, each in a child process)."""
    os.makedirs(directory, exist_ok=True)
    paths = [os.path.join(directory, f"engine{seed}.kvtrace") for seed in range(traces)]
    missing = [(seed, path) for seed, path in enumerate(paths) if not os.path.exists(path)]
    for start in range(0, len(missing), 2):
        children = [subprocess.Popen([sys.executable, __file__, "--child", "generate", path,
                                      str(records // traces), str(seed)],
                                     stdout=subprocess.DEVNULL)
                    for seed, path in missing[start:start + 2]]
        for child in children:
            if child.wait() != 0:
                raise SystemExit("generating the fleet failed")
    return paths


def generate(path: str, records: int, seed: int) -> dict:
    sys.path.insert(0, HERE)
    from forensics import generate as forensics_trace

    partial = path + ".partial"
    forensics_trace(partial, records, seed=seed)
    os.replace(partial, path)
    return {}


def load(output: str, workers: int, parquet: bool, *paths: str) -> dict:
    """One load of the fleet: its time, CPU (this process and its workers) and merge time."""
    from kvtrace.analysis import load as module

    merge = [0.0]
    insert_batch = module._IntoDatabase._insert_batch

    def timed_batch(self) -> None:
        started = time.perf_counter()
        insert_batch(self)
        merge[0] += time.perf_counter() - started

    module._IntoDatabase._insert_batch = timed_batch
    started, own, children = time.perf_counter(), _cpu(resource.RUSAGE_SELF), _cpu(
        resource.RUSAGE_CHILDREN)
    write = module.load_partitions if parquet else module.load_traces
    summary = write(list(paths), output, workers=workers)
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "cpu": _cpu(resource.RUSAGE_SELF) - own,
            "workers_cpu": _cpu(resource.RUSAGE_CHILDREN) - children, "merge": merge[0],
            "records": summary.num_records, "runs": len(summary.runs),
            "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "worker_rss_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
            "output_mib": _size(output) / 2**20}


def _cpu(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def _size(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(root, name))
               for root, _, names in os.walk(path) for name in names)


def in_child(*args: str) -> dict:
    output = subprocess.run([sys.executable, __file__, "--child", *args], check=True,
                            stdout=subprocess.PIPE, text=True).stdout
    return json.loads(output.splitlines()[-1])


def spread(values: list[float], unit: str = " s", digits: int = 2) -> str:
    return (f"{statistics.median(values):.{digits}f}{unit} ({min(values):.{digits}f}-"
            f"{max(values):.{digits}f})")


def rate(records: float, seconds: float) -> str:
    return f"{records / seconds / 1e6:.2f} M records/s"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=10_000_000, help="records in all")
    parser.add_argument("--traces", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--parquet", action="store_true",
                        help="kvtrace load --parquet (partitions) instead of a database")
    parser.add_argument("--dir", help="where the fleet is generated (default: the temp dir)")
    parser.add_argument("--project", type=float, default=1e9,
                        help="records to project the time of (default one billion)")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        work, *rest = args.child
        figures = (generate(rest[0], int(rest[1]), int(rest[2])) if work == "generate"
                   else load(rest[0], int(rest[1]), rest[2] == "parquet", *rest[3:]))
        print(json.dumps(figures))
        return 0
    directory = args.dir or os.path.join(tempfile.gettempdir(),
                                         f"kvtrace-fleet-{args.records}-{args.traces}")
    started = time.perf_counter()
    paths = generate_fleet(directory, args.records, args.traces)
    size = sum(os.path.getsize(path) for path in paths)
    print(f"{args.traces} traces, {size / 2**20:,.0f} MiB in {directory} (ready in "
          f"{time.perf_counter() - started:.1f} s)", flush=True)
    kind = "parquet" if args.parquet else "db"
    rounds: list[dict[int, dict]] = []
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        for number in range(args.rounds):
            load_average = os.getloadavg()[0]
            figures: dict[int, dict] = {}
            order = (1, args.workers) if number % 2 == 0 else (args.workers, 1)
            for workers in order:
                output = os.path.join(scratch, f"out-{workers}" + (".duckdb" if kind == "db"
                                                                   else ""))
                figures[workers] = in_child("load", output, str(workers), kind, *paths)
                if os.path.isdir(output):
                    shutil.rmtree(output)
                else:
                    os.remove(output)
            rounds.append(figures)
            serial, parallel = figures[1], figures[args.workers]
            print(f"round {number + 1} ({'serial first' if order[0] == 1 else 'workers first'}"
                  f", load average {load_average:.2f}): serial {serial['seconds']:.2f} s (CPU "
                  f"{serial['cpu']:.2f} s); {args.workers} workers {parallel['seconds']:.2f} s "
                  f"(CPU {parallel['cpu']:.2f} s here + {parallel['workers_cpu']:.2f} s in the "
                  f"workers; merge {parallel['merge']:.2f} s); ratio "
                  f"{serial['seconds'] / parallel['seconds']:.2f}x", flush=True)
    records = rounds[0][1]["records"]
    serial = [r[1] for r in rounds]
    parallel = [r[args.workers] for r in rounds]
    print(f"{records:,} records in {rounds[0][1]['runs']} runs; "
          f"{'partitions' if args.parquet else 'database'} "
          f"{statistics.median(r['output_mib'] for r in serial):,.0f} MiB")
    print(f"serial {spread([r['seconds'] for r in serial])}, CPU "
          f"{spread([r['cpu'] for r in serial])}, peak RSS "
          f"{spread([r['rss_mib'] for r in serial], ' MiB', 0)}")
    print(f"{args.workers} workers {spread([r['seconds'] for r in parallel])}, CPU "
          f"{spread([r['cpu'] + r['workers_cpu'] for r in parallel])} (workers "
          f"{spread([r['workers_cpu'] for r in parallel])}), merge "
          f"{spread([r['merge'] for r in parallel])}, peak RSS "
          f"{spread([r['rss_mib'] for r in parallel], ' MiB', 0)} (a worker "
          f"{spread([r['worker_rss_mib'] for r in parallel], ' MiB', 0)})")
    ratios = [r[1]["seconds"] / r[args.workers]["seconds"] for r in rounds]
    print(f"ratio serial / {args.workers} workers: {spread(ratios, 'x')} over {len(rounds)} "
          f"rounds; CPU cores busy: serial "
          f"{spread([r['cpu'] / r['seconds'] for r in serial], '')}, workers "
          f"{spread([(r['cpu'] + r['workers_cpu']) / r['seconds'] for r in parallel], '')}")
    _project(args, records, serial, parallel)
    return 0


def _project(args, records: int, serial: list[dict], parallel: list[dict]) -> None:
    """What the measured rates give for ``args.project`` records: here, in proportion; with W
    workers on idle cores, the slower of W workers making parts and the merge, plus the last
    batch's merge. A worker is one process, about one core: its rate is per CPU-second. The
    merge's rate is its own only where it ran alone, after the workers (a fleet whose batch
    fills with its last part at the earliest); past that each batch merges while the workers
    make the next."""
    from kvtrace.analysis.load import MERGE_BATCH_RECORDS

    serial_s = statistics.median(r["seconds"] for r in serial)
    parallel_s = statistics.median(r["seconds"] for r in parallel)
    merge_s = statistics.median(r["merge"] for r in parallel)
    per_worker = records / statistics.median(r["workers_cpu"] for r in parallel)
    # alone: the batch filled only with the last part, which no worker follows
    alone = merge_s and records - records / args.traces < MERGE_BATCH_RECORDS
    print(f"rates: serial {rate(records, serial_s)}; a worker making parts "
          f"{rate(per_worker, 1)} of CPU"
          + (f"; the merge {rate(records, merge_s)}" if alone else
             "; the merge overlapped the workers (no rate of its own)" if merge_s else ""))
    scale = args.project / records
    print(f"projected for {args.project:,.0f} records: serial {serial_s * scale / 60:.1f} min; "
          f"{args.workers} workers here {parallel_s * scale / 60:.1f} min", end="")
    if alone:
        merging = args.project / (records / merge_s)
        batch = min(MERGE_BATCH_RECORDS, args.project) / (records / merge_s)
        for workers in (8, 16, 32):
            making = args.project / (per_worker * workers)
            print(f"; {workers} workers on idle cores {(max(making, merging) + batch) / 60:.1f}"
                  f" min ({'merge' if merging > making else 'workers'}-bound)", end="")
    print()


if __name__ == "__main__":
    sys.exit(main())
