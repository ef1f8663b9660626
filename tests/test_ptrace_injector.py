"""kvtrace's own injector (``kvtrace.capture.ptrace``): the addresses it reads from ELF files
are the dynamic linker's; one injection holds only the main thread, for milliseconds, in a
parked and in a busy target, which compute on correctly and wake as before; a file that is not
the mapped one, or not an ELF kvtrace reads, is one error; the stop sampler sees a stop that
lasts."""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from debugger_support import SYSTEM_PYTHON, needs_ptrace

from kvtrace.capture.debuggers import Ptrace
from kvtrace.capture.elf_symbols import Mapping, exported_functions, mapped_files, resolve
from kvtrace.capture.inject import AttachError
from kvtrace.capture.stalls import StallSampler

pytestmark = needs_ptrace
HELD = re.compile(r"KVTRACE_HELD_MS: ([0-9.]+) \(the main thread only; (.*)\)")

# A target of the engine's kind: its main thread parked in queue.get() (an idle engine core)
# or busy hashing and adding, checked (a serving one); a ticking thread counts how long it
# was ever kept from running; "wake" on stdin is put on the queue by another thread.
TARGET = r'''
import hashlib, os, queue, sys, threading, time
MODE = sys.argv[1]
WAKE = queue.Queue()
DIGEST = hashlib.sha256(b"x" * 4096).hexdigest()
longest_gap = 0.0
def ticking():
    global longest_gap
    last = time.monotonic()
    while True:
        time.sleep(0.001)
        now = time.monotonic()
        longest_gap, last = max(longest_gap, now - last), now
def reading():
    for line in sys.stdin:
        WAKE.put(line.strip())
threading.Thread(target=ticking, daemon=True).start()
threading.Thread(target=reading, daemon=True).start()
print("ready", flush=True)
while True:
    if MODE == "asleep":
        time.sleep(5)
        MODE = "parked"
    if MODE == "parked":
        said = WAKE.get()
        print("woken " + said + " " + str(longest_gap), flush=True)
    else:
        for _ in range(2000):
            if hashlib.sha256(b"x" * 4096).hexdigest() != DIGEST or sum(
                    i * 0.5 for i in range(100)) != 2475.0:
                print("broken", flush=True)
                os._exit(3)
        try:
            said = WAKE.get_nowait()
            print("woken " + said + " " + str(longest_gap), flush=True)
        except queue.Empty:
            pass
'''


def start_target(mode: str) -> subprocess.Popen:
    process = subprocess.Popen([SYSTEM_PYTHON, "-I", "-c", TARGET, mode], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, cwd="/")
    assert process.stdout.readline().strip() == "ready"
    time.sleep(0.3)  # parked, or busy, by now
    return process


def inject(pid: int, code: str, mode: str = "pending") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-I", "-m", "kvtrace.capture.ptrace", str(pid), mode,
                           code], capture_output=True, text=True, timeout=60, cwd="/")


def test_the_addresses_are_the_dynamic_linkers():
    """Differential: the ELF reading against what ctypes resolves in this very process."""
    found = resolve(os.getpid(), {"Py_AddPendingCall", "PyRun_SimpleString"}, {"mmap"})
    expected = {name: ctypes.cast(getattr(library, name), ctypes.c_void_p).value
                for name, library in (("Py_AddPendingCall", ctypes.pythonapi),
                                      ("PyRun_SimpleString", ctypes.pythonapi),
                                      ("mmap", ctypes.CDLL(None)))}
    assert found == expected


@pytest.mark.parametrize("mode, call, how", [
    ("parked", "pending", "handed EINTR in its wait"),
    ("busy", "pending", "resumed where it was"),
    ("asleep", "direct", "handed EINTR in its wait"),
])
def test_an_injection_holds_the_main_thread_alone_for_milliseconds(tmp_path, mode, call, how):
    """Each of the injector's paths on the thread state it is for: the code runs, the other
    threads never wait, and the main thread goes on as before (woken, busy and checked, or
    asleep and then parked on its queue)."""
    target = start_target(mode)
    marker = tmp_path / "ran"
    try:
        with StallSampler(target.pid) as sampler:
            result = inject(target.pid, f"open({str(marker)!r}, 'w').write('ran')", call)
            deadline = time.monotonic() + 10
            while not marker.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        assert result.returncode == 0, result.stdout + result.stderr
        held = HELD.search(result.stdout)
        assert held and held.group(2) == how, result.stdout
        assert float(held.group(1)) < 200
        assert marker.read_text() == "ran", "the pending call ran in the target"
        assert sampler.stalls.longest_s < 0.2, sampler.stalls.describe()
        target.stdin.write("again\n")
        target.stdin.flush()
        line = target.stdout.readline().split()
        assert line[:2] == ["woken", "again"], "the main thread waits and wakes as before"
        assert float(line[2]) < 0.2, "the other threads were never kept from running"
        assert target.poll() is None
    finally:
        target.kill()
        target.wait()


@pytest.mark.parametrize("mode", ["parked", "busy"])
def test_a_direct_call_runs_nothing_on_a_lock_or_a_running_thread(tmp_path, mode):
    """A futex wait may be the allocator's lock, and a running thread may be anywhere: the
    direct call says so and calls nothing."""
    target = start_target(mode)
    marker = tmp_path / "ran"
    try:
        result = inject(target.pid, f"open({str(marker)!r}, 'w')", "direct")
        time.sleep(0.5)
        assert result.returncode == 0, result.stdout
        assert result.stdout.startswith("KVTRACE_NOT_RUN: the main thread is " + (
            "waiting on a lock" if mode == "parked" else "running"))
        assert not marker.exists() and target.poll() is None
    finally:
        target.kill()
        target.wait()


def test_a_library_replaced_since_it_was_mapped_is_refused(tmp_path):
    """The file at the mapping's path must be the one mapped (device and inode)."""
    library = next(m for m in mapped_files(os.getpid()) if "/libpython" in m.path
                   or m.path == os.path.realpath(sys.executable))
    stranger = Mapping(library.path, library.base, library.device, library.inode + 1)
    with pytest.raises(AttachError, match="is no longer the file pid"):
        exported_functions(os.getpid(), stranger, {"Py_AddPendingCall"})


@pytest.mark.parametrize("content, message", [
    (b"not an ELF file at all" * 4, "is not a 64-bit little-endian ELF file"),
    (b"\x7fELF\x02\x01\x01" + b"\0" * 9 + b"\x03\x00\xb7\x00" + b"\0" * 44,
     "is not an x86-64 object"),
    (b"\x7fELF\x02\x01", "is cut short"),
])
def test_a_file_that_is_no_elf_it_reads_is_one_error(tmp_path, content, message):
    path = tmp_path / "lib.so"
    path.write_bytes(content)
    info = path.stat()
    mapping = Mapping(str(path), 0, f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}",
                      info.st_ino)
    with pytest.raises(AttachError, match=message):
        exported_functions(os.getpid(), mapping, {"mmap"})


def test_no_such_process_is_one_line():
    result = inject(4194303, "pass")
    assert result.returncode == 1
    assert result.stdout.startswith("KVTRACE_CALL_FAILED: cannot read /proc/4194303/maps")


def test_the_sampler_sees_a_stop_that_lasts():
    """The measure the tests hold an attach to: a process stopped for 0.3 s is seen as such."""
    process = subprocess.Popen(["sleep", "30"])
    try:
        time.sleep(0.1)
        with StallSampler(process.pid) as sampler:
            time.sleep(0.05)
            os.kill(process.pid, signal.SIGSTOP)
            time.sleep(0.3)
            os.kill(process.pid, signal.SIGCONT)
            time.sleep(0.05)
        assert 0.25 < sampler.stalls.longest_s < 0.6, sampler.stalls.describe()
        assert "stood stopped at most" in sampler.stalls.describe()
    finally:
        process.kill()
        process.wait()


def test_the_injector_runs_isolated_from_the_working_directory(tmp_path):
    """Root attaches from a directory another user owns: a kvtrace package planted there is
    never imported by the injector's command."""
    planted = tmp_path / "kvtrace"
    planted.mkdir()
    (planted / "__init__.py").write_text(f"open({str(tmp_path / 'planted-ran')!r}, 'w')\n")
    command = Ptrace.find()._direct_command(4194303, "pass")
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert result.stdout.startswith("KVTRACE_CALL_FAILED: cannot read /proc/4194303/maps")
    assert not (tmp_path / "planted-ran").exists()


def test_the_cli_offers_every_way_in_in_attachs_order():
    from kvtrace.attach_methods import INJECTORS, METHODS
    from kvtrace.capture.debuggers import DEBUGGERS
    from kvtrace.cli.capture import command as capture

    method = next(p for p in capture.params if p.name == "method")
    assert tuple(method.type.choices) == METHODS
    assert INJECTORS.index("ptrace") < INJECTORS.index("gdb"), "least stop first"
    assert set(DEBUGGERS) == set(INJECTORS), "every injector auto tries has its class"
