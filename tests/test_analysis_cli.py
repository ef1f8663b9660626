"""The load / sql / report commands end to end, and their one-line errors on bad input."""

from __future__ import annotations

import json
import os
import re

import duckdb
import pytest
from click.testing import CliRunner

from kvtrace.analysis.database import DB_SCHEMA_VERSION
from kvtrace.cli import cli
from kvtrace.traceio import write_trace

from test_analysis_scenario import header, scenario


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    directory = tmp_path_factory.mktemp("cli")
    runs = directory / "runs"
    runs.mkdir()
    write_trace(runs / "fixed.kvtrace", header("fixed"), scenario(unfixed=False))
    write_trace(runs / "unfixed.kvtrace", header("unfixed"), scenario(unfixed=True))
    result = CliRunner().invoke(cli, ["load", str(runs), "-o", str(directory / "s.duckdb")])
    assert result.exit_code == 0, result.output
    assert "loaded 127 records from 2 trace(s)" in result.output
    return directory / "s.duckdb"


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def assert_one_error(result, fragment):
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    errors = [line for line in lines if line.startswith("kvtrace: error:")]
    assert len(errors) == 1 and fragment in errors[0], result.output
    assert lines[-1].startswith("kvtrace: hint:")


def test_load_tags_rows_with_run_variant_seq_and_step(db):
    connection = duckdb.connect(str(db), read_only=True)
    rows = connection.execute(
        "SELECT run, variant, backend, seq, step FROM block_removed ORDER BY seq").fetchall()
    assert rows == [(1, "unfixed", "model", 42, 5), (1, "unfixed", "model", 44, 5)]
    assert connection.execute("SELECT variant, mode, hash_block_size, num_gpu_blocks FROM runs "
                              "ORDER BY run").fetchall() == [("fixed", "reschedule", 16, 7),
                                                            ("unfixed", "reschedule", 16, 7)]
    connection.close()


def test_sql_outputs_table_csv_and_json(db):
    statement = "SELECT run, variant FROM runs ORDER BY run"
    table = invoke("sql", db, statement)
    assert table.exit_code == 0
    assert table.output.splitlines()[2:4] == ["  0  fixed", "  1  unfixed"]
    assert invoke("sql", db, statement, "--csv").output == "run,variant\n0,fixed\n1,unfixed\n"
    lines = invoke("sql", db, "--query", "checkpoint_pushouts", "--json").output.splitlines()
    assert [json.loads(line)["regret_tokens"] for line in lines] == [16]


def test_sql_list_shows_queries_with_params():
    output = invoke("sql", "--list").output
    assert "checkpoint_pushouts:" in output and "--param min_hits=2" in output


def test_report_writes_html_with_plots(db, tmp_path):
    out = tmp_path / "r.html"
    result = invoke("report", db, "--html", out)
    assert result.exit_code == 0, result.output
    assert "Top pushed-out prefixes" in result.output and "scenario.kvtrace" in result.output
    figures = report_figures(out.read_text())
    assert set(figures) == {"plot-hit-rate", "plot-hits-went", "plot-pushouts",
                            "plot-occupancy-0", "plot-occupancy-1"}
    # The unfixed run's occupancy marks its one pushout: S (hash 100) evicted at step 5.
    marks = [t for t in figures["plot-occupancy-1"]["data"] if t["name"].startswith("evicted")]
    assert [(t["name"], t["x"]) for t in marks] == [("evicted: hash 100", [5])]
    assert not [t for t in figures["plot-occupancy-0"]["data"] if "evicted" in t["name"]]


def report_figures(page: str) -> dict:
    """The Plotly figures an HTML report draws, by plot id."""
    found = re.search(r'<script type="application/json" id="kvtrace-figures">(.*?)</script>',
                      page, re.DOTALL)
    return json.loads(found.group(1).replace("<\\/", "</"))


def test_unknown_query_name(db):
    assert_one_error(invoke("sql", db, "--query", "nope"), "no shipped query named 'nope'")


def test_unknown_and_malformed_parameters(db):
    assert_one_error(invoke("sql", db, "--query", "checkpoint_pushouts", "--param", "x=1"),
                     "has no parameter 'x'")
    assert_one_error(invoke("sql", db, "--query", "checkpoint_pushouts", "--param", "min_hits=a"),
                     "min_hits must be INTEGER")
    assert_one_error(invoke("sql", db, "--query", "checkpoint_pushouts", "--param", "min_hits"),
                     "is not K=V")


def test_missing_parameter_in_ad_hoc_sql(db):
    assert_one_error(invoke("sql", db, "SELECT $min_hits"), "SQL error")


def test_sql_error(db):
    assert_one_error(invoke("sql", db, "SELECT * FROM no_such_table"), "SQL error: Catalog Error")


def test_database_from_a_newer_kvtrace_is_refused(db, tmp_path):
    newer = tmp_path / "newer.duckdb"
    newer.write_bytes(db.read_bytes())
    connection = duckdb.connect(str(newer))
    connection.execute("UPDATE kvtrace_meta SET value = ? WHERE key = 'db_schema_version'",
                       [str(DB_SCHEMA_VERSION + 1)])
    connection.close()
    assert_one_error(invoke("sql", newer, "SELECT 1"), "newer than this kvtrace reads")
    assert_one_error(invoke("report", newer), "newer than this kvtrace reads")


def test_not_a_database_and_missing_database(tmp_path):
    junk = tmp_path / "junk.duckdb"
    junk.write_text("hello")
    assert_one_error(invoke("sql", junk, "SELECT 1"), "cannot open")
    assert_one_error(invoke("sql", tmp_path / "none.duckdb", "SELECT 1"), "no such database")


def test_failed_load_leaves_nothing(tmp_path):
    good = tmp_path / "good.kvtrace"
    write_trace(good, header("fixed"), scenario(unfixed=False))
    bad = tmp_path / "bad.kvtrace"
    bad.write_bytes(b"not a trace")
    out = tmp_path / "out.duckdb"
    assert_one_error(invoke("load", good, bad, "-o", out), "not a kvtrace trace")
    assert sorted(os.listdir(tmp_path)) == ["bad.kvtrace", "good.kvtrace"]
    assert_one_error(invoke("load", tmp_path / "empty_dir_missing", "-o", out), "no such trace")


def test_report_tables_cut_long_cells():
    from kvtrace.analysis.render import format_table

    text = format_table(["source", "n"], [("sha256:" + "ab" * 32, 3)], max_width=12)
    assert text.splitlines()[2] == "sha256:abab…  3"
    assert "ab" * 32 in format_table(["source", "n"], [("sha256:" + "ab" * 32, 3)])
