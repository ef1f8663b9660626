"""Attacks on capture by another local user (issue "Hardening"), each refused with nothing
written, chowned or run: kvtrace capture runs as root against production engines.

The attacker is a second uid (``setpriv --reuid``) working in a shared, sticky, world-writable
directory standing in for ``/tmp`` (KVTRACE_RUNTIME_DIR points there). S1-S4 run the real
``kvtrace capture`` CLI as root against real processes; E1 a real ``kvtrace engine`` with the
plugin. The trace and bootstrap-report attacks run the engine side in this process."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import pytest
from debugger_support import can_call, needs_gdb
from test_capture_live import (  # noqa: F401 (workload is a fixture)
    run_cli, sleeper, start_engine, workload)
from vllm_support import vllm_backend_class  # noqa: F401 (a fixture)

from kvtrace.capture import attach, control, hook
from kvtrace.capture.messages import CaptureOptions, ErrorReply, decode_reply
from kvtrace.capture.safe_paths import NewTraceFile
from kvtrace.errors import KvtraceError, UnsafePathError
from kvtrace.traceio import TraceReader

ATTACKER_UID = 4242
ATTACKER = ["setpriv", f"--reuid={ATTACKER_UID}", f"--regid={ATTACKER_UID}", "--clear-groups"]
pytestmark = pytest.mark.skipif(
    os.getuid() != 0 or shutil.which("setpriv") is None,
    reason="the attacks need root (the operator) and setpriv (to act as a second uid)")
# A Python without kvtrace that the second uid can run (the venv's lies under /root).
PLAIN_PYTHON = shutil.which("python3", path="/usr/bin:/bin")
needs_plain_python = pytest.mark.skipif(PLAIN_PYTHON is None, reason="no /usr/bin/python3")


@pytest.fixture
def shared(monkeypatch) -> Path:
    """A directory like /tmp (root's, mode 1777), made KVTRACE_RUNTIME_DIR for the CLI, the
    engines and this process."""
    path = Path(tempfile.mkdtemp(prefix="kvtrace-shared-", dir="/tmp"))
    os.chmod(path, 0o1777)
    monkeypatch.setenv("KVTRACE_RUNTIME_DIR", str(path))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def as_attacker(*command: str) -> None:
    subprocess.run([*ATTACKER, *command], check=True, cwd="/")


def root_file(path: Path, text: str) -> Path:
    """A file only root may read or write: what the attacks aim at."""
    path.write_text(text)
    os.chmod(path, 0o600)
    return path


def snapshot(directory: Path) -> dict[str, tuple]:
    """Every entry below ``directory`` (links not followed): kind, owner, mode, size, mtime."""
    found = {}
    for entry in sorted(directory.rglob("*")):
        info = entry.lstat()
        found[str(entry.relative_to(directory))] = (
            stat.S_IFMT(info.st_mode), info.st_uid, stat.S_IMODE(info.st_mode), info.st_size,
            info.st_mtime_ns, os.readlink(entry) if entry.is_symlink() else None)
    return found


def assert_untouched(victim: Path, text: str) -> None:
    info = victim.lstat()
    assert (victim.read_text(), info.st_uid, stat.S_IMODE(info.st_mode)) == (text, 0, 0o600)


# --- S1: root follows the engine user's links in that user's runtime directory ---------------

@needs_plain_python
def test_s1_links_in_the_targets_runtime_dir_are_never_followed(shared):
    """The engine's user plants links where root writes the bootstrap and reads its report;
    root replaces the links (in that user's own directory) and the files they aim at keep
    their content and owner. The capture goes on and reports what the target said. Through
    a debugger that can make calls on this host; where none can, kvtrace refuses before it
    writes anything, and the links stay as they were."""
    secret, report_secret = "root's secret\n", '{"kind": "X", "error": "root json"}\n'
    victim = root_file(shared / "victim", secret)
    report_victim = root_file(shared / "victim.json", report_secret)
    target = sleeper("VLLM::EngineCore", user=ATTACKER, python=PLAIN_PYTHON)
    private = shared / f"kvtrace-{ATTACKER_UID}"
    usable = [name for name in ("ptrace", "gdb", "lldb")
              if (name == "ptrace" or shutil.which(name)) and can_call(name)]
    try:
        as_attacker("mkdir", "-m", "0700", str(private))
        as_attacker("ln", "-s", str(victim), str(private / f"inject-{target.pid}.py"))
        as_attacker("ln", "-s", str(report_victim), str(private / f"inject-{target.pid}.err"))
        code, err = run_cli("capture", "--pid", str(target.pid), "--method",
                            usable[0] if usable else "auto", "-o", str(shared / "x.kvtrace"))
        alive = target.poll() is None
    finally:
        target.kill()
    assert_untouched(victim, secret)
    assert_untouched(report_victim, report_secret)
    script = (private / f"inject-{target.pid}.py").lstat()
    if usable:
        assert stat.S_ISREG(script.st_mode) and script.st_uid == ATTACKER_UID
        assert code == 1 and "kvtrace is not importable in pid" in err and alive
    else:
        assert stat.S_ISLNK(script.st_mode)
        assert code == 1 and "no debugger can safely inject here" in err and alive


@needs_gdb
@needs_plain_python
def test_s1_a_linked_runtime_dir_is_refused_and_not_chowned(shared):
    rootdir = shared / "root-only"
    rootdir.mkdir(mode=0o700)
    target = sleeper("VLLM::EngineCore", user=ATTACKER, python=PLAIN_PYTHON)
    private = shared / f"kvtrace-{ATTACKER_UID}"
    try:
        as_attacker("ln", "-s", str(rootdir), str(private))
        code, err = run_cli("-v", "capture", "--pid", str(target.pid), "--method", "gdb", "-o",
                            str(shared / "x.kvtrace"))
    finally:
        target.kill()
    assert code == 1
    assert f"kvtrace: error: {private} is not a directory but a symbolic link" in err
    assert "gdb -p" not in err, "nothing may be injected"
    info = rootdir.lstat()
    assert (info.st_uid, stat.S_IMODE(info.st_mode), os.listdir(rootdir)) == (0, 0o700, [])


# --- S2, S4: another user made root's runtime directory first -------------------------------

def squat_root_runtime_dir(shared: Path, target_pid: int) -> tuple[Path, Path]:
    """The attacker's /tmp/kvtrace-0 (mode 0777) with a bootstrap of its own already there;
    (the directory, the file its code would create if root's engine ran it)."""
    squatted, marker = shared / "kvtrace-0", shared / "attacker-ran-as-root"
    as_attacker("mkdir", "-m", "0777", str(squatted))
    code = f"open({str(marker)!r}, 'w').close()\n"
    as_attacker("sh", "-c", f'printf "%s" "$0" > {squatted}/inject-{target_pid}.py', code)
    as_attacker("chmod", "0666", str(squatted / f"inject-{target_pid}.py"))
    return squatted, marker


@needs_gdb
@needs_plain_python
@pytest.mark.parametrize("method", ["gdb", "auto"])
def test_s2_a_runtime_dir_made_by_another_user_is_refused(shared, method):
    target = sleeper("VLLM::EngineCore", python=PLAIN_PYTHON)  # root's engine
    try:
        squatted, marker = squat_root_runtime_dir(shared, target.pid)
        before = snapshot(shared)
        code, err = run_cli("-v", "capture", "--pid", str(target.pid), "--method", method, "-o",
                            str(shared / "x.kvtrace"))
        time.sleep(0.5)  # what a pending call would run, it would have run by now
    finally:
        target.kill()
    assert code == 1 and f"kvtrace: error: {squatted} is open to other users (mode 0777)" in err
    assert "gdb -p" not in err and not marker.exists()
    assert snapshot(shared) == before, "nothing written, chowned or removed"


def test_s4_the_plugin_refuses_a_squatted_dir_and_capture_does_not_fall_back(shared):
    """The engine's plugin finds the attacker's directory: it says so and stays off; `auto`
    then refuses the same directory instead of falling back to gdb (which was S2)."""
    squatted = shared / "kvtrace-0"
    as_attacker("mkdir", "-m", "0777", str(squatted))
    engine = subprocess.Popen(
        [sys.executable, "-c", "import setproctitle, sys, time\n"
         "setproctitle.setproctitle('VLLM::EngineCore')\n"
         "from kvtrace.capture.plugin import register\n"
         "register()\nprint('ready', flush=True)\ntime.sleep(600)\n"],
        env={**os.environ, "KVTRACE_PLUGIN": "force"}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, cwd="/")
    try:
        assert engine.stdout.readline().strip() == "ready"
        before = snapshot(shared)
        code, err = run_cli("-v", "capture", "--pid", str(engine.pid), "-o",
                            str(shared / "x.kvtrace"))
    finally:
        engine.kill()
    plugin_said = engine.stderr.read()
    assert (f"kvtrace: plugin disabled in pid {engine.pid}: {squatted} is open to other users"
            in plugin_said)
    assert code == 1 and f"kvtrace: error: {squatted} is open to other users" in err
    assert "gdb -p" not in err and snapshot(shared) == before


# --- S3: a socket that is not the engine's ---------------------------------------------------

FAKE_ENGINE = r"""
import os, socket, sys
path, log, claimed_pid = sys.argv[1], sys.argv[2], int(sys.argv[3])
server = socket.socket(socket.AF_UNIX)
server.bind(path)
os.chmod(path, 0o777)
server.listen(1)
server.settimeout(60)
print("ready", flush=True)
connection, _ = server.accept()
connection.settimeout(5)
data = b""
try:
    while not data.endswith(b"\n"):
        chunk = connection.recv(4096)
        if not chunk:
            break
        data += chunk
except socket.timeout:
    pass
with open(log, "w") as out:
    out.write(f"received {len(data)} bytes: {data!r}")
connection.sendall(b'{"reply":"status","pid":%d,"armed":false,"path":"/x","written":999999,'
                   b'"dropped":0,"bytes":1}\n' % claimed_pid)
"""


def fake_engine(socket_path: Path, log: Path, claimed_pid: int) -> subprocess.Popen:
    """The attacker's server on ``socket_path``: it logs what it is sent and claims a capture
    of 999,999 records."""
    server = subprocess.Popen([*ATTACKER, PLAIN_PYTHON or sys.executable, "-I", "-c",
                               FAKE_ENGINE, str(socket_path), str(log), str(claimed_pid)],
                              stdout=subprocess.PIPE, text=True, cwd="/")
    assert server.stdout.readline().strip() == "ready"
    return server


def test_s3_a_socket_in_a_squatted_dir_is_never_connected_to(shared):
    target = sleeper("VLLM::EngineCore")  # root's engine
    squatted, log = shared / "kvtrace-0", shared / "fake-engine.log"
    as_attacker("mkdir", "-m", "0777", str(squatted))
    server = fake_engine(squatted / f"engine-{target.pid}.sock", log, target.pid)
    try:
        code, err = run_cli("capture", "--pid", str(target.pid), "--method", "plugin", "-o",
                            str(shared / "x.kvtrace"), "--duration", "1s")
        time.sleep(0.5)
    finally:
        target.kill()
        server.kill()
    assert code == 1 and f"kvtrace: error: {squatted} is open to other users" in err
    assert "999,999" not in err and not log.exists(), "the fake engine heard nothing"


def test_s3_a_socket_served_by_another_process_is_refused_unsent(shared):
    """In the engine user's own directory, the socket is served by another of that user's
    processes: the client checks who listens (SO_PEERCRED) before it sends a byte."""
    target = sleeper("VLLM::EngineCore", user=ATTACKER)
    private, log = shared / f"kvtrace-{ATTACKER_UID}", shared / "fake-engine.log"
    as_attacker("mkdir", "-m", "0700", str(private))
    as_attacker("touch", str(log))
    server = fake_engine(private / f"engine-{target.pid}.sock", log, target.pid)
    try:
        code, err = run_cli("capture", "--pid", str(target.pid), "--method", "plugin", "-o",
                            str(shared / "x.kvtrace"), "--duration", "1s")
        server.wait(timeout=30)
    finally:
        target.kill()
        server.kill()
    assert code == 1 and (f"kvtrace: error: {private}/engine-{target.pid}.sock is served by "
                          f"pid {server.pid}") in err
    assert f"not by the engine pid {target.pid} (uid {ATTACKER_UID}); kvtrace sent it" in err
    assert log.read_text() == "received 0 bytes: b''" and "999,999" not in err


def test_a_link_in_place_of_the_socket_is_refused(shared, tmp_path):
    """The engine's user points the socket's name at another socket (a root daemon's)."""
    target = sleeper("VLLM::EngineCore", user=ATTACKER)
    daemon = socket.socket(socket.AF_UNIX)
    daemon.bind(str(tmp_path / "daemon.sock"))
    daemon.listen(1)
    daemon.settimeout(0.5)
    private = shared / f"kvtrace-{ATTACKER_UID}"
    try:
        as_attacker("mkdir", "-m", "0700", str(private))
        as_attacker("ln", "-s", str(tmp_path / "daemon.sock"),
                    str(private / f"engine-{target.pid}.sock"))
        code, err = run_cli("capture", "--pid", str(target.pid), "--method", "plugin", "-o",
                            str(shared / "x.kvtrace"))
        with pytest.raises(socket.timeout):
            daemon.accept()
    finally:
        target.kill()
        daemon.close()
    assert code == 1 and f"engine-{target.pid}.sock is not a socket" in err


# --- E1: a malformed arm, on a real engine ---------------------------------------------------

@pytest.mark.slow
def test_e1_an_ill_typed_arm_leaves_the_engine_able_to_arm(workload, tmp_path):
    engine = start_engine(workload)
    trace = tmp_path / "after.kvtrace"
    try:
        with socket.socket(socket.AF_UNIX) as client:
            client.settimeout(30)
            client.connect(str(control.socket_path(engine.pid)))
            client.sendall(msgspec.json.encode({"cmd": "arm", "options": {
                "path": str(tmp_path / "bad.kvtrace"), "gpu_interval_ms": "abc"}}) + b"\n")
            reply = decode_reply(control._read_line(client))
        code, err = run_cli("capture", "--pid", str(engine.pid), "--method", "plugin", "-o",
                            str(trace), "--duration", "2s")
        alive = engine.process.poll() is None
    finally:
        engine.stop()
    assert type(reply) is ErrorReply and reply.kind == "ControlMessageError"
    assert "`$.options.gpu_interval_ms`" in reply.message
    assert code == 0, err
    assert alive and trace.exists() and not (tmp_path / "bad.kvtrace").exists()


# --- the trace at -o, written by the engine --------------------------------------------------

def test_a_link_planted_at_the_trace_path_is_not_followed(shared, vllm_backend_class):
    """The attacker's link at the -o path is replaced by the trace, not written through."""
    secret = "root's secret\n"
    victim = root_file(shared / "victim", secret)
    trace = shared / "trace.kvtrace"
    as_attacker("ln", "-s", str(victim), str(trace))
    hook.arm(CaptureOptions(path=str(trace), gpu_interval_ms=0))
    final = hook.disarm()
    assert_untouched(victim, secret)
    info = trace.lstat()
    assert stat.S_ISREG(info.st_mode) and (info.st_uid, stat.S_IMODE(info.st_mode)) == (0, 0o600)
    assert TraceReader(str(trace)).header.source == "capture" and final.error is None


@pytest.mark.parametrize("owner, mode, problem", [
    (0, 0o777, "can be written by other users (mode 0777, not sticky)"),
    (ATTACKER_UID, 0o755, f"is owned by uid {ATTACKER_UID}, not by root or uid 0")])
def test_a_trace_dir_others_can_write_is_refused(shared, owner, mode, problem):
    directory = shared / "traces"
    directory.mkdir()
    os.chown(directory, owner, owner)
    os.chmod(directory, mode)
    with pytest.raises(UnsafePathError, match=re.escape(f"{directory} {problem}")):
        NewTraceFile(str(directory / "t.kvtrace"))
    assert os.listdir(directory) == []


def test_a_trace_takes_its_name_only_when_published(shared):
    """A draft nobody can guess or pre-empt; the old file at the path stays as it was until
    the trace is published (a failed start discards the draft), then is replaced."""
    old = shared / "t.kvtrace"
    old.write_text("last week's trace")
    draft = NewTraceFile(str(old))
    (draft_name,) = [name for name in os.listdir(shared) if name.endswith(".partial")]
    info = (shared / draft_name).lstat()
    assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (0, 0o600)
    draft.discard()
    draft.close()
    assert os.listdir(shared) == ["t.kvtrace"] and old.read_text() == "last week's trace"
    trace = NewTraceFile(str(old))
    trace.publish()
    trace.close()
    assert os.listdir(shared) == ["t.kvtrace"] and old.read_text() == ""
    with pytest.raises(KvtraceError, match="is not absolute"):
        NewTraceFile("t.kvtrace")


@pytest.mark.parametrize("plant", ["directory", "socket", "fifo"])
def test_a_trace_never_replaces_what_is_not_a_file(shared, plant):
    """A directory, a socket (an engine's control socket, say) or a FIFO at the trace's path is
    refused before a draft exists, and stays as it was."""
    target = shared / "d.kvtrace"
    if plant == "directory":
        target.mkdir()
    elif plant == "fifo":
        os.mkfifo(target)
    else:
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(str(target))
        listener.close()
    before = target.lstat()
    with pytest.raises(UnsafePathError, match="d.kvtrace exists and is not a regular file"):
        NewTraceFile(str(target))
    assert os.listdir(shared) == ["d.kvtrace"]
    assert (target.lstat().st_ino, target.lstat().st_mode) == (before.st_ino, before.st_mode)


def test_a_trace_is_never_written_into_the_runtime_directory(tmp_path, monkeypatch):
    """`capture -o <runtime dir>/engine-PID.sock` would have replaced the engine's control
    socket: a path in the runtime directory is refused, even through a link to it."""
    monkeypatch.setenv("KVTRACE_RUNTIME_DIR", str(tmp_path))
    private = control.runtime_dir()
    private.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(private)
    for path in (private / f"engine-{os.getpid()}.sock", private / "x.kvtrace",
                 tmp_path / "link" / "x.kvtrace"):
        with pytest.raises(UnsafePathError, match="runtime directory"):
            NewTraceFile(str(path))
    assert list(private.iterdir()) == []
    own = NewTraceFile(str(private / "capture-default.kvtrace"), in_runtime_dir=True)
    own.discard()
    own.close()


# --- the bootstrap's report, read by root ----------------------------------------------------

@pytest.mark.parametrize("plant", [["ln", "-s", "{victim}", "{report}"], ["mkfifo", "{report}"]])
def test_the_bootstrap_report_is_read_without_links_or_blocking(shared, plant):
    """Between root writing the bootstrap and reading its report, the engine's user puts a
    link to a root-only JSON file (or a FIFO, which would block a plain read) in its place."""
    victim = root_file(shared / "victim.json", json.dumps({"kind": "X", "error": "secret"}))
    target = sleeper("VLLM::EngineCore", user=ATTACKER)
    try:
        bootstrap = attach.Bootstrap(attach.describe(target.pid))
        bootstrap.write()
        as_attacker(*(part.format(victim=victim, report=bootstrap.report) for part in plant))
        started = time.monotonic()
        with pytest.raises(UnsafePathError, match=str(bootstrap.report)) as refused:
            bootstrap.failure()
        bootstrap.close()
    finally:
        target.kill()
    assert time.monotonic() - started < 1 and "secret" not in str(refused.value)


# --- root's other commands: outputs and databases another user controls (round three) -------

@pytest.mark.parametrize("plant", [["ln", "-s", "{victim}", "{path}"], ["mkfifo", "{path}"],
                                   ["ln", "-s", "/proc/self/fd/1", "{path}"]])
def test_an_output_path_another_user_planted_is_left_alone(shared, plant):
    """In a sticky shared directory the attacker puts a link (to a root-only file, or where
    /dev/stdout points) or a FIFO where root's output goes: root's command refuses it before
    any work, writes nothing through it and does not replace it."""
    secret = "root's secret\n"
    victim = root_file(shared / "victim", secret)
    path = shared / "w.kvtrace"
    as_attacker(*(part.format(victim=victim, path=path) for part in plant))
    before = snapshot(shared)
    code, err = run_cli("synth", "--preset", "chat", "--requests", "3", "-o", str(path))
    assert code == 1 and "kvtrace replaces only regular files" in err, err
    assert snapshot(shared) == before
    assert_untouched(victim, secret)


def test_a_database_another_user_made_reads_no_root_file(shared, workload, tmp_path):
    """A database is input: the attacker hands root one whose view reads a root-only file.
    Root's sql, report, why and export refuse it, and print nothing of the file."""
    from bad_traces import crafted_databases
    from click.testing import CliRunner

    from kvtrace.cli import cli

    secret = "root's secret\n"
    victim = root_file(tmp_path / "victim", secret)
    sound = tmp_path / "sound.duckdb"
    assert run_cli("load", str(workload), "-o", str(sound))[0] == 0
    crafted = crafted_databases(shared, sound, victim)["a view that reads a file"]
    os.chown(crafted, ATTACKER_UID, ATTACKER_UID)
    for args in (["sql", crafted, "SELECT * FROM lookups"], ["report", crafted],
                 ["why", crafted, "-r", "0"], ["export", crafted, "--parquet", tmp_path / "pq"]):
        result = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
        assert result.exit_code == 1 and "disabled by configuration" in result.stderr, args
        assert secret.strip() not in result.output
    assert_untouched(victim, secret)
    assert not (tmp_path / "pq").exists()
