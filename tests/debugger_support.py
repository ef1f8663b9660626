"""Debuggers for the attach tests: whether this host's gdb and lldb can make calls at all (asked
the way issue 21 asks any host, without kvtrace), and stand-in debuggers that break their
target, put first on PATH."""

from __future__ import annotations

import functools
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

SYSTEM_PYTHON = os.path.realpath(sys.executable)  # the interpreter behind the venv: no kvtrace
needs_ptrace = pytest.mark.skipif(
    os.uname().machine != "x86_64", reason="kvtrace's own injector runs on x86-64 Linux only")
needs_gdb = pytest.mark.skipif(shutil.which("gdb") is None, reason="gdb is not installed")
needs_lldb = pytest.mark.skipif(
    shutil.which("lldb") is None,
    reason="lldb is not installed (apt-get install lldb; scripts/bootstrap installs it where it "
           "runs as root with apt)")
CALL_GETPID = {"gdb": ["-batch", "-nx", "-ex", "call (long)getpid()"],
               "lldb": ["--batch", "--no-lldbinit", "-o", "expr (long)getpid()"]}


@functools.cache
def can_call(debugger: str) -> bool:
    """Whether ``debugger`` calls ``getpid()`` in a sleeping Python and leaves it alive: the
    check issue 21 gives for any host (`gdb -p PID -batch -ex 'call (long)getpid()'`), which
    fails on AMX hosts with gdb 13 and kills the sleeper. kvtrace's own injector (``ptrace``)
    runs wherever it is built for: x86-64 Linux."""
    if debugger == "ptrace":
        return os.uname().machine == "x86_64" and sys.platform.startswith("linux")
    sleeper = subprocess.Popen([SYSTEM_PYTHON, "-c", "import time; time.sleep(120)"], cwd="/")
    try:
        time.sleep(0.5)
        result = subprocess.run([debugger, "-p", str(sleeper.pid), *CALL_GETPID[debugger]],
                                capture_output=True, text=True, timeout=120, check=False,
                                stdin=subprocess.DEVNULL)
        time.sleep(0.5)
        return sleeper.poll() is None and f"= {sleeper.pid}" in result.stdout
    finally:
        sleeper.kill()
        sleeper.wait()


STAND_IN = """#!/bin/sh
# A stand-in {name} for kvtrace's tests: {what}
case "$1" in --version) echo "{version}"; exit 0;; -P) exit 0;; esac
pid=
while [ $# -gt 0 ]; do
    if [ "$1" = "-p" ]; then pid=$2; fi
    shift
done
echo "$pid" >> "{log}"
{body}
"""
BEHAVIOURS = {
    "kills": ("it kills the process it attaches to, as gdb 13 does on AMX hosts",
              'echo "{error}Couldn\'t write extended state status: Bad address."\n'
              'kill -9 "$pid"'),
    "does-nothing": ("it attaches, detaches and calls nothing", "exit 0"),
}
VERSIONS = {"gdb": "GNU gdb (stand-in) 0.1", "lldb": "lldb version 0.1 (stand-in)",
            "ptrace": "kvtrace's injector (stand-in)"}


def stand_in(directory: Path, name: str, behaviour: str) -> Path:
    """Write a stand-in ``name`` into ``directory`` (put it first on PATH); it appends each
    pid it is given to ``directory/NAME.pids``. Returns that log."""
    directory.mkdir(exist_ok=True)
    log = directory / f"{name}.pids"
    what, body = BEHAVIOURS[behaviour]
    script = directory / name
    script.write_text(STAND_IN.format(name=name, what=what, version=VERSIONS[name], log=log,
                                      body=body.format(error="error: " if name == "lldb" else "")))
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return log


def path_with(directory: Path) -> dict[str, str]:
    """The environment with ``directory`` first on PATH."""
    return {**os.environ, "PATH": f"{directory}{os.pathsep}{os.environ['PATH']}"}


def pids_in(log: Path) -> list[int]:
    return [int(line) for line in log.read_text().split()] if log.exists() else []
