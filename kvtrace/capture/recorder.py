"""The engine's side of a flight recorder's ring directory (``kvtrace capture --ring``).

``RingFiles`` makes the directory (private: 0700, the engine user's) when it is missing, each
segment's trace file in it (``ring.segment_name``), and removes the segments that fell out of the ring: those whose last write is
older than the ring's length, then the oldest while the ring holds more than its size cap.
The segment being written is never removed; files that are not segments, not regular or not
the engine user's are never touched. Segments an earlier session left (a controller that
restarted) age out the same way, so a restarted ring resumes where it was.

Runs inside vLLM, on the capture's writer thread: stdlib and kvtrace's safe paths only.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

from kvtrace.capture.safe_paths import NewTraceFile, open_private_dir
from kvtrace.errors import KvtraceError
from kvtrace.ring import list_segments, segment_name


class RingFiles:
    def __init__(self, directory: str, session: int, ring_s: float, max_bytes: int) -> None:
        if not os.path.isabs(directory):
            raise KvtraceError(f"the ring directory {directory!r} is not absolute",
                               "Give the engine an absolute --dir (kvtrace capture does).")
        try:
            os.close(open_private_dir(Path(directory), os.geteuid(), create=True))
        except OSError as error:
            raise KvtraceError(f"cannot make the ring directory {directory}: {error.strerror}",
                               "Pick a --dir in a directory the engine user can write to."
                               ) from None
        self.directory, self.session = directory, session
        self.ring_ns, self.max_bytes = int(ring_s * 1e9), max_bytes
        self.seq = 0
        self.num_removed = 0

    def next_segment(self) -> NewTraceFile:
        """The next segment's file (to ``publish`` once its writer is ready)."""
        self.seq += 1
        return NewTraceFile(os.path.join(self.directory, segment_name(self.session, self.seq)))

    def prune(self) -> None:
        """Remove the segments that fell out of the ring (see the module's docstring)."""
        dir_fd = open_private_dir(Path(self.directory), os.geteuid(), create=False)
        try:
            current = segment_name(self.session, self.seq)
            kept = []  # (name, size) of the segments still in the ring, oldest first
            oldest_ns = time.time_ns() - self.ring_ns
            for segment in list_segments(dir_fd):
                if segment.name == current:
                    continue
                try:
                    info = os.stat(segment.name, dir_fd=dir_fd, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
                    continue
                if info.st_mtime_ns < oldest_ns:
                    self._remove(segment.name, dir_fd)
                else:
                    kept.append((segment.name, info.st_size))
            if self.max_bytes:
                total = sum(size for _, size in kept) + os.stat(
                    current, dir_fd=dir_fd, follow_symlinks=False).st_size
                for name, size in kept:
                    if total <= self.max_bytes:
                        break
                    self._remove(name, dir_fd)
                    total -= size
        finally:
            os.close(dir_fd)

    def _remove(self, name: str, dir_fd: int) -> None:
        try:
            os.unlink(name, dir_fd=dir_fd)
            self.num_removed += 1
        except FileNotFoundError:
            pass
