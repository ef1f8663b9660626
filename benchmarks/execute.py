"""Execute mode's cost: the replay with --execute against the same replay without it.

``replay`` (the default; needs vLLM): the demo workload (``kvtrace demo``'s: 200 shared-prompt
requests, 300 blocks, retention 0) replayed under unfixed and fixed, with and without
``--execute`` on the CPU at the default state scale, interleaved, ``--repeats`` times. Reports
the replay's throughput (prompt tokens per second of wall time) with and without execute mode,
the slowdown (their ratio; target <= 5x), and the measured prefill throughput of the
recurrence (recomputed tokens per second of measured prefill).

``traces DIR`` (needs torch only): execute mode over replay traces already written (*.kvtrace
in DIR), without the cache replay, on ``--device`` cpu, cuda or both; with both, the verdicts
(verified and wrong-state hits, recomputed tokens) must agree, and the CUDA speed-up is
reported. ``scripts/device-check`` runs it on a GPU machine over traces that ``prepare DIR``
writes here (the demo workload's replays and the seed's wrong-state scenario).

    .venv/bin/python benchmarks/execute.py [replay] [--repeats 3]
    .venv/bin/python benchmarks/execute.py prepare DIR
    python3 benchmarks/execute.py traces DIR [--device both] [--state-scale F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEMO_REQUESTS, DEMO_BLOCKS = 200, 300
DEMO_WORKLOAD = {"system_prompts": 8, "system_prompt_len": 512, "prompt_len": 1024}
VARIANTS = ("unfixed", "fixed")
VERDICTS = ("verified_hits", "wrong_state_hits", "stale_key_reads", "recomputed_tokens",
            "first_wrong_state_hit")


def write_demo_workload(path: Path) -> None:
    from kvtrace.workloads.synth import synthesize
    from kvtrace.workloads.workload import EngineShape, write_workload

    shape = EngineShape(num_gpu_blocks=DEMO_BLOCKS)
    write_workload(path, synthesize("shared-prompt", DEMO_REQUESTS, 0, shape.hash_block_size,
                                    DEMO_WORKLOAD), shape, cmdline=["benchmarks/execute.py"])


def spread(values: list[float]) -> str:
    return (f"median {statistics.median(values):,.2f} (min {min(values):,.2f}, "
            f"max {max(values):,.2f}, n={len(values)})")


def bench_replay(repeats: int) -> int:
    from kvtrace.replay.execute import ExecuteOptions
    from kvtrace.replay.options import ReplayOptions
    from kvtrace.replay.run import replay

    work = Path(tempfile.mkdtemp(prefix="kvtrace-bench-execute-"))
    workload = work / "demo.kvtrace"
    write_demo_workload(workload)
    runs: dict[tuple[str, bool], list[dict]] = {}
    replay(ReplayOptions(source=str(workload), outdir=str(work / "warm"), variants=VARIANTS[:1]))
    for repeat in range(repeats):
        for execute in (False, True):  # interleaved: the machine's noise hits both alike
            options = ReplayOptions(source=str(workload), outdir=str(work / f"r{repeat}{execute}"),
                                    variants=VARIANTS,
                                    execute=ExecuteOptions(device="cpu") if execute else None)
            for result in replay(options).variants:
                runs.setdefault((result.variant, execute), []).append(
                    {"wall_s": result.wall_s, **result.summary})
    print(f"demo workload: {DEMO_REQUESTS} shared-prompt requests, {DEMO_BLOCKS} blocks, "
          f"retention 0; {repeats} interleaved repeats, CPU, default state scale")
    worst = 0.0
    for variant in VARIANTS:
        plain, executed = runs[(variant, False)], runs[(variant, True)]
        prompt = plain[0]["prompt_tokens"]
        ratios = [e["wall_s"] / p["wall_s"] for p, e in zip(plain, executed)]
        figures = executed[0]["execute"]
        prefill = [e["execute"]["measured_tokens_per_s"] for e in executed]
        print(f"{variant}:")
        print(f"  replay           {spread([prompt / p['wall_s'] for p in plain])} prompt tok/s")
        print(f"  replay --execute {spread([prompt / e['wall_s'] for e in executed])} prompt tok/s")
        print(f"  slowdown         {spread(ratios)} x (target <= 5)")
        print(f"  recurrence       {spread(prefill)} recomputed tok/s "
              f"({figures['recomputed_tokens']:,} tokens, state {figures['state']})")
        print(f"  verdicts         {figures['verified_hits']} verified, "
              f"{figures['wrong_state_hits']} wrong-state hits; "
              f"estimated {figures['estimated_gpu_s']:.3f} GPU-s ({figures['gpu']})")
        worst = max(worst, statistics.median(ratios))
    return 0 if worst <= 5 else 1


def prepare(outdir: Path) -> int:
    """Replay traces for ``traces``: the demo workload under every variant, and the seed's
    wrong-state scenario (tests/test_execute.py) under naive and fixed."""
    from kvtrace import __version__
    from kvtrace.events import TraceHeader
    from kvtrace.replay.options import ReplayOptions
    from kvtrace.replay.run import replay
    from kvtrace.replay.vllm_backend import VllmBackend
    from kvtrace.traceio import TraceWriter

    sys.path.insert(0, str(ROOT / "tests"))
    from test_execute import run_seed_scenario
    from vllm_support import seed_config

    outdir.mkdir(parents=True, exist_ok=True)
    workload = outdir / "demo-workload.kvtrace"
    write_demo_workload(workload)
    replay(ReplayOptions(source=str(workload), outdir=str(outdir),
                         variants=("unfixed", "fixed", "naive", "upstream")))
    workload.unlink()
    for variant in ("naive", "fixed"):
        _, records = run_seed_scenario(VllmBackend, variant)
        header = TraceHeader(kvtrace_version=__version__, created_ns=time.time_ns(),
                             source="replay", config=seed_config(0))
        with TraceWriter(str(outdir / f"seed.{variant}.kvtrace"), header) as writer:
            for record in records:
                writer.write(record)
    print(f"wrote {len(list(outdir.glob('*.kvtrace')))} replay traces to {outdir}")
    return 0


def bench_traces(directory: Path, devices: list[str], state_scale: float | None,
                 json_path: Path | None) -> int:
    import torch

    from kvtrace.replay.execute import ExecuteOptions
    from kvtrace.replay.execute.executor import execute_trace

    paths = sorted(directory.glob("*.kvtrace"))
    if not paths:
        print(f"no *.kvtrace in {directory}: run `benchmarks/execute.py prepare {directory}` "
              "where vLLM is installed", file=sys.stderr)
        return 2
    failures = 0
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    print(f"torch {torch.__version__}, CUDA device: {gpu}")
    everything = {}
    for path in paths:
        results = {}
        for device in devices:
            started = time.perf_counter()
            figures = execute_trace(str(path), ExecuteOptions(device=device,
                                                              state_scale=state_scale))
            figures["wall_s"] = time.perf_counter() - started
            results[device] = figures
            print(f"{path.name:<31} {device:<4} {figures['kernel']:<13} "
                  f"state {figures['state']}: {figures['verified_hits']} verified, "
                  f"{figures['wrong_state_hits']} wrong; {figures['recomputed_tokens']:,} tok "
                  f"in {figures['measured_prefill_s']:.3f} s measured "
                  f"({figures['measured_tokens_per_s']:,.0f} tok/s), "
                  f"wall {figures['wall_s']:.2f} s")
        if len(results) == 2:
            cpu, cuda = results["cpu"], results["cuda"]
            differ = [key for key in VERDICTS if cpu[key] != cuda[key]]
            if differ:
                failures += 1
                print(f"  MISMATCH between cpu and cuda in {differ}")
            elif cpu["state"] == cuda["state"]:
                print(f"  same verdicts; CUDA prefill speed-up "
                      f"{cpu['measured_prefill_s'] / max(cuda['measured_prefill_s'], 1e-9):.1f}x")
            else:
                print("  same verdicts (states of different scales)")
        if path.name.startswith("seed.naive") and results[devices[-1]]["wrong_state_hits"] < 1:
            failures += 1
            print("  FAILED: the seed scenario under naive must show a wrong-state hit")
        everything[path.name] = results
    if json_path is not None:
        json_path.write_text(json.dumps(everything, indent=1) + "\n")
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    replay_parser = sub.add_parser("replay", help="CPU: replay with and without --execute")
    replay_parser.add_argument("--repeats", type=int, default=3)
    prepare_parser = sub.add_parser("prepare", help="write replay traces for `traces`")
    prepare_parser.add_argument("outdir", type=Path)
    traces_parser = sub.add_parser("traces", help="execute mode over written replay traces")
    traces_parser.add_argument("directory", type=Path)
    traces_parser.add_argument("--device", choices=["cpu", "cuda", "both"], default="both")
    traces_parser.add_argument("--state-scale", type=float, default=None)
    traces_parser.add_argument("--json", type=Path, default=None, help="write every figure here")
    args = parser.parse_args()
    if args.command == "prepare":
        return prepare(args.outdir)
    if args.command == "traces":
        devices = ["cpu", "cuda"] if args.device == "both" else [args.device]
        return bench_traces(args.directory, devices, args.state_scale, args.json)
    return bench_replay(getattr(args, "repeats", 3))


if __name__ == "__main__":
    sys.exit(main())
