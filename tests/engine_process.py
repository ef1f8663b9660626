"""A ``kvtrace engine`` subprocess for tests: wait for its stdout lines, send it commands."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

READY_TIMEOUT_S = 120
# Runs its arguments as a child and waits: an API-server-like parent above the engine core.
PARENT = "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))"


class EngineProcess:
    """A ``kvtrace engine`` subprocess whose stdout lines can be waited for.

    ``parent=True`` starts it under a plain parent process (``process`` is then the parent);
    ``pid`` is the engine's own pid, read from its ready line."""

    def __init__(self, args: list[str], env: dict[str, str], parent: bool = False) -> None:
        command = [sys.executable, "-m", "kvtrace", "engine", *args]
        if parent:
            command = [sys.executable, "-c", PARENT, *command]
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=env)
        self.pid: int | None = None if parent else self.process.pid
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.process.stdout:
            self.lines.put(line.rstrip("\n"))

    def expect(self, prefix: str, timeout: float = READY_TIMEOUT_S) -> str:
        deadline = time.monotonic() + timeout
        seen = []
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=remaining)
            except queue.Empty:
                break
            if match := re.match(r"kvtrace engine: pid (\d+) ready", line):
                self.pid = int(match.group(1))
            if line.startswith(prefix):
                return line
            seen.append(line)
        raise AssertionError(f"no line {prefix!r} within {timeout} s; stdout so far: {seen}; "
                             f"exit code {self.process.poll()}")

    def send(self, command: str) -> None:
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()

    def stop(self) -> None:
        for pid in {self.pid, self.process.pid} - {None}:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait()
