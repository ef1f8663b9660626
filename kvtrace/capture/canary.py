"""A canary before every debugger injection: a debugger touches an engine only after the same
injection left a throw-away process of the same interpreter alive and answering.

Whether a debugger can call into a process depends on the host, not on kvtrace: on CPUs with
AMX, gdb 13's calls fail and kill the process they call into (issue 21). So before gdb or lldb
touches an engine, ``prove`` starts a canary: the engine's own interpreter binary
(``/proc/PID/exe``, with the engine's ``libpython``, run as the engine's user) parked like an
idle engine core, its main thread in ``queue.get()`` and two more threads asleep, one in
``time.sleep`` and one in ``select``. The same debugger then runs the same sequence on it as it
would on the engine (``inject.run_in_main_thread``: the pending call, then, the main thread
being parked, the direct call; kvtrace's own injector wakes the parked thread instead, then
queues a call while the woken main thread is busy hashing and adding, checked, as a serving
engine's is, and runs its direct call once it sleeps in ``time.sleep``) on a bootstrap file
written the same way. The canary passes when
both calls ran its answering script and it, and every thread of it, lives on; a thread that
meets an error (``OSError: [Errno 514]``, a futex failure) ends it.

A verdict is kept for ``CACHE_S`` in the operator's private runtime directory (``safe_paths``:
no links, owner and mode checked), under a key of the host (name and boot id), the kernel, the
CPU's flags, the debugger's binary and version, and the interpreter and ``libpython`` files; it
is never used on another host or another boot. A failure of the set-up (no ptrace permission,
no Python at ``/proc/PID/exe``) is raised as the engine's, since the canary shares its user and
interpreter; it is not a verdict.
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from kvtrace.capture import control
from kvtrace.capture.inject import (
    AttachError,
    Bootstrap,
    InjectionError,
    is_alive,
    main_thread_parked,
    run_in_main_thread,
)
from kvtrace.capture.safe_paths import open_private_dir, read_owned_file, replace_file

CACHE_S = 300.0
DEBUGGER_TIMEOUT_S = 60.0  # one debugger run on the canary (never on an engine)
START_TIMEOUT_S = 10.0
ANSWER_TIMEOUT_S = 10.0
GRACE_S = 0.3  # the canary's main thread is parked: its pending call cannot run before
SURVIVAL_S = 0.3  # how long the canary must live on after its last answer
MAX_CACHE_BYTES = 1 << 16

CANARY_PROGRAM = r'''
import hashlib, os, queue, select, threading, time
ANSWER_FD = 1
BUSY_S = 3.0  # after each wake-up: longer than an injection takes
WAKE = queue.Queue()
def broken(where, error):
    os.write(1, ("broken: " + where + ": " + repr(error) + "\n").encode())
    os._exit(3)
def sleeping():
    try:
        while True:
            time.sleep(3600)
    except BaseException as error:
        broken("a thread in time.sleep", error)
def polling(fd):
    try:
        select.select([fd], [], [])
        broken("a thread in select", "woken with nothing to read")
    except BaseException as error:
        broken("a thread in select", error)
def busy(seconds):
    # Hashing (vector registers) and float arithmetic, each checked: an injection that does
    # not put the interrupted state back shows here.
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if hashlib.sha256(b"kvtrace canary" * 64).hexdigest() != DIGEST:
            broken("the main thread, busy", "a wrong digest")
        if sum(i * 0.5 for i in range(100)) != 2475.0:
            broken("the main thread, busy", "a wrong sum")
DIGEST = hashlib.sha256(b"kvtrace canary" * 64).hexdigest()
quiet, _kept_open = os.pipe()
threading.Thread(target=sleeping, daemon=True).start()
threading.Thread(target=polling, args=(quiet,), daemon=True).start()
os.write(1, b"ready\n")
try:
    WAKE.get()  # parked on a lock: each injector's first call meets it
    busy(BUSY_S)  # after the first answer
    WAKE.get()
    while True:  # after the second: asleep
        time.sleep(3600)
except BaseException as error:
    broken("the main thread", error)
'''

# What the injected line runs in the canary (with the same exec as kvtrace's bootstrap): answer,
# and wake the main thread, so that a pending call still queued runs too.
CANARY_ANSWER = '''\
import os, sys
_canary = sys.modules["__main__"]
os.write(_canary.ANSWER_FD, b"answered\\n")
_canary.WAKE.put(None)
'''


@dataclass(frozen=True)
class Verdict:
    passed: bool
    detail: str  # what the canary showed
    age_s: float | None = None  # how old, when it comes from the cache

    def describe(self, debugger) -> str:
        said = "passed its canary" if self.passed else f"failed its canary: {self.detail}"
        cached = "" if self.age_s is None else f" ({self.age_s:.0f} s ago on this host)"
        return f"{debugger.label} {said}{cached}"


@dataclass(frozen=True)
class _CanaryTarget:
    """The canary as ``Bootstrap`` sees a target."""

    pid: int
    uid: int


def prove(debugger, target, log) -> Verdict:
    """Whether ``debugger``'s injection leaves a canary of ``target``'s interpreter alive and
    answering; from the cache when it was proven here in the last ``CACHE_S`` seconds."""
    executable, library = _interpreter(target.pid)
    key = _cache_key(debugger, executable, library)
    cached = _read_cache(debugger, key)
    if cached is not None:
        log(f"canary: {cached.describe(debugger)}")
        return cached
    verdict = _run_canary(debugger, target, executable, library, log)
    log(f"canary: {verdict.describe(debugger)}")
    _write_cache(debugger, key, verdict)
    return verdict


def _interpreter(pid: int) -> tuple[str, dict | None]:
    """The binary ``pid`` runs, and the ``libpython`` it mapped (None when linked in)."""
    try:
        executable = os.readlink(f"/proc/{pid}/exe")
        maps = Path(f"/proc/{pid}/maps").read_text()
    except PermissionError:
        raise AttachError(
            f"no ptrace permission for pid {pid}",
            "Run as root or with CAP_SYS_PTRACE, or use --method plugin.") from None
    except OSError as error:
        raise AttachError(f"cannot read /proc/{pid}: {error.strerror}",
                          "The process may have exited; check the pid.") from None
    if not os.path.isfile(executable):
        raise AttachError(
            f"pid {pid}'s interpreter {executable} is no longer there; kvtrace cannot try a "
            "debugger on a copy of it first",
            "Attach through the plugin (install kvtrace into vLLM's environment and restart "
            "vLLM).")
    return executable, _libpython(maps)


def _libpython(maps: str) -> dict | None:
    for line in maps.splitlines():
        fields = line.split(None, 5)
        if len(fields) == 6 and "/libpython" in fields[5]:
            return {"path": fields[5], "device": fields[3], "inode": int(fields[4])}
    return None


def _file_identity(path: str) -> dict:
    info = os.stat(path)
    return {"path": path, "device": info.st_dev, "inode": info.st_ino, "size": info.st_size,
            "mtime_ns": info.st_mtime_ns}


def _cache_key(debugger, executable: str, library: dict | None) -> dict:
    cpu_flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags")), "")
    return {"host": socket.gethostname(),
            "boot_id": Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
            "kernel": os.uname().release, "machine": os.uname().machine,
            "cpu_flags": hashlib.sha256(cpu_flags.encode()).hexdigest(),
            "debugger": debugger.identity(), "interpreter": _file_identity(executable),
            "libpython": library,
            "canary": hashlib.sha256((CANARY_PROGRAM + CANARY_ANSWER).encode()).hexdigest()}


def _cache_name(debugger, key: dict) -> str:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    return f"canary-{debugger.name}-{digest}.json"


def _read_cache(debugger, key: dict) -> Verdict | None:
    directory, uid = control.runtime_dir(os.getuid()), os.getuid()
    dir_fd = open_private_dir(directory, uid, create=True)
    try:
        name = _cache_name(debugger, key)
        data = read_owned_file(name, dir_fd, directory / name, uid, MAX_CACHE_BYTES)
    finally:
        os.close(dir_fd)
    try:
        entry = json.loads(data) if data is not None else None
        age = time.time() - entry["at"] if entry is not None else None
        if entry is None or entry["key"] != key or not 0 <= age <= CACHE_S:
            return None
        return Verdict(bool(entry["passed"]), str(entry["detail"]), age)
    except (ValueError, KeyError, TypeError):
        return None


def _write_cache(debugger, key: dict, verdict: Verdict) -> None:
    directory, uid = control.runtime_dir(os.getuid()), os.getuid()
    dir_fd = open_private_dir(directory, uid, create=True)
    try:
        entry = {"key": key, "at": time.time(), "passed": verdict.passed,
                 "detail": verdict.detail}
        with os.fdopen(replace_file(_cache_name(debugger, key), dir_fd), "w") as file:
            json.dump(entry, file)
    except FileExistsError:
        pass  # another kvtrace wrote the same verdict at the same moment
    finally:
        os.close(dir_fd)


class Canary:
    """The canary process and what it writes on its stdout: ``ready``, one ``answered`` per
    injected run, or ``broken: ...`` before it ends itself."""

    def __init__(self, executable: str, library: dict | None, uid: int, gid: int) -> None:
        env = {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"}
        if library is not None:
            env["LD_LIBRARY_PATH"] = os.path.dirname(library["path"])
        switch = ({"user": uid, "group": gid, "extra_groups": []}
                  if os.geteuid() == 0 and uid != 0 else {})
        self.process = subprocess.Popen(
            [executable, "-I", "-c", CANARY_PROGRAM], stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd="/", env=env,
            start_new_session=True, **switch)
        self.pid = self.process.pid
        self._buffer = b""
        self.lines: list[str] = []

    def next_line(self, timeout_s: float) -> str | None:
        """The next line it writes; None when the time is up or its stdout closed."""
        deadline = time.monotonic() + timeout_s
        fd = self.process.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        self.lines.append(line.decode(errors="replace"))
        return self.lines[-1]

    def answered(self, timeout_s: float) -> bool:
        """True once it answers; ``InjectionError`` if it ends instead."""
        line = self.next_line(timeout_s)
        if line == "answered":
            return True
        if line is None and is_alive(self.pid):
            return False
        raise InjectionError(f"the canary (pid {self.pid}) ended", self.how_it_ended())

    def how_it_ended(self) -> str:
        """Its exit status, and its last words (a ``broken:`` line, or stderr's last line)."""
        try:
            code = self.process.wait(timeout=2)
        except subprocess.TimeoutExpired:
            return "it stopped answering"
        how = (f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}")
        self.next_line(0.1)
        broken = [line for line in self.lines if line.startswith("broken:")]
        stderr = self.process.stderr.read().decode(errors="replace").strip().splitlines()
        said = broken[-1] if broken else (stderr[-1] if stderr else "")
        return how + (f"; it said: {said}" if said else "")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.process.stdout.close()
        self.process.stderr.close()


def _run_canary(debugger, target, executable: str, library: dict | None, log) -> Verdict:
    status = dict(line.split(":", 1) for line in
                  Path(f"/proc/{target.pid}/status").read_text().splitlines() if ":" in line)
    gid = int(status["Gid"].split()[0])
    canary = Canary(executable, library, target.uid, gid)
    log(f"canary: pid {canary.pid} runs {executable} as uid {target.uid}, parked like an idle "
        f"engine core; {debugger.label} injects into it first")
    bootstrap = None
    try:
        if canary.next_line(START_TIMEOUT_S) != "ready":
            raise AttachError(
                f"cannot start a canary of pid {target.pid}'s interpreter {executable} "
                f"({canary.how_it_ended()})",
                "kvtrace attaches only to Python processes; check the pid, or use the plugin.")
        _check_same_library(canary.pid, library, target.pid)
        _wait_until_parked(canary.pid)
        bootstrap = Bootstrap(_CanaryTarget(canary.pid, target.uid), CANARY_ANSWER)
        bootstrap.write()
        outputs: list[str] = []

        def record(message: str) -> None:
            outputs.append(message)
            log(message)

        try:
            how = run_in_main_thread(debugger, canary.pid, bootstrap.run_string,
                                     canary.answered, record, named_pid=target.pid,
                                     grace_s=GRACE_S, timeout_s=DEBUGGER_TIMEOUT_S)
            if how == "direct call" and not canary.answered(ANSWER_TIMEOUT_S):
                return Verdict(False, "it ran the direct call but never its pending call")
            if debugger.wakes:  # its other paths: a busy main thread, then a sleeping one
                run_in_main_thread(debugger, canary.pid, bootstrap.run_string,
                                   canary.answered, record, named_pid=target.pid,
                                   grace_s=GRACE_S, timeout_s=DEBUGGER_TIMEOUT_S)
                _wait_until_parked(canary.pid)
                if run_in_main_thread(debugger, canary.pid, bootstrap.run_string,
                                      canary.answered, record, named_pid=target.pid,
                                      grace_s=GRACE_S,
                                      timeout_s=DEBUGGER_TIMEOUT_S) != "direct call":
                    return Verdict(False, "its sleeping main thread ran a pending call, not "
                                          "the direct call")
            time.sleep(SURVIVAL_S)
            if not is_alive(canary.pid):
                raise InjectionError("the canary ended after answering")
        except InjectionError:
            said = debugger.failure("\n".join(outputs))
            what = ("it did not run the injected code" if is_alive(canary.pid)
                    else f"it died ({canary.how_it_ended()})")
            return Verdict(False, what + (f"; {debugger.name} said: {said}" if said else ""))
        if debugger.wakes:
            return Verdict(True, "its main thread ran a pending call woken from a lock and one "
                                 "busy, and a direct call asleep, and it lived on")
        return Verdict(True, "it answered a direct call and a pending call and lived on")
    finally:
        canary.stop()
        if bootstrap is not None:
            bootstrap.remove()
            bootstrap.close()


def _check_same_library(canary_pid: int, library: dict | None, target_pid: int) -> None:
    ran = _libpython(Path(f"/proc/{canary_pid}/maps").read_text())
    same = (ran is None) if library is None else (
        ran is not None and (ran["device"], ran["inode"]) == (library["device"],
                                                              library["inode"]))
    if not same:
        raise AttachError(
            f"the canary of pid {target_pid} loaded {ran and ran['path']}, not the engine's "
            f"{library and library['path']}; kvtrace cannot try the debugger on the same code",
            "Attach through the plugin (install kvtrace into vLLM's environment).")


def _wait_until_parked(pid: int) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not main_thread_parked(pid):
        if time.monotonic() > deadline:
            raise AttachError(f"the canary (pid {pid}) never parked its main thread",
                              "The host may be overloaded; retry in a moment.")
        time.sleep(0.02)
