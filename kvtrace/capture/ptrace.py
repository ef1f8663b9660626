"""kvtrace's own injector: have one line of Python run in a process's main thread, holding that
one thread for milliseconds (``python -m kvtrace.capture.ptrace PID pending|direct CODE``,
isolated as ``kvtrace.children`` starts every child Python).

A debugger stops every thread of the target while it loads symbols and compiles its
expressions: lldb held a serving ``kvtrace engine`` 5-9 s and a real ``vllm serve`` about 7 s
(docs/performance.md). This needs neither. The addresses of ``mmap`` and of CPython's C API
are read from the mapped ELF files first, while the target runs (``elf_symbols``). Then, on
the main thread alone (``PTRACE_SEIZE`` + ``PTRACE_INTERRUPT``; every other thread runs on):

1. its registers and its whole extended (x87/SSE/AVX/AMX) state are saved;
2. ``mmap`` gives a fresh page, which the line is written into through ``/proc/PID/mem``;
3. ``pending``: ``Py_AddPendingCall(PyRun_SimpleString, page)`` queues it, and CPython runs it
   at its next safe point. Neither call takes a lock the interrupted thread could hold, except
   CPython's pending-call lock, which the main thread holds only while it runs pending calls,
   and only injectors queue those. ``direct`` (the caller saw, in ``/proc``, a main thread
   parked in a blocking syscall that the pending call did not wake): ``PyGILState_Ensure``,
   ``PyRun_SimpleString(page)``, ``PyGILState_Release``, the way a debugger's direct call
   does; refused in a futex wait, which may be the allocator's lock;
4. everything saved is put back, and the thread goes on where it was. A thread that was
   parked in a syscall the kernel would restart is handed ``EINTR`` instead: a futex wait (an
   idle engine core's ``queue.get()``) then returns to CPython's lock acquire, which runs the
   pending call before it waits again, as after a signal (other futex waiters take ``EINTR``
   as the spurious wake-up futexes allow), and no restart reads a restart block that the
   calls' own syscalls may have replaced. Python retries its other waits on ``EINTR``.

Each call returns to address 0, which faults; the fault is taken as the call's end and never
delivered. A signal that arrives for the thread meanwhile is held and delivered at the detach.
A call is never abandoned mid-flight: the process waits for it, with the stop signals blocked
(the CLI waits too). x86-64 Linux only; the canary proves each path on each host first.
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import sys
import time

from kvtrace.capture.elf_symbols import resolve
from kvtrace.capture.inject import AttachError

PTRACE_CONT, PTRACE_DETACH = 7, 17
PTRACE_GETREGS, PTRACE_SETREGS = 12, 13
PTRACE_GETFPREGS, PTRACE_SETFPREGS = 14, 15
PTRACE_GETREGSET, PTRACE_SETREGSET = 0x4204, 0x4205
PTRACE_SEIZE, PTRACE_INTERRUPT = 0x4206, 0x4207
NT_X86_XSTATE = 0x202
WALL = 0x40000000
SYS_FUTEX = 202
# What a wait the kernel would restart holds in rax: ERESTARTSYS, ERESTARTNOINTR,
# ERESTARTNOHAND, ERESTART_RESTARTBLOCK. All but ERESTARTNOINTR may return EINTR (as after a
# signal handler); that one must restart, and uses no restart block.
RESTART_CODES = (512, 513, 514, 516)
MUST_RESTART = 513
STACK_GAP = 512  # below the interrupted frame's red zone (128 bytes) and then some
XSTATE_BYTES = 1 << 16  # larger than any CPU's XSAVE area (AMX's is about 11 KiB)
PAGE = 65536
FAILED = "KVTRACE_CALL_FAILED"
HELD = "KVTRACE_HELD_MS"
NOT_RUN = "KVTRACE_NOT_RUN"
PYTHON_FUNCTIONS = ("Py_AddPendingCall", "PyRun_SimpleString", "PyGILState_Ensure",
                    "PyGILState_Release")
STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT}
FAULTS = {signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGTRAP}


class Registers(ctypes.Structure):
    """Linux's ``struct user_regs_struct`` on x86-64."""

    _fields_ = [(name, ctypes.c_ulonglong) for name in (
        "r15 r14 r13 r12 rbp rbx r11 r10 r9 r8 rax rcx rdx rsi rdi orig_rax rip cs eflags rsp "
        "ss fs_base gs_base ds es fs gs").split()]


class IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
_libc.ptrace.restype = ctypes.c_long


def _ptrace(request: int, pid: int, address=None, data=None) -> None:
    if _libc.ptrace(request, pid, address, data) == -1:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


class Died(Exception):
    """The process ended while it was held."""


class MainThread:
    """The main thread of ``pid``, seized and held for the length of a ``with`` block."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.held_signals: list[int] = []
        self.held_since = 0.0

    def __enter__(self) -> "MainThread":
        _ptrace(PTRACE_SEIZE, self.pid, None, None)
        _ptrace(PTRACE_INTERRUPT, self.pid)
        self.held_since = time.monotonic()
        self._wait_for_stop()
        self._memory = os.open(f"/proc/{self.pid}/mem", os.O_RDWR)
        return self

    def __exit__(self, kind, *exc) -> None:
        os.close(self._memory)
        if kind is Died:
            return
        first, *later = self.held_signals or [0]
        try:
            _ptrace(PTRACE_DETACH, self.pid, None, first)
        except ProcessLookupError:
            return
        for number in later:
            os.kill(self.pid, number)

    def _wait(self) -> int:
        """The next stop's status; ``Died`` when the process ended instead."""
        _, status = os.waitpid(self.pid, WALL)
        if os.WIFEXITED(status) or os.WIFSIGNALED(status):
            raise Died(os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
        return status

    def _wait_for_stop(self) -> None:
        status = self._wait()
        if status >> 16 == 0:  # a signal arrived before the interrupt: held, and this stop used
            self.held_signals.append(os.WSTOPSIG(status))

    def registers(self) -> Registers:
        registers = Registers()
        _ptrace(PTRACE_GETREGS, self.pid, None, ctypes.byref(registers))
        return registers

    def set_registers(self, registers: Registers) -> None:
        _ptrace(PTRACE_SETREGS, self.pid, None, ctypes.byref(registers))

    def extended_state(self) -> tuple[int, ctypes.Array]:
        """The whole XSAVE area (or, without XSAVE, the FXSAVE one): how to put it back."""
        buffer = ctypes.create_string_buffer(XSTATE_BYTES)
        vector = IoVec(ctypes.cast(buffer, ctypes.c_void_p), XSTATE_BYTES)
        try:
            _ptrace(PTRACE_GETREGSET, self.pid, NT_X86_XSTATE, ctypes.byref(vector))
            return vector.length, buffer
        except OSError as error:
            if error.errno not in (errno.EINVAL, errno.ENODEV, errno.EIO):
                raise
        _ptrace(PTRACE_GETFPREGS, self.pid, None, buffer)
        return 0, buffer

    def set_extended_state(self, saved: tuple[int, ctypes.Array]) -> None:
        length, buffer = saved
        if length == 0:
            _ptrace(PTRACE_SETFPREGS, self.pid, None, buffer)
            return
        vector = IoVec(ctypes.cast(buffer, ctypes.c_void_p), length)
        _ptrace(PTRACE_SETREGSET, self.pid, NT_X86_XSTATE, ctypes.byref(vector))

    def write(self, address: int, data: bytes) -> None:
        if os.pwrite(self._memory, data, address) != len(data):
            raise OSError(errno.EIO, f"short write at {address:#x}")

    def call(self, saved: Registers, function: int, *arguments: int) -> int:
        """``function(*arguments)`` on the thread's own stack, below the interrupted frame;
        its return value (rax). The registers are left as the call left them."""
        registers = Registers.from_buffer_copy(saved)
        stack = ((saved.rsp - STACK_GAP) & ~0xF) - 8  # as after a call: rsp + 8 is aligned
        self.write(stack, (0).to_bytes(8, "little"))  # the return address: 0, which faults
        registers.rsp, registers.rip, registers.rax = stack, function, 0
        registers.orig_rax = (1 << 64) - 1  # not in a syscall: nothing to restart
        registers.eflags &= ~0x400  # the ABI's clear direction flag
        for name, value in zip(("rdi", "rsi", "rdx", "rcx", "r8", "r9"), arguments):
            setattr(registers, name, value & ((1 << 64) - 1))
        self.set_registers(registers)
        _ptrace(PTRACE_CONT, self.pid, None, 0)
        while True:
            status = self._wait()
            number, event = os.WSTOPSIG(status), status >> 16
            if event:
                _ptrace(PTRACE_CONT, self.pid, None, 0)
                continue
            if number in FAULTS:
                after = self.registers()
                if number == signal.SIGSEGV and after.rip == 0:
                    return after.rax
                raise AttachError(f"the call at {function:#x} faulted "
                                  f"({signal.Signals(number).name} at {after.rip:#x})",
                                  "The process was put back as it was; use --method plugin.")
            self.held_signals.append(number)
            _ptrace(PTRACE_CONT, self.pid, None, 0)


def inject(pid: int, code: str, direct: bool, log=print) -> None:
    """Have ``pid``'s main thread run ``code`` (the module docstring's sequence): queued as a
    pending call, or with ``direct`` run at once under ``PyGILState_Ensure``, which only a
    thread parked in a blocking syscall other than a futex wait gets."""
    found = resolve(pid, set(PYTHON_FUNCTIONS), {"mmap"})
    with MainThread(pid) as thread:
        saved, state = thread.registers(), thread.extended_state()
        restart = -ctypes.c_int64(saved.rax).value
        parked = saved.orig_rax != (1 << 64) - 1 and restart in RESTART_CODES
        if direct and (not parked or saved.orig_rax == SYS_FUTEX):
            # Woken meanwhile (its pending call runs), or waiting on a lock, perhaps inside
            # the allocator, where no Python may run: nothing is called.
            log(f"{NOT_RUN}: the main thread is {'waiting on a lock' if parked else 'running'}")
            return
        try:
            page = thread.call(saved, found["mmap"], 0, PAGE, 3, 0x22, (1 << 64) - 1, 0)
            if page >= (1 << 64) - 4096:
                raise AttachError(f"mmap in pid {pid} failed", "The process may be out of "
                                  "memory; use --method plugin.")
            thread.write(page, code.encode() + b"\0")
            if direct:
                gil = thread.call(saved, found["PyGILState_Ensure"])
                ran = ctypes.c_int32(thread.call(saved, found["PyRun_SimpleString"],
                                                 page)).value
                thread.call(saved, found["PyGILState_Release"], gil)
            else:
                ran = ctypes.c_int32(thread.call(saved, found["Py_AddPendingCall"],
                                                 found["PyRun_SimpleString"], page)).value
        except Died:
            raise
        except BaseException:
            thread.set_extended_state(state)
            thread.set_registers(saved)
            raise
        thread.set_extended_state(state)
        handed_eintr = parked and restart != MUST_RESTART
        if handed_eintr:  # not a restart: the restart block may be another syscall's by now,
            # and a futex waiter must come back to run the call
            saved.rax, saved.orig_rax = -errno.EINTR & ((1 << 64) - 1), (1 << 64) - 1
        thread.set_registers(saved)
        held_ms = (time.monotonic() - thread.held_since) * 1000
    if ran != 0:
        raise AttachError(f"pid {pid} could not queue the call: its pending-call queue is full"
                          if not direct else f"the code run in pid {pid} raised",
                          "Retry in a moment." if not direct else "Run with -v.")
    log(f"{HELD}: {held_ms:.2f} (the main thread only; "
        f"{'handed EINTR in its wait' if handed_eintr else 'resumed where it was'})")


def main(argv: list[str]) -> int:
    """``PID pending|direct CODE``: what a run printed is read by ``debuggers.Ptrace``."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    pid, mode, code = int(argv[0]), argv[1], argv[2]
    try:
        inject(pid, code, direct=mode == "direct")
    except AttachError as error:
        print(f"{FAILED}: {error}")
        return 1
    except Died as died:
        print(f"{FAILED}: pid {pid} exited ({died})")
        return 1
    except OSError as error:
        if error.errno == errno.EPERM:
            print(f"ptrace: Operation not permitted ({error})")
        else:
            print(f"{FAILED}: ptrace on pid {pid}: {error}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
