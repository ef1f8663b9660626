"""How much a warm start from the engine's cache tells, on an engine captured twice, a minute apart.

A rescheduled replay of a mid-flight capture starts every variant from the capture's start
snapshot: the cache the engine's own variant built. A variant that would have held other keys
at that moment (``fixed`` keeps no transient checkpoint an ``unfixed`` engine's pool holds)
inherits the engine's. To see what that costs, a ``kvtrace engine`` serves a workload where the
variants differ (by default the agent preset on the default model, where ``unfixed`` hits
several points more than ``fixed``: docs/findings.md) under ``unfixed`` and is captured twice,
a minute apart; the requests whose first lookup falls inside each window are scored three
ways:

* *captured*: their first-lookup hits in the capture itself (the engine's run);
* *warm*: in the capture's rescheduled replay from its snapshot, per variant;
* *whole run*: in a rescheduled replay of the whole workload from an empty cache, per variant,
  where each variant has had its own history from the first request on.

``warm`` against ``whole run`` is the error of the warm start for that window; for ``unfixed``
(the engine's variant) it is the scheduler model's, for ``fixed`` that plus the inherited keys.

    .venv/bin/python benchmarks/warm_start.py [--preset agent] [--model kimi-k3]
                                              [--requests 2000] [--speed 5] [--gap-s 60]
                                              [--window-s 10]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvtrace.engine.process import EngineProcess
from kvtrace.events import (
    ComputedBlocksFound,
    RequestArrived,
    RequestState,
    SlotsAllocated,
)
from kvtrace.replay.options import ReplayOptions
from kvtrace.replay.run import replay
from kvtrace.traceio import TraceReader
from kvtrace.workloads.synth import synthesize
from kvtrace.workloads.workload import EngineShape, write_workload

VARIANTS = ("unfixed", "fixed")


def first_lookups(path: str) -> tuple[dict[int, int], dict[int, int], dict[int, str]]:
    """Per request of a trace: its first admission's hit tokens, its prompt length (requests
    whose first lookup is in the trace), and its request id."""
    hits, prompts, ids, lookups, admitted = {}, {}, {}, {}, set()
    for record in TraceReader(path):
        kind = type(record)
        if kind is RequestArrived:
            prompts.setdefault(record.req, record.prompt_len)
            ids.setdefault(record.req, record.request_id)
        elif kind is RequestState:
            ids[record.req] = record.request_id
            if record.status == "WAITING" and not record.num_preemptions:
                prompts[record.req] = record.prompt_len
            else:
                admitted.add(record.req)
        elif kind is ComputedBlocksFound:
            lookups[record.req] = record.num_hit_tokens
        elif kind is SlotsAllocated and record.success and record.req in lookups:
            hit = lookups.pop(record.req)
            if record.req not in admitted:
                admitted.add(record.req)
                hits[record.req] = hit
    return hits, prompts, ids


def window_rate(hits: dict[int, int], prompts: dict[int, int], reqs) -> float:
    reqs = [r for r in reqs if r in prompts]
    total = sum(prompts[r] for r in reqs)
    return sum(hits.get(r, 0) for r in reqs) / total if total else 0.0


def capture_window(pid: int, path: Path, seconds: float) -> None:
    done = subprocess.run([sys.executable, "-m", "kvtrace", "capture", "--pid", str(pid),
                           "--duration", f"{seconds}s", "-o", str(path)],
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"capture failed: {done.stderr}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="agent")
    parser.add_argument("--model", default="kimi-k3")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--speed", type=float, default=5.0)
    parser.add_argument("--first-s", type=float, default=10.0, help="first window's start")
    parser.add_argument("--gap-s", type=float, default=60.0, help="between the windows' starts")
    parser.add_argument("--window-s", type=float, default=10.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvtrace-warm-"))
    shape = EngineShape(model=args.model)
    workload = work / "workload.kvtrace"
    write_workload(workload, synthesize(args.preset, args.requests, 0, shape.hash_block_size),
                   shape)
    engine = EngineProcess([str(workload), "--variant", "unfixed", "--speed", str(args.speed)],
                           {**os.environ, "KVTRACE_PLUGIN": "1"})
    captures = [work / "first.kvtrace", work / "second.kvtrace"]
    try:
        engine.wait_ready()
        engine.send("start")
        engine.expect("kvtrace engine: running")
        started = time.monotonic()
        for index, capture in enumerate(captures):
            time.sleep(max(0.0, started + args.first_s + index * args.gap_s - time.monotonic()))
            capture_window(engine.pid, capture, args.window_s)
        if engine.process.poll() is not None:
            raise SystemExit("the engine finished before the second window: more --requests")
    finally:
        engine.stop()
    whole = {}
    for variant in VARIANTS:
        result = replay(ReplayOptions(source=str(workload), outdir=str(work / "whole"),
                                      variants=(variant,), backend="model"))
        whole[variant] = first_lookups(result.variants[0].output)
    results = []
    for capture in captures:
        captured = first_lookups(str(capture))
        to_workload = {req: int(request_id) for req, request_id in captured[2].items()}
        window = [req for req in captured[1]]  # first lookup inside the window
        row = {"window": capture.stem, "requests": len(window),
               "captured": window_rate(captured[0], captured[1], window)}
        warm = replay(ReplayOptions(source=str(capture), outdir=str(work / capture.stem),
                                    variants=VARIANTS, backend="model"))
        for result in warm.variants:
            hits, prompts, _ = first_lookups(result.output)
            row[f"warm_{result.variant}"] = window_rate(hits, prompts, window)
            hits, prompts, _ = whole[result.variant]
            row[f"whole_{result.variant}"] = window_rate(
                hits, prompts, [to_workload[req] for req in window])
        results.append(row)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"{args.preset} on {args.model}, {args.requests} requests at {args.speed:g}x; windows of "
          f"{args.window_s:g} s, {args.gap_s:g} s apart; first-lookup hit rate of the "
          "requests whose first lookup falls inside each window")
    print(f"{'window':<8} {'requests':>8} {'captured':>9} "
          + " ".join(f"{'warm ' + v:>13} {'whole ' + v:>14}" for v in VARIANTS)
          + f" {'fixed-unfixed warm':>19} {'whole':>7}")
    for row in results:
        print(f"{row['window']:<8} {row['requests']:>8} {row['captured']:>9.2%} "
              + " ".join(f"{row['warm_' + v]:>13.2%} {row['whole_' + v]:>14.2%}" for v in VARIANTS)
              + f" {row['warm_fixed'] - row['warm_unfixed']:>+19.2%}"
              + f" {row['whole_fixed'] - row['whole_unfixed']:>+7.2%}")


if __name__ == "__main__":
    main()
