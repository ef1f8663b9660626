"""``kvtrace export --parquet``: every table of a forensics database round-trips through
hive-partitioned Parquet (read back with DuckDB's read_parquet), and the directory appears
whole or not at all."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import pytest
from click.testing import CliRunner
from test_sweep import workload

from kvtrace.analysis import export as export_module
from kvtrace.cli import cli


def run(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


@pytest.fixture(scope="module")
def db(tmp_path_factory) -> Path:
    """Two replay runs (every kind of record a replay writes) and two sweeps."""
    root = tmp_path_factory.mktemp("export")
    source = workload(root / "hot.kvtrace")
    db = root / "forensics.duckdb"
    result = run("replay", str(source), "--variant", "unfixed", "--variant", "fixed",
                 "--num-gpu-blocks", "60", "-o", str(root / "runs"), "--db", str(db))
    assert result.exit_code == 0, result.output
    for sizes in ("60", "60,90"):
        result = run("sweep", str(source), "--num-gpu-blocks", sizes, "--variant", "fixed",
                     "--backend", "vllm", "-j", "1", "-o", str(root / "sweep"), "--db", str(db))
        assert result.exit_code == 0, result.output
    return db


def tables(connection) -> dict[str, list[str]]:
    """Every table, by the name and columns SQL reads it with (a table stored in kvtrace_rows
    is read through its view in main)."""
    names = [n for (n,) in connection.execute(
        "SELECT table_name FROM duckdb_tables() WHERE schema_name IN ('main', 'kvtrace_rows')"
    ).fetchall()]
    return {name: [c for (c,) in connection.execute(
        "SELECT column_name FROM duckdb_columns() WHERE schema_name = 'main' AND table_name = ? "
        "ORDER BY column_index", [name]).fetchall()] for name in names}


def test_every_table_round_trips_with_its_rows(db, tmp_path):
    outdir = tmp_path / "parquet"
    result = run("export", str(db), "--parquet", str(outdir))
    assert result.exit_code == 0, result.output
    manifest = json.loads((outdir / "_kvtrace_export.json").read_text())["tables"]
    connection = duckdb.connect(str(db), read_only=True)
    expected = tables(connection)
    assert set(manifest) == set(expected) and {"block_stored", "runs", "sweep"} <= set(expected)
    checked_rows = 0
    for table, columns in expected.items():
        partition = manifest[table]["partition_by"]
        assert partition == ("run" if "run" in columns else
                             "sweep_id" if table == "sweep" else None), table
        counts = dict(connection.execute(
            f"SELECT {partition or 'NULL'}, count(*) FROM {table} GROUP BY ALL").fetchall())
        files = sorted((outdir / table).rglob("*.parquet"))
        if not counts:  # an empty table: an empty directory, listed with no rows
            assert (outdir / table).is_dir() and files == [] and manifest[table]["rows"] == {}
            continue
        glob = outdir / table / ("*/*.parquet" if partition else "*.parquet")
        read = f"read_parquet('{glob}', hive_partitioning = {partition is not None})"
        back = dict(connection.execute(
            f"SELECT {partition or 'NULL'}, count(*) FROM {read} GROUP BY ALL").fetchall())
        assert back == counts, table
        assert manifest[table]["rows"] == {
            "" if k is None else str(k): v for k, v in counts.items()}
        if partition:
            assert {f.parent.name for f in files} == {f"{partition}={k}" for k in counts}
        # Not only the counts: the same rows, value for value.
        listed = ", ".join(f'"{c}"' for c in columns)
        for left, right in [(table, read), (read, table)]:
            assert connection.execute(
                f"SELECT count(*) FROM (SELECT {listed} FROM {left} EXCEPT ALL "
                f"SELECT {listed} FROM {right})").fetchone() == (0,), table
        checked_rows += sum(counts.values())
    connection.close()
    assert manifest["sweep"]["rows"] == {"0": 1, "1": 2}
    assert len(manifest["block_stored"]["rows"]) == 2  # the two replay runs
    assert checked_rows > 1000


def test_refuses_a_non_empty_directory_unless_overwrite(db, tmp_path):
    outdir = tmp_path / "parquet"
    outdir.mkdir()
    (outdir / "keep.txt").write_text("mine")
    result = run("export", str(db), "--parquet", str(outdir))
    assert result.exit_code == 1 and "is not empty" in result.output
    assert (outdir / "keep.txt").read_text() == "mine"
    result = run("export", str(db), "--parquet", str(outdir), "--overwrite")
    assert result.exit_code == 0, result.output
    assert not (outdir / "keep.txt").exists() and (outdir / "runs").is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["parquet"]  # no partial left


def test_a_failed_export_leaves_nothing(db, tmp_path, monkeypatch):
    copies = []
    real = export_module._copy

    def fail_third(*args):
        copies.append(args)
        if len(copies) == 3:
            raise OSError(28, "No space left on device")
        real(*args)

    monkeypatch.setattr(export_module, "_copy", fail_third)
    result = run("export", str(db), "--parquet", str(tmp_path / "parquet"))
    assert result.exit_code == 1 and "No space left on device" in result.output
    assert list(tmp_path.iterdir()) == []


def test_refuses_a_file_that_is_no_forensics_database(tmp_path):
    other = tmp_path / "other.duckdb"
    duckdb.connect(str(other)).close()
    result = run("export", str(other), "--parquet", str(tmp_path / "parquet"))
    assert result.exit_code == 1 and "not a kvtrace forensics database" in result.output
    assert not (tmp_path / "parquet").exists()
