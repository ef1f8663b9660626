"""The private control channel between ``kvtrace capture`` and a kvtrace hook in an engine.

Inside the engine, ``start_control_server()`` listens on a Unix socket
``/tmp/kvtrace-<uid>/engine-<pid>.sock`` (the directory 0700, the socket 0600) on a daemon
thread, and answers one request per connection (``messages.py``: ping, arm, status, disarm).
Peers must run as the engine's user or as root (checked with SO_PEERCRED). It also binds SIGUSR1
(arm to a default path) and SIGUSR2 (disarm) where nothing else uses them. Starting it twice is
a no-op, so the plugin and an injected bootstrap can both call it.

On the operator side, ``request(pid, message)`` sends one request and returns the reply of the
type that request gets; an error reply is raised as the ``KvtraceError`` the engine raised.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import stat
import struct
import threading
import time
from pathlib import Path

from kvtrace import __version__
from kvtrace.capture.messages import (
    REPLY_TYPES,
    ArmRequest,
    CaptureOptions,
    ControlMessageError,
    DisarmRequest,
    ErrorReply,
    PingRequest,
    Pong,
    Reply,
    Request,
    StatusRequest,
    decode_reply,
    decode_request,
    encode,
    error_reply,
    raise_error,
)
from kvtrace.errors import KvtraceError

ACCEPT_POLL_S = 0.5
MAX_REQUEST_BYTES = 1 << 16


class ControlChannelError(KvtraceError):
    default_hint = "Is kvtrace armed in that process? Start it with `kvtrace capture --pid PID`."


def runtime_dir(uid: int | None = None) -> Path:
    """Where an engine running as ``uid`` keeps its control socket."""
    uid = os.getuid() if uid is None else uid
    return Path(os.environ.get("KVTRACE_RUNTIME_DIR", "/tmp")) / f"kvtrace-{uid}"


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
            raise ControlMessageError(f"control message longer than {MAX_REQUEST_BYTES} bytes")
    return data


def handle_request(request: Request) -> Reply:
    """Answer one control request; never raises."""
    from kvtrace.capture import hook

    try:
        match request:
            case PingRequest():
                return Pong(os.getpid(), __version__, hook.vllm_version(), hook.process_title(),
                            hook.active_session() is not None)
            case ArmRequest(options=options):
                return hook.arm(options)
            case StatusRequest():
                return hook.status()
            case DisarmRequest():
                return hook.disarm()
        raise ControlMessageError(f"no handler for {type(request).__name__}")
    except BaseException as error:  # noqa: BLE001 - the engine must never see it
        return error_reply(error)


def answer(line: bytes) -> Reply:
    """The reply to one request as it came off the socket; a malformed one gets an error
    reply naming what is wrong, and changes nothing."""
    try:
        request = decode_request(line)
    except ControlMessageError as error:
        return error_reply(error)
    return handle_request(request)


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
                        reply = ErrorReply(KvtraceError.__name__,
                                           "permission denied: peer runs as another user",
                                           "Run kvtrace as the engine's user or as root.")
                    else:
                        try:
                            reply = answer(_read_line(connection))
                        except ControlMessageError as error:
                            reply = error_reply(error)
                    connection.sendall(encode(reply))
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
    actions = {
        signal.SIGUSR1: lambda: handle_request(
            ArmRequest(CaptureOptions(path=default_trace_path()))),
        signal.SIGUSR2: lambda: handle_request(DisarmRequest()),
    }
    for signum, action in actions.items():
        if signal.getsignal(signum) is signal.SIG_DFL:
            # The handler runs between bytecodes of the main thread: hand the work to a thread.
            signal.signal(signum, lambda *_, act=action: threading.Thread(target=act,
                                                                          daemon=True).start())


# --- operator side -------------------------------------------------------------------------------


def request(pid: int, message: Request, uid: int | None = None,
            timeout_s: float = 30.0) -> Reply:
    """Send one request to the engine ``pid``'s control server; return its reply, of the type
    ``messages.REPLY_TYPES`` gives that request. An error reply is raised as the engine's
    ``KvtraceError`` subclass; a malformed reply as ``ControlMessageError``."""
    path = socket_path(pid, uid)
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.settimeout(timeout_s)
    try:
        client.connect(str(path))
        client.sendall(encode(message))
        line = _read_line(client)
    except FileNotFoundError:
        raise ControlChannelError(f"no kvtrace control socket for pid {pid} ({path})") from None
    except (ConnectionRefusedError, socket.timeout, OSError) as error:
        raise ControlChannelError(f"cannot talk to kvtrace in pid {pid}: {error}") from None
    finally:
        client.close()
    if not line:
        raise ControlChannelError(f"pid {pid} closed the control connection without a reply")
    reply = decode_reply(line)
    if isinstance(reply, ErrorReply):
        raise_error(reply)
    expected = REPLY_TYPES[type(message)]
    if not isinstance(reply, expected):
        raise ControlMessageError(f"pid {pid} answered a {type(message).__name__} with a "
                                  f"{type(reply).__name__}, not a {expected.__name__}")
    return reply
