"""The trace reader and writer when the file fails them: a FIFO, a file that fails to read, a
writer that fails while closing or on a full disk. One error, and no scratch left behind."""

from __future__ import annotations

import os
import subprocess

import pytest
from bad_traces import header
from cli_runs import KVTRACE, fill, full_disk, run, vllm_imported  # noqa: F401

from kvtrace.events import StepStarted
from kvtrace.traceio import TraceWriter


# Hardening finding H1.
def test_replay_of_a_fifo_is_refused_at_once(tmp_path):
    fifo = tmp_path / "w.kvtrace"
    os.mkfifo(fifo)
    done = subprocess.run([*KVTRACE, "replay", str(fifo), "-o", str(tmp_path / "runs")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "is not a regular file" in done.stderr


# Hardening round three, R11.
@pytest.mark.parametrize("command", ["info", "cat", "replay", "load", "why"])
def test_a_trace_that_fails_to_read_is_one_error(tmp_path, command):
    args = {"info": [], "cat": [], "replay": ["-o", tmp_path / "r"],
            "load": ["-o", tmp_path / "x.duckdb"], "why": ["-r", "0"]}[command]
    result = run(command, "/proc/self/mem", *args)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "/proc/self/mem" in result.stderr and "Input/output error" in result.stderr


# Hardening finding C6.
def test_an_atomic_writer_that_fails_while_closing_leaves_nothing(tmp_path):
    with pytest.raises(OverflowError), TraceWriter(tmp_path / "t.kvtrace", header(),
                                                   atomic=True) as writer:
        writer.write(StepStarted(step=2**64, ts_ns=0))  # encoded only when closing
    assert list(tmp_path.iterdir()) == []


# Hardening round three, R6.
def test_an_abandoned_writer_removes_its_scratch_even_when_its_tail_cannot_be_written(
        full_disk):
    fill(full_disk)
    with pytest.raises(OSError), TraceWriter(full_disk / "t.kvtrace", header(),
                                             atomic=True) as writer:
        writer.write_many(StepStarted(step=i, ts_ns=i) for i in range(100_000))
    assert sorted(p.name for p in full_disk.iterdir()) == ["filler"]
