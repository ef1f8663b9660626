"""The canary before every debugger injection (issue 21): a debugger that would kill the engine
kills a throw-away canary instead and kvtrace stops with the engine untouched, on any host
(stand-in debuggers put first on PATH); the verdict is reused only for the same host, debugger
and interpreter, and its cache is read without following links; the real gdb's and lldb's
verdicts on this host agree with issue 21's own check."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest
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
from test_capture_live import run_cli, sleeper

import kvtrace
from kvtrace.capture import attach, canary, control
from kvtrace.capture.debuggers import Gdb, Lldb, Ptrace
from kvtrace.errors import UnsafePathError

OTHER = {"gdb": "lldb", "lldb": "gdb"}


def error_and_hint(stderr: str) -> tuple[str, str]:
    """The CLI's one error line and one hint line, without their prefixes."""
    lines = stderr.splitlines()
    (error,) = [line for line in lines if line.startswith("kvtrace: error: ")]
    (hint,) = [line for line in lines if line.startswith("kvtrace: hint: ")]
    return error.removeprefix("kvtrace: error: "), hint.removeprefix("kvtrace: hint: ")


@pytest.fixture
def engine_like():
    """A Python titled like an engine core, its main thread asleep (kvtrace is not importable
    in it: nothing may get that far here)."""
    process = sleeper("VLLM::EngineCore", python=SYSTEM_PYTHON)
    yield process
    process.kill()
    process.wait()


@pytest.fixture
def runtime_dir(tmp_path, monkeypatch):
    """A runtime directory of this test's own, so that no verdict is shared with another."""
    monkeypatch.setenv("KVTRACE_RUNTIME_DIR", str(tmp_path / "run"))
    (tmp_path / "run").mkdir()
    return control.runtime_dir()


@pytest.mark.parametrize("name", ["gdb", "lldb"])
def test_a_debugger_that_kills_its_target_is_stopped_by_its_canary(engine_like, tmp_path, name):
    log = stand_in(tmp_path / "bin", name, "kills")
    code, err = run_cli("capture", "--pid", str(engine_like.pid), "--method", name, "-o",
                        str(tmp_path / "x.kvtrace"), env=path_with(tmp_path / "bin"))
    attacked = pids_in(log)
    error, hint = error_and_hint(err)
    assert code == 1
    assert error.startswith(f"{name} 0.1 failed its canary: it died (killed by SIGKILL); "
                            f"{name} said: ") and "Bad address" in error
    assert error.endswith(f"; kvtrace did not touch pid {engine_like.pid}")
    assert hint.startswith(f"Use --method {OTHER[name]}") and "the plugin" in hint
    assert hint.endswith(f"or a newer {name}.")
    assert attacked and engine_like.pid not in attacked, "only the canary was attacked"
    assert engine_like.poll() is None, "the engine lives on"


def test_auto_tries_each_injector_and_touches_nothing_when_none_passes(engine_like, tmp_path,
                                                                        runtime_dir,
                                                                        monkeypatch):
    """kvtrace's injector first, then gdb, then lldb: each kills its canary (stand-ins; the
    injector's command is pointed at one), so none touches the engine."""
    logs = [stand_in(tmp_path / "bin", name, "kills") for name in ("ptrace", "gdb", "lldb")]
    monkeypatch.setenv("PATH", path_with(tmp_path / "bin")["PATH"])
    monkeypatch.setattr(Ptrace, "_pending_call_command",
                        lambda self, pid, code: [str(tmp_path / "bin" / "ptrace"), "-p", str(pid)])
    with pytest.raises(attach.AttachError) as error:
        attach.ensure_hook(attach.describe(engine_like.pid), "auto", lambda message: None)
    assert str(error.value).startswith(
        f"no debugger can safely inject here (kvtrace's injector {kvtrace.__version__} failed "
        "its canary: it died (killed by SIGKILL); gdb 0.1 failed its canary: it died (killed "
        "by SIGKILL)")
    assert "; lldb 0.1 failed its canary: it died (killed by SIGKILL)" in str(error.value)
    assert str(error.value).endswith(f"kvtrace did not touch pid {engine_like.pid}")
    assert error.value.hint.startswith("Install kvtrace into vLLM's environment and restart")
    for log in logs:
        assert pids_in(log) and engine_like.pid not in pids_in(log)
    assert engine_like.poll() is None


def test_a_debugger_whose_calls_do_nothing_fails_its_canary(engine_like, tmp_path, runtime_dir,
                                                             monkeypatch):
    stand_in(tmp_path / "bin", "gdb", "does-nothing")
    monkeypatch.setenv("PATH", path_with(tmp_path / "bin")["PATH"])
    verdict = canary.prove(Gdb.find(), attach.describe(engine_like.pid), lambda message: None)
    assert verdict == canary.Verdict(False, "it did not run the injected code")


def test_a_verdict_is_reused_only_for_the_same_host_and_debugger(engine_like, tmp_path,
                                                                  runtime_dir, monkeypatch):
    log = stand_in(tmp_path / "bin", "gdb", "kills")
    monkeypatch.setenv("PATH", path_with(tmp_path / "bin")["PATH"])
    target = attach.describe(engine_like.pid)

    def prove() -> canary.Verdict:
        return canary.prove(Gdb.find(), target, lambda message: None)

    first = prove()
    assert not first.passed and first.age_s is None and len(pids_in(log)) == 1
    again = prove()
    assert (again.passed, again.detail) == (first.passed, first.detail)
    assert again.age_s is not None and len(pids_in(log)) == 1, "no second canary"
    (entry,) = runtime_dir.glob("canary-gdb-*.json")
    assert json.loads(entry.read_text())["key"]["kernel"] == os.uname().release
    real_hostname = socket.gethostname()
    monkeypatch.setattr(socket, "gethostname", lambda: real_hostname + "-elsewhere")
    assert prove().age_s is None and len(pids_in(log)) == 2, "never across hosts"
    monkeypatch.setattr(socket, "gethostname", lambda: real_hostname)
    later = time.time() + canary.CACHE_S + 1
    monkeypatch.setattr(canary.time, "time", lambda: later)
    assert prove().age_s is None and len(pids_in(log)) == 3, "a verdict expires"
    monkeypatch.undo()
    monkeypatch.setenv("KVTRACE_RUNTIME_DIR", str(runtime_dir.parent))
    monkeypatch.setenv("PATH", path_with(tmp_path / "bin")["PATH"])
    os.utime(tmp_path / "bin" / "gdb", ns=(time.time_ns(), time.time_ns() + 10**9))
    assert prove().age_s is None and len(pids_in(log)) == 4, "another build of the debugger"


def test_the_verdict_cache_follows_no_link(engine_like, tmp_path, runtime_dir, monkeypatch):
    """A link in place of a cached verdict (pointing at a file claiming a pass) is refused."""
    stand_in(tmp_path / "bin", "gdb", "kills")
    monkeypatch.setenv("PATH", path_with(tmp_path / "bin")["PATH"])
    target = attach.describe(engine_like.pid)
    canary.prove(Gdb.find(), target, lambda message: None)
    (entry,) = runtime_dir.glob("canary-gdb-*.json")
    forged = json.loads(entry.read_text())
    forged["passed"] = True
    (tmp_path / "forged.json").write_text(json.dumps(forged))
    entry.unlink()
    entry.symlink_to(tmp_path / "forged.json")
    with pytest.raises(UnsafePathError, match=f"{entry} is a symbolic link"):
        canary.prove(Gdb.find(), target, lambda message: None)


def test_a_canary_needs_a_python(tmp_path):
    log = stand_in(tmp_path / "bin", "gdb", "kills")
    process = sleeper("VLLM::EngineCore")  # /usr/bin/sleep under that title
    try:
        code, err = run_cli("capture", "--pid", str(process.pid), "--method", "gdb", "-o",
                            str(tmp_path / "x.kvtrace"), env=path_with(tmp_path / "bin"))
        alive = process.poll() is None
    finally:
        process.kill()
    assert code == 1 and f"cannot start a canary of pid {process.pid}'s interpreter" in err
    assert "kvtrace attaches only to Python processes" in err
    assert pids_in(log) == [] and alive


def test_a_target_that_dies_during_injection_is_said_to_have_died(engine_like, tmp_path,
                                                                   runtime_dir, monkeypatch):
    """Past a canary (here: one said to pass), a target killed by the injection is reported as
    dead, not as 'busy in native code' (what kvtrace said before, for a dead target)."""
    stand_in(tmp_path / "bin", "gdb", "kills")
    monkeypatch.setenv("PATH", path_with(tmp_path / "bin")["PATH"])
    monkeypatch.setattr(canary, "prove", lambda *args: canary.Verdict(True, "said to pass"))
    target = attach.describe(engine_like.pid)
    with pytest.raises(attach.AttachError) as error:
        attach.ensure_hook(target, "gdb", lambda message: None)
    assert str(error.value) == (f"pid {target.pid} died while gdb 0.1 was injecting into it (gdb "
                                "said: Couldn't write extended state status: Bad address.)")
    assert "busy" not in error.value.hint


@pytest.mark.slow
@pytest.mark.parametrize("kind", [pytest.param(Ptrace, marks=needs_ptrace),
                                  pytest.param(Gdb, marks=needs_gdb),
                                  pytest.param(Lldb, marks=needs_lldb)])
def test_the_canary_agrees_with_the_issues_check_on_this_host(engine_like, runtime_dir, kind):
    """The real debugger: its canary passes exactly where issue 21's check finds it can make a
    call without killing the process (gdb 13 on an AMX host: both fail)."""
    messages = []
    verdict = canary.prove(kind.find(), attach.describe(engine_like.pid), messages.append)
    assert verdict.passed == can_call(kind.name), verdict
    assert verdict.age_s is None and any(m.startswith("canary: pid ") for m in messages)
    assert engine_like.poll() is None
    if verdict.passed and kind.wakes:
        assert verdict.detail == ("its main thread ran a pending call woken from a lock and one "
                                  "busy, and a direct call asleep, and it lived on")
    elif verdict.passed:
        assert verdict.detail == "it answered a direct call and a pending call and lived on"
