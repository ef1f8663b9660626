"""`kvtrace capture --pid` against live processes: the real `kvtrace engine` (real vLLM 0.33
cache code) attached through the plugin, gdb and lldb (or, where this host's debugger cannot
make calls, refused with the engine unharmed), replayed in lockstep to 100%; auto past a broken
gdb to lldb; and each diagnosis (no such pid, not an engine, another user, no ptrace permission, kvtrace missing in
the target, unsupported vLLM, already attached, target killed)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from debugger_support import (
    SYSTEM_PYTHON,
    can_call,
    needs_gdb,
    needs_lldb,
    needs_ptrace,
    path_with,
    pids_in,
    stand_in,
)

from kvtrace.cli import cli
from kvtrace.engine.process import EngineProcess
from kvtrace.workloads.workload import EngineShape, write_workload
from kvtrace.workloads.synth import synthesize
from kvtrace.traceio import TraceReader

pytestmark = pytest.mark.slow
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
# Processes start in an empty directory: `python -m` / `-c` put their cwd on sys.path.
EMPTY_DIR = tempfile.mkdtemp(prefix="kvtrace-test-cwd-")
os.chmod(EMPTY_DIR, 0o755)


@pytest.fixture(scope="module")
def workload(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("capture") / "shared.kvtrace"
    shape = EngineShape()
    write_workload(path, synthesize("shared-prompt", 40, seed=0, hash_unit=shape.hash_block_size),
                   shape)
    return path


def kvtrace(*args: str, prefix: list[str] | None = None, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([*(prefix or []), sys.executable, "-m", "kvtrace", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=EMPTY_DIR, **kwargs)


def wait_for_stderr_line(process: subprocess.Popen, prefix: str, timeout: float = 120) -> list[str]:
    """Read stderr until a line starts with ``prefix``; fail with what it said otherwise."""
    lines, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stderr.readline()
        if not line:
            break
        lines.append(line.rstrip("\n"))
        if line.startswith(prefix):
            return lines
    raise AssertionError(f"no {prefix!r} on stderr: {lines}; exit code {process.poll()}")


def start_engine(workload: Path, *extra: str, plugin: bool = True, parent: bool = False) -> EngineProcess:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    env["KVTRACE_PLUGIN"] = "1" if plugin else "0"
    args = [str(workload), "--variant", "unfixed", "--speed", "0", *extra]
    engine = EngineProcess(args, env, parent=parent)
    engine.expect("kvtrace engine: pid ")
    return engine


def lockstep_verify(trace: Path, outdir: Path) -> dict:
    summary = outdir / "summary.json"
    result = CliRunner().invoke(cli, ["replay", str(trace), "--lockstep", "--verify", "-o",
                                      str(outdir), "--summary-json", str(summary)])
    assert result.exit_code == 0, result.output + result.stderr
    return json.loads(summary.read_text())["fidelity"]


@pytest.mark.parametrize("method", ["plugin", pytest.param("ptrace", marks=needs_ptrace),
                                    pytest.param("gdb", marks=needs_gdb),
                                    pytest.param("lldb", marks=needs_lldb)])
def test_captured_engine_replays_in_lockstep_to_100_percent(workload, tmp_path, method):
    """Where the debugger cannot make calls on this host (issue 21's check: gdb 13 on an AMX
    CPU), the capture must instead be refused with the engine untouched and able to serve."""
    # The debugger runs start the engine under a parent process and pass the parent's pid, as
    # an operator passes the API server's: kvtrace must find the engine-core child itself.
    debugger = method != "plugin"
    engine = start_engine(workload, plugin=not debugger, parent=debugger)
    target_pid = engine.process.pid if debugger else engine.pid
    if debugger and not can_call(method):
        assert_refused_and_engine_unharmed(engine, target_pid, method, tmp_path)
        return
    capture_and_verify(workload, engine, target_pid, method, tmp_path, expect_via=method,
                       second_capture_refused=method == "plugin")


@needs_ptrace
def test_auto_without_the_plugin_captures_via_kvtraces_injector_first(workload, tmp_path):
    """Without the plugin, auto takes kvtrace's own injector, which stops the engine least,
    before any debugger (a stand-in gdb that kills is on PATH: it is never run)."""
    gdb_log = stand_in(tmp_path / "bin", "gdb", "kills")
    engine = start_engine(workload, plugin=False)
    lines = capture_and_verify(workload, engine, engine.pid, "auto", tmp_path,
                               expect_via="ptrace", env=path_with(tmp_path / "bin"))
    assert (f"no kvtrace plugin answered in pid {engine.pid}; Python "
            f"{sys.version.split()[0]} has no sys.remote_exec; kvtrace's injector "
            f"{__import__('kvtrace').__version__} passed its canary") in lines[-1]
    assert not gdb_log.exists(), "no debugger was needed"


def test_a_gdb_that_would_kill_the_engine_is_refused_and_the_engine_serves_on(workload, tmp_path):
    """Issue 21's host on any host: gdb kills what it attaches to (a stand-in first on PATH;
    test_canary.py does the same with lldb). `capture --method gdb` exits 1 naming it, and the
    engine then serves its workload."""
    log = stand_in(tmp_path / "bin", "gdb", "kills")
    engine = start_engine(workload, plugin=False)
    assert_refused_and_engine_unharmed(engine, engine.pid, "gdb", tmp_path,
                                       env=path_with(tmp_path / "bin"))
    assert pids_in(log) and engine.pid not in pids_in(log)


def assert_refused_and_engine_unharmed(engine: EngineProcess, target_pid: int, method: str,
                                       tmp_path: Path, env: dict | None = None) -> None:
    """kvtrace refuses (exit 1, one line naming the debugger and its canary), and the engine,
    untouched, then serves its whole workload and exits cleanly."""
    try:
        code, err = run_cli("capture", "--pid", str(target_pid), "--method", method, "-o",
                            str(tmp_path / "never.kvtrace"), env=env)
        assert code == 1 and "failed its canary" in err, err
        assert f"kvtrace did not touch pid {engine.pid}" in err
        engine.send("start")
        engine.expect("kvtrace engine: done (", timeout=120)
        engine.send("quit")
        assert engine.process.wait(timeout=60) == 0, "the engine must survive the refusal"
    finally:
        engine.stop()
    assert not (tmp_path / "never.kvtrace").exists()


def capture_and_verify(workload: Path, engine: EngineProcess, target_pid: int, method: str,
                       tmp_path: Path, expect_via: str, env: dict | None = None,
                       second_capture_refused: bool = False,
                       variant: str = "unfixed") -> list[str]:
    """Capture the engine's whole ``workload`` through ``method``, check the trace and replay it in
    lockstep to 100%; the capture's stderr lines up to "capturing pid"."""
    trace = tmp_path / "live.kvtrace"
    capture = kvtrace("-v", "capture", "--pid", str(target_pid), "--method", method, "-o",
                      str(trace), "--duration", "300s", env=env)
    try:
        lines = wait_for_stderr_line(capture, "kvtrace: capturing pid")
        assert f"capturing pid {engine.pid} (VLLM::EngineCore)" in lines[-1]
        assert f"via {expect_via} (" in lines[-1]
        if expect_via == "ptrace":
            assert longest_stop_ms(lines[-1]) <= MAX_INJECTOR_STOP_MS, lines[-1]
        if second_capture_refused:
            second = kvtrace("capture", "--pid", str(engine.pid), "-o", str(tmp_path / "two.kvtrace"))
            _, err = second.communicate(timeout=60)
            assert second.returncode == 1 and "already capturing" in err, err
        engine.send("start")
        engine.expect("kvtrace engine: done (", timeout=120)
        capture.send_signal(signal.SIGINT)  # Ctrl-C: disarm, close, summarise
        out, err = capture.communicate(timeout=60)
        assert capture.returncode == 0, err
        assert "records written, 0 dropped" in out
        engine.send("quit")
        assert engine.process.wait(timeout=60) == 0, "the engine must survive capture"
        from kvtrace.capture.control import socket_path

        assert not socket_path(engine.pid).exists(), "a clean exit removes the control socket"
    finally:
        capture.kill()
        engine.stop()
    reader = TraceReader(str(trace))
    assert reader.header.source == "capture" and reader.header.process_title == "VLLM::EngineCore"
    assert reader.header.params["variant"] == variant
    assert (reader.header.params["scheduler"], reader.header.params["async_scheduling"]) == (
        "Scheduler", "false"), "kvtrace engine runs vLLM's synchronous scheduler"
    # The scheduler's limits are read off vLLM's own scheduler: the workload's, which it ran.
    ran = TraceReader(str(workload)).header.config
    assert ran.max_num_seqs and ran.max_num_batched_tokens  # the workload sets them
    assert reader.header.config == ran
    assert sum(len(batch) for batch in reader.batches()) > 1000 and not reader.truncated
    fidelity = lockstep_verify(trace, tmp_path / "runs")
    assert fidelity["matched"] == fidelity["total"] > 1000, fidelity
    return lines


MAX_INJECTOR_STOP_MS = 200  # issue 30: an attach without the plugin stops the engine no longer


def longest_stop_ms(line: str) -> float:
    """The longest stop of an engine thread that a "capturing pid" line reports (0 for none)."""
    if "no thread was seen stopped" in line:
        return 0.0
    match = re.search(r"threads stood stopped at most ([0-9.]+) ms in one stretch", line)
    assert match, line
    return float(match.group(1))


def test_target_killed_mid_capture_leaves_a_readable_trace(workload, tmp_path):
    engine = start_engine(workload, "--speed", "1")
    trace = tmp_path / "killed.kvtrace"
    capture = kvtrace("capture", "--pid", str(engine.pid), "--method", "plugin", "-o", str(trace))
    try:
        wait_for_stderr_line(capture, "kvtrace: capturing pid")
        engine.send("start")
        time.sleep(1.5)
        os.kill(engine.pid, signal.SIGKILL)
        _, err = capture.communicate(timeout=60)
    finally:
        capture.kill()
        engine.stop()
    assert capture.returncode == 1
    assert f"kvtrace: error: target pid {engine.pid} died during the capture" in err
    reader = TraceReader(str(trace))
    assert sum(len(batch) for batch in reader.batches()) > 0 and reader.truncated


def run_cli(*args: str, prefix: list[str] | None = None, **kwargs) -> tuple[int, str]:
    process = kvtrace(*args, prefix=prefix, **kwargs)
    _, err = process.communicate(timeout=120)
    errors = [line for line in err.splitlines() if line.startswith("kvtrace: error:")]
    assert len(errors) <= 1 and "Traceback" not in err, err
    return process.returncode, err


def sleeper(title: str, user: list[str] | None = None, python: str | None = None) -> subprocess.Popen:
    """A process whose title is ``title`` (bash ``exec -a``), sleeping in its main thread; a
    Python one once it has started and said so: its title is there at exec, its libpython only
    once the loader mapped it, and a canary compares that (a race CI lost once)."""
    body = (f'exec -a "{title}" {python} -c "import time; print(flush=True); time.sleep(600)"'
            if python else f'exec -a "{title}" sleep 600')
    process = subprocess.Popen([*(user or []), "bash", "-c", body], cwd=EMPTY_DIR,
                               stdout=subprocess.PIPE if python else None)
    if python:
        process.stdout.readline()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if Path(f"/proc/{process.pid}/cmdline").read_bytes().startswith(title.encode()):
            return process
        time.sleep(0.05)
    raise AssertionError("the sleeper never took its title")


def test_no_such_pid():
    code, err = run_cli("capture", "--pid", "4194303", "-o", "/tmp/x.kvtrace")
    assert code == 1 and "kvtrace: error: no process with pid 4194303" in err


def test_a_pid_that_is_no_engine_core(tmp_path):
    process = sleeper("my-api-server")
    try:
        code, err = run_cli("capture", "--pid", str(process.pid), "-o", str(tmp_path / "x.kvtrace"))
    finally:
        process.kill()
    assert code == 1 and "is not a vLLM engine core and has none among its child" in err


@pytest.mark.skipif(os.getuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv to run as another user")
def test_another_users_process(tmp_path):
    process = sleeper("VLLM::EngineCore")
    try:
        code, err = run_cli("capture", "--pid", str(process.pid), "-o", "/tmp/never.kvtrace",
                            prefix=NOBODY)
    finally:
        process.kill()
    assert code == 1 and f"kvtrace: error: pid {process.pid} belongs to another user" in err


@needs_gdb
@pytest.mark.skipif(os.getuid() != 0 or shutil.which("capsh") is None,
                    reason="needs root and capsh to drop CAP_SYS_PTRACE")
def test_no_ptrace_permission(tmp_path):
    process = sleeper("VLLM::EngineCore", user=NOBODY)
    try:
        code, err = run_cli("capture", "--pid", str(process.pid), "--method", "gdb", "-o",
                            str(tmp_path / "x.kvtrace"),
                            prefix=["capsh", "--drop=cap_sys_ptrace", "--", "-c", 'exec "$0" "$@"'])
    finally:
        process.kill()
    assert code == 1 and f"kvtrace: error: no ptrace permission for pid {process.pid}" in err


@pytest.mark.parametrize("method", [pytest.param("ptrace", marks=needs_ptrace),
                                    pytest.param("gdb", marks=needs_gdb),
                                    pytest.param("lldb", marks=needs_lldb)])
def test_kvtrace_not_importable_in_the_target(tmp_path, method):
    """Where the debugger cannot make calls on this host, its canary refuses first instead."""
    process = sleeper("VLLM::EngineCore", python=SYSTEM_PYTHON)
    try:
        code, err = run_cli("capture", "--pid", str(process.pid), "--method", method, "-o",
                            str(tmp_path / "x.kvtrace"))
        alive = process.poll() is None
    finally:
        process.kill()
    if can_call(method):
        assert code == 1 and "kvtrace is not importable in pid" in err and SYSTEM_PYTHON in err
    else:
        assert code == 1 and f"{method} " in err and "failed its canary" in err
    assert alive, "a failed injection must leave the target running"


UNSUPPORTED_VLLM = """
import setproctitle, sys, time
setproctitle.setproctitle("VLLM::EngineCore")
from vllm.v1.core.block_pool import BlockPool
def touch(self, blocks, pinned):  # as a future vLLM might have it
    pass
BlockPool.touch = touch
from kvtrace.capture.control import start_control_server
start_control_server()
print("ready", flush=True)
time.sleep(600)
"""


def test_unsupported_vllm_version_is_refused_before_patching(tmp_path):
    process = subprocess.Popen([sys.executable, "-c", UNSUPPORTED_VLLM], stdout=subprocess.PIPE,
                               text=True, cwd=EMPTY_DIR)
    try:
        assert process.stdout.readline().strip() == "ready"
        code, err = run_cli("capture", "--pid", str(process.pid), "--method", "plugin", "-o",
                            str(tmp_path / "x.kvtrace"))
    finally:
        process.kill()
    assert code == 1 and "BlockPool.touch has parameters (self, blocks, pinned)" in err
    assert not (tmp_path / "x.kvtrace").exists()


def test_plugin_method_without_the_plugin(workload, tmp_path):
    process = sleeper("VLLM::EngineCore")
    try:
        code, err = run_cli("capture", "--pid", str(process.pid), "--method", "plugin", "-o",
                            str(tmp_path / "x.kvtrace"))
    finally:
        process.kill()
    assert code == 1 and "no kvtrace plugin is listening in pid" in err


def test_stop_from_another_shell(workload, tmp_path):
    engine = start_engine(workload)
    trace = tmp_path / "stopped.kvtrace"
    capture = kvtrace("capture", "--pid", str(engine.pid), "-o", str(trace))
    try:
        wait_for_stderr_line(capture, "kvtrace: capturing pid")
        engine.send("start")
        engine.expect("kvtrace engine: done (", timeout=120)
        stop = kvtrace("capture", "--stop", str(engine.pid))
        stop_out, stop_err = stop.communicate(timeout=60)
        out, err = capture.communicate(timeout=60)
    finally:
        capture.kill()
        engine.stop()
    assert stop.returncode == 0, stop_err
    assert f"kvtrace: pid {engine.pid}: " in stop_out and "records written, 0 dropped" in stop_out
    assert capture.returncode == 0, err
    assert "stopped from elsewhere" in out
    reader = TraceReader(str(trace))
    assert sum(len(batch) for batch in reader.batches()) > 1000 and not reader.truncated


def test_sigusr1_arms_and_sigusr2_disarms_the_plugin(workload):
    from kvtrace.capture import control

    engine = start_engine(workload)
    try:
        os.kill(engine.pid, signal.SIGUSR1)
        status = wait_for_status(engine.pid, armed=True)
        engine.send("start")
        engine.expect("kvtrace engine: done (", timeout=120)
        os.kill(engine.pid, signal.SIGUSR2)
        wait_for_status(engine.pid, armed=False)
        assert engine.process.poll() is None, "the signals must not stop the engine"
    finally:
        engine.stop()
    trace = Path(status.path)
    assert trace.parent == control.runtime_dir() and trace.name.startswith(f"capture-{engine.pid}-")
    reader = TraceReader(str(trace))
    assert sum(len(batch) for batch in reader.batches()) > 1000 and not reader.truncated
    trace.unlink()


def wait_for_status(pid: int, armed: bool, timeout: float = 30):
    from kvtrace.capture import control
    from kvtrace.capture.messages import StatusRequest

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = control.request(pid, StatusRequest())
        # Disarmed means the session is gone: "armed" turns false as soon as it starts stopping.
        if armed and status.armed or not armed and status.path is None:
            return status
        time.sleep(0.05)
    raise AssertionError(f"pid {pid} never became {'armed' if armed else 'disarmed'}: {status}")


def test_a_capture_of_an_idle_engine_is_said_to_have_caught_no_call(workload, tmp_path):
    """An engine that served nothing while armed: lockstep says so, not that the trace is a
    workload (what it said before)."""
    engine = start_engine(workload)
    trace = tmp_path / "idle.kvtrace"
    try:
        capture = kvtrace("capture", "--pid", str(engine.pid), "--duration", "1s", "-o",
                          str(trace))
        _, err = capture.communicate(timeout=120)
        assert capture.returncode == 0, err
    finally:
        engine.stop()
    result = CliRunner().invoke(cli, ["replay", str(trace), "--lockstep", "--verify", "-o",
                                      str(tmp_path / "runs")])
    assert result.exit_code == 1
    assert (f"kvtrace: error: {trace} is a capture of an engine that made no allocate_slots "
            "call while it was armed") in result.stderr
    assert "kvtrace: hint: Capture while the engine serves" in result.stderr
    assert "a workload" not in result.stderr
