"""The speculative-decoding table of docs/findings.md: what MTP costs a hybrid prefix cache on
vLLM 0.33's own scheduler and cache (``kvtrace engine``, the installed vLLM, variant upstream),
with 0.33's lookahead block hashes (its default) and with the dropped last block (vLLM's
``disable_lookahead_block_hashes``; releases before 0.33 drop it always), against the same
workload without drafts and with n-gram drafts (the same speculative Mamba state blocks and
drafts, no lookahead). Two draft tokens a step, each accepted with probability 0.7.

    .venv/bin/python benchmarks/speculative.py [--requests 200] [--models ...]
        [--workloads ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

from findings import MODELS, ROOT, run, workload_command

WORKLOADS = ["documents", "chat", "agent"]
DRAFTERS = {
    "none": [],
    "ngram": ["--num-speculative-tokens", "2", "--speculative-method", "ngram"],
    "mtp": ["--num-speculative-tokens", "2", "--speculative-method", "mtp"],
    "mtp, dropped block": ["--num-speculative-tokens", "2", "--speculative-method", "mtp",
                           "--no-lookahead-block-hashes"],
}


def engine_command(workload: str, drafter: str, summary: str) -> list[str]:
    return ["kvtrace", "engine", workload, "--variant", "upstream", "--autostart", "--speed",
            "0", *DRAFTERS[drafter], "--summary-json", summary]


def hit_rate(workload: str, drafter: str, directory: Path) -> float:
    summary = directory / f"{drafter.replace(', ', '-').replace(' ', '-')}.json"
    command = engine_command(workload, drafter, str(summary))
    subprocess.run([str(ROOT / ".venv" / "bin" / command[0]), *command[1:]], check=True,
                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, cwd=directory)
    return json.loads(summary.read_text())["hit_rate"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--workloads", nargs="+", default=WORKLOADS)
    args = parser.parse_args()
    print("| model | workload | no drafts | n-gram | MTP, lookahead hashes (0.33) | MTP, dropped "
          "block | command |")
    print("|---|---|---|---|---|---|---|")
    for model in args.models:
        for workload in args.workloads:
            with tempfile.TemporaryDirectory() as directory:
                path = Path(directory)
                name = f"{model}.{workload}.kvtrace"
                run(workload_command(workload, model, args.requests, name), path)
                rates = [hit_rate(name, drafter, path) for drafter in DRAFTERS]
            command = " && ".join([
                " ".join(workload_command(workload, model, args.requests, name)),
                " ".join(engine_command(name, "mtp, dropped block", "run.json"))
                + " < /dev/null"])
            print(f"| {model} | {workload} | " + " | ".join(f"{rate:.2%}" for rate in rates)
                  + f" | `{command}` |", flush=True)


if __name__ == "__main__":
    main()
