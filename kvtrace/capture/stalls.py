"""How long an attach stopped a process's threads, seen from outside: every thread's state in
``/proc/PID/task/*/stat``, sampled about every millisecond while the attach runs. A thread
in ``t`` (a ptrace stop) or ``T`` (stopped by a signal) stands; the longest stretch in which
a thread stood is what a client of the engine may have waited on it.

A stretch is measured from the first sample that saw it to the first that did not, so it is
exact to about one sampling period (longer where reading many threads takes longer).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

STOPPED_STATES = ("t", "T")
PERIOD_S = 0.001


@dataclass
class Stalls:
    """The stretches in which some thread stood, in seconds, and the sampling they rest on."""

    stretches: list[float] = field(default_factory=list)
    samples: int = 0
    longest_gap_s: float = 0.0  # the longest time between two samples: the figures' precision

    @property
    def longest_s(self) -> float:
        return max(self.stretches, default=0.0)

    def describe(self) -> str:
        if not self.stretches:
            return (f"no thread was seen stopped ({self.samples} samples, at most "
                    f"{self.longest_gap_s * 1000:.1f} ms apart)")
        return (f"threads stood stopped at most {self.longest_s * 1000:.1f} ms in one stretch "
                f"({len(self.stretches)} stretches, {self.samples} samples at most "
                f"{self.longest_gap_s * 1000:.1f} ms apart)")


class StallSampler:
    """Samples ``pid``'s threads in a thread of its own between ``start`` and ``stop``."""

    def __init__(self, pid: int, period_s: float = PERIOD_S) -> None:
        self.pid, self.period_s = pid, period_s
        self.stalls = Stalls()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtrace-stall-sampler",
                                        daemon=True)

    def __enter__(self) -> "StallSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()

    def _stopped_threads(self) -> set[str] | None:
        """The ids of the threads that stand now; None once the process is gone."""
        try:
            tasks = os.listdir(f"/proc/{self.pid}/task")
        except OSError:
            return None
        stopped = set()
        for task in tasks:
            try:
                with open(f"/proc/{self.pid}/task/{task}/stat", "rb") as stat:
                    state = stat.read().rsplit(b")", 1)[1].split()[0].decode()
            except (OSError, IndexError):
                continue
            if state in STOPPED_STATES:
                stopped.add(task)
        return stopped

    def _run(self) -> None:
        since: dict[str, float] = {}
        last = time.monotonic()
        while not self._done.is_set():
            stopped = self._stopped_threads()
            now = time.monotonic()
            self.stalls.samples += 1
            self.stalls.longest_gap_s = max(self.stalls.longest_gap_s, now - last)
            last = now
            for task in list(since):
                if stopped is None or task not in stopped:
                    self.stalls.stretches.append(now - since.pop(task))
            if stopped is None:
                return
            for task in stopped - since.keys():
                since[task] = now
            time.sleep(self.period_s)
        now = time.monotonic()
        self.stalls.stretches.extend(now - start for start in since.values())
