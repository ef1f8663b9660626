"""The operator side of capture: find the engine core(s), get kvtrace's hook into them, arm it.

Ways in, best first (``--method auto`` tries them in this order):

* ``plugin`` - kvtrace is installed in vLLM's environment, so its ``vllm.general_plugins`` entry
  point already started a dormant control server in each engine core. No ptrace needed.
* ``remote-exec`` - PEP 768 ``sys.remote_exec`` runs a bootstrap in the target when both sides
  run Python >= 3.14.
* ``gdb`` - for older Pythons. gdb never runs our code while the target is stopped somewhere
  arbitrary (that deadlocked a busy vLLM target inside ``malloc``, reference/environment-notes.md
  section 3a): it writes the bootstrap's file name into a fresh ``mmap``'d page and schedules
  ``PyRun_SimpleString`` on it with ``Py_AddPendingCall``, which CPython runs at its next safe
  point in the main thread. An idle engine core never reaches one (its main thread waits in
  ``input_queue.get()``), so if nothing ran after a grace period and the main thread is parked
  in a blocking syscall outside the allocator, the bootstrap is run directly under
  ``PyGILState_Ensure``. The bootstrap is idempotent, so running twice is harmless.

Every way in ends the same: the bootstrap starts the control server (``kvtrace.capture.control``)
and the CLI arms the capture over its socket. The bootstrap reports its own failure (e.g. kvtrace
not importable in the target's Python) through a side-channel file next to the socket.

The bootstrap and its report live in the target user's private runtime directory, which is
checked first (``safe_paths``): one another user made or opened is refused, never written to,
and never a reason to fall back from the plugin to gdb. Both files are reached only through
that directory's descriptor, without following links; as root, the bootstrap is handed to the
target's user on its descriptor.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kvtrace.capture import control
from kvtrace.capture.messages import (
    ArmRequest,
    CaptureOptions,
    CaptureStatus,
    DisarmRequest,
    PingRequest,
    StatusRequest,
    options_from,
)
from kvtrace.capture.safe_paths import (
    check_not_in_runtime_dir,
    open_private_dir,
    read_owned_file,
    remove_if_there,
    replace_file,
)
from kvtrace.errors import KvtraceError

ENGINE_CORE_TITLE = "::EngineCore"
PENDING_CALL_GRACE_S = 3.0
BOOTSTRAP_WAIT_S = 10.0
GDB_TIMEOUT_S = 120.0
# Syscalls an idle main thread waits in (x86-64 numbers): read, poll, select, nanosleep,
# recvfrom, futex, epoll_wait, clock_nanosleep, pselect6, ppoll, epoll_pwait, epoll_pwait2.
BLOCKING_SYSCALLS = {0, 7, 23, 35, 45, 202, 232, 230, 270, 271, 281, 441}
MAX_BOOTSTRAP_REPORT_BYTES = 1 << 16


class AttachError(KvtraceError):
    """Attaching to a process failed; the message says why and the hint what to do."""


@dataclass(frozen=True)
class Target:
    pid: int
    title: str
    uid: int

    @property
    def is_engine_core(self) -> bool:
        return ENGINE_CORE_TITLE in self.title

    @property
    def rank_suffix(self) -> str:
        """``dp0`` for ``VLLM::EngineCore_DP0``; empty for a single engine core."""
        _, _, tail = self.title.partition(ENGINE_CORE_TITLE)
        return tail.lstrip("_").lower()


def describe(pid: int) -> Target:
    """Read a process's title, owner and parent; diagnose a missing or foreign process."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        raise AttachError(f"no process with pid {pid}",
                          "Check the pid: `pgrep -af EngineCore` lists vLLM engine cores.") from None
    except PermissionError:
        raise AttachError(f"pid {pid} belongs to another user",
                          "Run kvtrace as the engine's user, or as root.") from None
    try:
        title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError as error:
        raise AttachError(f"cannot read /proc/{pid}: {error.strerror}",
                          "The process may have exited; check the pid.") from None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    uid = int(fields["Uid"].split()[0])
    if uid != os.getuid() and os.getuid() != 0:
        raise AttachError(f"pid {pid} belongs to another user (uid {uid})",
                          "Run kvtrace as the engine's user, or as root.")
    return Target(pid, title, uid)


def _children(pid: int) -> list[int]:
    children = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            children.extend(int(c) for c in task.read_text().split())
        except OSError:
            continue
    return children


def find_engine_cores(pid: int) -> list[Target]:
    """The engine core(s) behind ``pid``: itself, or its descendants titled ``VLLM::EngineCore``
    (an API-server pid has one per data-parallel rank)."""
    target = describe(pid)
    if target.is_engine_core:
        return [target]
    found, pending = [], _children(pid)
    while pending:
        child = pending.pop(0)
        try:
            info = describe(child)
        except AttachError:
            continue
        if info.is_engine_core:
            found.append(info)
        pending.extend(_children(child))
    if not found:
        raise AttachError(
            f"pid {pid} ({target.title or 'no title'}) is not a vLLM engine core and has none "
            "among its child processes",
            "Pass the vLLM API-server pid or an engine-core pid (`pgrep -af EngineCore`).")
    return sorted(found, key=lambda t: t.title)


# --- getting the hook in -----------------------------------------------------------------------


def _control_up(target: Target) -> bool:
    """Whether kvtrace's control server answers in ``target``; an answer that is an error
    (another kvtrace version, a refusal) is raised, not taken for "not there"."""
    try:
        control.request(target.pid, PingRequest(), uid=target.uid, timeout_s=5)
    except control.ControlChannelError:
        return False
    return True


class Bootstrap:
    """The script the target runs to start kvtrace, and the file it reports a failure in, in
    the target user's private runtime directory (made, or checked, on creation)."""

    def __init__(self, target: Target) -> None:
        self.target = target
        directory = control.runtime_dir(target.uid)
        self.script = directory / f"inject-{target.pid}.py"
        self.report = directory / f"inject-{target.pid}.err"
        self._dir_fd = open_private_dir(directory, target.uid, create=True)

    def write(self) -> None:
        """Write the script afresh (whatever had its name is removed, not followed)."""
        remove_if_there(self.report.name, self._dir_fd)
        with os.fdopen(replace_file(self.script.name, self._dir_fd), "w") as script:
            if os.geteuid() == 0 and self.target.uid != 0:
                os.fchown(script.fileno(), self.target.uid, -1)
            script.write(BOOTSTRAP.format(error_file=str(self.report)))

    def failure(self) -> dict | None:
        """What the bootstrap reported, if it failed and finished writing the report."""
        data = read_owned_file(self.report.name, self._dir_fd, self.report, self.target.uid,
                               MAX_BOOTSTRAP_REPORT_BYTES)
        try:
            return None if data is None else json.loads(data)
        except ValueError:
            return None

    def close(self) -> None:
        os.close(self._dir_fd)


BOOTSTRAP = '''\
def _kvtrace_bootstrap():
    import json, os, sys, traceback
    try:
        from kvtrace.capture.control import start_control_server
        start_control_server()
    except BaseException as error:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        with os.fdopen(os.open({error_file!r}, flags, 0o600), "w") as report:
            json.dump({{"kind": type(error).__name__, "error": str(error),
                       "executable": sys.executable, "traceback": traceback.format_exc()}}, report)
_kvtrace_bootstrap()
del _kvtrace_bootstrap
'''


def _wait_for_bootstrap(target: Target, bootstrap: Bootstrap, timeout_s: float) -> bool:
    """True once the control server answers; raise what the bootstrap reported if it failed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        report = bootstrap.failure()
        if report is not None:
            _raise_bootstrap_error(target, report)
        if _control_up(target):
            return True
        try:
            os.kill(target.pid, 0)
        except ProcessLookupError:
            raise AttachError(f"pid {target.pid} exited while kvtrace was attaching",
                              "Check the engine's log.") from None
        time.sleep(0.1)
    return False


def _raise_bootstrap_error(target: Target, report: dict) -> None:
    if report.get("kind") == "ModuleNotFoundError" and "kvtrace" in report.get("error", ""):
        try:
            executable = os.readlink(f"/proc/{target.pid}/exe")
        except OSError:
            executable = report.get("executable") or "unknown"
        raise AttachError(
            f"kvtrace is not importable in pid {target.pid}'s Python ({executable})",
            f"Install it into vLLM's environment ({executable} -m pip install {_kvtrace_source()}) "
            "and attach again.")
    raise AttachError(f"kvtrace failed to start in pid {target.pid}: "
                      f"{report.get('kind')}: {report.get('error')}",
                      "Run with -v to see the target's traceback.")


def _kvtrace_source() -> str:
    """Where this kvtrace is installed from (a checkout, for an editable install)."""
    import kvtrace

    return str(Path(kvtrace.__file__).resolve().parent.parent)


def _inject_remote_exec(target: Target, script: Path) -> None:
    remote_exec = getattr(sys, "remote_exec", None)
    if remote_exec is None:
        raise AttachError(
            f"--method remote-exec needs Python 3.14 or newer; kvtrace runs on "
            f"{sys.version.split()[0]}",
            "Use --method gdb, or the plugin (install kvtrace in vLLM's environment).")
    try:
        remote_exec(target.pid, str(script))
    except (OSError, RuntimeError) as error:
        raise AttachError(f"sys.remote_exec into pid {target.pid} failed: {error}",
                          "The target must run Python >= 3.14 and allow ptrace.") from None


def _gdb_base(target: Target) -> list[str]:
    gdb = shutil.which("gdb")
    if gdb is None:
        raise AttachError("gdb is not installed",
                          "Install gdb (apt-get install gdb), or use --method plugin.")
    return [gdb, "-p", str(target.pid), "-batch", "-nx", "-q", "-iex", "set auto-solib-add off",
            "-ex", "sharedlibrary libpython3", "-ex", "sharedlibrary libc.so"]


def _run_gdb(command: list[str], target: Target, log: Callable[[str], None]) -> str:
    log("$ " + shlex.join(command))
    result = subprocess.run(command, capture_output=True, text=True, timeout=GDB_TIMEOUT_S,
                            stdin=subprocess.DEVNULL, check=False)
    output = result.stdout + result.stderr
    log(output)
    if "ptrace: Operation not permitted" in output or "Could not attach to process" in output:
        raise AttachError(
            f"no ptrace permission for pid {target.pid}",
            "Run as root or with CAP_SYS_PTRACE (check /proc/sys/kernel/yama/ptrace_scope), "
            "or use --method plugin.")
    if 'No symbol "Py_AddPendingCall"' in output or 'No symbol "PyRun_SimpleString"' in output:
        raise AttachError(f"gdb found no CPython symbols in pid {target.pid}",
                          "The target's Python must export its C API; use --method plugin.")
    return output


def _run_string(script: Path) -> str:
    return f"exec(open({str(script)!r}).read(), {{'__name__': 'kvtrace_bootstrap'}})"


def _inject_pending_call(target: Target, script: Path, log: Callable[[str], None]) -> None:
    code = _run_string(script).encode()
    command = _gdb_base(target) + [
        "-ex", "set $buf = (char*)(long)mmap(0, 65536, 3, 0x22, -1, 0)",
        "-ex", f"python gdb.selected_inferior().write_memory(int(gdb.parse_and_eval('$buf')), "
               f"{code!r} + b'\\0')",
        "-ex", "call (int)Py_AddPendingCall((int(*)(void*))PyRun_SimpleString, (void*)$buf)",
    ]
    _run_gdb(command, target, log)


def main_thread_parked(pid: int) -> bool:
    """Whether the main thread sleeps in a blocking syscall (GIL released, not mid-bytecode)."""
    try:
        state = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        syscall = Path(f"/proc/{pid}/task/{pid}/syscall").read_text().split()[0]
    except (OSError, IndexError):
        return False
    return state == "S" and syscall.isdigit() and int(syscall) in BLOCKING_SYSCALLS


# Refuses (prints the marker and detaches) when the main thread sits inside the allocator:
# running Python there is what deadlocked a target for good.
_ALLOCATOR_CHECK = """\
frame, names = gdb.selected_frame(), []
while frame is not None:
    names.append(frame.name() or "")
    frame = frame.older()
if any(n.startswith(("malloc", "_int_", "free", "__libc_malloc", "__libc_free", "arena_"))
       for n in names):
    print("KVTRACE_IN_ALLOCATOR")
    gdb.execute("detach")
    gdb.execute("quit")
"""


def _inject_direct(target: Target, script: Path, log: Callable[[str], None]) -> None:
    code = _run_string(script).replace("\\", "\\\\").replace('"', '\\"')
    command = _gdb_base(target) + [
        "-ex", "thread 1", "-ex", f"python exec({_ALLOCATOR_CHECK!r})",
        "-ex", "call (int)PyGILState_Ensure()",
        "-ex", f'call (int)PyRun_SimpleString("{code}")',
        "-ex", "call (void)PyGILState_Release($1)",
    ]
    output = _run_gdb(command, target, log)
    if "KVTRACE_IN_ALLOCATOR" in output:
        raise AttachError(f"pid {target.pid}'s main thread is inside the memory allocator",
                          "Try again in a moment; kvtrace will not inject there.")


def ensure_hook(target: Target, method: str, log: Callable[[str], None]) -> str:
    """Make sure kvtrace's control server runs in ``target``; return the way it got there.
    A runtime directory or socket that fails its checks is an error here, not a reason to try
    the next way in."""
    if _control_up(target):
        return "plugin" if method in ("auto", "plugin") else "already present"
    if method == "plugin":
        raise AttachError(
            f"no kvtrace plugin is listening in pid {target.pid}",
            "Install kvtrace into vLLM's environment and restart vLLM (the plugin loads at "
            "start-up), or attach with --method gdb.")
    if method == "auto":
        method = "remote-exec" if hasattr(sys, "remote_exec") else "gdb"
    bootstrap = Bootstrap(target)
    try:
        bootstrap.write()
        return _inject(target, method, bootstrap, log)
    finally:
        bootstrap.close()


def _inject(target: Target, method: str, bootstrap: Bootstrap,
            log: Callable[[str], None]) -> str:
    script = bootstrap.script
    if method == "remote-exec":
        _inject_remote_exec(target, script)
        if _wait_for_bootstrap(target, bootstrap, BOOTSTRAP_WAIT_S):
            return method
        raise AttachError(f"pid {target.pid} did not run the injected bootstrap",
                          "sys.remote_exec runs only when the target's main thread runs Python; "
                          "retry while the engine is serving, or use the plugin.")
    _inject_pending_call(target, script, log)
    if _wait_for_bootstrap(target, bootstrap, PENDING_CALL_GRACE_S):
        return "gdb"
    if not main_thread_parked(target.pid):
        if _wait_for_bootstrap(target, bootstrap, BOOTSTRAP_WAIT_S):
            return "gdb"
        raise AttachError(f"pid {target.pid} did not reach a safe point to run kvtrace",
                          "Its main thread is busy in native code; retry in a moment.")
    log(f"pid {target.pid}'s main thread is idle in a syscall; running the bootstrap directly")
    _inject_direct(target, script, log)
    if _wait_for_bootstrap(target, bootstrap, BOOTSTRAP_WAIT_S):
        return "gdb"
    raise AttachError(f"pid {target.pid} did not start kvtrace after injection",
                      "Run with -v to see gdb's output.")


def arm(target: Target, options: CaptureOptions | dict) -> control.Lease:
    """Start capturing in ``target`` (options: a Struct or a dict of its fields, checked here
    and again by the engine). The capture lasts as long as the returned lease is held: close
    it after disarming (this process's end closes it too, and the engine then disarms)."""
    options = options_from(options)
    check_not_in_runtime_dir(options.path, target.uid)
    return control.Lease.take(target.pid, ArmRequest(options), uid=target.uid)


def status(target: Target) -> CaptureStatus:
    return control.request(target.pid, StatusRequest(), uid=target.uid)


def disarm(target: Target) -> CaptureStatus:
    return control.request(target.pid, DisarmRequest(), uid=target.uid)


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (killed, not yet reaped) is dead for our purposes.
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
