"""``kvtrace report``: a verdict first - per pair of variants, what moving from one to the other
does to hits, prefill and GPU time on this traffic, and what to do - then the forensics behind
it, for a terminal, as Markdown for an incident ticket, or as one self-contained HTML page.

The report is made in layers, each below the next: ``pricing`` (what prices recomputed
tokens), ``report_model`` (what a report holds), ``verdict`` and ``fleet_verdict`` (their
sentences), ``report_collect`` (the data, from the shipped queries), then the formats:
``report_text`` (terminal and Markdown) and ``report_html`` (the page).
"""

from __future__ import annotations

from kvtrace.analysis.pricing import pricing_for
from kvtrace.analysis.report_collect import collect
from kvtrace.analysis.report_text import render_markdown, render_text
from kvtrace.geometry.cost import DEFAULT_GPU


def report_database(db: str, html_path: str | None = None, *, bucket_steps: int = 10,
                    min_hits: int = 2, markdown: bool = False, gpu: str = DEFAULT_GPU,
                    model: str | None = None) -> str:
    """The terminal report of ``db`` (Markdown with ``markdown``); with ``html_path``, also
    write the HTML report there (atomically)."""
    from kvtrace.analysis.database import open_database
    from kvtrace.files import write_atomically

    pricing = pricing_for(gpu, model)
    connection = open_database(db)
    try:
        data = collect(connection, db, bucket_steps=bucket_steps, min_hits=min_hits,
                       pricing=pricing)
    finally:
        connection.close()
    if html_path:
        from kvtrace.analysis.report_html import render_html

        write_atomically(html_path, render_html(data).encode())
    return render_markdown(data) if markdown else render_text(data)
