"""``kvtrace sweep``: replay one source under a grid of pool sizes, retentions and variants."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import click


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@click.command("sweep")
@click.argument("source", type=click.Path(dir_okay=False))
@click.option("--pool-fraction", "pool_fractions", multiple=True, metavar="F[,F...]",
              help="Pool sizes as shares of SOURCE's distinct attention blocks (its attention "
                   "working set, a shared prefix block counted once), e.g. 0.05,0.1,0.2.")
@click.option("--num-gpu-blocks", "num_gpu_blocks", multiple=True, metavar="N[,N...]",
              help="Pool sizes in blocks (instead of --pool-fraction).")
@click.option("--variant", "variants", multiple=True, metavar="NAME[,NAME...]",
              help="Checkpoint variants: unfixed, fixed, naive, upstream (default: unfixed,fixed).")
@click.option("--retention", "retentions", multiple=True, metavar="none|0|N[,...]",
              help="Retention intervals: none (dense), 0 (latest-only), N tokens "
                   "(default: the source's).")
@click.option("--backend", default=None, metavar="NAME",
              help="Cache implementation (default: model, the fast one, where installed; "
                   "else vllm).")
@click.option("-o", "--outdir", required=True, type=click.Path(file_okay=False),
              help="Directory for sweep.json, sweep.png, sweep.html (and sweep.duckdb).")
@click.option("--db", type=click.Path(dir_okay=False), default=None,
              help="Add the rows to this DuckDB file's sweep table instead of OUTDIR/sweep.duckdb "
                   "(created if missing).")
@click.option("-j", "--jobs", type=click.IntRange(min=1), default=None,
              help="Configurations run at once: local processes, or Ray CPUs with --ray local "
                   "(default: the CPUs here; 1 runs them in this process).")
@click.option("--ray", "ray_address", default=None, metavar="ADDRESS|auto|local",
              help="Run the configurations as Ray tasks: on the cluster at ADDRESS, the one "
                   "this host belongs to (auto), or a private local instance (local). Needs "
                   "pip install 'kvtrace[ray]'.")
def command(source: str, pool_fractions: tuple[str, ...], num_gpu_blocks: tuple[str, ...],
            variants: tuple[str, ...], retentions: tuple[str, ...], backend: str | None,
            outdir: str, db: str | None, jobs: int | None, ray_address: str | None) -> None:
    """Replay SOURCE once per configuration of a grid and compare hit rates.

    The grid is every --variant x --retention x pool size. Each configuration is a replay
    (no trace is written); each gives one row: hit rate, hit tokens, evictions, checkpoints
    published and suppressed. The whole grid is checked first: a pool too small for the
    largest request is refused, naming the smallest usable size. Writes OUTDIR/sweep.json,
    a hit-rate-vs-pool-size plot per variant (sweep.png, sweep.html) and a DuckDB `sweep`
    table (`kvtrace sql OUTDIR/sweep.duckdb "SELECT * FROM sweep"`).

    \b
    Example:
        kvtrace sweep mooncake.kvtrace --pool-fraction 0.05,0.1,0.15,0.2,0.25,0.3,0.35,0.4 \\
            --variant unfixed,fixed -o sweep/
        kvtrace sweep prod.kvtrace --num-gpu-blocks 20000,40000 --retention 0,none \\
            -o sweep/ --db prod.duckdb --ray auto
    """
    from kvtrace.analysis.sweep import check_outputs, write_outputs
    from kvtrace.engine_config import KEEP, parse_retention
    from kvtrace.replay.options import DEFAULT_VARIANTS
    from kvtrace.replay.sweep import SweepGrid, plan_sweep, run_sweep

    grid = SweepGrid(
        source=source,
        variants=_parse(variants, str) or DEFAULT_VARIANTS,
        retentions=_parse(retentions, parse_retention) or (KEEP,),
        pool_fractions=_parse(pool_fractions, _number(float, "--pool-fraction")),
        num_gpu_blocks=_parse(num_gpu_blocks, _number(int, "--num-gpu-blocks")),
        backend=backend or "")
    check_outputs(outdir, db, source)
    plan = plan_sweep(grid)
    jobs = min(jobs or _cpus(), len(plan.tasks))
    for note in plan.notes:
        click.echo(f"note: {note}", err=True)
    count = f"{len(plan.tasks)} configuration{'s' if len(plan.tasks) > 1 else ''}"
    click.echo(f"sweeping {count} of {source} on the {plan.backend} "
               f"backend" + (f", {jobs} at a time" if ray_address is None else
                             f", on Ray ({ray_address})"), err=True)
    result = run_sweep(plan, jobs=jobs, ray_address=ray_address, on_row=_progress(len(plan.tasks)))
    sweep = result.to_json()
    written = write_outputs(sweep, outdir, db)
    _print_rows(sweep)
    click.echo(f"{count} in {result.wall_s:.1f} s ({result.runner}); "
               "wrote " + ", ".join(written.values()))


def _parse(values: tuple[str, ...], parse: Callable[[str], Any]) -> tuple:
    """Values given repeated and/or comma-separated (``0.05,0.1 --x 0.2``), parsed."""
    return tuple(parse(item.strip()) for value in values for item in value.split(",")
                 if item.strip())


def _number(kind: type, option: str) -> Callable[[str], Any]:
    def parse(text: str):
        from kvtrace.errors import ConfigError

        try:
            return kind(text)
        except ValueError:
            raise ConfigError(f"{option} {text!r} is not a number",
                              f"Give {option} comma-separated numbers.") from None
    return parse


def _progress(total: int) -> Callable[[int, int, dict], None]:
    """A bar on a terminal, else one line per finished configuration (on stderr)."""
    if sys.stderr.isatty():
        bar = click.progressbar(length=total, label="configurations", show_eta=True,
                                file=sys.stderr)

        def advance(finished: int, total: int, row: dict) -> None:
            bar.update(1)
            if finished == total:
                bar.render_finish()
        return advance

    def line(finished: int, total: int, row: dict) -> None:
        click.echo(f"[{finished:>{len(str(total))}}/{total}] {_label(row)}: hit rate "
                   f"{row['hit_rate']:.2%} ({row['wall_s']:.1f} s)", err=True)
    return line


def _label(row: dict) -> str:
    from kvtrace.engine_config import describe_retention

    fraction = "" if row["pool_fraction"] is None else f" ({row['pool_fraction']:g})"
    return (f"{row['variant']}, retention {describe_retention(row['retention_interval'])}, "
            f"{row['num_gpu_blocks']} blocks{fraction}")


def _print_rows(sweep: dict) -> None:
    from kvtrace.analysis.render import format_table

    columns = ["variant", "retention_interval", "num_gpu_blocks", "pool_fraction", "hit_rate",
               "hit_tokens", "evictions", "checkpoints_published", "checkpoints_suppressed",
               "wall_s"]
    click.echo(format_table(columns, [tuple(row[c] for c in columns) for row in sweep["rows"]]),
               nl=False)
