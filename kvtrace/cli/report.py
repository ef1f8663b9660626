"""``kvtrace report``: a verdict, then the forensics of a database: terminal, Markdown or HTML."""

from __future__ import annotations

import click

from kvtrace.cli.model_options import hf_overrides_option


@click.command("report")
@click.argument("db", type=click.Path(dir_okay=False))
@click.option("--html", "html_path", type=click.Path(dir_okay=False),
              help="Also write the HTML report (interactive plots, no network needed) here.")
@click.option("--markdown", is_flag=True,
              help="Print the verdict and the top tables as Markdown (for an incident ticket).")
@click.option("--gpu", default="h200", show_default=True, metavar="h200|h100|b200|TFLOPS",
              help="The GPU that prices recomputed tokens: a preset (published dense BF16 peak "
                   "x 40%) or effective TFLOP/s.")
@click.option("--model", "model", default=None, metavar="NAME|CONFIG.json",
              help="The model that prices the runs whose header names none (a capture of a "
                   "model kvtrace could not resolve, replayed without --model): a preset of "
                   "`kvtrace geometry` or a config.json.")
@hf_overrides_option
@click.option("--bucket-steps", type=click.IntRange(min=1), default=10, show_default=True,
              help="Scheduler steps per point of the time plots.")
@click.option("--min-hits", type=click.IntRange(min=0), default=2, show_default=True,
              help="Hits that make a prefix hot (pushouts, occupancy).")
def command(db: str, html_path: str | None, markdown: bool, gpu: str, model: str | None,
            bucket_steps: int, min_hits: int) -> None:
    """Summarise DB: a verdict per pair of variants, then hit rates, pushed-out prefixes, lost
    hits, GPU-seconds and eviction causes.

    \b
    Example:
        kvtrace report prod.duckdb --html report.html
        kvtrace report prod.duckdb --markdown --gpu h100 > ticket.md
    """
    from kvtrace.analysis.report import report_database
    from kvtrace.cli.common import terminal_safe
    from kvtrace.files import check_output_dir, refuse_overwrite

    if html_path:
        refuse_overwrite([("--html", html_path)], [db])
        check_output_dir(html_path, "--html")
    text = report_database(db, html_path, bucket_steps=bucket_steps, min_hits=min_hits,
                           markdown=markdown, gpu=gpu, model=model)
    click.echo(terminal_safe(text), nl=False)  # the database's strings, shown inert
    if html_path:
        click.echo(terminal_safe(f"wrote {html_path}"), err=markdown)
