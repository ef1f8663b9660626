"""``kvtrace replay``: replay a workload or a captured trace under checkpoint variants."""

from __future__ import annotations

import sys

import click

from kvtrace.cli.common import async_scheduling_option, lookahead_block_hashes_option
from kvtrace.cli.model_options import hf_overrides_option
from kvtrace.vllm_release_table import RELEASES


@click.command("replay")
@click.argument("source", type=click.Path(dir_okay=False))
@click.option("--variant", "variants", multiple=True, metavar="NAME",
              help="Checkpoint variant: unfixed, fixed, naive, upstream, or a vLLM release's own "
                   f"code, vllm-{RELEASES[0].version} ... vllm-{RELEASES[-1].version} (kvtrace "
                   "vllm install). Repeat to compare (default: unfixed and fixed; with --verify: "
                   "the engine's own).")
@click.option("--backend", default="vllm", show_default=True,
              help="Cache implementation: vllm (the installed vLLM's KVCacheManager, the "
                   "fidelity reference) or model (kvtrace's re-implementation of it: the same "
                   "records, several times faster; see docs/replay-backends.md).")
@click.option("--num-gpu-blocks", type=click.IntRange(min=1), default=None,
              help="Block pool size (default: the source's).")
@click.option("--retention", default=None, metavar="none|0|N",
              help="prefix-cache retention interval: none (dense), 0 (latest-only) or N tokens "
                   "(default: the source's).")
@click.option("--max-num-batched-tokens", type=click.IntRange(min=1), default=None,
              help="Token budget per step (default: the source's, else 8192).")
@click.option("--max-num-seqs", type=click.IntRange(min=1), default=None,
              help="Most running requests (default: the source's, else 1024).")
@click.option("--long-prefill-token-threshold", type=click.IntRange(min=0), default=None,
              help="Cap on one request's prefill chunk (default: the source's, else 0 = off).")
@async_scheduling_option
@lookahead_block_hashes_option
@click.option("--lockstep", is_flag=True,
              help="Re-issue a captured trace's calls in order instead of rescheduling.")
@click.option("--verify", is_flag=True,
              help="With --lockstep: compare effects with the captured ones; exit 1 on a mismatch.")
@click.option("-o", "--outdir", required=True, type=click.Path(file_okay=False),
              help="Directory for one replay trace per variant (SOURCE.VARIANT.kvtrace).")
@click.option("--summary-json", type=click.Path(dir_okay=False), default=None,
              help="Also write the summary as JSON to this file.")
@click.option("--db", type=click.Path(dir_okay=False), default=None,
              help="Then load the replay traces (and a captured SOURCE) into this DuckDB file.")
@click.option("--model", "model", default=None, metavar="NAME|CONFIG.json",
              help="The model whose prefill FLOPs price the lookups (and whose state --execute "
                   "re-executes): a preset of `kvtrace geometry` or a config.json  [default: "
                   "the model the source was written for; for a capture, the one its engine "
                   "served, when it names a preset or its Hugging Face repository].")
@hf_overrides_option
@click.option("--execute", is_flag=True,
              help="Also re-execute the recurrent state in torch: check every Mamba hit "
                   "against a recomputed state, time the recomputed prefill, price it in GPU "
                   "time (docs/execute.md).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default=None,
              help="With --execute: where the state pool and recurrence run  [default: auto, "
                   "CUDA when torch sees one].")
@click.option("--state-scale", type=float, default=None, metavar="F",
              help="With --execute: state dimensions times F in (0, 1]  [default: 1 on CUDA "
                   "when the pool fits, 1/16 on CPU].")
@click.option("--gpu", default=None, metavar="h200|h100|b200|TFLOPS",
              help="With --execute: the GPU that prices recomputed tokens, a preset (published "
                   "peak x 40%) or effective TFLOP/s  [default: h200].")
def command(source: str, variants: tuple[str, ...], backend: str, num_gpu_blocks: int | None,
            retention: str | None, max_num_batched_tokens: int | None, max_num_seqs: int | None,
            long_prefill_token_threshold: int | None, async_scheduling: bool | None,
            lookahead_block_hashes: bool | None, lockstep: bool, verify: bool, outdir: str,
            summary_json: str | None, db: str | None, model: str | None, execute: bool,
            device: str | None, state_scale: float | None, gpu: str | None) -> None:
    """Replay SOURCE against the prefix-cache logic of each --variant.

    A workload (kvtrace synth / import) is rescheduled: kvtrace's model of vLLM's scheduler
    drives every variant from the same arrivals. A captured trace can also be replayed in
    --lockstep, re-issuing its calls; --verify then checks that the engine's own variant
    reproduces the captured effects. Prints one summary row per variant.

    \b
    Examples:
        kvtrace replay agent.kvtrace --variant unfixed --variant fixed -o runs/
        kvtrace replay prod.kvtrace --lockstep --verify -o runs/
        kvtrace replay prod.kvtrace --variant unfixed --variant fixed -o runs/ --db prod.duckdb
        kvtrace replay agent.kvtrace --variant naive --variant fixed --execute -o runs/
        kvtrace replay agent.kvtrace --variant vllm-0.30.0 --variant vllm-0.33.0 -o runs/
    """
    import msgspec

    from kvtrace.cli.common import write_atomically
    from kvtrace.engine_config import KEEP, Overrides, parse_retention
    from kvtrace.errors import KvtraceError
    from kvtrace.geometry.cost import DEFAULT_GPU
    from kvtrace.replay.execute import ExecuteOptions
    from kvtrace.replay.options import ReplayOptions
    from kvtrace.replay.run import replay

    if verify and not lockstep:
        raise KvtraceError("--verify needs --lockstep",
                           "Verification re-issues the captured calls: add --lockstep.")
    execute_flags = {"--device": device, "--state-scale": state_scale, "--gpu": gpu}
    given = [flag for flag, value in execute_flags.items() if value is not None]
    if given and not execute:
        raise KvtraceError(f"{given[0]} applies to execute mode only", "Add --execute.")
    _check_outputs(source, outdir, summary_json, db)
    options = ReplayOptions(
        source=source, outdir=outdir, variants=variants, backend=backend,
        lockstep=lockstep, verify=verify, overrides=Overrides(
            num_gpu_blocks=num_gpu_blocks,
            retention_interval=KEEP if retention is None else parse_retention(retention),
            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
            long_prefill_token_threshold=long_prefill_token_threshold,
            async_scheduling=async_scheduling, lookahead_block_hashes=lookahead_block_hashes),
        execute=ExecuteOptions(device=device or "auto", state_scale=state_scale,
                               gpu=gpu or DEFAULT_GPU) if execute else None, model=model)
    result = replay(options, progress=_progress_bar if sys.stderr.isatty() else None)
    _print_table(result)
    for warning in result.warnings:
        click.echo(f"kvtrace: warning: {warning}", err=True)
    _warn_of_silent_zeros(result)
    if summary_json:
        write_atomically(summary_json, msgspec.json.format(
            msgspec.json.encode(result.summary_json()), indent=2) + b"\n")
    if db:
        _load(source, result, db)
    if result.fidelity is not None:
        _print_fidelity(result)
        if result.fidelity.matched != result.fidelity.total:
            raise SystemExit(1)


def _check_outputs(source: str, outdir: str, summary_json: str | None, db: str | None) -> None:
    """Before any replay: --summary-json and --db can be written, and replace neither the
    source, nor each other, nor a replay trace in OUTDIR."""
    import os

    from kvtrace.files import OutputError, check_output_dir, refuse_overwrite, same_file

    outputs = [("--summary-json", summary_json), ("--db", db)]
    refuse_overwrite(outputs, [source])
    for option, path in outputs:
        if path is None:
            continue
        directory = os.path.dirname(os.path.abspath(path))
        in_outdir = same_file(directory, outdir) or directory == os.path.abspath(outdir)
        if in_outdir and path.endswith(".kvtrace"):
            raise OutputError(f"{option} {path} is in OUTDIR, where the replay traces go",
                              f"Give {option} a path outside {outdir}.")
        if not in_outdir:  # OUTDIR itself is made (or refused) before any variant runs
            check_output_dir(path, option)


def _warn_of_silent_zeros(result) -> None:
    """A variant whose hit rate is near zero is attributed (one pass over its output), and
    warned about when something other than cold prompts explains it."""
    from kvtrace.analysis.attribution import attribute_trace
    from kvtrace.analysis.miss_summary import (NEAR_ZERO_HIT_RATE, CauseTotals,
                                               silent_zero_warning)

    for variant in result.variants:
        summary = variant.summary
        if not summary["prompt_tokens"] or summary["hit_rate"] >= NEAR_ZERO_HIT_RATE:
            continue
        lookups = attribute_trace(variant.output).lookups
        warning = silent_zero_warning(f"variant {variant.variant}",
                                      CauseTotals.of(l for l in lookups if l.lookup == 1),
                                      result.config.hash_block_size)
        if warning:
            click.echo(f"kvtrace: warning: {warning}; see `kvtrace why {variant.output} "
                       "--request N`", err=True)


def _load(source: str, result, db: str) -> None:
    """Load the replay outputs, and the source itself when it is a capture (its own forensics
    need no replay), into ``db``."""
    from kvtrace.analysis.load import load_traces
    from kvtrace.traceio import TraceReader

    with TraceReader(source) as reader:
        captured = reader.header.source == "capture"
    paths = ([source] if captured else []) + [v.output for v in result.variants]
    loaded = load_traces(paths, db, option="--db")
    click.echo(f"loaded {len(loaded.runs)} trace(s), {loaded.num_records:,} records into {db} "
               f"in {loaded.seconds:.1f}s; try: kvtrace report {db}")


def _progress_bar(variant: str, num_requests: int):
    """A finished-requests bar with ETA on stderr (only used when stderr is a terminal)."""
    bar = click.progressbar(length=num_requests, label=f"{variant:<10}", show_eta=True,
                            file=sys.stderr)
    done = 0

    def update(num_finished: int) -> None:
        nonlocal done
        bar.update(num_finished - done)
        done = num_finished
        if done == num_requests:
            bar.render_finish()

    return update


def _print_table(result) -> None:
    from kvtrace.engine_config import describe_retention

    config = result.config
    executed = [v.summary.get("execute") for v in result.variants]
    click.echo(f"mode {result.mode}, {config.num_gpu_blocks} blocks, "
               f"retention {describe_retention(config.retention_interval)}")
    width = max(10, *(len(v.variant) for v in result.variants))
    header = (f"{'variant':<{width}} {'requests':>8} {'prompt tok':>11} {'hit tok':>10} {'hit rate':>8} "
              f"{'evicted':>8} {'ckpt pub':>8} {'ckpt sup':>8} {'stale':>6} {'preempt':>7} "
              f"{'wall s':>7}")
    if all(executed):
        header += f" {'wrong st':>8} {'exec s':>7} {'gpu s':>8}"
    click.echo(f"{header}  output")
    for v, figures in zip(result.variants, executed):
        s = v.summary
        row = (f"{v.variant:<{width}} {s['requests']:>8} {s['prompt_tokens']:>11} {s['hit_tokens']:>10} "
               f"{s['hit_rate']:>8.2%} {s['evictions'].get('lru_reuse', 0):>8} "
               f"{s['checkpoints_published']:>8} {s['checkpoints_suppressed']:>8} "
               f"{s['stale_key_hazards']:>6} {s['preemptions']:>7} {v.wall_s:>7.1f}")
        if figures:
            row += (f" {figures['wrong_state_hits']:>8} {figures['measured_prefill_s']:>7.2f} "
                    f"{figures['estimated_gpu_s']:>8.3f}")
        click.echo(f"{row}  {v.output}")
    if all(executed):
        _print_execute(result.variants, executed)


def _print_execute(variants, executed) -> None:
    """What the columns above rest on, and the first wrong-state hit of each variant."""
    first = executed[0]
    click.echo(f"execute: {first['device']}, {first['kernel']}, state per block and group "
               f"{first['state']}; GPU time: {first['model']} at "
               f"{first['gpu_flops_per_s'] / 1e12:g} TFLOP/s ({first['gpu']})")
    for v, figures in zip(variants, executed):
        hit = figures["first_wrong_state_hit"]
        if hit is None:
            continue
        holds = hit["holds"]
        held = (f"the state of request {holds['req']} at {holds['num_tokens']} tokens"
                if holds else "no state execute mode wrote")
        click.echo(f"{v.variant}: first wrong-state hit: request {hit['req']} read block "
                   f"{hit['block_id']} (group {hit['group']}) for its {hit['depth']}-token "
                   f"prefix; the block held {held}")


def _print_fidelity(result) -> None:
    fidelity = result.fidelity
    verdict = "identical" if fidelity.matched == fidelity.total else "DIVERGED"
    click.echo(f"fidelity ({result.fidelity_variant}): {fidelity.matched}/{fidelity.total} "
               f"effect records match: {verdict}")
    if fidelity.first_divergence is not None:
        click.echo(f"first divergence: {fidelity.first_divergence}")
