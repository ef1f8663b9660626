"""The report for a terminal (``render_text``) and as Markdown for an incident ticket
(``render_markdown``): the verdict first, then the fleet and the tables.

A database is input: every string it holds (variants, file names, models, anything a query
returns) is written through the format's escaping, ``text_value`` or ``markdown_value``, so that
it can neither drive a terminal nor start a line, a heading, a table cell, a link or HTML.
"""

from __future__ import annotations

import os
import re

from kvtrace.analysis.fleet_verdict import fleet_lines
from kvtrace.analysis.pricing import Pricing
from kvtrace.analysis.queries import Result, sql_command
from kvtrace.analysis.render import cell, format_markdown, format_table
from kvtrace.analysis.report_model import TOP_ROWS, ReportData, Verdict
from kvtrace.analysis.verdict import (
    advice,
    diagnosis_lines,
    prefix_phrase,
    verdict_lines,
    verdict_title,
)
from kvtrace.analysis.vllm_counters import QUERY as COUNTERS_QUERY

TEXT_CELL_WIDTH = 24  # a long cell would otherwise take a terminal's width

# What a terminal acts on, or ends a line at, rather than shows: C0 controls (newline and tab
# included), DEL, C1 controls, the Unicode line and paragraph separators, and the bidirectional
# marks and overrides that make text read other than it is.
_CONTROLS = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e"
                       r"\u2066-\u2069]")
# What Markdown acts on inside a line: HTML, entities and table cells (as entities, which a GFM
# table's cell split does not see), and what makes a heading, code, a link, strikethrough or
# emphasis (backslash-escaped); '_' only where it can open or close emphasis, not inside a word
# (hash_id).
_MARKDOWN_ENTITIES = {"&": "&amp;", "<": "&lt;", ">": "&gt;", "|": "&#124;"}
_MARKDOWN_ACTIVE = re.compile(r"[\\`*\[\]#~&<>|]|(?<![^\W_])_|_(?![^\W_])")


def text_value(value) -> str:
    """``value`` for a terminal: every control character, newline and tab included, shown as
    its escape (``\\n``, ``\\x1b``), so that it cannot start a line of its own or drive the
    terminal."""
    return _CONTROLS.sub(lambda match: ascii(match.group())[1:-1], str(value))


def markdown_value(value) -> str:
    """``value`` for Markdown: as ``text_value`` (a newline would start a heading or end a
    table row), then inert: HTML characters and pipes as entities, the rest of Markdown's
    punctuation backslash-escaped."""
    return _MARKDOWN_ACTIVE.sub(
        lambda match: _MARKDOWN_ENTITIES.get(match.group(), "\\" + match.group()),
        text_value(value))


def markdown_code(text: str) -> str:
    """``text`` (a command) as a Markdown code span, inside which nothing is interpreted: its
    controls shown escaped, fenced by more backticks than any run of them in it."""
    text = text_value(text)
    fence = "`" * (max(map(len, re.findall("`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _inert_value(value, escape):
    """A number as it is, anything else shown by ``escape``."""
    return value if value is None or isinstance(value, (int, float)) else escape(cell(value))


def _inert(result: Result, escape) -> Result:
    """``result`` with its column names and every cell but a number shown by ``escape``."""
    return Result([escape(column) for column in result.columns],
                  [tuple(_inert_value(v, escape) for v in row) for row in result.rows])


def _inert_verdict(verdict: Verdict, pricing: Pricing, escape) -> Verdict:
    """``verdict`` with what came from the database shown by ``escape``, and its advice
    written anew around those values (its own Markdown kept)."""
    def inert(row: dict) -> dict:
        return {key: _inert_value(value, escape) for key, value in row.items()}

    row = inert(verdict.row)
    return Verdict(row, escape(verdict.source), [inert(p) for p in verdict.prefixes],
                   advice(row, pricing))


def render_text(data: ReportData) -> str:
    parts = [f"WARNING: {text_value(warning)}\n" for warning in data.warnings]
    if data.warnings:
        parts.append("\n")
    parts.append("== Verdict ==\n")
    parts += _verdict_text(data, bullet="  ", escape=text_value, code=text_value)
    parts.append("\n")
    if data.fleet is not None:
        table = data.fleet.table
        parts.append(f"== {table.title} ==\n")
        parts += [f"  {text_value(line)}\n" for line in fleet_lines(data)]
        parts.append(f"  Reproduce: {text_value(table.command)}\n{table.note}\n")
        result = _inert(table.result, text_value)
        parts.append(format_table(result.columns, result.rows, max_rows=TOP_ROWS,
                                  max_width=TEXT_CELL_WIDTH) + "\n")
    for table in data.tables:
        parts.append(f"== {table.title} ==\n{table.note}\n")
        if table.result.rows:
            result = _inert(table.result, text_value)
            parts.append(format_table(result.columns, result.rows, max_rows=TOP_ROWS,
                                      max_width=TEXT_CELL_WIDTH))
        else:
            parts.append("(none)\n")
        parts.append("\n")
    return "".join(parts)


def _verdict_text(data: ReportData, bullet: str, escape, code,
                  title=lambda text: text) -> list[str]:
    """The verdict block's lines, shared by the terminal and Markdown (``escape`` shows what
    came from the database, ``code`` marks a command, ``title`` a pair's heading)."""
    lines = [] if data.verdicts else [
        f"{bullet}No pair of variants replayed from one source: replay the traffic under two "
        f"variants (kvtrace replay SOURCE --variant unfixed --variant fixed --db DB) for a "
        "verdict.\n"]
    for verdict in (_inert_verdict(v, data.pricing, escape) for v in data.verdicts):
        lines.append(f"{title(verdict_title(verdict))}\n")
        lines.append(f"{bullet}{verdict.advice}\n")
        lines += [f"{bullet}{label}: {value}\n" for label, value, _ in verdict_lines(verdict)]
        if verdict.prefixes:
            lines.append(f"{bullet}top pushed-out prefixes (run {verdict.row['from_run']}): "
                         + "; ".join(prefix_phrase(p) for p in verdict.prefixes) + "\n")
    if data.verdicts:
        lines.append(f"{bullet}{data.pricing.describe(escape(m) for m in data.cost_models if m)}"
                     "\n")
        lines.append(f"{bullet}Reproduce: {code(data.verdict_command)}; prefixes: "
                     f"{code(data.table('pushouts').command)}\n")
    lines += [f"{bullet}{escape(line)}\n" for line in diagnosis_lines(data)]
    if data.diagnoses:
        lines.append(f"{bullet}Each finding's evidence, and what a replay of its change "
                     f"predicts: {code(f'kvtrace doctor {data.db}')}\n")
    lines += [f"{bullet}{escape(line)}\n" for line in data.counters]
    if data.counters:
        lines.append(f"{bullet}vLLM's counters against the trace: "
                     f"{code(sql_command(data.db, COUNTERS_QUERY))}\n")
    return lines


MARKDOWN_TABLES = ("hit_rates", "pushouts", "lost_hits", "gpu_per_variant")


def render_markdown(data: ReportData) -> str:
    """The verdict and the top tables, to paste into an incident ticket."""
    parts = [f"## kvtrace report: {markdown_value(os.path.basename(data.db))}\n\n"]
    parts += [f"> **Warning:** {markdown_value(warning)}\n\n" for warning in data.warnings]
    parts.append("### Verdict\n\n")
    parts += _verdict_text(data, bullet="- ", escape=markdown_value, code=markdown_code,
                           title=lambda s: f"**{s}**\n")
    if data.fleet is not None:
        table = data.fleet.table
        parts.append(f"\n### {table.title}\n\n")
        parts += [f"- {markdown_value(line)}\n" for line in fleet_lines(data)]
        result = _inert(table.result, markdown_value)
        parts.append(f"\n{table.note}\n\n"
                     + format_markdown(result.columns, result.rows, max_rows=TOP_ROWS)
                     + f"\n{markdown_code(table.command)}\n")
    for table in (data.table(key) for key in MARKDOWN_TABLES):
        parts.append(f"\n### {table.title}\n\n{table.note}\n\n")
        result = _inert(table.result, markdown_value)
        parts.append(format_markdown(result.columns, result.rows, max_rows=TOP_ROWS)
                     if result.rows else "(none)\n")
        parts.append(f"\n{markdown_code(table.command)}\n")
    return "".join(parts)
