"""`kvtrace doctor` measured (issue #31): does its top finding name the cause that dominates the
miss attribution, does its prediction of a change come within a point of running the change,
and how long does it take on a 10,000,000-record trace.

``--table``: each row of docs/findings.md's first table (bundled model x workload, written as
benchmarks/findings.py writes it), replayed under `unfixed` on the model backend; then
`kvtrace doctor <replay dir> --json` (keeping its database with --db), the miss attribution's
summary of that database (`kvtrace sql DB --query miss_attribution_summary`: the cause with
the most tokens at first admissions, `cold` included, and the largest other cause), doctor's
top finding and whether it owns that cause (``CAUSE_MECHANISMS``), and for every finding with a
prediction the `kvtrace replay` command doctor printed, run with --summary-json: its hit rate
against the predicted one, in points.

``--events N`` (10,000,000 by default): benchmarks/forensics.py's generator makes an N-record
trace (cached beside its own, or at ``--trace``); `kvtrace doctor TRACE --no-predict` and
`kvtrace doctor TRACE` run ``--repeats`` times each, in fresh processes (wall seconds, the
CPU seconds of the child, its peak RSS: min / median / max); `--threshold 0.01 --backend
model`, which makes a finding with a change of the trace's few-percent
`mamba-state-not-retained` and so replays the trace twice, once; and one in-process run split
into its phases (the load, the diagnosis SQL, vLLM's counters against the trace (none
recorded: vLLM's columns empty, kvtrace's over the whole trace), ``diagnose``).

    .venv/bin/python benchmarks/doctor.py --table [--requests 200] [--models ...]
        [--workloads ...] [--json FILE]
    .venv/bin/python benchmarks/doctor.py --events 10000000 [--trace PATH] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from findings import MODELS, MOONCAKE, ROOT, WORKLOADS, run, workload_command
from forensics import _records, generate

KVTRACE = str(ROOT / ".venv" / "bin" / "kvtrace")
POINTS = 1.0  # the bound on a prediction's error, in points of hit rate


# --- part 1: the findings table --------------------------------------------------------------


def output(command: list[str], directory: Path, quiet: bool = False) -> str:
    return subprocess.run([KVTRACE, *command[1:]], check=True, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE if quiet else None, cwd=directory,
                          text=True).stdout


def summary_hit_rate(path: Path) -> float:
    variants = json.loads(path.read_text())["variants"]
    (figures,) = variants.values()
    return figures["hit_rate"]


def check_prediction(command: str, name: str, directory: Path) -> float:
    """Run doctor's printed `kvtrace replay` command (its own -o swapped for a fresh one) with
    --summary-json: the hit rate it measures."""
    words = shlex.split(command)
    at = words.index("-o")
    words[at + 1] = f"{name}/"
    run(words + ["--summary-json", f"{name}.json"], directory)
    return summary_hit_rate(directory / f"{name}.json")


def measure(model: str, workload: str, requests: int, directory: Path) -> dict:
    from kvtrace.analysis.causes import CAUSE_MECHANISMS

    name = f"{model}.{workload}"
    make = workload_command(workload, model, requests, f"{name}.kvtrace")
    replay = ["kvtrace", "replay", f"{name}.kvtrace", "--backend", "model", "--variant",
              "unfixed", "-o", f"{name}/"]
    doctor = ["kvtrace", "doctor", f"{name}/", "--json", "--db", f"{name}.duckdb"]
    sql = ["kvtrace", "sql", f"{name}.duckdb", "--query", "miss_attribution_summary", "--json"]
    started = time.perf_counter()
    run(make, directory)
    run(replay + ["--summary-json", f"{name}.json"], directory)
    replayed = summary_hit_rate(directory / f"{name}.json")
    begun = time.perf_counter()
    fallback = None
    try:
        diagnosis = json.loads(output(doctor, directory, quiet=True))
    except subprocess.CalledProcessError as error:
        # doctor cannot read the model backend's trace: say so, and diagnose the same
        # replay on the vllm backend (the same figures, docs/replay-backends.md)
        fallback = error.stderr.strip().splitlines()[0]
        shutil.rmtree(directory / f"{name}", ignore_errors=True)
        replay[replay.index("model")] = "vllm"
        run(replay + ["--summary-json", f"{name}.json"], directory)
        fallback_rate = summary_hit_rate(directory / f"{name}.json")
        fallback += (f"; on --backend vllm the replay hits {fallback_rate:.2%} (model "
                     f"backend {replayed:.2%})")
        replayed = fallback_rate
        begun = time.perf_counter()
        diagnosis = json.loads(output(doctor, directory))
    doctor_s = time.perf_counter() - begun
    rows = [json.loads(line) for line in output(sql, directory).splitlines() if line.strip()]
    first = [row for row in rows if row["lookups"] == "first"]
    causes = {row["cause"]: row["tokens"] for row in first}
    missed = first[0]["query_tokens"] - first[0]["hit_tokens"] if first else 0
    ranked = sorted(causes.items(), key=lambda item: (-item[1], item[0]))
    dominant = ranked[0][0] if ranked else None
    warm = next((cause for cause, _ in ranked if cause != "cold"), None)
    findings = [f for f in diagnosis["findings"] if f["run"] == 0]
    top = findings[0] if findings else None
    checks = []
    for finding in findings:
        predicted = finding["predicted"]
        if predicted is None:
            continue
        measured = check_prediction(predicted["command"], f"{name}.check-{finding['id']}",
                                    directory)
        checks.append({
            "id": finding["id"], "change": predicted["change"],
            "command": predicted["command"].replace(f"{directory}/", "").replace(
                "-o doctor-runs/", f"-o {name}.check/") + f" --summary-json {name}.check.json",
            "before": predicted["hit_rate_before"], "after": predicted["hit_rate_after"],
            "measured": measured,
            "points": (measured - predicted["hit_rate_after"]) * 100})
    owner = CAUSE_MECHANISMS.get(dominant) if dominant else None
    commands = " && ".join(" ".join(c) for c in (make, replay, doctor, sql)).replace(
        str(MOONCAKE), os.path.relpath(MOONCAKE, ROOT))
    return {
        "model": model, "workload": workload, "hit_rate": replayed,
        "missed": missed, "causes": causes, "dominant": dominant, "dominant_owner": owner,
        "largest_warm_cause": warm, "largest_warm_owner": CAUSE_MECHANISMS.get(warm),
        "top": top and {"id": top["id"], "tokens": top["tokens"],
                        "share": top["share_of_missed"], "note": top["note"]},
        "findings": [(f["id"], f["share_of_missed"]) for f in findings],
        "agrees": top is not None and top["id"] == owner,
        "checks": checks, "doctor_s": doctor_s, "fallback": fallback, "commands": commands,
        "wall_s": time.perf_counter() - started}


def signed(points: float) -> str:
    return f"{round(points, 2) + 0.0:+.2f}"  # no -0.00


def share(row: dict, cause: str) -> str:
    return f"`{cause}` {row['causes'][cause] / row['missed']:.1%}" if row["missed"] else cause


def markdown(rows: list[dict]) -> str:
    lines = ["| model | workload | hit rate (unfixed) | the cause of most missed tokens at first "
             "admissions (its mechanism; the largest other cause) | doctor's findings, top "
             "first (share of the missed prefill) | top finding owns that cause | top "
             "finding's prediction: hit rate before -> after | running the change | "
             "prediction - run (points) | every prediction's error (points) | command |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        dominant = share(row, row["dominant"]) + f" (`{row['dominant_owner']}`"
        if row["dominant"] == "cold" and row["largest_warm_cause"]:
            dominant += f"; {share(row, row['largest_warm_cause'])}, " \
                        f"`{row['largest_warm_owner']}`"
        dominant += ")"
        findings = ", ".join(f"`{id_}` {s:.1%}" for id_, s in row["findings"]) or "none"
        top = row["top"]
        check = next((c for c in row["checks"] if top and c["id"] == top["id"]), None)
        if check:
            predicted = (f"{check['change']}: {check['before']:.2%} -> {check['after']:.2%}")
            measured = f"{check['measured']:.2%}"
            points = signed(-check["points"])
        else:
            predicted = "none (no change kvtrace can replay)" if top else "no finding"
            measured = points = "-"
        errors = ", ".join(f"`{c['id']}` {signed(-c['points'])}" for c in row["checks"]) or "-"
        command = row["commands"]
        if check:
            command += f" && {check['command']}"
        workload = row["workload"] + (" (replayed on the vllm backend: doctor cannot read "
                                      "the model backend's trace)" if row["fallback"] else "")
        lines.append(
            f"| {row['model']} | {workload} | {row['hit_rate']:.2%} | {dominant} | "
            f"{findings} | {'yes' if row['agrees'] else '**no**'} | {predicted} | {measured} | "
            f"{points} | {errors} | `{command}` |")
    return "\n".join(lines)


def checks_markdown(rows: list[dict]) -> str:
    """Every finding's prediction against running its command."""
    lines = ["| model | workload | finding (rank) | change | predicted: hit rate before -> after "
             "(points) | running the change | prediction - run (points) | command |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        ranks = {id_: rank for rank, (id_, _) in enumerate(row["findings"], 1)}
        for c in row["checks"]:
            lines.append(
                f"| {row['model']} | {row['workload']} | `{c['id']}` ({ranks[c['id']]}) | "
                f"{c['change']} | {c['before']:.2%} -> {c['after']:.2%} "
                f"({signed((c['after'] - c['before']) * 100)}) | {c['measured']:.2%} | "
                f"{signed(-c['points'])} | `{row['commands']} && {c['command']}` |")
    return "\n".join(lines)


def table(args) -> int:
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvtrace-doctor-bench-") as directory:
        for model in args.models:
            for workload in args.workloads:
                row = measure(model, workload, args.requests, Path(directory))
                rows.append(row)
                top = row["top"]["id"] if row["top"] else "none"
                print(f"{model:<20} {workload:<10} dominant {row['dominant']:<20} top {top:<26}"
                      f" agrees {row['agrees']!s:<5} "
                      + " ".join(f"{c['id']} predicted {c['after']:.2%} ran {c['measured']:.2%}"
                                 f" ({signed(-c['points'])})" for c in row["checks"])
                      + f"  (doctor {row['doctor_s']:.1f} s, row {row['wall_s']:.0f} s)",
                      file=sys.stderr, flush=True)
    print(markdown(rows))
    print()
    print(checks_markdown(rows))
    disagree = [r for r in rows if not r["agrees"]]
    off = [(r, c) for r in rows for c in r["checks"] if abs(c["points"]) > POINTS]
    print(f"\n{len(rows) - len(disagree)} of {len(rows)} rows: the top finding owns the cause "
          f"of most missed tokens; {sum(len(r['checks']) for r in rows)} predictions checked, "
          f"{len(off)} off by more than {POINTS:g} point")
    for r in disagree:
        print(f"  disagrees: {r['model']} {r['workload']}: dominant {r['dominant']} "
              f"({r['dominant_owner']}), top {r['top'] and r['top']['id']}")
    for r in rows:
        if r["fallback"]:
            print(f"  {r['model']} {r['workload']}: {r['fallback']}")
        for c in r["checks"]:
            if abs(c["before"] - r["hit_rate"]) > 1e-9:
                print(f"  note: {r['model']} {r['workload']}: doctor's baseline {c['before']:.2%}"
                      f" is not the replay's {r['hit_rate']:.2%}")
    for r, c in off:
        print(f"  off: {r['model']} {r['workload']} {c['id']}: predicted {c['after']:.2%}, "
              f"ran {c['measured']:.2%}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


# --- part 2: a 10 M-record trace -------------------------------------------------------------


def timed(command: list[str]) -> dict:
    """Wall and CPU seconds of a command in a fresh process, and its peak RSS."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        started = time.perf_counter()
        process = subprocess.Popen(command, stdout=out, stderr=err)
        _, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - started
        process.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if process.returncode != 0:
            raise SystemExit(f"{' '.join(command)} failed ({process.returncode}): "
                             f"{err.read().decode().strip()}")
        return {"wall": wall, "cpu": usage.ru_utime + usage.ru_stime,
                "rss_mib": usage.ru_maxrss / 1024, "stdout": out.read().decode()}


def phases(trace: str) -> dict:
    """One `kvtrace doctor --no-predict`, in this process, split into its phases."""
    from kvtrace.analysis.database import open_database
    from kvtrace.analysis.diagnosis import COUNTERS, diagnose
    from kvtrace.analysis.load import load_traces
    from kvtrace.analysis.queries import run_query
    from kvtrace.analysis.pricing import pricing_for

    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(trace))) as scratch:
        db = os.path.join(scratch, "doctor.duckdb")
        started = time.perf_counter()
        pricing = pricing_for("h200", None).params()
        load_traces([trace], db)
        loaded = time.perf_counter()
        connection = open_database(db)
        run_query(connection, "diagnosis", pricing)
        queried = time.perf_counter()
        run_query(connection, COUNTERS)
        reconciled = time.perf_counter()
        diagnose(connection, "doctor.duckdb", pricing=pricing)
        diagnosed = time.perf_counter()
        connection.close()
    sql = (queried - loaded) + (reconciled - queried)
    return {"load": loaded - started, "diagnosis_sql": queried - loaded,
            f"{COUNTERS}_sql": reconciled - queried,
            "diagnose() (both queries again, and the rest)": diagnosed - reconciled,
            "diagnose()'s rest (estimate)": max(0.0, diagnosed - reconciled - sql)}


def spread(values: list[float], unit: str = " s") -> str:
    return (f"median {statistics.median(values):.2f}{unit} (min {min(values):.2f}, "
            f"max {max(values):.2f}, {len(values)} runs)")


def events(args) -> int:
    trace = args.trace or os.path.join(tempfile.gettempdir(),
                                       f"kvtrace-bench-{args.events}-kimi-k3-v2.kvtrace")
    if not os.path.exists(trace):
        started = time.perf_counter()
        generate(trace, args.events)
        print(f"generated {trace} in {time.perf_counter() - started:.1f} s", flush=True)
    print(f"trace {trace}: {_records(trace):,} records, {os.path.getsize(trace) / 2**20:.0f} MiB; "
          f"machine load average "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    kinds = {"--no-predict": ["--no-predict"], "with predictions": []}
    results: dict[str, list[dict]] = {kind: [] for kind in kinds}
    for repeat in range(args.repeats):  # the two kinds interleaved, repeat by repeat
        for kind, flags in kinds.items():
            figures = timed(["prlimit", f"--as={args.memory}", KVTRACE, "doctor", trace,
                             "--json", *flags])
            results[kind].append(figures)
            diagnosis = json.loads(figures["stdout"])
            findings = [f["id"] for f in diagnosis["findings"]]
            predicted = [f["id"] for f in diagnosis["findings"] if f["predicted"]]
            print(f"repeat {repeat + 1}, kvtrace doctor TRACE {' '.join(flags)}: "
                  f"{figures['wall']:.2f} s wall, {figures['cpu']:.2f} s CPU, peak RSS "
                  f"{figures['rss_mib']:.0f} MiB; findings "
                  f"{findings}, predicted {predicted}; load average {os.getloadavg()[0]:.2f}",
                  flush=True)
    for kind in kinds:
        print(f"kvtrace doctor TRACE ({kind}): wall {spread([r['wall'] for r in results[kind]])}"
              f"; CPU {spread([r['cpu'] for r in results[kind]])}; peak RSS "
              f"{spread([r['rss_mib'] for r in results[kind]], ' MiB')}")
    if args.forced_prediction:
        figures = timed(["prlimit", f"--as={args.memory}", KVTRACE, "doctor", trace, "--json",
                         "--threshold", "0.01", "--backend", "model"])
        diagnosis = json.loads(figures["stdout"])
        for finding in diagnosis["findings"]:
            note = (finding["predicted"] and
                    f"{finding['predicted']['hit_rate_before']:.2%} -> "
                    f"{finding['predicted']['hit_rate_after']:.2%}") or finding["note"] or "-"
            print(f"  finding {finding['id']} {finding['share_of_missed']:.1%}: {note}")
        print(f"kvtrace doctor TRACE --threshold 0.01 --backend model (two model-backend "
              f"replays of the trace): {figures['wall']:.2f} s wall, {figures['cpu']:.2f} s CPU",
              flush=True)
    split = phases(trace)
    print("in-process phases of one --no-predict run: " + ", ".join(
        f"{k} {v:.2f} s" for k, v in split.items()))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", action="store_true", help="part 1: the findings table")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--workloads", nargs="+", default=WORKLOADS)
    parser.add_argument("--json", metavar="FILE", help="also write the table's rows as JSON")
    parser.add_argument("--events", type=int, default=10_000_000)
    parser.add_argument("--trace", help="trace path (generated if missing)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--memory", default="12000000000",
                        help="address-space cap of each doctor process (prlimit --as)")
    parser.add_argument("--no-forced-prediction", dest="forced_prediction",
                        action="store_false",
                        help="skip the --threshold 0.01 --backend model run")
    args = parser.parse_args()
    return table(args) if args.table else events(args)


if __name__ == "__main__":
    sys.exit(main())
