"""Query results as text: an aligned table, a Markdown table, CSV or JSON lines."""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable

import msgspec

from kvtrace.analysis.queries import Query, Result


def cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def numeric_columns(count: int, rows: list[tuple]) -> list[bool]:
    """Which columns hold only numbers (or nothing): they align right."""
    return [bool(rows) and all(isinstance(row[i], (int, float)) or row[i] is None for row in rows)
            for i in range(count)]


def format_table(columns: list[str], rows: list[tuple], *, max_rows: int | None = None,
                 max_width: int | None = None) -> str:
    """Columns padded to their widest cell; numbers right-aligned; with ``max_width``, longer
    cells are cut and end in an ellipsis."""
    shown = rows if max_rows is None else rows[:max_rows]
    cells = [[cell(v) for v in row] for row in shown]
    if max_width is not None:
        cells = [[c if len(c) <= max_width else c[:max_width - 1] + "…" for c in row]
                 for row in cells]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    numeric = numeric_columns(len(columns), shown)

    def line(values):
        return "  ".join(v.rjust(w) if num else v.ljust(w)
                         for v, w, num in zip(values, widths, numeric)).rstrip()
    out = [line(columns), line(["-" * w for w in widths])] + [line(r) for r in cells]
    if max_rows is not None and len(rows) > max_rows:
        out.append(f"... {len(rows) - max_rows} more rows")
    out.append(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")
    return "\n".join(out) + "\n"


def format_markdown(columns: list[str], rows: list[tuple], *, max_rows: int | None = None) -> str:
    """A GitHub-flavoured Markdown table (numbers right-aligned), for an incident ticket."""
    shown = rows if max_rows is None else rows[:max_rows]
    numeric = numeric_columns(len(columns), shown)

    def line(values) -> str:
        return "| " + " | ".join(v.replace("|", "\\|") for v in values) + " |"

    out = [line(columns), line(["---:" if num else "---" for num in numeric])]
    out += [line([cell(v) for v in row]) for row in shown]
    if max_rows is not None and len(rows) > max_rows:
        out.append(f"\n{len(rows) - max_rows} more rows")
    return "\n".join(out) + "\n"


def format_result(result: Result, output_format: str = "table") -> str:
    if output_format == "csv":
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(result.columns)
        writer.writerows([[_csv_cell(v) for v in row] for row in result.rows])
        return buffer.getvalue()
    if output_format == "json":
        return "".join(
            msgspec.json.encode(dict(zip(result.columns, row)), enc_hook=str).decode() + "\n"
            for row in result.rows)
    return format_table(result.columns, result.rows)


def _csv_cell(value):
    return "" if value is None else value


def format_query_list(queries: Iterable[Query]) -> str:
    lines = []
    for query in queries:
        lines.append(f"{query.name}: {query.summary}")
        for param in query.params:
            lines.append(f"    --param {param.name}={param.default}  ({param.sql_type}) "
                         f"{param.description}")
        lines.append(f"    returns: {', '.join(query.columns)}")
    return "\n".join(lines) + "\n"
