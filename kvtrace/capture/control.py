"""The private control channel between ``kvtrace capture`` and a kvtrace hook in an engine.

Inside the engine, ``start_control_server()`` listens on a Unix socket
``/tmp/kvtrace-<uid>/engine-<pid>.sock`` (the directory 0700, the socket 0600) on a daemon
thread, and answers one JSON request per connection: ``ping`` (versions, title), ``arm``
(start capturing with the given options), ``status``, ``disarm``. Peers must run as the engine's
user or as root (checked with SO_PEERCRED). It also binds SIGUSR1 (arm to a default path) and
SIGUSR2 (disarm) where nothing else uses them. Starting it twice is a no-op, so the plugin and an
injected bootstrap can both call it.

On the operator side, ``request(pid, payload)`` sends one request and returns the reply,
turning an error reply back into a ``KvtraceError``.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import stat
import struct
import threading
import time
from pathlib import Path

from kvtrace import __version__
from kvtrace.errors import KvtraceError

ACCEPT_POLL_S = 0.5
MAX_REQUEST_BYTES = 1 << 16


class ControlChannelError(KvtraceError):
    default_hint = "Is kvtrace armed in that process? Start it with `kvtrace capture --pid PID`."


def runtime_dir(uid: int | None = None) -> Path:
    """Where an engine running as ``uid`` keeps its control socket."""
    return Path(os.environ.get("KVTRACE_RUNTIME_DIR", "/tmp")) / f"kvtrace-{os.getuid() if uid is None else uid}"


def socket_path(pid: int, uid: int | None = None) -> Path:
    return runtime_dir(uid) / f"engine-{pid}.sock"


def ensure_private_dir(path: Path) -> Path:
    """Create ``path`` 0700, or accept it only if it is ours and private (no squatting)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise KvtraceError(f"{path} is not a private directory owned by uid {os.getuid()}",
                           "Remove it or set KVTRACE_RUNTIME_DIR to a private directory.")
    return path


def _peer_uid(connection: socket.socket) -> int:
    creds = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid


def _read_line(connection: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = connection.recv(4096)
        if not chunk:
            break
        data += chunk
        if len(data) > MAX_REQUEST_BYTES:
            raise ValueError("request too long")
    return data


def _error_reply(error: BaseException) -> dict:
    hint = getattr(error, "hint", "Run the engine with kvtrace's plugin, or see its log.")
    return {"ok": False, "error": str(error), "hint": hint, "kind": type(error).__name__}


def handle_request(request: dict) -> dict:
    """Answer one control request; never raises."""
    from kvtrace.capture import hook

    try:
        command = request.get("cmd")
        if command == "ping":
            return {"ok": True, "pid": os.getpid(), "kvtrace_version": __version__,
                    "vllm_version": hook.vllm_version(), "process_title": hook.process_title(),
                    "capturing": hook.active_session() is not None}
        if command == "arm":
            return {"ok": True, "status": hook.arm(hook.CaptureOptions.from_dict(request["options"]))}
        if command == "status":
            session = hook.active_session()
            return {"ok": True, "status": session.status() if session else {"armed": False}}
        if command == "disarm":
            return {"ok": True, "status": hook.disarm()}
        return {"ok": False, "error": f"unknown command {command!r}", "hint": "", "kind": "KvtraceError"}
    except BaseException as error:  # noqa: BLE001 - the engine must never see it
        return _error_reply(error)


class ControlServer:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._stop = threading.Event()
        self._socket: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        ensure_private_dir(self.path.parent)
        if self.path.exists():
            self.path.unlink()  # a stale socket of an earlier process with our pid
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(self.path))
        os.chmod(self.path, 0o600)
        listener.listen(4)
        listener.settimeout(ACCEPT_POLL_S)
        self._socket = listener
        self._thread = threading.Thread(target=self._serve, name="kvtrace-control", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                connection, _ = self._socket.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            with connection:
                try:
                    connection.settimeout(10)
                    if _peer_uid(connection) not in (os.getuid(), 0):
                        reply = {"ok": False, "error": "permission denied: peer runs as another user",
                                 "hint": "Run kvtrace as the engine's user or as root.",
                                 "kind": "KvtraceError"}
                    else:
                        reply = handle_request(json.loads(_read_line(connection)))
                    connection.sendall(json.dumps(reply).encode() + b"\n")
                except Exception:  # noqa: BLE001 - a bad client must not stop the server
                    continue

    def stop(self) -> None:
        self._stop.set()
        if self._socket is not None:
            self._socket.close()
        try:
            self.path.unlink()
        except OSError:
            pass


_server: ControlServer | None = None
_server_lock = threading.Lock()


def start_control_server() -> Path:
    """Start this process's control server once; returns its socket path. The socket file is
    removed when the process exits normally."""
    global _server
    with _server_lock:
        if _server is None:
            server = ControlServer(socket_path(os.getpid()))
            server.start()
            atexit.register(server.stop)
            _server = server
            _install_signal_handlers()
        return _server.path


def default_trace_path() -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return str(runtime_dir() / f"capture-{os.getpid()}-{stamp}.kvtrace")


def _install_signal_handlers() -> None:
    """SIGUSR1 arms to a default path, SIGUSR2 disarms; only where vLLM left them unused."""
    if threading.current_thread() is not threading.main_thread():
        return
    actions = {signal.SIGUSR1: lambda: handle_request(
        {"cmd": "arm", "options": {"path": default_trace_path()}}),
        signal.SIGUSR2: lambda: handle_request({"cmd": "disarm"})}
    for signum, action in actions.items():
        if signal.getsignal(signum) is signal.SIG_DFL:
            # The handler runs between bytecodes of the main thread: hand the work to a thread.
            signal.signal(signum, lambda *_, act=action: threading.Thread(target=act, daemon=True).start())


# --- operator side -------------------------------------------------------------------------------


def request(pid: int, payload: dict, uid: int | None = None, timeout_s: float = 30.0) -> dict:
    """Send one request to the engine ``pid``'s control server; return its reply."""
    path = socket_path(pid, uid)
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.settimeout(timeout_s)
    try:
        client.connect(str(path))
        client.sendall(json.dumps(payload).encode() + b"\n")
        line = _read_line(client)
    except FileNotFoundError:
        raise ControlChannelError(f"no kvtrace control socket for pid {pid} ({path})") from None
    except (ConnectionRefusedError, socket.timeout, OSError) as error:
        raise ControlChannelError(f"cannot talk to kvtrace in pid {pid}: {error}") from None
    finally:
        client.close()
    if not line:
        raise ControlChannelError(f"pid {pid} closed the control connection without a reply")
    reply = json.loads(line)
    if not reply.get("ok"):
        raise KvtraceError(reply.get("error", "unknown error"), reply.get("hint") or None)
    return reply
