"""Where `kvtrace export` writes (kvtrace/analysis/export.py): only its own directory, never
through a link, over the working directory or a mount point, whatever the database's table
names and partition values hold."""

from __future__ import annotations

from pathlib import Path

from bad_traces import crafted_databases
from cli_runs import (  # noqa: F401 (fixtures)
    assert_error,
    full_disk,
    loaded,
    run,
    vllm_imported,
    workload,
)


# Hardening round three, R1.
def test_export_never_replaces_a_link(tmp_path, loaded):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("x")
    (tmp_path / "exports").symlink_to(elsewhere)
    assert_error(run("export", loaded, "--parquet", tmp_path / "exports", "--overwrite"),
                 "is a symbolic link")
    assert (tmp_path / "exports").is_symlink() and (elsewhere / "keep").read_text() == "x"


# Hardening round three, R2.
def test_export_quotes_table_names_and_writes_only_its_own_directory(tmp_path, loaded):
    secret = tmp_path / "secret"
    secret.write_text("root's secret\n")
    crafted = crafted_databases(tmp_path, loaded, secret)
    assert_error(run("export", crafted["table named as SQL"], "--parquet", tmp_path / "pq"),
                 "cannot be a directory name")
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "pq").exists()
    result = run("export", crafted["partition value as a path"], "--parquet", tmp_path / "pq")
    assert result.exit_code == 0, result.output
    assert not Path("/tmp/kvtrace-hop").exists()
    hop = list((tmp_path / "pq" / "hop").iterdir())
    assert len(hop) == 1 and hop[0].name.startswith("run=..%2F")  # DuckDB escapes the value


# Hardening round three, R11.
def test_export_onto_the_working_directory_is_refused(tmp_path, loaded, monkeypatch):
    exports = tmp_path / "exports"
    exports.mkdir()
    (exports / "old").write_text("kept")
    monkeypatch.chdir(exports)
    assert_error(run("export", loaded, "--parquet", ".", "--overwrite"),
                 "holds the working directory")
    monkeypatch.chdir(tmp_path)
    assert (exports / "old").read_text() == "kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exports", "w.duckdb", "w.kvtrace"]


# Hardening round three, R11.
def test_export_onto_a_mount_point_keeps_it_and_leaves_no_old(tmp_path, loaded, full_disk):
    (full_disk / "old").write_text("kept")
    result = run("export", loaded, "--parquet", full_disk, "--overwrite")
    assert_error(result, "cannot write")
    assert (full_disk / "old").read_text() == "kept"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".full.")]
