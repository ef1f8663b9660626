"""The Python processes kvtrace starts (issue 30, R4-1, R4-5, R4-8): none runs code from the
working directory, a release worker dies with its replay and leaves nothing behind, and a
worker's full disk is one error line."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from cli_runs import fill, full_disk  # noqa: F401

import kvtrace
from kvtrace import vllm_releases
from kvtrace.cli import cli
from kvtrace.engine.process import EngineProcess
from kvtrace.files import WRITE_HINT

KVTRACE = str(Path(sys.executable).parent / "kvtrace")  # the console script, as root runs it
RELEASE = "0.30.0"
needs_release = pytest.mark.skipif(
    not vllm_releases.is_installed(RELEASE),
    reason=f"vLLM {RELEASE} is not installed beside the project's vLLM (scripts/bootstrap "
           f"installs it; or kvtrace vllm install {RELEASE})")
# A planted package: it says it ran, then passes for the real one so that the command works.
PLANTED = """import os
with open({marker!r}, "a") as file:
    file.write(f"{{os.getpid()}}\\n")
__path__[:] = [{real!r}]
exec(compile(open({init!r}).read(), {init!r}, "exec"))
"""


def synth(path: Path, requests: int) -> Path:
    result = CliRunner().invoke(cli, ["synth", "--preset", "documents", "--model",
                                      "nemotron-h-8b", "--requests", str(requests), "-o",
                                      str(path)])
    assert result.exit_code == 0, result.output
    return path


@pytest.fixture(scope="module")
def workload(tmp_path_factory) -> Path:
    return synth(tmp_path_factory.mktemp("children") / "documents.kvtrace", 30)


@pytest.fixture
def planted(tmp_path) -> tuple[Path, Path]:
    """A working directory another user could own, holding their ``kvtrace`` and ``pip``
    packages; and the marker file either writes when it is imported."""
    cwd, marker = tmp_path / "cwd", tmp_path / "marker"
    package = Path(kvtrace.__file__).parent
    (cwd / "kvtrace").mkdir(parents=True)
    (cwd / "kvtrace" / "__init__.py").write_text(PLANTED.format(
        marker=str(marker), real=str(package), init=str(package / "__init__.py")))
    (cwd / "pip").mkdir()
    (cwd / "pip" / "__init__.py").write_text(f"open({str(marker)!r}, 'a').write('pip\\n')\n")
    return cwd, marker


def run_in(cwd: Path, *args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([KVTRACE, *args], cwd=cwd, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=300, **kwargs)


# --- no child Python takes code from the working directory ----------------------------------------


@needs_release
def test_a_release_worker_does_not_run_code_planted_in_the_working_directory(planted, workload):
    cwd, marker = planted
    result = run_in(cwd, "replay", str(workload), "--variant", f"vllm-{RELEASE}", "-o", "out")
    assert not marker.exists(), f"planted code ran in pids {marker.read_text().split()}"
    assert result.returncode == 0, result.stderr
    assert (cwd / "out" / f"documents.vllm-{RELEASE}.kvtrace").is_file()


@pytest.mark.parametrize("release", [None, pytest.param(RELEASE, marks=needs_release)])
def test_kvtrace_engine_does_not_run_code_planted_in_the_working_directory(planted, workload,
                                                                           release):
    """Nor do the Pythons vLLM starts from the engine (its model registry's)."""
    cwd, marker = planted
    on_release = ["--vllm", release] if release else []
    result = run_in(cwd, "engine", str(workload), *on_release, "--autostart", "--speed", "0",
                    "--summary-json", "summary.json")
    assert not marker.exists(), f"planted code ran in pids {marker.read_text().split()}"
    assert result.returncode == 0, result.stderr
    assert (cwd / "summary.json").is_file()


@pytest.mark.parametrize("parent", [False, True])
def test_an_engine_process_does_not_run_code_planted_in_the_working_directory(
        planted, workload, parent):
    cwd, marker = planted
    engine = EngineProcess([str(workload)], parent=parent, cwd=str(cwd))
    try:
        engine.wait_ready()
    finally:
        engine.stop(grace_s=10)
    assert not marker.exists(), f"planted code ran in pids {marker.read_text().split()}"


def test_pip_does_not_run_code_planted_in_the_working_directory(planted, tmp_path,
                                                                 monkeypatch):
    """``kvtrace vllm install`` runs pip with the command ``install`` builds: its interpreter
    part, run from the planted directory, must reach the real pip."""
    cwd, marker = planted
    monkeypatch.setenv(vllm_releases.RELEASES_ENV, str(tmp_path / "releases"))
    calls = []

    def pip(command, **kwargs):
        calls.append((command, kwargs.get("env")))
        return subprocess.CompletedProcess(command, 1)

    monkeypatch.setattr(vllm_releases.subprocess, "run", pip)
    with pytest.raises(vllm_releases.ReleaseError):
        vllm_releases.install(RELEASE, lambda line: None)
    monkeypatch.undo()  # subprocess.run itself again
    command, env = calls[0]
    result = subprocess.run([*command[:command.index("install")], "--version"], cwd=cwd,
                            env=env, capture_output=True, text=True, timeout=120)
    assert not marker.exists(), "planted pip ran"
    assert result.returncode == 0 and result.stdout.startswith("pip "), result.stderr


# --- a release worker dies with its replay --------------------------------------------------------


def children_running(pid: int, name: str) -> list[int]:
    """Live processes whose parent is ``pid`` and whose command line holds ``name``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == pid and state != "Z" and name.encode() in command:
            found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_for(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout_s} s: {what}")


@needs_release
def test_a_killed_replay_takes_its_release_worker_and_its_scratch_with_it(tmp_path):
    # Long enough that the kill always lands while the worker replays (150 requests could be
    # done in half a second); test_release_worker.py holds the worker's rules, race included.
    source = synth(tmp_path / "big.kvtrace", 3000)
    scratch, out = tmp_path / "tmp", tmp_path / "out"
    scratch.mkdir()
    replay = subprocess.Popen(
        [KVTRACE, "replay", str(source), "--variant", f"vllm-{RELEASE}", "-o", str(out)],
        cwd=tmp_path, env={**os.environ, "TMPDIR": str(scratch)}, stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        worker = wait_for(lambda: children_running(replay.pid, "kvtrace.replay.release_worker"),
                          60, "the release worker started")[0]
        wait_for(lambda: any(path.is_file() for path in out.rglob("*")), 60,
                 "the worker writes its trace")
        assert alive(worker)
        replay.kill()
        replay.wait()
        wait_for(lambda: not alive(worker), 5, f"the worker (pid {worker}) is gone")
    finally:
        replay.kill()
        replay.wait()
    assert list(out.iterdir()) == []  # no .partial
    assert list(scratch.glob("kvtrace-release-worker-*")) == []


# --- a worker's full disk is one error ------------------------------------------------------------


@needs_release
def test_a_release_worker_out_of_space_is_one_error_line(full_disk, workload, tmp_path):
    out = full_disk / "out"
    fill(full_disk)
    result = run_in(tmp_path, "replay", str(workload), "--variant", f"vllm-{RELEASE}", "-o",
                    str(out))
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        f"kvtrace: error: cannot write the vllm-{RELEASE} trace in {out}: "
        "No space left on device",
        f"kvtrace: hint: {WRITE_HINT}"], result.stderr
    assert list(out.iterdir()) == []
