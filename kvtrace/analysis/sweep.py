"""What a ``kvtrace sweep`` leaves behind: ``sweep.json``, the hit-rate-vs-pool-size plot (PNG,
and an HTML page with the plot and every row) and the rows in a DuckDB ``sweep`` table.

The sweep arrives as its JSON document (``replay.sweep.SweepResult.to_json``), the interface
between the replay stage and this one. Outputs appear all together or not at all: files are
staged beside their final names, the database is loaded (in one transaction), then the files
are renamed into place.
"""

from __future__ import annotations

import base64
import html
import io
import os
from pathlib import Path
from typing import Any

import msgspec

from kvtrace.analysis.database import SWEEP_COLUMNS, open_database
from kvtrace.analysis.html_style import CSS
from kvtrace.analysis.load import load_sweep
from kvtrace.analysis.render import cell
from kvtrace.errors import KvtraceError
from kvtrace.files import (
    StagedOutput,
    cannot_write,
    check_output_dir,
    existing_output,
    locked_output,
    refuse_overwrite,
)

SWEEP_JSON, SWEEP_PNG, SWEEP_HTML = "sweep.json", "sweep.png", "sweep.html"
SWEEP_DB = "sweep.duckdb"


def check_outputs(outdir: str | os.PathLike, db: str | None, source: str = "") -> None:
    """Refuse, before a sweep runs, outputs it could not write, that would replace its source
    (``-o DIR`` holding a source named ``sweep.html``), or that name one file twice
    (``--db DIR/sweep.json``)."""
    if os.path.exists(outdir) and not os.path.isdir(outdir):
        raise KvtraceError(f"output directory {outdir} is a file", "Give -o a directory.")
    outputs = _outputs(outdir, db)
    refuse_overwrite(outputs, [source] if source else [])
    for option, path in outputs:
        existing_output(path, option)
    if db is not None and os.path.exists(db):
        open_database(db).close()  # a kvtrace database this version can write to
    elif db is not None:
        check_output_dir(db, "--db")


def _outputs(outdir: str | os.PathLike, db: str | None) -> list[tuple[str, str]]:
    """What a sweep writes: ``(option, path)``, the database first."""
    database = ("--db", db) if db is not None else ("-o", os.path.join(outdir, SWEEP_DB))
    return [database, *(("-o", os.path.join(outdir, name))
                        for name in (SWEEP_JSON, SWEEP_PNG, SWEEP_HTML))]


def write_outputs(sweep: dict[str, Any], outdir: str | os.PathLike,
                  db: str | None = None) -> dict[str, str]:
    """Write the sweep's files into ``outdir`` and its rows into ``db`` (default:
    ``outdir/sweep.duckdb``, replaced); returns what was written, by kind."""
    check_outputs(outdir, db)
    outdir = Path(outdir)
    try:
        outdir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise cannot_write(outdir, error) from None
    png = plot_png(sweep)
    contents = {
        SWEEP_JSON: msgspec.json.format(msgspec.json.encode(sweep), indent=2) + b"\n",
        SWEEP_PNG: png,
        SWEEP_HTML: render_html(sweep, png).encode(),
    }
    staged: list[StagedOutput] = []
    try:
        for name, data in contents.items():
            staged.append(StagedOutput(outdir / name))
            Path(staged[-1].path).write_bytes(data)
        target = db if db is not None else str(outdir / SWEEP_DB)
        sweep_id = _add_rows(sweep, target, replace=db is None)
    except OSError as error:
        _remove(staged)
        raise cannot_write(outdir, error) from None
    except BaseException:
        _remove(staged)
        raise
    for output in staged:
        output.publish()
    written = {name: output.final for output, name in zip(staged, contents)}
    written["db"] = f"{target} (sweep_id {sweep_id})"
    return written


def _add_rows(sweep: dict[str, Any], db: str, *, replace: bool) -> int:
    """The sweep's rows into ``db``: a new database, or (``--db`` an existing one) added in
    place while holding its lock, so that a ``kvtrace load -o`` of the same path waits, and
    then refuses to replace what was added (``files.StagedOutput.publish``)."""
    if not replace:
        with locked_output(db, "--db") as existing:
            if existing is not None:
                return load_sweep(sweep, db)
    return load_sweep(sweep, db, replace=True)


def _remove(staged: list[StagedOutput]) -> None:
    for output in staged:
        output.discard()


def curves(sweep: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Rows per curve (variant x retention), each by pool size."""
    lines: dict[str, list[dict[str, Any]]] = {}
    for row in sweep["rows"]:
        retention = row["retention_interval"]
        label = f"{row['variant']}, retention {'none' if retention is None else retention}"
        lines.setdefault(label, []).append(row)
    return {label: sorted(rows, key=lambda r: r["num_gpu_blocks"])
            for label, rows in lines.items()}


def plot_png(sweep: dict[str, Any]) -> bytes:
    """Hit rate against pool size, one curve per variant (x retention)."""
    pyplot, figure, axes = _figure()
    for label, rows in curves(sweep).items():
        axes.plot([r["num_gpu_blocks"] for r in rows], [r["hit_rate"] for r in rows],
                  marker="o", label=label)
    axes.set_xlabel("pool size (num_gpu_blocks)")
    axes.set_ylabel("hit rate (prompt tokens)")
    axes.set_ylim(0, 1)
    distinct = sweep.get("distinct_attention_blocks")
    if distinct:
        top = axes.secondary_xaxis("top", functions=(lambda blocks: blocks / distinct,
                                                     lambda share: share * distinct))
        top.set_xlabel(f"share of the {distinct} distinct attention blocks")
    axes.legend(loc="lower right", fontsize="small")
    return _png(pyplot, figure)


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(9, 3.6), dpi=100)
    return pyplot, figure, axes


def _png(pyplot, figure) -> bytes:
    buffer = io.BytesIO()
    figure.tight_layout()
    figure.savefig(buffer, format="png")
    pyplot.close(figure)
    return buffer.getvalue()


def render_html(sweep: dict[str, Any], png: bytes) -> str:
    title = f"kvtrace sweep: {os.path.basename(sweep['source'])}"
    facts = (f"{len(sweep['rows'])} configurations of {sweep['source']} "
             f"({sweep['source_digest']}) on the {sweep['backend']} backend, "
             f"in {sweep['runner']}, {sweep['wall_s']:.1f} s")
    columns = [name for name, _ in SWEEP_COLUMNS if name in sweep["rows"][0]]
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    rows = "".join("<tr>" + "".join(f"<td>{html.escape(cell(row[c]))}</td>"
                                    for c in columns) + "</tr>" for row in sweep["rows"])
    notes = "".join(f"<p>{html.escape(note)}</p>" for note in sweep["notes"])
    image = base64.b64encode(png).decode()
    return ("<!doctype html><html><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title><style>{CSS}</style></head><body>"
            f"<h1>{html.escape(title)}</h1><p>{html.escape(facts)}</p>{notes}"
            f'<img alt="hit rate against pool size" src="data:image/png;base64,{image}">'
            f"<table><tr>{head}</tr>{rows}</table></body></html>\n")
