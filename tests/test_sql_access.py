"""What SQL can reach (kvtrace/analysis/sql_access.py, `kvtrace sql`): nothing but the database,
unless `--unsafe`; a database's own views read no file; identifiers are quoted whatever they
hold; an empty statement is one error."""

from __future__ import annotations

import duckdb
import pytest
from bad_traces import crafted_databases
from cli_runs import assert_error, loaded, run, vllm_imported, workload  # noqa: F401


# Hardening round three, R3.
@pytest.mark.parametrize("statement", [
    "COPY runs TO '{out}' (FORMAT CSV)",
    "SELECT * FROM read_text('{secret}')",
    "SELECT * FROM read_csv('{secret}')",
    "SELECT * FROM glob('{dir}/*')",
    "ATTACH '{out}' AS other",
    "EXPORT DATABASE '{dir}/exported'",
    "INSTALL httpfs",
    "LOAD httpfs",
    "SET enable_external_access = true",
    "SET allowed_directories = ['/']",
])
def test_sql_reaches_nothing_but_the_database(tmp_path, loaded, statement):
    secret = tmp_path / "secret"
    secret.write_text("root's secret\n")
    sql = statement.format(out=tmp_path / "out.csv", secret=secret, dir=tmp_path)
    result = run("sql", loaded, sql)
    assert result.exit_code == 1 and "root's secret" not in result.output, result.output
    assert "Traceback" not in result.output and result.stderr.count("kvtrace: error:") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["secret", "w.duckdb", "w.kvtrace"]


# Hardening round three, R3.
def test_sql_unsafe_lifts_the_limits(tmp_path, loaded):
    secret = tmp_path / "secret"
    secret.write_text("readable\n")
    refused = run("sql", loaded, f"SELECT content FROM read_text('{secret}')")
    assert_error(refused, "disabled by configuration")
    assert "--unsafe lifts that" in refused.stderr
    result = run("sql", "--unsafe", loaded, f"SELECT content FROM read_text('{secret}')")
    assert result.exit_code == 0 and "readable" in result.stdout
    assert run("sql", "--unsafe", loaded,
               f"COPY runs TO '{tmp_path / 'runs.csv'}'").exit_code == 0
    assert (tmp_path / "runs.csv").read_text().startswith("run,")


# Hardening round three, R3.
def test_a_databases_views_read_no_file_in_report_why_or_export(tmp_path, loaded):
    secret = tmp_path / "secret"
    secret.write_text("root's secret\n")
    crafted = crafted_databases(tmp_path, loaded, secret)["a view that reads a file"]
    for args in (["report", crafted], ["sql", crafted, "--query", "miss_attribution"],
                 ["sql", crafted, "SELECT * FROM lookups"], ["why", crafted, "-r", "0"],
                 ["export", crafted, "--parquet", tmp_path / "pq"]):
        result = run(*args)
        assert_error(result, "disabled by configuration")
        assert "root's secret" not in result.output, args
    assert not (tmp_path / "pq").exists()


# Hardening round three, R2.
def test_an_identifier_is_quoted_whatever_it_holds(tmp_path):
    """The quoting export uses, against DuckDB itself: the issue's table name stays a name."""
    from kvtrace.analysis.sql_access import sql_identifier

    name = ('x"; COPY x TO (chr(47)||\'' + str(tmp_path).lstrip("/") + "'||chr(47)||'pwned') "
            '(FORMAT CSV); SELECT count(*) FROM "x')
    with duckdb.connect() as connection:
        connection.execute(f"CREATE TABLE {sql_identifier(name)} (a INTEGER)")
        connection.execute(f"INSERT INTO {sql_identifier(name)} VALUES (7)")
        assert connection.execute(f"SELECT sum(a) FROM {sql_identifier(name)}").fetchall() == [
            (7,)]
        assert connection.execute("SHOW TABLES").fetchall() == [(name,)]
    assert not (tmp_path / "pwned").exists()


# Hardening finding C4.
@pytest.mark.parametrize("statement", ["", "   ", "\n"])
def test_an_empty_sql_statement_is_one_error(tmp_path, workload, statement):
    db = tmp_path / "w.duckdb"
    assert run("load", workload, "-o", db).exit_code == 0
    assert_error(run("sql", db, statement), "empty")
