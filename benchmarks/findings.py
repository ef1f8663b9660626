"""The findings table of docs/findings.md: each bundled model's geometry, each workload, the
variants unfixed / fixed / upstream, measured by replay on kvtrace's model backend (held to vLLM
0.33's own cache record for record by tests/test_model_backend.py).

For every (model, workload) it writes the workload with `kvtrace synth` / `kvtrace import`
(the model's geometry as vLLM builds it on H200s, retention 0, the default pool under
pressure), replays it, and reads from the replay traces: the hit rate, LRU evictions,
checkpoints published and suppressed, the prompt-end keys `fixed` strips, and the share of the
pool held by transient checkpoint entries (blocks whose newest key is a CHECKPOINT store of a
TRANSIENT checkpoint, in use or cached; mean over steps and peak).

    .venv/bin/python benchmarks/findings.py [--requests 200] [--models ...] [--workloads ...]
        [--markdown]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MOONCAKE = ROOT / "data" / "mooncake" / "synthetic_trace.jsonl"
MODELS = ["kimi-k3", "kimi-linear-48b-a3b", "qwen3-next-80b-a3b", "nemotron-h-8b"]
WORKLOADS = ["documents", "chat", "agent", "mooncake"]
VARIANTS = ["unfixed", "fixed", "upstream"]


def workload_command(workload: str, model: str, requests: int, out: str) -> list[str]:
    if workload == "mooncake":
        return ["kvtrace", "import", "mooncake", str(MOONCAKE), "--model", model, "-o", out]
    return ["kvtrace", "synth", "--preset", workload, "--requests", str(requests),
            "--model", model, "-o", out]


def replay_command(source: str, outdir: str) -> list[str]:
    return ["kvtrace", "replay", source, "--backend", "model",
            *(arg for v in VARIANTS for arg in ("--variant", v)), "-o", outdir]


def run(command: list[str], directory: Path) -> None:
    executable = str(ROOT / ".venv" / "bin" / command[0])
    subprocess.run([executable, *command[1:]], check=True, stdout=subprocess.DEVNULL,
                   cwd=directory)


def transient_share(path: str) -> tuple[float, float, int, int]:
    """(mean, peak) share of the pool's usable blocks holding a transient checkpoint entry, over
    steps; checkpoints published; prompt-end keys stripped (STALE_CHECKPOINT removals of a
    key at a recorded prompt-end checkpoint)."""
    from kvtrace.events import (BlockRemoved, BlockStored, CheckpointClass, CheckpointRecorded,
                                RemoveReason, StepStarted, StoreKind)
    from kvtrace.traceio import TraceReader

    reader = TraceReader(path)
    classes: dict[tuple[int, int, int], int] = {}
    prompt_ends: set[tuple[int, int]] = set()  # (group, position) of prompt-end checkpoints
    holding: set[int] = set()
    samples, peak, published, stripped = [], 0, 0, 0
    transient, prompt_end = CheckpointClass.TRANSIENT, CheckpointClass.PROMPT_END
    checkpoint, stale = StoreKind.CHECKPOINT, RemoveReason.STALE_CHECKPOINT
    for record in reader:
        kind = type(record)
        if kind is StepStarted:
            samples.append(len(holding))
            peak = max(peak, len(holding))
        elif kind is CheckpointRecorded:
            classes[(record.req, record.group, record.position)] = record.position_class
            if record.position_class == prompt_end:
                prompt_ends.add((record.group, record.position))
        elif kind is BlockStored:
            is_transient = (record.kind == checkpoint and classes.get(
                (record.req, record.group, record.num_tokens)) == transient)
            published += record.kind == checkpoint
            if is_transient:
                holding.add(record.block_id)
            else:
                holding.discard(record.block_id)
        elif kind is BlockRemoved:
            holding.discard(record.block_id)
            stripped += (record.reason == stale
                         and (record.group, record.num_tokens) in prompt_ends)
    usable = reader.header.config.num_gpu_blocks - 1
    mean = sum(samples) / len(samples) / usable if samples else 0.0
    return mean, peak / usable, published, stripped


def measure(model: str, workload: str, requests: int, directory: Path) -> dict:
    import json

    name = f"{model}.{workload}"
    source, outdir = directory / f"{name}.kvtrace", directory / name
    make = workload_command(workload, model, requests, f"{name}.kvtrace")
    replay = replay_command(f"{name}.kvtrace", f"{name}/")
    started = time.perf_counter()
    run(make, directory)
    run(replay + ["--summary-json", f"{name}.json"], directory)
    figures = json.loads((directory / f"{name}.json").read_text())["variants"]
    from kvtrace.traceio import TraceReader

    config = TraceReader(str(source)).header.config
    row = {"model": model, "workload": workload, "pool": config.num_gpu_blocks,
           "block": config.kv_cache_groups[0].block_size,
           "groups": len(config.kv_cache_groups),
           "commands": " && ".join(" ".join(c) for c in (make, replay)).replace(
               str(MOONCAKE), os.path.relpath(MOONCAKE, ROOT)),  # as run from the checkout
           "wall_s": 0.0, "variants": {}}
    for variant in VARIANTS:
        mean, peak, _, stripped = transient_share(str(outdir / f"{name}.{variant}.kvtrace"))
        v = figures[variant]
        row["variants"][variant] = {
            "hit_rate": v["hit_rate"], "hit_tokens": v["hit_tokens"],
            "prompt_tokens": v["prompt_tokens"],
            "evictions": v["evictions"].get("lru_reuse", 0),
            "published": v["checkpoints_published"], "suppressed": v["checkpoints_suppressed"],
            "prompt_end_stripped": stripped, "transient_mean": mean, "transient_peak": peak}
    row["wall_s"] = time.perf_counter() - started
    return row


def markdown(rows: list[dict]) -> str:
    lines = ["| model | workload | pool (blocks x tokens, groups) | unfixed | fixed | upstream | "
             "fix saves (tokens, fixed - unfixed) | transient checkpoints' share of the pool, "
             "unfixed (mean / peak) | checkpoints published (unfixed) / suppressed (fixed) | "
             "prompt-end keys `fixed` strips | command |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        v = row["variants"]
        saves = v["fixed"]["hit_tokens"] - v["unfixed"]["hit_tokens"]
        lines.append(
            f"| {row['model']} | {row['workload']} | {row['pool']:,} x {row['block']}, "
            f"{row['groups']} | "
            + " | ".join(f"{v[x]['hit_rate']:.2%}" for x in VARIANTS)
            + f" | {saves:+,} | {v['unfixed']['transient_mean']:.1%} / "
            f"{v['unfixed']['transient_peak']:.1%} | {v['unfixed']['published']:,} / "
            f"{v['fixed']['suppressed']:,} | {v['fixed']['prompt_end_stripped']:,} | "
            f"`{row['commands']}` |")
    return "\n".join(lines)


def arguments(doc: str) -> argparse.ArgumentParser:
    """The options every findings table takes (benchmarks/releases.py's too)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    return parser


def tabulate(cases: list[tuple], measure, markdown, json_path: str | None) -> None:
    """``measure(*case, directory)`` for each case, one progress line each on stderr; then the
    markdown table on stdout, and the rows as JSON to ``json_path``."""
    import json

    rows = []
    with tempfile.TemporaryDirectory(prefix="kvtrace-findings-") as directory:
        for case in cases:
            row = measure(*case, Path(directory))
            rows.append(row)
            print(" ".join(f"{part:<20}" for part in case[:-1]) + "  ".join(
                f"{x} {figures['hit_rate']:.2%}" for x, figures in row["variants"].items())
                + f"  ({row['wall_s']:.0f} s)", file=sys.stderr, flush=True)
    print(markdown(rows))
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=2))


def main() -> int:
    parser = arguments(__doc__)
    parser.add_argument("--workloads", nargs="+", default=WORKLOADS)
    args = parser.parse_args()
    tabulate([(model, workload, args.requests) for model in args.models
              for workload in args.workloads], measure, markdown, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
