"""``kvtrace report``: a forensics summary of a database, in the terminal or as HTML."""

from __future__ import annotations

import click


@click.command("report")
@click.argument("db", type=click.Path(dir_okay=False))
@click.option("--html", "html_path", type=click.Path(dir_okay=False),
              help="Also write an HTML report with embedded plots here.")
@click.option("--bucket-steps", type=click.IntRange(min=1), default=10, show_default=True,
              help="Scheduler steps per point of the time plots.")
@click.option("--min-hits", type=click.IntRange(min=0), default=2, show_default=True,
              help="Hits that make a prefix hot (pushouts, occupancy).")
def command(db: str, html_path: str | None, bucket_steps: int, min_hits: int) -> None:
    """Summarise DB: hit rates per variant, top pushed-out prefixes, lost hits, eviction causes.

    \b
    Example:
        kvtrace report prod.duckdb --html report.html
    """
    from kvtrace.analysis.report import report_database
    from kvtrace.cli.common import terminal_safe
    from kvtrace.files import check_output_dir, refuse_overwrite

    if html_path:
        refuse_overwrite([("--html", html_path)], [db])
        check_output_dir(html_path, "--html")
    text = report_database(db, html_path, bucket_steps=bucket_steps, min_hits=min_hits)
    click.echo(terminal_safe(text), nl=False)  # the database's strings, shown inert
    if html_path:
        click.echo(terminal_safe(f"wrote {html_path}"))
