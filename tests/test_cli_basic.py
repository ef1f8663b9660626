"""`kvtrace --version`, `info` and `cat`, including how they fail on bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner
from trace_samples import frame_ends, one_of_each_kind, sample_header

from kvtrace import __version__
from kvtrace.cli import cli
from kvtrace.events import BlockStored
from kvtrace.traceio import TraceWriter


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "t.kvtrace"
    with TraceWriter(path, sample_header(), batch_size=5) as writer:
        writer.write_many(one_of_each_kind())
    return path


def test_version():
    result = run("--version")
    assert result.exit_code == 0 and __version__ in result.output


def test_info_reports_header_counts_and_completeness(trace):
    result = run("info", str(trace))
    assert result.exit_code == 0, result.output
    assert f"records:    {len(one_of_each_kind())}" in result.stdout
    assert "block_stored" in result.stdout and "complete:   yes" in result.stdout
    assert "retention 0" in result.stdout and "full_attention/16, mamba/32" in result.stdout


def test_info_json(trace):
    summary = json.loads(run("info", str(trace), "--json").stdout)
    assert summary["num_records"] == len(one_of_each_kind()) and summary["truncated"] is False
    assert summary["counts"]["request_arrived"] == 1
    assert summary["header"]["config"]["hash_block_size"] == 16


def test_cat_filters_limits_and_names_enums(trace):
    lines = run("cat", str(trace), "--kind", "block_removed", "--kind", "block_stored").stdout.splitlines()
    rows = [json.loads(line) for line in lines]
    assert [r["record"] for r in rows] == ["block_stored", "block_removed"]
    assert rows[1]["reason"] == "STALE_CHECKPOINT" and rows[0]["kind"] == "CHECKPOINT"
    assert rows[0]["seq"] == [type(r) for r in one_of_each_kind()].index(BlockStored)
    assert len(run("cat", str(trace), "--limit", "3").stdout.splitlines()) == 3


def test_cat_unknown_kind_is_a_clear_error(trace):
    result = run("cat", str(trace), "--kind", "nope")
    assert result.exit_code == 1
    assert result.stderr.splitlines()[0] == "kvtrace: error: unknown record kind 'nope'"


def bad_file(tmp_path, kind: str):
    path = tmp_path / f"{kind}.kvtrace"
    if kind == "missing":
        return path
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "garbage":
        path.write_bytes(b"\x00\xffnot a trace at all" * 10)
    elif kind == "truncated":
        with TraceWriter(path, sample_header(), batch_size=5) as writer:
            writer.write_many(one_of_each_kind())
        data = path.read_bytes()
        path.write_bytes(data[: frame_ends(data)[-2] - 10])  # inside the last batch
    return path


@pytest.mark.parametrize("command", ["info", "cat"])
@pytest.mark.parametrize("kind", ["missing", "empty", "garbage", "truncated"])
def test_bad_files_give_one_error_line_and_exit_1(tmp_path, command, kind):
    result = run(command, str(bad_file(tmp_path, kind)))
    assert result.exit_code == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("kvtrace: error:")]
    assert len(errors) == 1, result.stderr
    assert result.stderr.splitlines()[-1].startswith("kvtrace: hint: ")
    assert "Traceback" not in result.stderr
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_truncated_trace_still_shows_what_was_recovered(tmp_path):
    path = bad_file(tmp_path, "truncated")
    result = run("cat", str(path))
    recovered = (len(one_of_each_kind()) - 1) // 5 * 5  # every complete batch of five
    assert len(result.stdout.splitlines()) == recovered
    assert f"truncated: {recovered} records recovered" in result.stderr
    assert "complete:   no (truncated)" in run("info", str(path)).stdout


def test_traceback_only_with_vv(tmp_path):
    path = str(tmp_path / "missing.kvtrace")
    assert "Traceback" not in run("-v", "info", path).stderr
    assert "Traceback" in run("-vv", "info", path).stderr


def test_python_dash_m_entry_point(trace):
    result = subprocess.run([sys.executable, "-m", "kvtrace", "info", str(trace)],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0 and f"records:    {len(one_of_each_kind())}" in result.stdout


def test_usage_errors_exit_2():
    assert run("cat").exit_code == 2
    assert run("no-such-command").exit_code == 2
