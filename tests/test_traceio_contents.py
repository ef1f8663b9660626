"""Traces whose frames are sound but whose contents are not (ill-typed records), or are a newer
writer's (enum values this kvtrace does not know): one error, or read on with a warning."""

from __future__ import annotations

import json

import duckdb
import pytest
from bad_traces import header, ill_typed_traces, requests, unknown_enum_records
from cli_runs import COMMANDS_ON_A_TRACE, assert_error, run, vllm_imported  # noqa: F401

from kvtrace.events import BlockRemoved, StepStarted
from kvtrace.traceio import TraceWriter, read_records


# Hardening finding W3.
@pytest.mark.parametrize("rows", [False, True], ids=["columns", "rows"])
def test_unknown_enum_values_are_kept_warned_and_read_past(tmp_path, rows):
    records = requests(2) + unknown_enum_records() + [StepStarted(step=9, ts_ns=0)]
    path = tmp_path / "newer.kvtrace"
    with TraceWriter(path, header(), rows=rows) as writer:
        writer.write_many(records)
    result = run("cat", path)
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(lines) == len(records) and lines[-1]["record"] == "step_started"
    assert [line.get("reason") for line in lines if line["record"] == "block_removed"] == [
        "9", "LRU_REUSE"]
    assert result.stderr.count("kvtrace: warning:") == 2  # one per field, not per record
    assert "reason this kvtrace does not know (9: 1)" in result.stderr
    info = run("info", path)
    assert info.exit_code == 0 and "kind this kvtrace does not know (7: 1)" in info.stdout
    db = tmp_path / "newer.duckdb"
    loaded = run("load", path, "-o", db)
    assert loaded.exit_code == 0 and "reason this kvtrace does not know" in loaded.stderr
    with duckdb.connect(str(db), read_only=True) as connection:
        assert connection.execute("SELECT reason FROM block_removed ORDER BY seq").fetchall() == [
            ("9",), ("LRU_REUSE",)]
        assert connection.execute("SELECT kind FROM block_stored ORDER BY seq").fetchall() == [
            ("FULL",), ("7",)]
    assert [r.reason for r in read_records(path)[1] if type(r) is BlockRemoved] == [9, 0]


@pytest.mark.parametrize("command", COMMANDS_ON_A_TRACE)
def test_ill_typed_contents_are_one_error_in_every_command(tmp_path, command):
    for name, path in ill_typed_traces(tmp_path).items():
        result = run(*COMMANDS_ON_A_TRACE[command](path, tmp_path))
        assert_error(result, str(path))
        assert not (tmp_path / "runs").exists() and not (tmp_path / "x.duckdb").exists(), name
