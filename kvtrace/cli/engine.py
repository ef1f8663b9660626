"""``kvtrace engine``: a live CPU engine process (vLLM's real scheduler and cache) to capture
from."""

from __future__ import annotations

import os
import sys

import click

from kvtrace.cli.common import async_scheduling_option, lookahead_block_hashes_option
from kvtrace.engine_config import MAX_SPECULATIVE_TOKENS, SPECULATIVE_METHODS, SchedulerSettings
from kvtrace.vllm_release_table import RELEASES

@click.command("engine")
@click.argument("workload", type=click.Path(dir_okay=False))
@click.option("--variant", default="upstream", show_default=True, metavar="NAME",
              help="Checkpoint variant the engine runs: upstream (the installed vLLM), "
                   "unfixed, fixed, naive.")
@click.option("--num-gpu-blocks", type=click.IntRange(min=1), default=None,
              help="Block pool size (default: the workload's).")
@click.option("--retention", default=None, metavar="none|0|N",
              help="prefix-cache retention interval: none (dense), 0 (latest-only) or N tokens "
                   "(default: the workload's).")
@async_scheduling_option
@click.option("--num-speculative-tokens", type=click.IntRange(min=0, max=MAX_SPECULATIVE_TOKENS),
              default=None,
              metavar="K",
              help="Draft tokens each decode step proposes, as vLLM's speculative decoding "
                   "does (default: the workload's, else none).")
@click.option("--speculative-method", type=click.Choice(SPECULATIVE_METHODS), default=None,
              help="How the drafts are made: ngram (prompt lookup, no forward pass) or mtp "
                   "(a drafter reading the target's hidden states, as MTP and EAGLE do: "
                   "lookahead slots and lookahead block hashes; run without a draft model, "
                   "which no step needs). Default: the workload's, else ngram.")
@lookahead_block_hashes_option
@click.option("--draft-acceptance", type=click.FloatRange(min=0, max=1),
              default=SchedulerSettings.draft_acceptance,
              show_default=True, metavar="P",
              help="With drafts: the chance the verifier accepts each draft token in turn.")
@click.option("--speed", type=click.FloatRange(min=0), default=1.0, show_default=True,
              help="Virtual seconds per wall second (10: ten times faster); 0: no waiting.")
@click.option("--autostart", is_flag=True,
              help="Run the workload at once instead of waiting for 'start' on stdin.")
@click.option("--summary-json", type=click.Path(dir_okay=False), default=None,
              help="Write the run's figures (requests, hit tokens, hit rate, steps, wall time) "
                   "as JSON to this file when the workload is done.")
@click.option("--vllm", "release", default=None, metavar="VERSION",
              help=f"Run on this vLLM release ({RELEASES[0].version}-{RELEASES[-1].version}; "
                   "installed beside the project's with kvtrace vllm install) instead of the "
                   "project's own.")
def command(workload: str, variant: str, num_gpu_blocks: int | None, retention: str | None,
            async_scheduling: bool | None, num_speculative_tokens: int | None,
            speculative_method: str | None, lookahead_block_hashes: bool | None,
            draft_acceptance: float, speed: float, autostart: bool,
            summary_json: str | None, release: str | None) -> None:
    """Run WORKLOAD through the real vLLM prefix cache as a live engine-core process.

    The process titles itself VLLM::EngineCore, loads vLLM's general plugins (an installed
    kvtrace plugin included), prints "kvtrace engine: pid N ready (...)" and idles until a
    line "start" on stdin (or --autostart); it then replays the workload's arrivals in
    accelerated real time under kvtrace's scheduler model, prints "kvtrace engine: done (...)"
    and idles again. "quit", end of input, SIGTERM or SIGINT make it exit (status 0).
    There is no model: a step is only scheduling and cache work.

    \b
    With --vllm VERSION the process replaces itself (exec, same pid) with one that has that
    release's directory first on sys.path, so that vLLM's scheduler and cache are that
    release's own.

    \b
    Examples:
        kvtrace engine agent.kvtrace --variant unfixed --speed 10
        kvtrace engine agent.kvtrace --autostart --speed 0 --summary-json run.json
        kvtrace engine agent.kvtrace --async-scheduling --speed 10
        kvtrace engine agent.kvtrace --num-speculative-tokens 2 --draft-acceptance 0.7
        kvtrace engine agent.kvtrace --num-speculative-tokens 2 --speculative-method mtp
        kvtrace engine agent.kvtrace --vllm 0.30.0
    """
    import msgspec

    from kvtrace.children import isolated_children
    from kvtrace.cli.common import write_atomically
    from kvtrace.engine.core import EngineOptions, run_engine
    from kvtrace.engine_config import KEEP, Overrides, parse_retention
    from kvtrace.files import check_output_dir, refuse_overwrite

    if summary_json:
        refuse_overwrite([("--summary-json", summary_json)], [workload])
        check_output_dir(summary_json, "--summary-json")
    if release is not None:
        _run_on(release, workload, variant=variant, num_gpu_blocks=num_gpu_blocks,
                retention=retention, speed=speed, autostart=autostart,
                summary_json=summary_json, num_speculative_tokens=num_speculative_tokens,
                speculative_method=speculative_method, draft_acceptance=draft_acceptance, **{
                    "async_scheduling": async_scheduling is True,
                    "sync_scheduling": async_scheduling is False,
                    "lookahead_block_hashes": lookahead_block_hashes is True,
                    "no_lookahead_block_hashes": lookahead_block_hashes is False})

    options = EngineOptions(
        source=workload, variant=variant, speed=speed, draft_acceptance=draft_acceptance,
        overrides=Overrides(
            num_gpu_blocks=num_gpu_blocks,
            retention_interval=KEEP if retention is None else parse_retention(retention),
            async_scheduling=async_scheduling, num_speculative_tokens=num_speculative_tokens,
            speculative_method=speculative_method,
            lookahead_block_hashes=lookahead_block_hashes))

    def write_summary(summary: dict) -> None:
        write_atomically(summary_json, msgspec.json.format(msgspec.json.encode(summary),
                                                            indent=2) + b"\n")

    with isolated_children():  # vLLM's own (its model registry runs python -m vllm...)
        run_engine(options, autostart=autostart,
                   on_done=write_summary if summary_json else None)


def _run_on(release: str, workload: str, **options) -> None:
    """Become ``kvtrace engine WORKLOAD ... --vllm RELEASE`` with the release first on
    ``sys.path`` (exec: the same pid); return at once when this process already runs it."""
    from kvtrace.children import python_child
    from kvtrace.cli import verbosity
    from kvtrace.vllm_releases import environment, running_vllm_version

    if release == running_vllm_version():
        return
    argv, env = python_child("kvtrace", *["-v"] * verbosity(), "engine", workload, "--vllm",
                             release, env=environment(release))  # refuses one not installed
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value not in (None, False):
            argv += [flag, str(value)]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(argv[0], argv, env)
