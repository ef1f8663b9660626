"""Drive a ``kvtrace engine`` child process: wait for its status lines, send it commands.

``kvtrace demo`` and the tests start engines this way; the engine's protocol is its stdout lines
(``kvtrace engine: pid N ready (...)``, ``kvtrace engine: done (...)``) and stdin commands
(``start``, ``quit``).
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import threading
import time

from kvtrace.children import python, python_child
from kvtrace.errors import KvtraceError

READY_TIMEOUT_S = 180
# Runs its arguments as a child and waits: an API-server-like parent above the engine core.
_PARENT = "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))"
_READY = re.compile(r"kvtrace engine: pid (\d+) ready")


class EngineProcess:
    """A ``kvtrace engine`` subprocess.

    ``parent=True`` starts it under a plain parent process (``process`` is then the parent);
    ``pid`` is the engine's own pid, read from its ready line."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None, *,
                 parent: bool = False, cwd: str | None = None) -> None:
        command, env = python_child("kvtrace", "engine", *args, env=env)
        if parent:
            command = python("-c", _PARENT, *command)
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=env, cwd=cwd)
        self.pid: int | None = None if parent else self.process.pid
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.process.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)  # end of output: the engine exited

    def expect(self, prefix: str, timeout: float = READY_TIMEOUT_S) -> str:
        """The next stdout line that starts with ``prefix``."""
        deadline = time.monotonic() + timeout
        seen = []
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                line = self._lines.get(timeout=remaining)
            except queue.Empty:
                break
            if line is None:
                self.process.wait()
                raise KvtraceError(
                    f"kvtrace engine exited (status {self.process.returncode}) before "
                    f"{prefix!r}: {self.process.stderr.read().strip()[-2000:]}",
                    "Run `make test` to check the installation.")
            if match := _READY.match(line):
                self.pid = int(match.group(1))
            if line.startswith(prefix):
                return line
            seen.append(line)
        raise KvtraceError(f"kvtrace engine printed no {prefix!r} within {timeout:.0f} s "
                           f"(it printed {seen})", "Check the machine's load.")

    def wait_ready(self) -> int:
        self.expect("kvtrace engine: pid ")
        return self.pid

    def send(self, command: str) -> None:
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()

    def stop(self, grace_s: float = 0.0) -> None:
        """Ask it to quit and wait up to ``grace_s``, then kill whatever is left."""
        if grace_s and self.process.poll() is None:
            try:
                self.send("quit")
                self.process.wait(timeout=grace_s)
            except (OSError, subprocess.TimeoutExpired):
                pass
        for pid in {self.pid, self.process.pid} - {None}:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait()
