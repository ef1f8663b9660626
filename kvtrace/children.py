"""The Python processes kvtrace starts: how each one is started, and how one dies with its
parent.

``python -m`` puts the working directory first on ``sys.path``: a user who owned root's working
directory could plant a ``kvtrace/`` (or ``pip/``, ``vllm/``) there and have root run it. So
every child Python runs isolated (``python_child``): ``-s -P`` (no user site-packages, nothing
prepended to ``sys.path``) and an environment whose ``PYTHONPATH`` keeps only its absolute
entries (an empty or relative one names the working directory) and which sets
``PYTHONSAFEPATH``, so that the Pythons the child starts in turn (vLLM's model registry runs
``python -m vllm...``) are isolated too. ``PYTHONPATH`` stays: it is how a child runs an older
vLLM release first on its path (``vllm_releases``), or a test's plugins. ``with
isolated_children():`` does the same for the Pythons a library starts from this process.
A parent that forks workers holds the stop signals meanwhile (``stop_signals_deferred``), and
finds what it started in /proc (``descendants``).

Imports: the standard library only.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator, Mapping
from typing import Any

_ISOLATING = ("PYTHONPATH", "PYTHONSAFEPATH")  # the variables child_environment changes
_PR_SET_PDEATHSIG = 1


def python(*arguments: str) -> list[str]:
    """This interpreter, isolated, with ``arguments``; run it with ``child_environment``."""
    return [sys.executable, "-s", "-P", *arguments]  # -I would drop PYTHONPATH too


def child_environment(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) as an isolated child Python gets it."""
    env = dict(os.environ if env is None else env)
    trusted = [entry for entry in env.pop("PYTHONPATH", "").split(os.pathsep)
               if os.path.isabs(entry)]
    if trusted:
        env["PYTHONPATH"] = os.pathsep.join(trusted)
    env["PYTHONSAFEPATH"] = "1"
    return env


def python_child(module: str, *arguments: str, env: Mapping[str, str] | None = None
                 ) -> tuple[list[str], dict[str, str]]:
    """The command and the environment that run ``python -m module arguments`` isolated;
    ``env``: the environment it would have had (default: this process's)."""
    return python("-m", module, *arguments), child_environment(env)


@contextlib.contextmanager
def isolated_children() -> Iterator[None]:
    """This process's environment as ``child_environment`` makes it, until the block ends:
    for the Pythons that a library (vLLM) starts from here."""
    saved = {key: os.environ.get(key) for key in _ISOLATING}
    _set(child_environment())
    try:
        yield
    finally:
        _set(saved)


def _set(values: Mapping[str, str | None]) -> None:
    for key in _ISOLATING:
        if values.get(key) is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = values[key]


def die_with_parent(parent: int, signum: int = signal.SIGKILL) -> bool:
    """Have Linux send ``signum`` to this process when the thread that started it exits
    (PR_SET_PDEATHSIG: even a SIGKILLed parent sends it), and say whether the parent is still
    ``parent``: one that exited before this call sent nothing."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the parent's own ways of stopping it still apply
    return os.getppid() == parent


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
_deferred_signals: list[int] = []  # stop signals heard while they were held


def defer_stop(signum: int, _frame: Any) -> None:
    """A stop signal's handler while they are held: heard, delivered later."""
    _deferred_signals.append(signum)


@contextlib.contextmanager
def stop_signals_deferred() -> Iterator[None]:
    """Hold the stop signals while the workers are forked, and deliver them after. Raised
    there, the exception of a stop lands in fork's at-fork handlers, which swallow it: the
    sweep went on and exited 0, and a second SIGTERM was ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, defer_stop) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        heard, _deferred_signals[:] = list(_deferred_signals), []
        for signum in heard:
            signal.raise_signal(signum)  # to the handler it was meant for, in plain code


def stops_heard() -> int:
    """How many stop signals ``stop_signals_deferred`` holds now (a forked worker that sees
    one was stopped while it was forked)."""
    return len(_deferred_signals)


def become_pool_worker(parent: int) -> None:
    """A process pool's initializer (``kvtrace load --workers``, sweeps): the worker dies with its
    parent (even a SIGKILLed one), takes SIGTERM's default action (a pool stops its workers so;
    SIGHUP's too, unless ignored), leaves Ctrl-C to its parent, and exits at once when it was
    orphaned, or stopped, while it was forked."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not die_with_parent(parent) or stops_heard():
        os._exit(1)


def descendants(pid: int) -> list[int]:
    """The processes below ``pid``, from /proc."""
    parent_of = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                with open(os.path.join(entry.path, "stat")) as stat:
                    parent_of[int(entry.name)] = int(stat.read().rsplit(")", 1)[1].split()[1])
    found, frontier = [], {pid}
    while frontier:
        frontier = {child for child, parent in parent_of.items() if parent in frontier}
        found += frontier
    return found
