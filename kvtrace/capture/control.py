"""The private control channel between ``kvtrace capture`` and a kvtrace hook in an engine.

Inside the engine, ``start_control_server()`` listens on a Unix socket
``$KVTRACE_RUNTIME_DIR/kvtrace-<uid>/engine-<pid>.sock`` (``/tmp`` by default; the directory
0700 and the engine user's, the socket 0600) on a daemon thread, and answers one request per
connection (``messages.py``: ping, arm, status, disarm). It also binds SIGUSR1 (arm to a default
path) and SIGUSR2 (disarm) where nothing else uses them. Starting it twice is a no-op, so the
plugin and an injected bootstrap can both call it. The engine removes its socket when it exits
cleanly, and a server that starts removes the sockets of engines that died without removing
theirs (killed).

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
import re
import select
import signal
import socket
import stat
import struct
import threading
import time
from pathlib import Path

import msgspec

from kvtrace import __version__
from kvtrace.capture.messages import (
    REPLY_TYPES,
    ArmRequest,
    CaptureOptions,
    CaptureStatus,
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
from kvtrace.capture.safe_paths import (
    open_private_dir,
    remove_if_there,
    remove_own_socket,
    runtime_dir,
)
from kvtrace.errors import KvtraceError, UnsafePathError
from kvtrace.vllm_releases import running_vllm_version

ACCEPT_POLL_S = 0.5
MAX_REQUEST_BYTES = 1 << 16
# A shorter lease than ``ArmRequest``'s, for the tests that let one lapse; no operator option.
LEASE_ENV = "KVTRACE_TEST_LEASE_S"
_SOCKET_NAME = re.compile(r"engine-(\d+)\.sock")


class ControlChannelError(KvtraceError):
    default_hint = "Is kvtrace armed in that process? Start it with `kvtrace capture --pid PID`."


class ControlSilentError(ControlChannelError):
    """The engine's control server took the connection but gave no reply: it is there (so
    nothing may be injected), and stalled or too busy to answer in time."""

    default_hint = ("The engine may be stalled or overloaded; check its log, and retry once it "
                    "steps again.")


def socket_path(pid: int, uid: int | None = None) -> Path:
    return runtime_dir(uid) / f"engine-{pid}.sock"


def is_alive(pid: int) -> bool:
    """Whether ``pid`` runs; a zombie (killed, not yet reaped by its parent) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _remove_dead_sockets(dir_fd: int) -> None:
    """Remove the sockets this user's engines left in their private directory when they died
    without removing them (killed, so no exit handler ran). A live pid's socket stays, and so
    does anything that is not a socket of this user's (``remove_own_socket``)."""
    for name in os.listdir(dir_fd):
        match = _SOCKET_NAME.fullmatch(name)
        if match and not is_alive(int(match.group(1))):
            remove_own_socket(name, dir_fd, os.getuid())


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


class LeaseWatch:
    """The engine's side of a controller's lease on its capture: the arm's connection, kept
    open. The capture ends (``hook.end``) when the controller closes it, which its death
    does whatever killed it, or lets ``lease_s`` pass without writing on it. Then, before it
    closes the connection, the engine writes the capture's final status on it: a controller
    that was stopped or starved reads, once it runs again, that its lease lapsed and what the
    capture holds (``Lease.lapsed``)."""

    def __init__(self, connection: socket.socket, lease_s: float, session) -> None:
        self.connection, self.lease_s, self.session = connection, lease_s, session
        threading.Thread(target=self._watch, name="kvtrace-lease", daemon=True).start()

    def _watch(self) -> None:
        from kvtrace.capture import hook

        connection = self.connection
        try:
            connection.settimeout(self.lease_s)
            while connection.recv(64):
                pass
            reason = "its controller closed the control connection"
        except socket.timeout:
            hook.end(self.session, f"its controller renewed no lease for {self.lease_s:g} s")
            try:
                connection.settimeout(ACCEPT_POLL_S)
                connection.sendall(encode(self.session.status()))
            except OSError:
                pass  # the controller is gone as well
            return
        except OSError as error:
            reason = f"its control connection failed ({error.strerror or error})"
        finally:
            connection.close()
        hook.end(self.session, reason)


def handle_request(request: Request) -> Reply:
    """Answer one control request; never raises."""
    from kvtrace.capture import hook

    try:
        match request:
            case PingRequest():
                from kvtrace.probes.signatures import replaced_methods

                return Pong(os.getpid(), __version__, running_vllm_version(), hook.process_title(),
                            hook.active_session() is not None, replaced_methods())
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
        self.pid = os.getpid()  # a forked child's copy must not remove its parent's socket

    def start(self) -> None:
        """Listen in this user's private runtime directory; ``UnsafePathError`` if another user
        made it (or anything on its way) theirs."""
        self._dir_fd = open_private_dir(self.path.parent, os.getuid(), create=True)
        name = self.path.name
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            remove_if_there(name, self._dir_fd)  # a stale socket of an earlier process, our pid
            _remove_dead_sockets(self._dir_fd)
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
            try:
                self._answer(connection)
            except Exception:  # noqa: BLE001 - a bad client must not stop the server
                connection.close()

    def _answer(self, connection: socket.socket) -> None:
        """Answer one request; the connection an arm came on becomes that capture's lease
        (``LeaseWatch``), every other one is closed."""
        from kvtrace.capture import hook

        request = None
        connection.settimeout(10)
        if _peer(connection)[1] not in (os.getuid(), 0):
            reply = ErrorReply(KvtraceError.__name__,
                               "permission denied: peer runs as another user",
                               "Run kvtrace as the engine's user or as root.")
        else:
            try:
                request = decode_request(_read_line(connection))
                reply = handle_request(request)
            except ControlMessageError as error:
                reply = error_reply(error)
            except OSError as error:  # the request did not come (in time): say so if it can hear
                reply = error_reply(ControlChannelError(f"no whole request came: {error}"))
        leased = type(request) is ArmRequest and type(reply) is CaptureStatus and reply.armed
        session = hook.active_session() if leased else None
        try:
            connection.sendall(encode(reply))
        except Exception:  # noqa: BLE001 - gone, or a reply that cannot be sent: nobody holds it
            if session is not None:  # the controller is gone before it heard of its capture
                hook.end(session, "its controller left while arming")
            connection.close()
            return
        if session is None:
            connection.close()
        else:
            LeaseWatch(connection, request.lease_s, session)

    def stop(self) -> None:
        if os.getpid() != self.pid:
            return
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
    """Start this process's control server once (a forked child starts its own); returns its
    socket path. The socket file is removed when the process exits normally: at exit, or, in a
    forked ``multiprocessing`` child (vLLM's engine cores), which ends with ``os._exit``, by
    multiprocessing's own finalisers."""
    global _server
    from multiprocessing import util

    with _server_lock:
        if _server is None or _server.pid != os.getpid():
            server = ControlServer(socket_path(os.getpid()))
            server.start()
            atexit.register(server.stop)
            util.Finalize(server, server.stop, exitpriority=0)
            _server = server
            _install_signal_handlers()
        return _server.path


def default_trace_path() -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return str(runtime_dir() / f"capture-{os.getpid()}-{stamp}.kvtrace")


# A capture armed by SIGUSR1 has no controller to hold a lease: it ends after this long.
SIGNAL_CAPTURE_S = 600.0


def _arm_on_signal() -> None:
    """SIGUSR1's capture, to a default path, ended after ``SIGNAL_CAPTURE_S`` at the latest.
    Never raises: it runs on a thread of the engine's."""
    from kvtrace.capture import hook

    try:
        hook.arm(CaptureOptions(path=default_trace_path()), default_path=True)
        session = hook.active_session()
    except BaseException:  # noqa: BLE001 - the engine must never see it (a second arm...)
        return
    timer = threading.Timer(SIGNAL_CAPTURE_S, hook.end, (
        session, f"a capture armed by SIGUSR1 lasts {SIGNAL_CAPTURE_S:g} s at most"))
    timer.daemon = True
    timer.start()


def _install_signal_handlers() -> None:
    """SIGUSR1 arms to a default path, SIGUSR2 disarms; only where vLLM left them unused."""
    if threading.current_thread() is not threading.main_thread():
        return
    actions = {
        signal.SIGUSR1: _arm_on_signal,
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
    ``KvtraceError`` subclass; a malformed reply as ``ControlMessageError``. An arm's
    connection is closed here too, which ends the capture at once: arm with ``Lease``."""
    client = _connect(pid, uid, timeout_s)
    try:
        return _exchange(client, pid, message)
    finally:
        client.close()


class Lease:
    """A controller's hold on the capture it armed in an engine (``Lease.take``): the arm's
    connection, kept open, on which a daemon thread writes a line every fifth of the lease.
    The engine disarms when it closes (``close``, or this process's death, however it dies)
    or falls silent for ``lease_s``. ``status`` is the arm's reply."""

    def __init__(self, client: socket.socket, status: CaptureStatus, lease_s: float) -> None:
        self._client, self.status, self.lease_s = client, status, lease_s
        self._closed = threading.Event()
        self._heard = b""  # what the engine wrote on the lease so far: its word when it lapsed
        self._lapsed: CaptureStatus | None = None
        # The renewing thread holds no reference to the lease: a lease dropped without
        # ``close`` (an exception on the way) is collected, and that closes it.
        threading.Thread(target=_renew, args=(client, self._closed, lease_s / 5),
                         name="kvtrace-lease", daemon=True).start()

    @classmethod
    def take(cls, pid: int, arm: ArmRequest, uid: int | None = None,
             timeout_s: float = 30.0) -> Lease:
        """Arm engine ``pid`` (``arm``) and hold the capture."""
        if os.environ.get(LEASE_ENV):
            arm = msgspec.structs.replace(arm, lease_s=float(os.environ[LEASE_ENV]))
        client = _connect(pid, uid, timeout_s)
        try:
            return cls(client, _exchange(client, pid, arm), arm.lease_s)
        except BaseException:
            client.close()
            raise

    def lapsed(self, wait_s: float = 0.0) -> CaptureStatus | None:
        """The capture's final status if the engine ended it because this lease lapsed (this
        process was stopped or starved past ``lease_s``: ``LeaseWatch`` writes it before it
        closes the connection); None if it has not said so within ``wait_s``. Kept once read,
        so it can be asked again after ``close``."""
        deadline = time.monotonic() + wait_s
        while self._lapsed is None and self._client.fileno() >= 0:
            readable, _, _ = select.select([self._client], [], [],
                                           max(0.0, deadline - time.monotonic()))
            try:
                chunk = self._client.recv(MAX_REQUEST_BYTES) if readable else b""
            except OSError:
                chunk = b""
            if not chunk:
                return None
            self._heard += chunk
            if self._heard.endswith(b"\n"):
                reply = decode_reply(self._heard)
                self._lapsed = reply if isinstance(reply, CaptureStatus) else None
                return self._lapsed
        return self._lapsed

    def close(self) -> None:
        """Let go: the engine disarms if it still captures."""
        self._closed.set()
        self._client.close()

    def __del__(self) -> None:
        """Collected (dropped without ``close``, or at exit): the connection closed lets the
        engine go and ends the renewals. No lock is taken: at interpreter exit the renewing
        daemon thread can be frozen holding the event's, and ``close`` here hung
        `kvtrace capture` after a stop, forever."""
        self._client.close()

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _renew(client: socket.socket, closed: threading.Event, interval_s: float) -> None:
    """A lease's renewals: a line every ``interval_s`` until it is closed (or the engine ended
    it: its status says why)."""
    while not closed.wait(interval_s):
        try:
            client.sendall(b"\n")
        except OSError:
            return


def _connect(pid: int, uid: int | None, timeout_s: float) -> socket.socket:
    """A connection to the engine ``pid``'s control socket, both ends checked."""
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
    except BaseException as error:
        client.close()
        if isinstance(error, FileNotFoundError):
            raise ControlChannelError(
                f"no kvtrace control socket for pid {pid} ({path})") from None
        if isinstance(error, OSError):
            raise ControlChannelError(f"cannot talk to kvtrace in pid {pid}: {error}") from None
        raise
    finally:
        os.close(dir_fd)
    return client


def _exchange(client: socket.socket, pid: int, message: Request) -> Reply:
    """Send ``message`` on ``client``; the reply (see ``request``)."""
    try:
        client.sendall(encode(message))
        line = _read_line(client)
    except socket.timeout:
        raise ControlSilentError(f"kvtrace's control server in pid {pid} took the connection "
                                 f"but did not answer in {client.gettimeout():g} s") from None
    except OSError as error:
        raise ControlChannelError(f"cannot talk to kvtrace in pid {pid}: {error}") from None
    if not line:
        raise ControlSilentError(f"pid {pid} closed the control connection without a reply")
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
