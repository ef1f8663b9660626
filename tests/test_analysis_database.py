"""A database that is not a sound kvtrace database (kvtrace/analysis/database.py): a damaged
schema-version row, or no kvtrace columns, is one error in every command that reads it."""

from __future__ import annotations

import duckdb
import pytest
from cli_runs import assert_error, run, vllm_imported, workload  # noqa: F401


@pytest.mark.parametrize("version", ["x2", "", "-1", "2.0"])
def test_a_damaged_schema_version_row_is_one_error(tmp_path, workload, version):
    db = tmp_path / "w.duckdb"
    assert run("load", workload, "-o", db).exit_code == 0
    with duckdb.connect(str(db)) as connection:
        connection.execute("UPDATE kvtrace_meta SET value = ? WHERE key = 'db_schema_version'",
                           [version])
    for args in (["sql", db, "SELECT 1"], ["report", db], ["why", db, "-r", "0"],
                 ["export", db, "--parquet", tmp_path / "parquet"]):
        assert_error(run(*args), "schema version")


def test_a_database_without_kvtrace_columns_is_one_error(tmp_path):
    db = tmp_path / "other.duckdb"
    with duckdb.connect(str(db)) as connection:
        connection.execute("CREATE TABLE kvtrace_meta (k INTEGER)")
    assert_error(run("sql", db, "SELECT 1"), "not a kvtrace forensics database")
