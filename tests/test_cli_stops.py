"""A stop is a stop (kvtrace/cli/): SIGTERM exits 143 and Ctrl-C 130 with `kvtrace: stopped by`
whatever it interrupted, and leaves no partial output."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest
from bad_traces import requests, trace
from cli_runs import KVTRACE, loaded, vllm_imported, workload  # noqa: F401


# Hardening finding M1.
@pytest.mark.slow
def test_sigterm_during_replay_leaves_no_partial_output(tmp_path):
    source = trace(tmp_path / "big.kvtrace", requests(3000))
    out = tmp_path / "runs"
    process = subprocess.Popen([*KVTRACE, "replay", str(source), "-o", str(out)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (out.exists() and any(out.iterdir())):  # a variant is being written
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    process.send_signal(signal.SIGTERM)
    assert process.wait(60) == 128 + signal.SIGTERM
    assert "stopped by SIGTERM" in process.stderr.read()
    assert list(out.iterdir()) == []


# Hardening round three, R7.
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_during_a_duckdb_query_exits_as_the_signal_says(tmp_path, loaded, stop):
    """DuckDB turned the stop into "RuntimeError: Query interrupted": a traceback, exit 1."""
    process = subprocess.Popen(
        [*KVTRACE, "sql", str(loaded), "SELECT sum(hash(range) % 7) FROM range(10000000000000)"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while threads(process.pid) < 3:  # DuckDB's workers: connected, the query next
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(1)
    process.send_signal(stop)
    out, err = process.communicate(timeout=30)  # DuckDB's workers are interrupted too
    assert process.returncode == 128 + stop
    assert err == f"kvtrace: stopped by {signal.Signals(stop).name}\n" and not out


def threads(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/status").read_text().split("Threads:")[1].split()[0])
    except (OSError, IndexError):
        return 0
