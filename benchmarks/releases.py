"""The release table of docs/findings.md: the seed scenario (`kvtrace synth --preset
documents`) on each bundled model's geometry, replayed with one variant per vLLM release
(`vllm-0.30.0` ... `vllm-0.33.0`, each release's own cache code in a process of its own), plus
the modelled `fixed` (#56794's gate on the project's 0.33.0 code) beside them.

The releases must be installed beside the project's vLLM (scripts/bootstrap does it, or
`kvtrace vllm install --all`). Each row's command reproduces it (run in an empty directory).

    .venv/bin/python benchmarks/releases.py [--requests 200] [--models ...] [--json FILE]
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from findings import arguments, run, tabulate, transient_share, workload_command

from kvtrace.probes.signatures import SUPPORTED_VLLM_VERSIONS

VARIANTS = [f"vllm-{version}" for version in SUPPORTED_VLLM_VERSIONS] + ["fixed"]


def replay_command(source: str, outdir: str) -> list[str]:
    return ["kvtrace", "replay", source, *(arg for v in VARIANTS for arg in ("--variant", v)),
            "-o", outdir]


def measure(model: str, requests: int, directory: Path) -> dict:
    name = f"{model}.documents"
    make = workload_command("documents", model, requests, f"{name}.kvtrace")
    replay = replay_command(f"{name}.kvtrace", f"{name}/")
    started = time.perf_counter()
    run(make, directory)
    run(replay + ["--summary-json", f"{name}.json"], directory)
    figures = json.loads((directory / f"{name}.json").read_text())["variants"]
    row = {"model": model, "commands": " && ".join(" ".join(c) for c in (make, replay)),
           "wall_s": time.perf_counter() - started,
           "variants": {v: {key: figures[v][key] for key in (
               "hit_rate", "hit_tokens", "prompt_tokens", "checkpoints_suppressed",
               "preemptions")} for v in VARIANTS}}
    for v in VARIANTS:
        row["variants"][v]["prompt_end_stripped"] = transient_share(
            str(directory / name / f"{name}.{v}.kvtrace"))[3]
    return row


def markdown(rows: list[dict]) -> str:
    lines = ["| model | " + " | ".join(VARIANTS) + " | preemptions (0.30.0 / 0.33.0 / fixed) "
             "| prompt-end keys stripped (0.30.0 / fixed) | command |",
             "|---" * (len(VARIANTS) + 4) + "|"]
    for row in rows:
        v = row["variants"]
        lines.append(f"| {row['model']} | "
                     + " | ".join(f"{v[x]['hit_rate']:.2%}" for x in VARIANTS)
                     + " | " + " / ".join(str(v[x]["preemptions"])
                                          for x in ("vllm-0.30.0", "vllm-0.33.0", "fixed"))
                     + f" | {v['vllm-0.30.0']['prompt_end_stripped']:,} / "
                     f"{v['fixed']['prompt_end_stripped']:,} | `{row['commands']}` |")
    return "\n".join(lines)


def main() -> int:
    args = arguments(__doc__).parse_args()
    tabulate([(model, args.requests) for model in args.models], measure, markdown, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
