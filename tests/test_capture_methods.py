"""Capture paths this machine cannot run for real: PEP 768 remote-exec (needs Python >= 3.14)
and NVML telemetry (needs an NVIDIA driver). Each is tested up to the boundary, and the test
that needs the real thing says why it is skipped."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import types

import pytest

from kvtrace.capture import attach, control
from kvtrace.capture.messages import PingRequest
from kvtrace.capture.telemetry import GpuSampler, visible_gpu_indices
from kvtrace.errors import UnsafePathError
from kvtrace.events import GpuSampled

# A stand-in for what PEP 768 does inside the target: run a script file at a safe point in the
# main thread. This target runs, in its own main thread, any script whose path arrives on stdin.
REMOTE_EXEC_TARGET = """
import sys
print("ready", flush=True)
for line in sys.stdin:
    exec(open(line.strip()).read(), {"__name__": "remote_exec"})
"""


@pytest.fixture
def remote_exec_target():
    cwd = tempfile.mkdtemp()
    process = subprocess.Popen([sys.executable, "-c", REMOTE_EXEC_TARGET], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, cwd=cwd)
    assert process.stdout.readline().strip() == "ready"
    yield process
    process.kill()
    process.wait()


def test_remote_exec_needs_python_3_14(remote_exec_target, monkeypatch):
    monkeypatch.delattr(sys, "remote_exec", raising=False)
    target = attach.describe(remote_exec_target.pid)
    with pytest.raises(attach.AttachError, match="needs Python 3.14 or newer"):
        attach.ensure_hook(target, "remote-exec", lambda message: None)


def test_remote_exec_bootstrap_starts_the_control_server(remote_exec_target, monkeypatch, tmp_path):
    """Up to the call: kvtrace hands sys.remote_exec the target's pid and a bootstrap script;
    run where PEP 768 would run it, that script brings up the control channel."""
    calls = []

    def remote_exec(pid: int, script: str) -> None:
        calls.append((pid, script))
        remote_exec_target.stdin.write(script + "\n")
        remote_exec_target.stdin.flush()

    monkeypatch.setattr(sys, "remote_exec", remote_exec, raising=False)
    target = attach.describe(remote_exec_target.pid)
    assert attach.ensure_hook(target, "remote-exec", lambda message: None).method == "remote-exec"
    assert calls == [(target.pid, str(control.runtime_dir() / f"inject-{target.pid}.py"))]
    reply = control.request(target.pid, PingRequest())
    assert reply.pid == target.pid and reply.capturing is False


@pytest.mark.skipif(sys.version_info < (3, 14) or not hasattr(sys, "remote_exec"),
                    reason="sys.remote_exec (PEP 768) needs Python >= 3.14 on both sides; this "
                           "machine has " + sys.version.split()[0] + " and its package registries "
                           "serve no runnable 3.14 (reference/environment-notes.md section 3b)")
def test_remote_exec_for_real(remote_exec_target):
    target = attach.describe(remote_exec_target.pid)
    assert attach.ensure_hook(target, "remote-exec", lambda message: None).method == "remote-exec"


class FakeNvml(types.ModuleType):
    """pynvml's calls as the sampler makes them, for two GPUs with known readings."""

    class NVMLError(Exception):
        pass

    def __init__(self) -> None:
        super().__init__("pynvml")
        self.shut_down = False

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        self.shut_down = True

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, index):
        return f"gpu{index}"

    def nvmlDeviceGetMemoryInfo(self, handle):
        return types.SimpleNamespace(used=(1 + int(handle[-1])) * 2**30, total=141 * 2**30)

    def nvmlDeviceGetUtilizationRates(self, handle):
        return types.SimpleNamespace(gpu=90 + int(handle[-1]))


def test_gpu_sampler_samples_the_visible_gpus(monkeypatch):
    """The sampling loop on an NVML stand-in; real NVML needs an NVIDIA driver, which this
    machine and CI lack (the test below covers that case for real)."""
    fake = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    samples = []
    sampler = GpuSampler(samples.append, origin_ns=time.time_ns(), interval_ms=10)
    sampler.start()
    deadline = time.monotonic() + 5
    while len(samples) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    sampler.stop()
    assert sampler.description == "sampling 1 GPU(s) every 10 ms"
    assert len(samples) >= 3 and fake.shut_down
    assert all(s == GpuSampled(s.ts_ns, 1, 2 * 2**30, 141 * 2**30, 91) for s in samples)


def test_gpu_interval_0_turns_sampling_off(monkeypatch):
    fake = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    samples = []
    sampler = GpuSampler(samples.append, origin_ns=0, interval_ms=0)
    sampler.start()
    time.sleep(0.05)
    sampler.stop()
    assert sampler.description == "GPU telemetry off"
    assert samples == [] and sampler._thread is None


def test_without_an_nvidia_driver_there_is_one_line_and_no_samples():
    samples = []
    sampler = GpuSampler(samples.append, origin_ns=0, interval_ms=10)
    sampler.start()
    time.sleep(0.05)
    sampler.stop()
    if not sampler.description.startswith("no GPU telemetry"):
        pytest.skip("this machine has an NVIDIA driver: " + sampler.description)
    assert samples == [] and sampler._thread is None


@pytest.mark.parametrize("visible, expected", [(None, [0, 1, 2]), ("2,0", [2, 0]), ("", []),
                                                ("GPU-uuid,1", [1]), ("7", [])])
def test_visible_gpu_indices(monkeypatch, visible, expected):
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert visible_gpu_indices(3) == expected


def test_control_socket_is_private(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTRACE_RUNTIME_DIR", str(tmp_path))
    shared = control.runtime_dir()
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)
    with pytest.raises(UnsafePathError, match=f"{shared} is open to other users .mode 0777."):
        control.ControlServer(control.socket_path(os.getpid())).start()
    assert os.listdir(shared) == []


# A kvtrace plugin that took the connection and never answers: an engine too busy to reply.
SILENT_PLUGIN = """
import os, socket, sys, time
from kvtrace.capture import control
path = control.socket_path(os.getpid())
os.makedirs(path.parent, mode=0o700, exist_ok=True)
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(str(path))
os.chmod(path, 0o600)
listener.listen(4)
print("listening", flush=True)
time.sleep(120)
"""


def test_a_plugin_that_does_not_answer_is_not_taken_for_no_plugin(tmp_path, monkeypatch):
    """The plugin's socket is served by the engine but no reply comes (a stalled or overloaded
    engine): `auto` says so and stops; it never falls back to a debugger, which would stop a
    busy engine that has kvtrace already."""
    monkeypatch.setenv("KVTRACE_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setattr(attach, "PING_TIMEOUT_S", 1.0)
    debuggers = []
    monkeypatch.setattr(attach, "_proven_debugger", lambda *args: debuggers.append(args))
    engine = subprocess.Popen([sys.executable, "-c", SILENT_PLUGIN], stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "KVTRACE_RUNTIME_DIR": str(tmp_path)})
    try:
        assert engine.stdout.readline().strip() == "listening"
        target = attach.describe(engine.pid)
        with pytest.raises(control.ControlSilentError,
                           match=f"control server in pid {engine.pid} took the connection but "
                                 "did not answer in 1 s"):
            attach.ensure_hook(target, "auto", lambda message: None)
        assert engine.poll() is None
    finally:
        engine.kill()
        engine.wait()
    assert debuggers == [] and not list(control.runtime_dir().glob("inject-*"))
