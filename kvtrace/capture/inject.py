"""Getting one line of Python run in another process's main thread through a debugger: the
sequence both an engine and its canary (``canary.py``) go through, and the bootstrap file that
line runs.

The sequence (``run_in_main_thread``): the debugger schedules the line as a pending call, which
CPython runs at its next safe point. An idle engine core never reaches one (its main thread
waits in ``input_queue.get()``), so if nothing answered after a grace period and the main
thread is parked in a blocking syscall, the debugger runs the line directly (outside the
allocator only, ``debuggers.py``). The line runs the bootstrap file, which must be idempotent:
the pending call may still run later.

A process that died is said to have died, whichever step it died in.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable

from kvtrace.capture import control
from kvtrace.capture.control import is_alive
from kvtrace.capture.safe_paths import (
    open_private_dir,
    read_owned_file,
    remove_if_there,
    replace_file,
)
from kvtrace.errors import KvtraceError

PENDING_CALL_GRACE_S = 3.0
SETTLE_S = 0.3  # how long a process is watched after each debugger run
BOOTSTRAP_WAIT_S = 10.0
# Syscalls an idle main thread waits in (x86-64 numbers): read, poll, select, nanosleep,
# recvfrom, futex, epoll_wait, clock_nanosleep, pselect6, ppoll, epoll_pwait, epoll_pwait2.
BLOCKING_SYSCALLS = {0, 7, 23, 35, 45, 202, 232, 230, 270, 271, 281, 441}
MAX_BOOTSTRAP_REPORT_BYTES = 1 << 16


class AttachError(KvtraceError):
    """Attaching to a process failed; the message says why and the hint what to do."""


class InjectionError(AttachError):
    """The debugger ran, but the process did not run the code: it died, never answered, or the
    debugger never finished (what a canary is run to find out)."""


def main_thread_parked(pid: int) -> bool:
    """Whether the main thread sleeps in a blocking syscall (GIL released, not mid-bytecode)."""
    try:
        state = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        syscall = Path(f"/proc/{pid}/task/{pid}/syscall").read_text().split()[0]
    except (OSError, IndexError):
        return False
    return state == "S" and syscall.isdigit() and int(syscall) in BLOCKING_SYSCALLS


class Bootstrap:
    """A script the process ``target`` (``.pid``, ``.uid``) is made to run, and the file it
    reports a failure in, in the target user's private runtime directory (made, or checked, on
    creation). By default the script starts kvtrace's control server; a canary's answers."""

    def __init__(self, target, text: str | None = None) -> None:
        self.target = target
        directory = control.runtime_dir(target.uid)
        self.script = directory / f"inject-{target.pid}.py"
        self.report = directory / f"inject-{target.pid}.err"
        self._text = BOOTSTRAP.format(error_file=str(self.report)) if text is None else text
        self._dir_fd = open_private_dir(directory, target.uid, create=True)

    def write(self) -> None:
        """Write the script afresh (whatever had its name is removed, not followed)."""
        remove_if_there(self.report.name, self._dir_fd)
        with os.fdopen(replace_file(self.script.name, self._dir_fd), "w") as script:
            if os.geteuid() == 0 and self.target.uid != 0:
                os.fchown(script.fileno(), self.target.uid, -1)
            script.write(self._text)

    @property
    def run_string(self) -> str:
        """The line of Python that runs the script, as the debugger hands it to the target."""
        return f"exec(open({str(self.script)!r}).read(), {{'__name__': 'kvtrace_bootstrap'}})"

    def failure(self) -> dict | None:
        """What the bootstrap reported, if it failed and finished writing the report."""
        data = read_owned_file(self.report.name, self._dir_fd, self.report, self.target.uid,
                               MAX_BOOTSTRAP_REPORT_BYTES)
        try:
            return None if data is None else json.loads(data)
        except ValueError:
            return None

    def remove(self) -> None:
        remove_if_there(self.script.name, self._dir_fd)

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


def died(pid: int, debugger, output: str) -> InjectionError:
    """The error for a process that died while ``debugger`` injected into it."""
    said = debugger.failure(output)
    return InjectionError(f"pid {pid} died while {debugger.label} was injecting into it"
                       + (f" ({debugger.name} said: {said})" if said else ""),
                       "Check the engine's log; attach with --method plugin or another "
                       "--method next time.")


def run_in_main_thread(debugger, pid: int, code: str, answered: Callable[[float], bool],
                       log: Callable[[str], None], named_pid: int | None = None,
                       grace_s: float = PENDING_CALL_GRACE_S,
                       timeout_s: float | None = None) -> str:
    """Have ``pid`` run ``code`` through ``debugger``; "pending call" or "direct call", the way
    it ran. ``answered(seconds)`` waits until the process answers (True) or the time is up.
    Errors name ``named_pid`` (a canary's engine); ``timeout_s`` bounds a canary's debugger."""
    named_pid = pid if named_pid is None else named_pid

    def step(run) -> None:
        output = run(pid, code, log, named_pid, timeout_s)
        settled = time.monotonic() + SETTLE_S  # a process the call broke may die on resuming
        while time.monotonic() < settled:
            if not is_alive(pid):
                raise died(pid, debugger, output)
            time.sleep(0.02)

    step(debugger.schedule_pending_call)
    if answered(grace_s):
        return "pending call"
    if not main_thread_parked(pid):
        if answered(BOOTSTRAP_WAIT_S):
            return "pending call"
        raise InjectionError(f"pid {pid} did not reach a safe point to run kvtrace",
                          "Its main thread is busy in native code; retry in a moment.")
    log(f"pid {pid}'s main thread is idle in a syscall; running the bootstrap directly")
    step(debugger.run_directly)
    if answered(BOOTSTRAP_WAIT_S):
        return "direct call"
    raise InjectionError(f"pid {pid} did not start kvtrace after injection",
                      f"Run with -v to see {debugger.name}'s output.")
