"""`kvtrace report` shows what a database holds as text, never as markup (issue 30, R4-6): a
variant or file name that carries a newline, a heading, pipes, code, a link or HTML forges no
line in the terminal report and no heading, table cell, link or HTML in the Markdown one."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest
from bad_traces import MARKUP_INJECTION, crafted_databases
from click.testing import CliRunner

from kvtrace.analysis.report_text import MARKDOWN_TABLES, markdown_value, text_value
from kvtrace.cli import cli
from test_analysis_cli import db as scenario_db  # noqa: F401 (a fixture: the scenario, loaded)

TABLE_TITLES = {"hit_rates": "Hit rate per run", "pushouts": "Top pushed-out prefixes",
                "lost_hits": "Hits lost by the unfixed variant",
                "gpu_per_variant": "GPU-seconds recomputing hits the other variant kept"}


@pytest.fixture(scope="module")
def forged(tmp_path_factory, scenario_db) -> Path:  # noqa: F811
    directory = tmp_path_factory.mktemp("forged")
    secret = directory / "secret"
    secret.write_text("")
    return crafted_databases(directory, scenario_db, secret)["strings that forge markup"]


def report(*args) -> str:
    result = CliRunner().invoke(cli, ["report", *map(str, args)])
    assert result.exit_code == 0, result.output
    return result.stdout


def test_the_text_report_shows_a_forged_line_as_escapes(forged):
    text = report(forged)
    assert not [line for line in text.splitlines() if line.lstrip().startswith("# H1")], text
    controls = {c for c in text if c != "\n" and unicodedata.category(c) in ("Cc", "Zl", "Zp")}
    assert not controls, controls
    assert r"\n# H1 | forged" in text  # the variant, in the verdict's title
    assert r"x<svg onload=alert(1)>|\n# H1.kvtrace" in text  # the source's file name


def table_rows(markdown: str) -> list[list[str]]:
    """Each table of ``markdown``: its lines split into cells at pipes no backslash escapes."""
    tables, current = [], []
    for line in markdown.splitlines() + [""]:
        if line.startswith("|"):
            current.append(re.split(r"(?<!\\)\|", line)[1:-1])
        elif current:
            tables.append(current)
            current = []
    return tables


def test_the_markdown_report_has_no_forged_heading_cell_html_or_link(forged):
    markdown = report(forged, "--markdown")
    headings = [line for line in markdown.splitlines() if re.match(r" {0,3}#", line)]
    assert headings == ["## kvtrace report: markup.duckdb", "### Verdict",
                        *(f"### {TABLE_TITLES[key]}" for key in MARKDOWN_TABLES)], headings
    tables = table_rows(markdown)
    assert len(tables) + markdown.count("\n(none)\n") == len(MARKDOWN_TABLES), tables
    for rows in tables:
        assert {len(row) for row in rows} == {len(rows[0])}, rows
    assert "<svg" not in markdown and "[l](" not in markdown and "`x`" not in markdown
    assert markdown_value(MARKUP_INJECTION) in markdown  # the variant, shown as it is


def test_the_markdown_report_renders_without_markup_from_the_database(forged):
    """As a CommonMark renderer with GFM tables sees it: no heading but the report's, no
    element the database wrote, and the variant's text there verbatim."""
    markdown_it = pytest.importorskip("markdown_it")
    html = markdown_it.MarkdownIt("commonmark").enable("table").render(
        report(forged, "--markdown"))
    assert "<h1>" not in html and "<svg" not in html and "<a " not in html, html
    assert "<em>y</em>" not in html and "<code>x</code>" not in html
    assert "&lt;svg onload=alert(1)&gt;`x` *y* [l](http://x) &amp;amp;" in html


@pytest.mark.parametrize("value, text, markdown", [
    ("a\nb\tc\x1b\u202e", r"a\nb\tc\x1b\u202e", r"a\\nb\\tc\\x1b\\u202e"),
    ("# x | y", "# x | y", r"\# x &#124; y"),
    ("<b>&`*_[]~\\", "<b>&`*_[]~\\", r"&lt;b&gt;&amp;\`\*\_\[\]\~\\"),
    ("hash_id _x_ __init__", "hash_id _x_ __init__", r"hash_id \_x\_ \_\_init\_\_"),
    ("plain-name.kvtrace (1)", "plain-name.kvtrace (1)", "plain-name.kvtrace (1)"),
])
def test_one_escape_per_format(value, text, markdown):
    assert text_value(value) == text and markdown_value(value) == markdown
