"""The private control channel between ``kvtrace capture`` and a kvtrace hook in an engine.

Inside the engine, ``start_control_server()`` listens on a Unix socket
``$KVTRACE_RUNTIME_DIR/kvtrace-<uid>/engine-<pid>.sock`` (``/tmp`` by default; the directory
0700 and the engine user's, the socket 0600) on a daemon thread, and answers one request per
connection (``messages.py``: ping, arm, status, disarm). It also binds SIGUSR1 (arm to a default
path) and SIGUSR2 (disarm) where nothing else uses them. Starting it twice is a no-op, so the
plugin and an injected bootstrap can both call it.

On the operator side, ``request(pid, message)`` sends one request and returns the reply of the
type that request gets; an error reply is raised as the ``KvtraceError`` the engine raised.

Both ends check the other (``safe_paths.py`` for the directory): the server answers only peers
running as its own user or root (SO_PEERCRED); the client talks only to a socket in the target
user's private directory whose listener is the target process itself, running as the target's
user or root, and it checks that before it sends anything.
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
from kvtrace.capture.safe_paths import open_private_dir, remove_if_there
from kvtrace.errors import KvtraceError, UnsafePathError

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


def _peer(connection: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end: the client, or the server that listens."""
    creds = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    return pid, uid


def _in(dir_fd: int, name: str) -> str:
    """``name`` in the directory open as ``dir_fd``, as a path that cannot lead elsewhere
    (for ``bind`` and ``connect``, which take no directory descriptor)."""
    return f"/proc/self/fd/{dir_fd}/{name}"


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
        self._dir_fd = -1

    def start(self) -> None:
        """Listen in this user's private runtime directory; ``UnsafePathError`` if another user
        made it (or anything on its way) theirs."""
        self._dir_fd = open_private_dir(self.path.parent, os.getuid(), create=True)
        name = self.path.name
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            remove_if_there(name, self._dir_fd)  # a stale socket of an earlier process, our pid
            listener.bind(_in(self._dir_fd, name))
            os.chmod(name, 0o600, dir_fd=self._dir_fd)
            listener.listen(4)
        except BaseException:
            listener.close()
            os.close(self._dir_fd)
            self._dir_fd = -1
            raise
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
                    if _peer(connection)[1] not in (os.getuid(), 0):
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
        if self._dir_fd >= 0:
            try:
                remove_if_there(self.path.name, self._dir_fd)
            except OSError:
                pass
            os.close(self._dir_fd)
            self._dir_fd = -1


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
    uid = os.getuid() if uid is None else uid
    path = socket_path(pid, uid)
    try:
        dir_fd = open_private_dir(path.parent, uid, create=False)
    except FileNotFoundError:
        raise ControlChannelError(f"no kvtrace control socket for pid {pid} ({path})") from None
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.settimeout(timeout_s)
    try:
        _check_socket_file(path, dir_fd)
        client.connect(_in(dir_fd, path.name))
        _check_server(client, path, pid, uid)  # before a byte of the request leaves
        client.sendall(encode(message))
        line = _read_line(client)
    except FileNotFoundError:
        raise ControlChannelError(f"no kvtrace control socket for pid {pid} ({path})") from None
    except (ConnectionRefusedError, socket.timeout, OSError) as error:
        raise ControlChannelError(f"cannot talk to kvtrace in pid {pid}: {error}") from None
    finally:
        client.close()
        os.close(dir_fd)
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



def _check_socket_file(path: Path, dir_fd: int) -> None:
    info = os.stat(path.name, dir_fd=dir_fd, follow_symlinks=False)  # FileNotFoundError: none
    if not stat.S_ISSOCK(info.st_mode):
        raise UnsafePathError(f"{path} is not a socket (mode {info.st_mode:o}); kvtrace will "
                              "not connect to it")


def _check_server(client: socket.socket, path: Path, pid: int, uid: int) -> None:
    """The listener must be the target process itself (SO_PEERCRED's pid is its thread
    group's), running as the target's user or root: not an impostor that took the name."""
    server_pid, server_uid = _peer(client)
    if server_pid != pid or server_uid not in (uid, 0):
        raise UnsafePathError(
            f"{path} is served by pid {server_pid} (uid {server_uid}), not by the engine pid "
            f"{pid} (uid {uid}); kvtrace sent it nothing",
            "Another process holds the engine's control socket; find it (ss -xp) before "
            "capturing.")
