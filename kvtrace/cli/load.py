"""``kvtrace load``: traces and replay outputs into one DuckDB forensics database."""

from __future__ import annotations

import click


@click.command("load")
@click.argument("traces", nargs=-1, required=True, type=click.Path())
@click.option("-o", "--output", "db_path", required=True, type=click.Path(dir_okay=False),
              help="The DuckDB file to create (an existing one is replaced; never a trace).")
def command(traces: tuple[str, ...], db_path: str) -> None:
    """Load TRACES (trace files, or `kvtrace replay` output directories) into a DuckDB file.

    One table per record kind, every row tagged with its run, variant, backend, seq and step;
    a `runs` table with each trace's provenance, engine configuration and digest. A trace
    whose content an earlier one already loaded (the same file twice, or a directory and a
    trace in it) is skipped, with a line saying so. Query it with `kvtrace sql` or
    `kvtrace report`.

    \b
    Example:
        kvtrace load prod.kvtrace runs/ -o prod.duckdb
    """
    from kvtrace.analysis.load import load_traces
    from kvtrace.cli.common import terminal_safe, unknown_value_warnings

    summary = load_traces(list(traces), db_path)
    for path, same in summary.duplicates:
        click.echo(terminal_safe(f"kvtrace: skipped {path}: the same content as {same}, "
                                 "loaded already"), err=True)
    for run in summary.runs:
        note = "  (truncated: records up to the cut)" if run.truncated else ""
        click.echo(terminal_safe(f"run {run.run}: {run.path}  variant {run.variant}, backend "
                                 f"{run.backend}, {run.num_records} records{note}"))
        for warning in unknown_value_warnings(run.path, run.unknown_values):
            click.echo(terminal_safe(f"kvtrace: warning: {warning}"), err=True)
    click.echo(terminal_safe(f"loaded {summary.num_records} records from {len(summary.runs)} "
                             f"trace(s) into {summary.db_path} in {summary.seconds:.1f} s"))
