"""Running kvtrace's commands in a test, and the contract a bad outcome keeps: one error line
plus a hint, exit 1 (2 for a usage error), and nothing lost.

The tests of what commands refuse share these (they were one adversarial suite, named by the
hardening issues' findings: D a command destroys its input, W wrong or doubled figures, H hangs
and memory, C a traceback instead of an error, M misc. consistency; round three R1-R13). A test
module imports the fixtures it uses by name."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from bad_traces import requests, trace
from click.testing import CliRunner

from kvtrace.cli import cli


KVTRACE = [str(Path(sys.executable).with_name("kvtrace"))]  # the console script


@pytest.fixture(scope="module", autouse=True)
def vllm_imported():
    """vLLM imported once per module, before its first test: the commands import it inside."""
    import vllm.v1.core.kv_cache_manager  # noqa: F401


def run(*args) -> object:
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)


def assert_error(result, message: str, code: int = 1) -> None:
    """One ``kvtrace: error:`` line holding ``message`` and one hint, exit ``code``."""
    assert result.exit_code == code, result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("kvtrace: error:")]
    assert len(errors) == 1 and message in errors[0], result.stderr
    assert "kvtrace: hint: " in result.stderr and "Traceback" not in result.output


@pytest.fixture
def workload(tmp_path) -> Path:
    return trace(tmp_path / "w.kvtrace", requests())


@pytest.fixture
def replayed(tmp_path, workload) -> Path:
    """A replay output: a trace with captured calls and effects, as lockstep reads one."""
    assert run("replay", workload, "--variant", "fixed", "-o", tmp_path / "runs").exit_code == 0
    return tmp_path / "runs" / "w.fixed.kvtrace"


@pytest.fixture
def loaded(tmp_path, workload) -> Path:
    db = tmp_path / "w.duckdb"
    assert run("load", workload, "-o", db).exit_code == 0
    return db


@pytest.fixture
def immutable_dir(tmp_path):
    """A directory nobody, root included, can add to (chattr +i; root ignores modes)."""
    directory = tmp_path / "ro"
    directory.mkdir()
    if subprocess.run(["chattr", "+i", str(directory)], capture_output=True).returncode:
        pytest.skip("chattr +i is not allowed here")
    yield directory
    subprocess.run(["chattr", "-i", str(directory)], check=True)


@pytest.fixture
def full_disk(tmp_path):
    """A small file system (tmpfs), filled up: every write there fails with ENOSPC."""
    mount = tmp_path / "full"
    mount.mkdir()
    if os.getuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs",
                                           str(mount)], capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def fill(mount: Path) -> None:
    free = os.statvfs(mount).f_bavail * os.statvfs(mount).f_frsize
    with open(mount / "filler", "wb") as filler:
        os.posix_fallocate(filler.fileno(), 0, free)


# Every command that reads a trace: its arguments for the trace at ``path``, writing under ``tmp``.
COMMANDS_ON_A_TRACE = {
    "info": lambda path, tmp: ["info", path],
    "cat": lambda path, tmp: ["cat", path],
    "load": lambda path, tmp: ["load", path, "-o", tmp / "x.duckdb"],
    "replay": lambda path, tmp: ["replay", path, "-o", tmp / "runs"],
    "replay --backend model": lambda path, tmp: ["replay", path, "--backend", "model",
                                                 "-o", tmp / "runs"],
    "why": lambda path, tmp: ["why", path, "--request", "0"],
    "sweep": lambda path, tmp: ["sweep", path, "--num-gpu-blocks", "300", "-j", "1",
                                "-o", tmp / "sweep"],
    "engine": lambda path, tmp: ["engine", path, "--autostart", "--speed", "0"],
}
