"""A lease that lapses is said as such (issue 30, R4-7): `kvtrace capture` stopped (SIGSTOP)
past its lease lets the engine disarm on its own; once it runs again it prints the summary of
what it captured, then one error saying that its lease lapsed, not a disk error."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from test_capture_live import kvtrace, wait_for_stderr_line
from test_midflight import documents_workload, finish, serving_engine

from kvtrace.capture import control
from kvtrace.capture.messages import PingRequest
from kvtrace.traceio import TraceReader

pytestmark = pytest.mark.slow
LEASE_S = 2


@pytest.fixture(scope="module")
def workload(tmp_path_factory) -> Path:
    return documents_workload(tmp_path_factory.mktemp("lapse") / "w.kvtrace", "nemotron-h-8b")


def ping(pid: int):
    return control.request(pid, PingRequest())


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_controller_stopped_past_its_lease_says_so_and_summarises(workload, tmp_path):
    engine = serving_engine(workload)
    trace = tmp_path / "cap.kvtrace"
    capture = kvtrace("capture", "--pid", str(engine.pid), "-o", str(trace),
                      env={**os.environ, control.LEASE_ENV: str(LEASE_S)})
    try:
        wait_for_stderr_line(capture, "kvtrace: capturing pid")
        wait_for(lambda: ping(engine.pid).patched, 30, "the capture never armed")
        capture.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        wait_for(lambda: not ping(engine.pid).capturing, 5 * LEASE_S, "the lease never lapsed")
        assert time.monotonic() - stopped >= LEASE_S * 0.9
        time.sleep(LEASE_S)
        capture.send_signal(signal.SIGCONT)
        out, err = finish(capture)
        assert engine.process.poll() is None, "the engine must survive"
    finally:
        capture.kill()
        engine.stop()
    assert capture.returncode == 1, err
    errors = [line for line in err.splitlines() if line.startswith("kvtrace: error:")]
    assert len(errors) == 1, err
    assert (f"stopped capturing because kvtrace capture did not renew its lease for {LEASE_S} s"
            in errors[0]), err
    assert "disk" not in err and "stopped from elsewhere" not in out
    assert "records written" in out and "the start snapshot held its scheduler" in out, out
    reader = TraceReader(str(trace))
    recovered = sum(len(batch) for batch in reader.batches())
    assert recovered > 0 and not reader.truncated
    assert f"pid {engine.pid}: {recovered:,} records written" in out
