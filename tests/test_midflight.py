"""Production is mid-flight: `kvtrace capture --pid` arms on a `kvtrace engine` that is already
serving (vLLM 0.33's own scheduler and cache) and stops while it still is.

* The capture starts with a snapshot of the live cache; lockstep replay rebuilds vLLM's
  `KVCacheManager` in that state and every effect record matches; a rescheduled replay under
  the engine's own variant, started from the snapshot, finds the capture's own first-lookup hit
  rate (issue #20's figures), on each bundled model's geometry.
* A capture never outlives its controller: killed with SIGKILL, SIGHUP or SIGTERM, while
  arming or while capturing, `kvtrace capture` leaves the engine disarmed within the lease,
  with every vLLM method its own again (the engine's ping lists what kvtrace replaced).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from debugger_support import needs_ptrace
from test_capture_live import (
    MAX_INJECTOR_STOP_MS,
    kvtrace,
    lockstep_verify,
    longest_stop_ms,
    wait_for_stderr_line,
)

from reschedule_bounds import assert_within_bounds

from kvtrace.capture import control
from kvtrace.capture.messages import PingRequest, StatusRequest
from kvtrace.capture.stalls import StallSampler
from kvtrace.cli.demo import BUSY_ENGINE
from kvtrace.engine.process import EngineProcess
from kvtrace.events import SlotsAllocated
from kvtrace.geometry.presets import preset_names
from kvtrace.replay.summary import ReplaySummary
from kvtrace.traceio import TraceReader, count_kinds
from kvtrace.workloads.synth import synthesize
from kvtrace.workloads.workload import EngineShape, write_workload

pytestmark = pytest.mark.slow
SPEED = "30"  # virtual seconds per wall second: the engine is busy for longer than the window


def documents_workload(path: Path, model: str, num_requests: int = 600) -> Path:
    """The #56794 seed scenario on ``model``'s cache as vLLM 0.33 builds it, with the demo's long
    answers (``BUSY_ENGINE``): 600 requests arrive over 20 s of wall time at --speed 30, and the
    engine always has one in flight after its first seconds, so a capture from 4 s to 10 s (or
    later, on a slow host) stops while requests are running."""
    shape = EngineShape(model=model)
    workload = synthesize("documents", num_requests, 0, shape.hash_block_size, BUSY_ENGINE)
    write_workload(path, workload, shape)
    return path


def serving_engine(workload: Path, *extra: str, plugin: bool = True) -> EngineProcess:
    """A `kvtrace engine` (plugin on, unless ``plugin`` is False) that has started serving its
    workload (``extra``: more of its options, e.g. ``--variant upstream --vllm 0.30.0``; else
    the variant is unfixed)."""
    engine = EngineProcess([str(workload), "--variant", "unfixed", "--speed", SPEED, *extra],
                           {**_environment(), "KVTRACE_PLUGIN": "1" if plugin else "0"})
    engine.wait_ready()
    engine.send("start")
    engine.expect("kvtrace engine: running")
    return engine


def _environment() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}


def first_lookup_hit_rate(trace: Path) -> dict:
    reader = TraceReader(str(trace))
    summary = ReplaySummary(reader.header.config)
    for record in reader:
        summary(record)
    return summary.to_dict()


def capture_mid_flight(engine: EngineProcess, trace: Path, method: str = "auto") -> str:
    """Capture ``engine`` (a ``serving_engine``) from 4 s to 10 s after `start`, and check the
    trace is a mid-flight one: it starts with a snapshot of requests that were running, and it
    stopped before they all ended. The engine is stopped afterwards. The capture's stderr."""
    try:
        time.sleep(4)
        capture = kvtrace("capture", "--pid", str(engine.pid), "--method", method,
                          "--duration", "6s", "-o", str(trace))
        out, err = capture.communicate(timeout=120)
        assert capture.returncode == 0, err
        assert "the start snapshot held its scheduler" in out
        assert engine.process.poll() is None, "the engine must survive the capture"
        assert not control.request(engine.pid, StatusRequest()).armed
    finally:
        engine.stop()
    kinds = count_kinds(trace)
    # Mid-flight: requests were running when it armed, and it stopped before they all ended.
    assert kinds["snapshot_started"] == 1 and kinds["request_state"] > 0, kinds
    assert kinds["request_arrived"] > kinds["request_finished"] - kinds["request_state"], kinds
    return err


# As production serves (vLLM's AsyncScheduler, MTP drafts: 2 a step, 70% accepted, lookahead
# slots and lookahead block hashes), and synchronously without drafts.
SCHEDULING = {"async-mtp": ("--async-scheduling", "--num-speculative-tokens", "2",
                            "--speculative-method", "mtp"),
              "sync": ("--sync-scheduling",)}


@pytest.mark.parametrize("scheduling", SCHEDULING)
@pytest.mark.parametrize("model", preset_names())
def test_a_capture_armed_mid_flight_replays_from_its_snapshot(tmp_path, model, scheduling):
    """Issue #20, must show: captured from 4 s to 10 s after `start` at --speed 30; issue #29:
    with vLLM's AsyncScheduler (its default) and MTP speculative decoding, as with the synchronous
    scheduler, lockstep matches every effect, and the rescheduled replay of the engine's own
    variant keeps the three bounds (``reschedule_bounds``) against the capture."""
    workload = documents_workload(tmp_path / "w.kvtrace", model)
    trace = tmp_path / "cap.kvtrace"
    capture_mid_flight(serving_engine(workload, *SCHEDULING[scheduling]), trace)
    header = TraceReader(str(trace)).header
    config = header.config
    assert (config.async_scheduling, config.num_speculative_tokens, config.num_lookahead_tokens,
            config.num_hash_lookahead_tokens, config.num_prefill_lookahead_tokens,
            config.use_eagle) == ((True, 2, 2, 1, 1, False) if scheduling == "async-mtp"
                                  else (False, 0, 0, 0, 0, False))
    if scheduling == "async-mtp":
        assert header.params["speculative_method"] == "mtp"
    fidelity = lockstep_verify(trace, tmp_path / "fidelity")
    assert fidelity["matched"] == fidelity["total"] > 1000, fidelity
    captured = first_lookup_hit_rate(trace)
    summary_path = tmp_path / "reschedule.json"
    result = subprocess.run(
        [*_kvtrace(), "replay", str(trace), "--variant", "unfixed", "-o", str(tmp_path / "runs"),
         "--summary-json", str(summary_path)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    rescheduled = json.loads(summary_path.read_text())["variants"]["unfixed"]
    assert rescheduled["requests"] == captured["requests"] > 0
    assert_within_bounds(trace, tmp_path / "runs" / "cap.unfixed.kvtrace")


def test_a_synchronous_engine_that_drafts_is_captured_verified_and_rescheduled(tmp_path):
    """Speculative decoding (issue #29) on the synchronous scheduler (the async one drafts in
    the test above): decode steps carry two draft tokens, about 70% of them accepted (vLLM's
    n-gram drafting, on vLLM's own scheduler), captured mid-flight: its config says it drafts,
    its decode steps schedule the drafts, the scheduler caches the verified tokens' blocks
    itself, lockstep matches every effect, and the rescheduled replay reads the verifier's
    rate off the capture and keeps the three bounds."""
    workload = documents_workload(tmp_path / "w.kvtrace", "kimi-k3")
    trace = tmp_path / "cap.kvtrace"
    capture_mid_flight(serving_engine(workload, "--sync-scheduling",
                                      "--num-speculative-tokens", "2"), trace)
    reader = TraceReader(str(trace))
    assert reader.header.config.num_speculative_tokens == 2
    assert reader.header.params["num_speculative_tokens"] == "2"
    kinds = count_kinds(trace)
    assert kinds["blocks_cached"] > 100, kinds
    decodes = [r.num_new_tokens for r in reader if isinstance(r, SlotsAllocated)
               and r.num_computed_tokens >= r.num_tokens - 1]
    assert decodes.count(3) > 100, "decode steps schedule their two drafts"
    fidelity = lockstep_verify(trace, tmp_path / "fidelity")
    assert fidelity["matched"] == fidelity["total"] > 1000, fidelity
    result = subprocess.run(
        [*_kvtrace(), "replay", str(trace), "--variant", "unfixed", "-o", str(tmp_path / "runs")],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    rate = float(re.search(r"each draft accepted with ([0-9.]+) \(the capture's rate\)",
                           result.stderr).group(1))
    assert abs(rate - 0.7) <= 0.05, result.stderr
    assert_within_bounds(trace, tmp_path / "runs" / "cap.unfixed.kvtrace")


@needs_ptrace
def test_an_engine_without_the_plugin_is_attached_mid_flight_without_a_stall(tmp_path):
    """Issue 30: kvtrace's own injector gets the hook into a serving engine with no thread of it
    stopped longer than 0.2 s (what the capture reports, and an independent sampler here),
    and the capture verifies in lockstep."""
    workload = documents_workload(tmp_path / "w.kvtrace", "nemotron-h-8b")
    engine = serving_engine(workload, plugin=False)
    trace = tmp_path / "cap.kvtrace"
    with StallSampler(engine.pid) as sampler:
        err = capture_mid_flight(engine, trace, method="ptrace")
    line = next(line for line in err.splitlines() if "kvtrace: capturing pid" in line)
    assert "via ptrace (--method ptrace; kvtrace's injector" in line
    assert longest_stop_ms(line) <= MAX_INJECTOR_STOP_MS, line
    assert sampler.stalls.longest_s * 1000 <= MAX_INJECTOR_STOP_MS, sampler.stalls.describe()
    fidelity = lockstep_verify(trace, tmp_path / "fidelity")
    assert fidelity["matched"] == fidelity["total"] > 1000, fidelity


def _kvtrace() -> list[str]:
    import sys

    return [sys.executable, "-m", "kvtrace"]


# --- a capture never outlives its controller ------------------------------------------------


@pytest.fixture(scope="module")
def small_workload(tmp_path_factory) -> Path:
    return documents_workload(tmp_path_factory.mktemp("lease") / "w.kvtrace", "nemotron-h-8b")


def controller(*args: str) -> subprocess.Popen:
    """`kvtrace capture ...` with Python's fault handler on: a run that hangs is made to show
    where (``finish``). It starts with SIGHUP's default action even when the suite runs under
    `nohup`, whose ignored SIGHUP kvtrace keeps ignored on purpose."""
    import os

    return kvtrace(*args, env={**os.environ, "PYTHONFAULTHANDLER": "1"},
                   preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))


def finish(process: subprocess.Popen, timeout_s: float = 60) -> tuple[str, str]:
    """``process``'s output once it exits; if it does not within ``timeout_s``, it is aborted
    and the test fails with every thread's stack (the fault handler's)."""
    try:
        return process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGABRT)
        out, err = process.communicate(timeout=30)
        raise AssertionError(f"{process.args} still ran {timeout_s} s later:\n{err}") from None


def wait_until_vllm_runs_alone(pid: int, timeout_s: float = 10) -> float:
    """Seconds until engine ``pid`` no longer captures and every probed vLLM method is vLLM's
    own again; fails after ``timeout_s``."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        pong = control.request(pid, PingRequest())
        if not pong.capturing and not pong.patched:
            return time.monotonic() - started
        time.sleep(0.05)
    raise AssertionError(f"pid {pid} still captures or is patched after {timeout_s} s: {pong}")


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGHUP, signal.SIGTERM],
                         ids=["SIGKILL", "SIGHUP", "SIGTERM"])
def test_a_capture_ends_with_its_controller(small_workload, tmp_path, signum):
    """Killed while capturing: the engine disarms at once, whatever the signal, and restores
    every patched method. SIGHUP and SIGTERM stop `kvtrace capture` as Ctrl-C does (the trace
    closed, the summary printed), then it exits 128 + the signal."""
    engine = serving_engine(small_workload)
    trace = tmp_path / "cap.kvtrace"
    try:
        capture = controller("capture", "--pid", str(engine.pid), "-o", str(trace))
        wait_for_stderr_line(capture, "kvtrace: capturing pid")
        deadline = time.monotonic() + 30
        while not control.request(engine.pid, PingRequest()).patched:  # the next step armed
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # and a step ran under the probes (a loaded machine may signal before one did, and a
        # capture stopped before any step rightly holds no record)
        while not control.request(engine.pid, StatusRequest()).records:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        capture.send_signal(signum)
        out, err = finish(capture)
        assert wait_until_vllm_runs_alone(engine.pid) < 5
        assert engine.process.poll() is None, "the engine must survive its controller"
    finally:
        capture.kill()
        engine.stop()
    assert capture.returncode == (-signum if signum == signal.SIGKILL else 128 + signum), err
    if signum != signal.SIGKILL:
        assert f"stopped by {signal.Signals(signum).name}" in err and "records written" in out
    reader = TraceReader(str(trace))
    assert sum(len(batch) for batch in reader.batches()) > 0 and not reader.truncated


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGHUP, signal.SIGTERM],
                         ids=["SIGKILL", "SIGHUP", "SIGTERM"])
def test_a_controller_killed_while_arming_leaves_nothing_armed(small_workload, tmp_path, signum):
    """The signal lands anywhere from the first ping to just after the arm: every time, the
    engine ends disarmed with every method vLLM's own, and it can be captured again."""
    engine = serving_engine(small_workload)
    try:
        for index, delay_s in enumerate((0.0, 0.05, 0.1, 0.2, 0.35, 0.5, 0.8)):
            capture = controller("capture", "--pid", str(engine.pid), "-o",
                                 str(tmp_path / f"cap{index}.kvtrace"))
            time.sleep(delay_s)
            capture.send_signal(signum)
            finish(capture)
            assert wait_until_vllm_runs_alone(engine.pid) < 5
        again = kvtrace("capture", "--pid", str(engine.pid), "--duration", "1s", "-o",
                        str(tmp_path / "again.kvtrace"))
        _, err = again.communicate(timeout=60)
        assert again.returncode == 0, err
        assert engine.process.poll() is None
    finally:
        engine.stop()


def test_a_controller_gone_before_the_arm_reply_leaves_nothing_armed(small_workload, tmp_path):
    """The arm request is sent and the controller dies before reading the reply (the engine
    may or may not have written it yet): the engine disarms."""
    engine = serving_engine(small_workload)
    try:
        script = (
            "import os, signal, sys\n"
            "from kvtrace.capture import control\n"
            "from kvtrace.capture.messages import ArmRequest, CaptureOptions, encode\n"
            f"client = control._connect({engine.pid}, None, 10)\n"
            f"client.sendall(encode(ArmRequest(CaptureOptions(path={str(tmp_path / 'x')!r}))))\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
        subprocess.run([*_kvtrace()[:1], "-c", script], timeout=60)
        assert wait_until_vllm_runs_alone(engine.pid) < 5
    finally:
        engine.stop()


def test_output_in_the_runtime_directory_is_refused(small_workload):
    """`-o` onto the engine's control socket (or anything beside it) is refused before the
    engine is touched; the engine keeps its socket and can be stopped."""
    engine = serving_engine(small_workload)
    try:
        socket_path = control.socket_path(engine.pid)
        for output in (socket_path, socket_path.parent / "trace.kvtrace"):
            capture = kvtrace("capture", "--pid", str(engine.pid), "-o", str(output))
            _, err = capture.communicate(timeout=60)
            assert capture.returncode == 1 and "runtime directory" in err, err
            assert "Traceback" not in err
        assert socket_path.is_socket()
        pong = control.request(engine.pid, PingRequest())
        assert not pong.capturing and not pong.patched
    finally:
        engine.stop()
