"""The control channel's typed messages: what decodes, what is refused (and how clearly), how an
engine's error reaches the operator, and that a refused request leaves the engine able to arm.

The engine side here is the real control server and hook in this process, on the real vLLM 0.33
classes; the operator side is ``control.request`` over the real Unix socket."""

from __future__ import annotations

import gc
import os
import re
import socket
import subprocess
import sys
import threading
import time

import msgspec
import pytest

from kvtrace.capture import control, hook
from kvtrace.capture.messages import (
    ENGINE_ERRORS,
    REPLY_TYPES,
    AlreadyCapturingError,
    ArmRequest,
    CaptureOptions,
    CaptureStatus,
    ControlMessageError,
    DisarmRequest,
    ErrorReply,
    PingRequest,
    Pong,
    StatusRequest,
    decode_reply,
    decode_request,
    encode,
    error_reply,
    options_from,
    raise_error,
)
from kvtrace.capture.safe_paths import open_private_dir
from kvtrace.errors import KvtraceError, TraceFormatError, error_class


def patched_functions():
    from kvtrace.probes import probe_targets

    return {(owner, name): owner.__dict__[name] for owner, name, _ in probe_targets()}


@pytest.fixture
def engine(tmp_path, monkeypatch):
    """A control server in this process, as the plugin starts one in an engine core."""
    monkeypatch.setenv("KVTRACE_RUNTIME_DIR", str(tmp_path))
    server = control.ControlServer(control.socket_path(os.getpid()))
    server.start()
    yield server
    hook.disarm()
    server.stop()


def send_raw(server: control.ControlServer, line: bytes):
    """One request as bytes on the socket, as a client of another version (or a fuzzer) might
    send it; the decoded reply."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.settimeout(10)
        client.connect(str(server.path))
        client.sendall(line)
        return decode_reply(control._read_line(client))


def arm_line(**options) -> bytes:
    return msgspec.json.encode({"cmd": "arm", "options": options}) + b"\n"


@pytest.mark.parametrize("request_", [
    PingRequest(), StatusRequest(), DisarmRequest(),
    ArmRequest(CaptureOptions(path="/x/t.kvtrace", hash_bytes=False, buffer_capacity=2048,
                              gpu_interval_ms=0)),
    ArmRequest(CaptureOptions(path="/x/ring", hash_bytes=False, ring_s=1800, keyframe_s=180,
                              max_bytes=2 << 30))])
def test_every_request_round_trips(request_):
    line = encode(request_)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert decode_request(line) == request_


def test_the_wire_format_is_tagged_json():
    """Written down, because a kvtrace of another version parses it."""
    assert encode(ArmRequest(CaptureOptions(path="/t"))) == (
        b'{"cmd":"arm","options":{"path":"/t","hash_bytes":true,"buffer_capacity":262144,'
        b'"gpu_interval_ms":1000,"ring_s":0.0,"keyframe_s":0.0,"max_bytes":0},'
        b'"lease_s":15.0}\n')
    assert encode(ErrorReply("AttachError", "m", "h")) == (
        b'{"reply":"error","kind":"AttachError","message":"m","hint":"h"}\n')


@pytest.mark.parametrize("line, names", [
    (arm_line(path="/t", gpu_interval_ms="abc"),
     "Expected `int`, got `str` - at `$.options.gpu_interval_ms`"),
    (arm_line(path="/t", hash_bytes=1), "Expected `bool`, got `int` - at `$.options.hash_bytes`"),
    (arm_line(path="/t", buffer_capacity=0),
     "Expected `int` >= 1 - at `$.options.buffer_capacity`"),
    (arm_line(path="/t", bufer_capacity=4096),
     "Object contains unknown field `bufer_capacity` - at `$.options`"),
    (arm_line(hash_bytes=True), "Object missing required field `path` - at `$.options`"),
    (b'{"cmd":"status","verbose":true}\n', "Object contains unknown field `verbose`"),
    (b'{"cmd":"rearm"}\n', "Invalid value 'rearm' - at `$.cmd`"),
    (b'{"options":{}}\n', "Object missing required field `cmd`"),
    (b"arm /t\n", "JSON is malformed: invalid character (byte 0)"),
])
def test_a_malformed_request_is_refused_naming_what_is_wrong(line, names):
    with pytest.raises(ControlMessageError) as error:
        decode_request(line)
    assert str(error.value) == f"malformed control request: {names}"
    reply = control.answer(line)
    assert reply == ErrorReply("ControlMessageError", str(error.value), error.value.hint)


def test_a_malformed_arm_leaves_the_engine_able_to_arm_again(engine, tmp_path):
    """Issue "Hardening" E1 on the socket: an ill-typed or unknown option is refused before
    anything happens, and the next, well-formed arm captures."""
    before = patched_functions()
    trace = tmp_path / "cap.kvtrace"
    for line in (arm_line(path=str(trace), gpu_interval_ms="abc"),
                 arm_line(path=str(trace), gpu_interval=5)):
        reply = send_raw(engine, line)
        assert type(reply) is ErrorReply and reply.kind == "ControlMessageError"
        assert "gpu_interval" in reply.message
        assert patched_functions() == before and hook.active_session() is None
        assert not trace.exists()
    with control.Lease.take(os.getpid(), ArmRequest(CaptureOptions(
            path=str(trace), gpu_interval_ms=0))) as lease:
        status = lease.status
        assert type(status) is CaptureStatus and status.armed and status.path == str(trace)
        # Armed: the engine's next step takes the snapshot and patches the rest.
        assert [name for (owner, name), function in patched_functions().items()
                if function is not before[(owner, name)]] == ["new_step_starts"]
        final = control.request(os.getpid(), DisarmRequest())
    assert final.path == str(trace) and not final.armed
    assert patched_functions() == before and trace.exists()


def wait_until_disarmed(timeout_s: float = 10) -> CaptureStatus:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = control.request(os.getpid(), StatusRequest())
        if status.path is None:
            return status
        time.sleep(0.02)
    raise AssertionError(f"still capturing after {timeout_s} s: {status}")


def test_a_capture_ends_with_its_lease(engine, tmp_path):
    """The arm's connection is the controller's lease: closing it (as the controller's death
    does, however it dies) disarms the engine and restores every patched function."""
    before = patched_functions()
    lease = control.Lease.take(os.getpid(), ArmRequest(CaptureOptions(
        path=str(tmp_path / "cap.kvtrace"), gpu_interval_ms=0)))
    assert control.request(os.getpid(), StatusRequest()).armed
    assert control.request(os.getpid(), PingRequest()).patched == [
        "vllm.v1.core.kv_cache_manager.KVCacheManager.new_step_starts"]  # the next step's trigger
    lease.close()
    status = wait_until_disarmed()
    assert status.error.endswith("its controller closed the control connection"), status
    assert patched_functions() == before and hook.active_session() is None
    assert control.request(os.getpid(), PingRequest()).patched == []


def test_a_lease_dropped_without_close_ends_its_connection():
    """A lease collected without ``close`` (an exception on the way) closes the arm's
    connection, which disarms the engine: its end reads the end of the stream."""
    ours, engines = socket.socketpair()
    with engines:
        engines.settimeout(10)
        lease = control.Lease(ours, CaptureStatus(pid=os.getpid(), armed=True), lease_s=0.05)
        del lease
        gc.collect()
        while engines.recv(64):  # renewals sent before it went
            pass


def test_a_lease_collected_at_exit_takes_no_lock_its_frozen_renewer_holds():
    """At interpreter exit a daemon thread is frozen where it stands: the renewing thread, woken
    by ``close``, can hold its event's lock then. The lease's finaliser called ``close`` again,
    which waited for that lock forever (`kvtrace capture` hung after "stopped by SIGHUP").
    Here a thread takes the lock for good, as the frozen one held it, and the process must
    exit (it hung on the old finaliser)."""
    script = """
import os, socket, threading
from kvtrace.capture import control
from kvtrace.capture.messages import CaptureStatus
ours, engines = socket.socketpair()
lease = control.Lease(ours, CaptureStatus(pid=os.getpid(), armed=True), lease_s=60)
lease.close()
holder = threading.Thread(target=lease._closed._cond.acquire)  # and never releases it
holder.start()
holder.join()
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=20)
    assert done.returncode == 0, done.stderr


def test_a_silent_controller_loses_its_lease(engine, tmp_path):
    """A controller that keeps the connection but writes nothing (hung, stopped) loses the
    capture after ``lease_s``; one that renews (``Lease``) keeps it."""
    trace = tmp_path / "cap.kvtrace"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
        silent.connect(str(engine.path))
        started = time.monotonic()
        silent.sendall(msgspec.json.encode({"cmd": "arm", "options": {
            "path": str(trace), "gpu_interval_ms": 0}, "lease_s": 0.5}) + b"\n")
        assert decode_reply(control._read_line(silent)).armed
        status = wait_until_disarmed()
        assert 0.4 < time.monotonic() - started < 5
        assert status.error.endswith("renewed no lease for 0.5 s"), status
    renewed = ArmRequest(CaptureOptions(path=str(trace), gpu_interval_ms=0), lease_s=0.5)
    with control.Lease.take(os.getpid(), renewed):
        time.sleep(2)
        assert control.request(os.getpid(), StatusRequest()).armed
    wait_until_disarmed()


def test_an_arm_without_a_lease_ends_at_once(engine, tmp_path):
    """``control.request`` closes its connection after the reply: an arm made that way (no
    controller holding it) ends as soon as it began."""
    reply = control.request(os.getpid(), ArmRequest(CaptureOptions(
        path=str(tmp_path / "cap.kvtrace"), gpu_interval_ms=0)))
    assert reply.armed
    assert "closed the control connection" in wait_until_disarmed().error


def test_an_engine_error_arrives_as_the_same_class(engine, tmp_path):
    """A second arm is refused in the engine with AlreadyCapturingError; the operator side
    raises that class, with the engine's message and hint."""
    first = ArmRequest(CaptureOptions(path=str(tmp_path / "one.kvtrace"), gpu_interval_ms=0))
    with control.Lease.take(os.getpid(), first), pytest.raises(AlreadyCapturingError) as error:
        control.request(os.getpid(), ArmRequest(CaptureOptions(path=str(tmp_path / "two"))))
    assert str(error.value) == f"pid {os.getpid()} is already capturing to {tmp_path}/one.kvtrace"
    assert error.value.hint == AlreadyCapturingError.default_hint
    assert not (tmp_path / "two").exists()


def test_status_and_ping_replies(engine):
    status = control.request(os.getpid(), StatusRequest())
    assert status == CaptureStatus(pid=os.getpid(), armed=False)
    pong = control.request(os.getpid(), PingRequest())
    assert type(pong) is Pong and pong.pid == os.getpid() and pong.capturing is False


@pytest.mark.parametrize("error_type", [KvtraceError, *ENGINE_ERRORS])
def test_each_engine_error_class_round_trips(error_type):
    line = encode(error_reply(error_type("what failed", "what to do")))
    with pytest.raises(error_type) as raised:
        raise_error(decode_reply(line))
    assert type(raised.value) is error_type
    assert (str(raised.value), raised.value.hint) == ("what failed", "what to do")


def test_error_kinds_this_side_does_not_know():
    with pytest.raises(KvtraceError) as raised:
        raise_error(ErrorReply("FutureKvtraceError", "from a newer kvtrace", "upgrade"))
    assert type(raised.value) is KvtraceError and raised.value.hint == "upgrade"
    assert error_class("TraceFormatError") is TraceFormatError  # known: its own class
    reply = error_reply(ValueError("a bug"))
    assert (reply.kind, reply.message) == ("KvtraceError", "ValueError: a bug")


def test_error_classes_need_distinct_names():
    with pytest.raises(TypeError, match="both KvtraceErrors named ControlMessageError"):
        type("ControlMessageError", (KvtraceError,), {"__module__": "somewhere.else"})
    assert error_class("ControlMessageError") is ControlMessageError


def serve_once(path, reply: bytes) -> threading.Thread:
    """A stand-in server that answers one connection with ``reply``."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)

    def serve():
        with listener:
            connection, _ = listener.accept()
            with connection:
                control._read_line(connection)
                connection.sendall(reply)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("reply, names", [
    (b'{"reply":"status","pid":1,"armed":true,"colour":"red"}\n',
     "malformed control reply: Object contains unknown field `colour`"),
    (b'{"reply":"status","pid":1,"armed":"yes"}\n',
     "malformed control reply: Expected `bool`, got `str` - at `$.armed`"),
    (b'{"reply":"pong","pid":1,"kvtrace_version":"0","vllm_version":"0","process_title":"",'
     b'"capturing":false}\n', "answered a StatusRequest with a Pong, not a CaptureStatus"),
])
def test_the_operator_side_refuses_a_malformed_reply(tmp_path, monkeypatch, reply, names):
    monkeypatch.setenv("KVTRACE_RUNTIME_DIR", str(tmp_path))
    path = control.socket_path(os.getpid())
    os.close(open_private_dir(path.parent, os.getuid(), create=True))
    thread = serve_once(path, reply)
    with pytest.raises(ControlMessageError, match=re.escape(names)):
        control.request(os.getpid(), StatusRequest())
    thread.join(5)


def test_options_from_a_dict_are_checked_as_on_the_socket():
    assert options_from({"path": "/t", "gpu_interval_ms": 0}) == CaptureOptions(
        path="/t", gpu_interval_ms=0)
    with pytest.raises(ControlMessageError, match="unknown field `gpu`"):
        options_from({"path": "/t", "gpu": 0})
    with pytest.raises(ControlMessageError, match=r"Expected `int`, got `str` - at `\$.gpu_int"):
        options_from(CaptureOptions(path="/t", gpu_interval_ms="abc"))


def test_every_request_has_its_reply_type():
    assert set(REPLY_TYPES) == {PingRequest, ArmRequest, StatusRequest, DisarmRequest}


@pytest.mark.parametrize("fields, names", [
    ({"ring_s": 60.0, "keyframe_s": 0.0, "hash_bytes": False}, "keyframes every 0 < keyframe_s"),
    ({"ring_s": 60.0, "keyframe_s": 61.0, "hash_bytes": False}, "keyframes every 0 < keyframe_s"),
    ({"ring_s": 60.0, "keyframe_s": 6.0}, "a ring records hash ids only"),
    ({"ring_s": -1.0}, "Expected `float` >= 0.0 - at `$.ring_s`"),
])
def test_ring_options_that_do_not_go_together_are_refused_before_anything_starts(fields, names):
    """A ring needs a keyframe within its length, and records no hash bytes: a segment it
    drops would take with it the only record of what an id hashes."""
    with pytest.raises(ControlMessageError, match=re.escape(names)):
        options_from({"path": "/x/ring", **fields})
    assert type(control.answer(arm_line(path="/x/ring", **fields))) is ErrorReply
