"""Following a trace still being written: ``TraceTail`` follows a growing trace file, or a
flight recorder's ring directory (``kvtrace.ring``); each ``poll`` hands over the record
batches written since the last one, whole frames only, and resumes at the frame it stopped at
(``TraceReader.new_batches``). ``analysis.live`` keeps figures of what it hands over.
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import os
import stat

from kvtrace.errors import TraceNotFoundError, UnsafePathError
from kvtrace.events import TraceHeader
from kvtrace.files import planted_link
from kvtrace.ring import list_segments, segment_name
from kvtrace.ring_join import KeyframeSkip
from kvtrace.traceio import HeaderCutError, RecordBatch, TraceReader

_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class NothingToTailError(TraceNotFoundError):
    """A path to follow that is not there yet: no such file, or a ring without a segment."""



class TraceTail:
    """Follows ``source``: a trace being written, or a ring directory (its newest session, from
    its oldest segment on). Segments after the first open with a keyframe, a start snapshot of
    the state the stream already holds, which is skipped. Batches come numbered as one stream
    (``first_seq``), as ``kvtrace dump`` joins a session.

    Files are opened without following a link (nor a link another user planted above them:
    ``files.planted_link``), and must be regular files of ``owners`` (default: root and this
    user) whose directory, for a ring, is theirs too. ``header`` is None until the header is
    whole; ``waiting`` then says why (``HeaderCutError``). A segment pruned before it was
    reached is skipped and counted in ``gaps``: the figures after one are approximate."""

    def __init__(self, source: str | os.PathLike, owners: tuple[int, ...] | None = None) -> None:
        self.source = os.fspath(source)
        self.owners = owners if owners is not None else (0, os.geteuid())
        self.header: TraceHeader | None = None
        self.waiting: HeaderCutError | None = None
        self.num_records = 0  # records handed over
        self.gaps = 0
        self._reader: TraceReader | None = None
        self._fd: int | None = None  # the plain file, until its header is read
        self._dir_fd: int | None = None
        self._session = self._seq = 0
        self._keyframes = KeyframeSkip()  # the keyframes of the segments after the first
        fd = self._open(self.source, None, regular_only=False)
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            self._dir_fd = fd
            try:
                self._start_ring()
            except BaseException:
                self.close()
                raise
        else:
            self._fd = fd
            self._read_header()

    @property
    def path(self) -> str:
        """The file being read now."""
        if self._dir_fd is None:
            return self.source
        return os.path.join(self.source, segment_name(self._session, self._seq))

    @property
    def complete(self) -> bool:
        """A plain trace whose writer closed it: nothing more will come."""
        return self._dir_fd is None and self._reader is not None and \
            self._reader.closing is not None

    def _open(self, name: str, dir_fd: int | None, regular_only: bool) -> int:
        label = name if dir_fd is None else os.path.join(self.source, name)
        if dir_fd is None:
            problem = planted_link(os.path.dirname(os.path.abspath(name)))
            if problem:
                raise UnsafePathError(f"{problem}; kvtrace will not follow it to {name}")
        try:
            fd = os.open(name, _OPEN_FLAGS, dir_fd=dir_fd)
        except FileNotFoundError:
            raise NothingToTailError(f"no such trace or ring directory: {label}") from None
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise UnsafePathError(f"{label} is a symbolic link; kvtrace follows none to a "
                                      "trace it tails",
                                      "Give the path of the trace (or ring directory) itself."
                                      ) from None
            raise TraceNotFoundError(f"cannot open {label}: {error.strerror}") from None
        info = os.fstat(fd)
        mode = stat.S_IMODE(info.st_mode)
        directory = not regular_only and stat.S_ISDIR(info.st_mode)
        problem = ("is not a regular file (a FIFO, socket or device)"
                   if not (stat.S_ISREG(info.st_mode) or directory)
                   else f"is owned by uid {info.st_uid}, not by uid "
                        f"{' or '.join(map(str, sorted(set(self.owners))))}"
                   if info.st_uid not in self.owners
                   else f"can be written by other users (mode {mode:04o})"
                   if directory and mode & 0o022 and not mode & stat.S_ISVTX else None)
        if problem:
            os.close(fd)
            raise UnsafePathError(f"{label} {problem}; kvtrace tails only what no other user "
                                  "can have written",
                                  "Run kvtrace top as the user that writes the trace (the "
                                  "engine's), or as root for root's; a ring's directory is "
                                  "private (0700).")
        if not directory:
            os.set_blocking(fd, True)
        return fd

    def _start_ring(self) -> None:
        while True:
            segments = list_segments(self._dir_fd)
            if not segments:
                raise NothingToTailError(
                    f"{self.source} holds no ring segment yet",
                    "Give the --dir of a `kvtrace capture --ring` that has started (it writes "
                    "its first segment once it is armed).")
            newest = segments[-1].session
            first = next(s for s in segments if s.session == newest)
            self._session, self._seq = first.session, first.seq
            try:
                self._fd = self._open(first.name, self._dir_fd, regular_only=True)
            except NothingToTailError:
                continue  # pruned between the listing and the open
            self._read_header()
            return

    def _read_header(self) -> None:
        """Read the current file's header, once it is whole (a writer may have just begun)."""
        os.lseek(self._fd, 0, os.SEEK_SET)
        try:
            self._reader = TraceReader(self.path, source=os.fdopen(os.dup(self._fd), "rb"))
        except HeaderCutError as error:
            self.waiting = error
            return
        os.close(self._fd)
        self._fd, self.waiting = None, None
        if self.header is None:
            self.header = self._reader.header

    def poll(self, max_batches: int | None = None) -> list[RecordBatch]:
        """The batches written since the last poll (at most ``max_batches``)."""
        batches: list[RecordBatch] = []
        while max_batches is None or len(batches) < max_batches:
            if self._reader is None:
                self._read_header()
                if self._reader is None:
                    break
            room = None if max_batches is None else max_batches - len(batches)
            new = 0
            for batch in itertools.islice(self._reader.new_batches(), room):
                new += 1
                batch = self._keyframes.past(batch)
                if batch is not None:
                    batch = dataclasses.replace(batch, first_seq=self.num_records)
                    self.num_records += len(batch)
                    batches.append(batch)
            if room is not None and new == room or not self._next_segment(new):
                break
        return batches

    def _next_segment(self, new: int) -> bool:
        """Move on to the ring's next segment once this one is done: closed, or left behind by
        a writer that began the next (a writer that died without closing it)."""
        if self._dir_fd is None:
            return False
        later = [s for s in list_segments(self._dir_fd)
                 if s.session == self._session and s.seq > self._seq]
        if not later or (self._reader.closing is None and new):
            return False
        for segment in later:
            try:
                fd = self._open(segment.name, self._dir_fd, regular_only=True)
            except NothingToTailError:
                continue
            self.gaps += segment.seq != self._seq + 1
            self._reader.close()
            self._reader, self._fd = None, fd
            self._seq = segment.seq
            self._keyframes.start_segment()
            self._read_header()
            return True
        return False

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
        for fd in (self._fd, self._dir_fd):
            if fd is not None:
                os.close(fd)
        self._reader = self._fd = self._dir_fd = None

    def __enter__(self) -> TraceTail:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

