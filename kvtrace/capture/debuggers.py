"""The injectors kvtrace gets its hook in with when no plugin runs: its own (``ptrace``), gdb
and lldb, under the same safety rules.

Each makes the target run one line of Python (``code``) in one of two ways, and nothing else.
``ptrace`` (``ptrace.py``) holds the main thread alone, for milliseconds, and its pending call
wakes a main thread parked in a futex wait; a debugger stops every thread for seconds while it
attaches. The two ways:

* ``schedule_pending_call``: call ``mmap`` for a fresh page, write ``code`` into it, and call
  ``Py_AddPendingCall(PyRun_SimpleString, page)``. CPython runs it at its next safe point in
  the main thread; nothing of ours runs while the target is stopped somewhere arbitrary.
* ``run_directly``: only for a main thread parked in a blocking syscall (the caller checks
  ``/proc``). The debugger first walks the main thread's stack and refuses, touching nothing,
  when it is inside the allocator (running Python there deadlocked a target for good,
  reference/environment-notes.md section 3a; ``ptrace``, which walks no stack, refuses every
  futex wait instead); otherwise it calls ``PyGILState_Ensure``,
  ``PyRun_SimpleString(code)`` and ``PyGILState_Release`` in the main thread.

During a call every thread of the target runs (gdb's default; lldb's ``SetStopOthers(False)``),
so a thread holding the GIL can drop it. No call is ever timed out mid-flight: an interrupted
call leaves the target stopped inside it. The debugger runs in its own session, so a Ctrl-C
meant for kvtrace does not reach it, and kvtrace waits for it to finish.

Whether a debugger's calls work at all depends on the host: on CPUs with AMX, gdb 13's calls
fail ("Couldn't write extended state status: Bad address") and kill the target. ``canary.py``
proves a debugger on a throw-away process before it touches an engine.
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
from functools import cached_property
from pathlib import Path
from typing import Callable

from kvtrace import children
from kvtrace.capture.inject import AttachError, InjectionError

# Frame-name prefixes of glibc's allocator: a main thread stopped under one of them is refused.
ALLOCATOR_FRAMES = ("malloc", "_int_", "free", "__libc_malloc", "__libc_free", "arena_")
IN_ALLOCATOR = "KVTRACE_IN_ALLOCATOR"
CALL_FAILED = "KVTRACE_CALL_FAILED"
NO_PTRACE = ("ptrace: Operation not permitted", "Could not attach to process",
             "Operation not permitted")
Log = Callable[[str], None]


def c_string(text: str) -> str:
    """``text`` as the inside of a C string literal (for a debugger's expression)."""
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Debugger:
    """One installed debugger: its binary, its version, and the two ways it injects."""

    name = ""
    install_hint = ""
    wakes = False  # whether its pending call wakes a main thread parked in a futex wait
    failure_line: re.Pattern  # a line of its output saying that a call or the attach failed

    def __init__(self, binary: str) -> None:
        self.binary = binary

    @classmethod
    def find(cls) -> "Debugger":
        """The debugger on PATH; ``AttachError`` if it is not installed."""
        binary = shutil.which(cls.name)
        if binary is None:
            raise AttachError(f"{cls.name} is not installed", cls.install_hint)
        return cls(binary)

    @cached_property
    def version(self) -> str:
        """The version its ``--version`` prints (e.g. ``13.1``), or its first line."""
        try:
            result = subprocess.run([self.binary, "--version"], capture_output=True, text=True,
                                    timeout=30, stdin=subprocess.DEVNULL, check=False)
        except (OSError, subprocess.TimeoutExpired) as error:
            return f"unknown ({error})"
        first = (result.stdout or result.stderr).strip().splitlines()[:1]
        match = re.search(r"\d+\.\d+(?:\.\d+)?", first[0]) if first else None
        return match.group(0) if match else (first[0] if first else "unknown")

    @property
    def label(self) -> str:
        return f"{self.name} {self.version}"

    def failure(self, output: str) -> str | None:
        """The first line of its output that reports a failure; None if none does."""
        for line in output.splitlines():
            line = line.strip()
            if self.failure_line.search(line):
                return line.removeprefix(CALL_FAILED + ": ")
        return None

    def identity(self) -> dict:
        """What tells this debugger apart from another build of it (for the canary's cache)."""
        real = os.path.realpath(self.binary)
        info = os.stat(real)
        sequence = self._pending_call_command(0, "") + self._direct_command(0, "")
        return {"path": real, "inode": info.st_ino, "size": info.st_size,
                "mtime_ns": info.st_mtime_ns, "version": self.version,
                "sequence": hashlib.sha256("\0".join(sequence).encode()).hexdigest()}

    def schedule_pending_call(self, pid: int, code: str, log: Log, named_pid: int,
                              timeout_s: float | None) -> str:
        """Queue ``code`` with ``Py_AddPendingCall`` from a fresh page; the debugger's output."""
        return self._run(self._pending_call_command(pid, code), log, named_pid, timeout_s)

    def run_directly(self, pid: int, code: str, log: Log, named_pid: int,
                     timeout_s: float | None) -> str:
        """Run ``code`` under ``PyGILState_Ensure`` unless the main thread is in the allocator."""
        output = self._run(self._direct_command(pid, code), log, named_pid, timeout_s)
        if IN_ALLOCATOR in output.splitlines():
            raise AttachError(f"pid {named_pid}'s main thread is inside the memory allocator",
                              "Try again in a moment; kvtrace will not inject there.")
        return output

    def _pending_call_command(self, pid: int, code: str) -> list[str]:
        raise NotImplementedError

    def _direct_command(self, pid: int, code: str) -> list[str]:
        raise NotImplementedError

    def _environment(self) -> dict[str, str] | None:
        return None

    def _run(self, command: list[str], log: Log, named_pid: int, timeout_s: float | None) -> str:
        """Run the debugger to its end (``timeout_s`` only for a canary: a call is never
        interrupted in an engine); raise the failures every later step would meet too."""
        log("$ " + shlex.join(command))
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                   env=self._environment())
        try:
            output, _ = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            raise InjectionError(f"{self.label} did not finish within {timeout_s:.0f} s",
                              "Run with -v to see its output.") from None
        except KeyboardInterrupt:
            log(f"waiting for {self.name} to finish: a call is never interrupted mid-flight")
            output, _ = process.communicate()
        log(output)
        if any(marker in output for marker in NO_PTRACE):
            raise AttachError(
                f"no ptrace permission for pid {named_pid}",
                "Run as root or with CAP_SYS_PTRACE (check /proc/sys/kernel/yama/ptrace_scope), "
                "or use --method plugin.")
        if self._no_symbols(output):
            raise AttachError(f"{self.name} found no CPython symbols in pid {named_pid}",
                              "The target's Python must export its C API; use --method plugin.")
        return output

    def _no_symbols(self, output: str) -> bool:
        raise NotImplementedError


class Gdb(Debugger):
    name = "gdb"
    install_hint = "Install gdb (apt-get install gdb), or use --method plugin or --method lldb."
    failure_line = re.compile(r"^(?!warning).*(couldn't|cannot|could not|error|signaled|"
                              r"terminated|exited|not permitted)", re.IGNORECASE)

    def _base(self, pid: int) -> list[str]:
        return [self.binary, "-p", str(pid), "-batch", "-nx", "-q", "-iex",
                "set auto-solib-add off", "-ex", "sharedlibrary libpython3", "-ex",
                "sharedlibrary libc.so"]

    def _pending_call_command(self, pid: int, code: str) -> list[str]:
        return self._base(pid) + [
            "-ex", "set $buf = (char*)(long)mmap(0, 65536, 3, 0x22, -1, 0)",
            "-ex", f"python gdb.selected_inferior().write_memory("
                   f"int(gdb.parse_and_eval('$buf')), {code.encode()!r} + b'\\0')",
            "-ex", "call (int)Py_AddPendingCall((int(*)(void*))PyRun_SimpleString, (void*)$buf)",
        ]

    def _direct_command(self, pid: int, code: str) -> list[str]:
        return self._base(pid) + [
            "-ex", "thread 1", "-ex", f"python exec({GDB_ALLOCATOR_CHECK!r})",
            "-ex", "call (int)PyGILState_Ensure()",
            "-ex", f'call (int)PyRun_SimpleString("{c_string(code)}")',
            "-ex", "call (void)PyGILState_Release($1)",
        ]

    def _no_symbols(self, output: str) -> bool:
        return ('No symbol "Py_AddPendingCall"' in output
                or 'No symbol "PyRun_SimpleString"' in output)


# Prints the marker and detaches when the selected (main) thread is inside the allocator.
GDB_ALLOCATOR_CHECK = f"""\
frame, names = gdb.selected_frame(), []
while frame is not None:
    names.append(frame.name() or "")
    frame = frame.older()
if any(n.startswith({ALLOCATOR_FRAMES!r}) for n in names):
    print({IN_ALLOCATOR!r})
    gdb.execute("detach")
    gdb.execute("quit")
"""


# lldb's wait for its lldb-server, in seconds (the first packet waits at least 6): on a loaded
# 2-core host the default, 5, failed an attach whose canary had just passed ("failed to get
# reply to handshake packet within timeout of 9.7 seconds"). A canary run allows 60.
LLDB_PACKET_S = 30


class Lldb(Debugger):
    """Debian's ``lldb``. The whole sequence runs in lldb's embedded Python (``LLDB_PROGRAM``),
    whose module Debian's lldb 14 does not find by itself (``lldb -P`` names a directory that
    does not exist): kvtrace points ``PYTHONPATH`` at the one beside the binary."""

    name = "lldb"
    install_hint = "Install lldb (apt-get install lldb), or use --method plugin or --method gdb."
    failure_line = re.compile(rf"^({CALL_FAILED}|error:|Process \d+ exited)")

    def _command(self, pid: int, mode: str, code: str) -> list[str]:
        program = LLDB_PROGRAM.format(pid=pid, mode=mode, code=code.encode(),
                                      call=c_string(code))
        return [self.binary, "--batch", "--no-lldbinit",
                "-O", "settings set interpreter.echo-commands false",
                "-O", "settings set target.preload-symbols false",
                "-O", f"settings set plugin.process.gdb-remote.packet-timeout {LLDB_PACKET_S}",
                "-p", str(pid), "-o", f"script exec({program!r})"]

    def _pending_call_command(self, pid: int, code: str) -> list[str]:
        return self._command(pid, "pending", code)

    def _direct_command(self, pid: int, code: str) -> list[str]:
        return self._command(pid, "direct", code)

    @cached_property
    def python_path(self) -> str | None:
        """The directory holding lldb's Python module, when lldb would not find it itself."""
        try:
            named = subprocess.run([self.binary, "-P"], capture_output=True, text=True,
                                   timeout=30, stdin=subprocess.DEVNULL,
                                   check=False).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            named = ""
        if named and Path(named, "lldb", "embedded_interpreter.py").is_file():
            return None
        llvm = Path(os.path.realpath(self.binary)).parent.parent
        found = sorted(glob.glob(str(llvm / "lib" / "python3*" / "*-packages" / "lldb" /
                                     "embedded_interpreter.py")))
        return str(Path(found[-1]).parent.parent) if found else None

    def _environment(self) -> dict[str, str] | None:
        if self.python_path is None:
            return None
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
        env["PYTHONPATH"] = self.python_path
        return env

    def _no_symbols(self, output: str) -> bool:
        return bool(re.search(r"use of undeclared identifier '(Py_AddPendingCall|"
                              r"PyRun_SimpleString|PyGILState_Ensure)'", output))


# Runs inside lldb's Python, attached to the target; formatted with pid, mode, code (bytes) and
# call (code as a C string). Each C function is called through its address with its declared
# type, which works with or without the interpreter's debug info. Every call runs all threads,
# with no timeout; a failed call prints CALL_FAILED, and a PyGILState_Ensure that succeeded is
# always released.
LLDB_PROGRAM = f"""\
import lldb
def _kvtrace(pid, mode, code, call_code):
    target = lldb.debugger.GetSelectedTarget()
    process = target.GetProcess()
    main = process.GetThreadByID(pid)
    process.SetSelectedThread(main)
    options = lldb.SBExpressionOptions()
    options.SetStopOthers(False)
    options.SetTryAllThreads(True)
    options.SetTimeoutInMicroSeconds(0)
    options.SetIgnoreBreakpoints(True)
    frame = main.GetFrameAtIndex(0)
    def function(name, signature):
        for found in target.FindSymbols(name):
            symbol = found.GetSymbol()
            if symbol.GetType() == lldb.eSymbolTypeCode:
                address = symbol.GetStartAddress().GetLoadAddress(target)
                return "((%s)%d)" % (signature, address)
        print({CALL_FAILED!r} + ": no symbol " + name)
        return None
    def call(name, signature, arguments, void=False):
        pointer = function(name, signature)
        if pointer is None:
            return None
        value = frame.EvaluateExpression(pointer + "(" + arguments + ")", options)
        error = value.GetError()
        if error.Fail() and not (void and error.GetError() == 0x1001):  # 0x1001: no result
            print({CALL_FAILED!r} + ": " + name + ": " + str(error.GetCString()).strip())
            return None
        return value
    try:
        if mode == "pending":
            page = call("mmap", "void *(*)(void *, unsigned long, int, int, int, long)",
                        "0, 65536, 3, 0x22, -1, 0")
            run = function("PyRun_SimpleString", "int (*)(const char *)")
            if page is None or run is None:
                return
            error = lldb.SBError()
            process.WriteMemory(page.GetValueAsUnsigned(), code + b"\\0", error)
            if error.Fail():
                print({CALL_FAILED!r} + ": writing the page: " + str(error.GetCString()))
                return
            call("Py_AddPendingCall", "int (*)(void *, void *)",
                 "(void *)%s, (void *)%d" % (run, page.GetValueAsUnsigned()))
            return
        if any((f.GetFunctionName() or "").startswith({ALLOCATOR_FRAMES!r}) for f in main):
            print({IN_ALLOCATOR!r})
            return
        state = call("PyGILState_Ensure", "int (*)(void)", "")
        if state is None:
            return
        try:
            call("PyRun_SimpleString", "int (*)(const char *)", '"%s"' % call_code)
        finally:
            call("PyGILState_Release", "void (*)(int)", str(state.GetValueAsSigned()),
                 void=True)
    finally:
        process.Detach()
_kvtrace({{pid}}, {{mode!r}}, {{code!r}}, {{call!r}})
"""

class Ptrace(Debugger):
    """kvtrace's own injector (``ptrace.py``), run as an isolated ``python -m
    kvtrace.capture.ptrace`` (``kvtrace.children``) in a session of its own, like a debugger.
    Its pending call wakes a main thread parked in a futex wait; its direct call runs only in
    one parked in another blocking syscall, and does nothing, saying so, elsewhere (the
    pending call then runs when the thread wakes)."""

    name = "ptrace"
    wakes = True
    failure_line = re.compile(rf"^({CALL_FAILED}|ptrace:)")

    @classmethod
    def find(cls) -> "Ptrace":
        if os.uname().machine != "x86_64" or not sys.platform.startswith("linux"):
            raise AttachError("kvtrace's own injector runs on x86-64 Linux only",
                              "Use --method lldb or --method gdb, or the plugin.")
        return cls(sys.executable)

    @cached_property
    def version(self) -> str:
        import kvtrace

        return kvtrace.__version__

    @property
    def label(self) -> str:
        return f"kvtrace's injector {self.version}"

    def identity(self) -> dict:
        """Its interpreter and the source of the sequence it runs."""
        from kvtrace.capture import elf_symbols, ptrace

        source = b"".join(Path(module.__file__).read_bytes() for module in (ptrace, elf_symbols))
        real = os.path.realpath(self.binary)
        return {"path": real, "inode": os.stat(real).st_ino, "version": self.version,
                "sequence": hashlib.sha256(source).hexdigest()}

    def _pending_call_command(self, pid: int, code: str) -> list[str]:
        return children.python("-m", "kvtrace.capture.ptrace", str(pid), "pending", code)

    def _direct_command(self, pid: int, code: str) -> list[str]:
        return children.python("-m", "kvtrace.capture.ptrace", str(pid), "direct", code)

    def _environment(self) -> dict[str, str]:
        return children.child_environment()

    def _no_symbols(self, output: str) -> bool:
        return bool(re.search(r"exports no .*(Py_AddPendingCall|PyRun_SimpleString)", output))


# Each injector's class by its --method name (``attach_methods.INJECTORS`` gives the order).
DEBUGGERS: dict[str, type[Debugger]] = {debugger.name: debugger for debugger in (Ptrace, Gdb, Lldb)}
