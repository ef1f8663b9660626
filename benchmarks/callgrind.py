"""Instruction counts of marked regions of a Python program, from valgrind's callgrind.

Why: on a shared machine wall time moves with the load; the number of instructions a piece of
code executes barely does. ``perf stat -e instructions`` would be cheaper, but virtual machines
often expose no hardware counters (``perf`` answers ``<not supported>``), so the counts come
from callgrind, which executes the program on a simulated CPU (tens of times slower).

Parent side: ``count_regions(argv, directory)`` runs ``argv`` (a command that starts Python)
under callgrind with instrumentation off, so imports and set-up run at valgrind's faster
uninstrumented speed, and returns ``{region name: instructions}`` and the child's output.
Child side: ``Regions()`` reaches callgrind through its client requests (the macros of
valgrind's ``callgrind.h``, compiled by ``count_regions`` into a small library whose path the
child finds in ``CALLGRIND_REGIONS_LIB``); ``with regions.count(name):`` counts one region:
every instruction that any thread of the process executes between its start and its end.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import subprocess
from typing import Iterator

LIBRARY_ENV = "CALLGRIND_REGIONS_LIB"
HEADER = "/usr/include/valgrind/callgrind.h"
OUT_FILE = "callgrind.out"

_CLIENT_SOURCE = """\
#include <valgrind/callgrind.h>
int running_on_valgrind(void) { return RUNNING_ON_VALGRIND; }
void start_region(void) { CALLGRIND_START_INSTRUMENTATION; CALLGRIND_ZERO_STATS; }
void end_region(const char *name) {
    CALLGRIND_DUMP_STATS_AT(name);
    CALLGRIND_STOP_INSTRUMENTATION;
}
"""


class CallgrindUnavailable(Exception):
    """No valgrind, no callgrind header, or no C compiler here: no instruction counts."""


class Regions:
    """The child's side: marks regions whose instructions callgrind counts."""

    def __init__(self) -> None:
        self._client = ctypes.CDLL(os.environ[LIBRARY_ENV])
        if not self._client.running_on_valgrind():
            raise CallgrindUnavailable("not running under valgrind: start this through "
                                       "count_regions()")

    @contextlib.contextmanager
    def count(self, name: str) -> Iterator[None]:
        """Instruments and counts the ``with`` body (all threads); its dump is called ``name``."""
        self._client.start_region()
        try:
            yield
        finally:
            self._client.end_region(name.encode())


def tools() -> tuple[str, str]:
    """Paths of valgrind and of a C compiler; ``CallgrindUnavailable`` when one is missing."""
    valgrind = shutil.which("valgrind")
    compiler = shutil.which("cc") or shutil.which("gcc")
    if valgrind is None or not os.path.exists(HEADER):
        raise CallgrindUnavailable(f"valgrind or {HEADER} is missing (Debian: "
                                   "apt-get install valgrind)")
    if compiler is None:
        raise CallgrindUnavailable("no C compiler (cc) to build callgrind's client requests")
    return valgrind, compiler


def count_regions(argv: list[str], directory: str, env: dict[str, str] | None = None
                  ) -> tuple[dict[str, int], str]:
    """Run ``argv`` under callgrind; the instructions of each region it marked, by name, in
    the order they ran, and the child's standard output. Raises ``CallgrindUnavailable`` when
    this machine cannot count, and ``RuntimeError`` (with the child's last output) when the
    child fails."""
    valgrind, compiler = tools()
    source = os.path.join(directory, "callgrind_regions.c")
    library = os.path.join(directory, "callgrind_regions.so")
    with open(source, "w") as file:
        file.write(_CLIENT_SOURCE)
    subprocess.run([compiler, "-O1", "-shared", "-fPIC", "-o", library, source], check=True)
    out_file = os.path.join(directory, OUT_FILE)
    child = subprocess.run(
        [valgrind, "--tool=callgrind", "--instr-atstart=no", "--dump-line=no",
         f"--callgrind-out-file={out_file}", *argv],
        env={**(env if env is not None else os.environ), LIBRARY_ENV: library},
        capture_output=True, text=True)
    if child.returncode != 0:
        raise RuntimeError(f"the child under callgrind failed (exit {child.returncode}):\n"
                           + (child.stdout + child.stderr)[-3000:])
    return _read_dumps(directory), child.stdout


def _read_dumps(directory: str) -> dict[str, int]:
    """``{region: instructions}`` from the dumps callgrind wrote for ``end_region``: one file
    per dump (``callgrind.out.<n>``), its trigger naming the region, its ``totals:`` the count
    (instructions, the one event collected by default)."""
    prefix = OUT_FILE + "."
    dumps = sorted((name for name in os.listdir(directory)
                    if name.startswith(prefix) and name[len(prefix):].isdigit()),
                   key=lambda name: int(name[len(prefix):]))
    counts: dict[str, int] = {}
    for name in dumps:
        with open(os.path.join(directory, name)) as file:
            text = file.read()
        trigger = re.search(r"^desc: Trigger: Client Request: (.*)$", text, re.M)
        totals = re.search(r"^totals: (\d+)$", text, re.M)
        if trigger and totals:
            counts[trigger.group(1)] = int(totals.group(1))
    return counts
