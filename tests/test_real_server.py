"""A real ``vllm serve`` (vLLM's CPU build 0.32.0, a tiny Qwen3-Next built locally, prefix
caching, vLLM's defaults) captured while it serves four clients, the way an
operator does, and verified: through kvtrace's plugin by the API server's pid, and, with the
plugin off, through kvtrace's own injector, which must stop no engine thread longer than 0.2 s.
Each trace names the release it ran (0.32.0), and lockstep re-issues its calls on that
release's own code (a worker on 0.32.0) with every effect record equal.

These start real servers (about a minute each on two cores); they skip, saying why, where
``scripts/bootstrap`` could not make the server's environment."""

from __future__ import annotations

import pytest
from debugger_support import needs_ptrace
from real_server import VllmServe, missing
from test_capture_live import (
    MAX_INJECTOR_STOP_MS,
    kvtrace,
    lockstep_verify,
    longest_stop_ms,
)

from kvtrace.capture.stalls import StallSampler
from kvtrace.traceio import TraceReader, count_kinds
from kvtrace.vllm_releases import is_installed

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(missing() is not None, reason=missing() or ""),
              pytest.mark.skipif(not is_installed("0.32.0"),
                                 reason="vLLM 0.32.0 is not installed beside the project's "
                                        "(kvtrace vllm install 0.32.0): lockstep needs it")]
RELEASE = "0.32.0"


def capture(server: VllmServe, trace, *options: str) -> str:
    """``kvtrace capture`` of ``server`` by its API server's pid for 8 s while it serves; its
    stderr. The server is stopped afterwards."""
    try:
        process = kvtrace("-v", "capture", "--pid", str(server.pid), "--duration", "8s",
                          "-o", str(trace), *options)
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err
        assert server.process.poll() is None, "the server must survive the capture"
    finally:
        server.stop()
    assert server.latencies, f"the clients got no answer ({server.failures} failures)"
    return err


def check_trace(trace, tmp_path) -> None:
    """The trace names the release and how the engine scheduled, holds calls, and verifies in
    lockstep on that release. vLLM turns async scheduling on by default, but its CPU platform
    turns it off again (``vllm/platforms/cpu.py``: "async scheduling is not required on CPU"),
    so this server runs the synchronous ``Scheduler``, and the header says so."""
    reader = TraceReader(str(trace))
    assert reader.header.vllm_version == RELEASE
    assert {key: reader.header.params[key] for key in ("scheduler", "async_scheduling",
                                                       "num_speculative_tokens")} == {
        "scheduler": "Scheduler", "async_scheduling": "false", "num_speculative_tokens": "0"}
    assert reader.header.process_title.startswith("VLLM::EngineCore")
    assert count_kinds(trace)["slots_allocated"] > 100
    fidelity = lockstep_verify(trace, tmp_path / "fidelity")
    assert fidelity["matched"] == fidelity["total"] > 100, fidelity


def test_a_real_server_captured_through_its_plugin_verifies_on_its_release(tmp_path):
    server = VllmServe(plugin=True).serve()
    trace = tmp_path / "plugin.kvtrace"
    err = capture(server, trace)
    assert f"via plugin (kvtrace's plugin answered in pid {server.engine_core})" in err
    check_trace(trace, tmp_path)


@needs_ptrace
def test_a_real_server_without_the_plugin_is_attached_without_a_stall(tmp_path):
    server = VllmServe(plugin=False).serve()
    trace = tmp_path / "ptrace.kvtrace"
    with StallSampler(server.engine_core) as sampler:
        err = capture(server, trace, "--method", "ptrace")
    line = next(line for line in err.splitlines() if "kvtrace: capturing pid" in line)
    assert "via ptrace (--method ptrace; kvtrace's injector" in line
    assert longest_stop_ms(line) <= MAX_INJECTOR_STOP_MS, line
    assert sampler.stalls.longest_s * 1000 <= MAX_INJECTOR_STOP_MS, sampler.stalls.describe()
    check_trace(trace, tmp_path)
