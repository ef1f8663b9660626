"""The CLI's error contract (kvtrace/cli/): a bad input or output is one error line and a hint,
never a traceback, and what a command prints from its input cannot drive the terminal."""

from __future__ import annotations

import subprocess

import pytest
from bad_traces import TERMINAL_ESCAPE, crafted_databases, header, requests, trace
from cli_runs import (  # noqa: F401 (fixtures)
    KVTRACE,
    loaded,
    replayed,
    run,
    vllm_imported,
    workload,
)

from kvtrace.events import ReplayInfo


# Hardening finding C7.
def test_cat_to_a_full_device_is_one_error(tmp_path, workload):
    with open("/dev/full", "w") as full:
        done = subprocess.run([*KVTRACE, "cat", str(workload)], stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.splitlines()[0] == ("kvtrace: error: cannot write to standard output: "
                                           "No space left on device"), done.stderr
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr


# Hardening finding M3.
def test_capture_duration_zero_is_refused_either_way():
    for source in (["--pid", str(1 << 22)], ["--zmq", "tcp://127.0.0.1:1"]):
        result = run("capture", *source, "--duration", "0", "-o", "/tmp/never.kvtrace")
        assert result.exit_code == 2 and "not a positive duration" in result.stderr


# Hardening finding M3.
def test_report_bucket_steps_must_be_positive(tmp_path, workload):
    db = tmp_path / "w.duckdb"
    assert run("load", workload, "-o", db).exit_code == 0
    result = run("report", db, "--bucket-steps", 0)
    assert result.exit_code == 2 and "Division" not in result.output


# Hardening round three, R10.
@pytest.mark.parametrize("case, message", [("runs.path a FIFO", "not a regular file"),
                                           ("runs.path NULL", "without a trace path")])
def test_why_reads_no_fifo_a_database_names(tmp_path, loaded, case, message):
    secret = tmp_path / "secret"
    secret.write_text("")
    crafted = crafted_databases(tmp_path, loaded, secret)[case]
    done = subprocess.run([*KVTRACE, "why", str(crafted), "-r", "0"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1 and message in done.stderr and "Traceback" not in done.stderr


# Hardening round three, R10.
def test_strings_that_drive_a_terminal_are_shown_inert(tmp_path, replayed):
    path = trace(tmp_path / "escape.kvtrace", requests(), header(
        host=TERMINAL_ESCAPE, process_title=TERMINAL_ESCAPE, pid=7, params={"x": TERMINAL_ESCAPE},
        replay=ReplayInfo(variant="fixed" + TERMINAL_ESCAPE, backend="vllm", mode="reschedule")))
    secret = tmp_path / "secret"
    secret.write_text("")
    loaded = tmp_path / "replayed.duckdb"
    assert run("load", replayed, "-o", loaded).exit_code == 0
    crafted = crafted_databases(tmp_path, loaded, secret)
    outputs = [run("info", path), run("load", path, "-o", tmp_path / "e.duckdb"),
               run("report", crafted["strings that drive a terminal"]),
               run("sql", crafted["strings that drive a terminal"], "SELECT variant FROM runs"),
               run("sql", crafted["strings that drive a terminal"], "SELECT variant FROM runs",
                   "--csv"),
               run("sql", crafted["columns named as SQL"], "SELECT * FROM odd"),
               run("info", tmp_path / f"missing{TERMINAL_ESCAPE}.kvtrace")]
    for result in outputs:
        assert result.exit_code in (0, 1), result.output
        assert not any(c in result.output for c in "\x1b\x07\u202e"), repr(result.output)
    assert r"\x1b]0;pwned\x07" in outputs[0].stdout and r"\x1b]0;pwned" in outputs[2].stdout
    assert r"\x1b" in outputs[-1].stderr  # an error line quoting the path
