"""A sweep's processes (kvtrace/replay/sweep.py): its workers and its local Ray instance stop
with it, whatever stops it; a Ray address where nothing listens fails at once."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from bad_traces import requests, trace
from cli_runs import KVTRACE, run, vllm_imported, workload  # noqa: F401

from kvtrace.children import descendants


def sweep_process(source: Path, out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([*KVTRACE, "sweep", str(source), "--backend", "vllm",
                             "--pool-fraction", "0.05,0.1,0.15,0.2,0.25,0.3", "-o", str(out),
                             *extra], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text(errors="replace")
    except OSError:
        return ""


def gone(pids: list[int], within: float = 15.0) -> bool:
    """Whether every pid exited (a zombie waiting for its reaper counts) within ``within``."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z":
                alive.append(pid)
        if not alive:
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def mooncake_workload(tmp_path_factory) -> Path:
    from third_party_data import MOONCAKE_SYNTHETIC

    path = tmp_path_factory.mktemp("mooncake") / "m.kvtrace"
    assert run("import", "mooncake", MOONCAKE_SYNTHETIC, "-o", path).exit_code == 0
    return path


# Hardening round three, R4.
@pytest.mark.slow
@pytest.mark.parametrize("stop, after", [(signal.SIGTERM, 0.0), (signal.SIGTERM, 1.0),
                                         (signal.SIGINT, 0.5), (signal.SIGKILL, 1.0)])
def test_sweep_workers_stop_with_the_sweep(tmp_path, mooncake_workload, stop, after):
    """SIGTERM was swallowed when it landed while workers were forked (the sweep finished and
    exited 0), and a SIGKILLed sweep left its workers blocked at 430 MB each, forever."""
    process = sweep_process(mooncake_workload, tmp_path / "sweep", "-j", "2")
    deadline = time.monotonic() + 300
    while len(workers := descendants(process.pid)) < 2:
        assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
        time.sleep(0.01)
    time.sleep(after)
    if stop == signal.SIGINT:  # Ctrl-C: the terminal signals the whole process group
        os.killpg(process.pid, stop)
    else:
        process.send_signal(stop)
    code = process.wait(60)
    assert gone(workers), f"workers {workers} outlived the sweep"
    if stop != signal.SIGKILL:
        assert code == 128 + stop
        assert process.stderr.read().splitlines()[-1] == (
            f"kvtrace: stopped by {signal.Signals(stop).name}")
    assert not (tmp_path / "sweep").exists() or not list((tmp_path / "sweep").iterdir())


# Hardening round three, R4.
@pytest.mark.slow
@pytest.mark.parametrize("when", ["connecting", "running"])
def test_sweep_on_a_local_ray_stops_with_its_instance(tmp_path, when):
    """A SIGTERM while Ray's driver connected (just after "Started a local Ray instance") was
    raised inside ``ray.init``: the sweep said "stopped by SIGTERM", then died of SIGABRT
    (absl's alarm) or SIGSEGV (a timer of the half-built core worker)."""
    pytest.importorskip("ray", reason="Ray is optional (pip install 'kvtrace[ray]')")
    source = trace(tmp_path / "big.kvtrace", requests(3000))
    process = sweep_process(source, tmp_path / "sweep", "--ray", "local", "-j", "2")
    said = []
    if when == "connecting":
        for line in iter(process.stderr.readline, ""):
            said.append(line)
            if "Started a local Ray instance" in line:
                break
        assert "Started a local Ray instance" in said[-1], "".join(said)
        time.sleep(0.1)
    else:
        deadline = time.monotonic() + 300
        while not any("raylet" in command_line(pid) for pid in descendants(process.pid)):
            assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
            time.sleep(0.2)
        time.sleep(2)  # Ray still starting, or running the tasks
    ray_processes = descendants(process.pid)
    process.send_signal(signal.SIGTERM)
    assert process.wait(60) == 128 + signal.SIGTERM
    assert "kvtrace: stopped by SIGTERM" in "".join(said) + process.stderr.read()
    assert gone(ray_processes, within=30), "the local Ray instance outlived the sweep"


# Hardening finding H.
def test_sweep_on_a_ray_address_where_nothing_listens_fails_at_once(tmp_path, workload):
    """Ray itself retried such an address for minutes (still retrying after 4)."""
    import socket

    with socket.socket() as closed:  # bound, never listening: a connection is refused
        closed.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{closed.getsockname()[1]}"
        done = subprocess.run([*KVTRACE, "sweep", str(workload), "--num-gpu-blocks", "300",
                               "--ray", address, "-o", str(tmp_path / "sweep")],
                              capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert f"kvtrace: error: cannot connect to Ray at {address}: nothing answers" in done.stderr


# Hardening round three, R4.
def test_sweep_on_a_ray_client_address_where_nothing_listens_fails_at_once(tmp_path,
                                                                           workload):
    import socket

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        address = f"ray://127.0.0.1:{closed.getsockname()[1]}"
        started = time.monotonic()
        done = subprocess.run([*KVTRACE, "sweep", str(workload), "--num-gpu-blocks", "300",
                               "--ray", address, "-o", str(tmp_path / "sweep")],
                              capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "nothing answers" in done.stderr
    assert time.monotonic() - started < 25  # Ray's client retried for 31 s
