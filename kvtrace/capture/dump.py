"""``kvtrace dump``: one trace out of a flight recorder's ring, while it records.

A ring directory (``kvtrace.ring``) holds segments, each a whole trace opening with a keyframe.
A dump picks the segments of the newest session that cover the time asked for (from the last
keyframe at or before its start), and writes them as one trace: the first segment whole, the
later ones without their keyframes (the records before them already say what the keyframes
say, as ``snapshot.take_keyframe`` arranges). The trace replays from its first keyframe, in
lockstep and in every variant. The segment being written is read up to its last whole frame.

The ring is read the way kvtrace reads what others may write: the directory must not be open
to other users' writes and is not reached through a link another user planted; each segment
is a regular file of the directory's owner, opened without following a link.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from dataclasses import dataclass
from typing import BinaryIO

import msgspec

from kvtrace.errors import KvtraceError, TraceFormatError, UnsafePathError
from kvtrace.events import SnapshotStarted, StepStarted
from kvtrace.files import refuse_planted_link
from kvtrace.ring import Segment, list_segments
from kvtrace.ring_join import KeyframeSkip
from kvtrace.traceio import TraceReader, TraceWriter

_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_SEGMENT = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class RingError(KvtraceError):
    default_hint = ("Point it at the --dir of a `kvtrace capture --ring` (it holds "
                    "ring-*.kvtrace segments).")


@dataclass(frozen=True)
class Keyframe:
    """A segment and the wall-clock time its keyframe was taken."""

    segment: Segment
    wall_ns: int


@dataclass(frozen=True)
class Dump:
    """What a dump wrote: its segments, records, and the wall-clock span it covers."""

    path: str
    keyframes: list[Keyframe]
    num_records: int
    num_dropped: int
    first_ns: int
    last_ns: int
    older_sessions: int  # sessions before the newest (a restarted controller): not in the dump


class Ring:
    """A ring directory, open for reading (see the module's docstring for the checks)."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = os.fspath(directory)
        refuse_planted_link(self.directory, f"the ring {self.directory}")
        try:
            self._fd = os.open(self.directory, _DIRECTORY)
        except FileNotFoundError:
            raise RingError(f"no ring at {self.directory}: it does not exist") from None
        except OSError as error:
            reason = ("is a symbolic link or not a directory"
                      if error.errno in (errno.ELOOP, errno.ENOTDIR) else error.strerror)
            raise RingError(f"cannot open the ring {self.directory}: {reason}") from None
        info = os.fstat(self._fd)
        self.owner = info.st_uid
        if stat.S_IMODE(info.st_mode) & 0o022 and not info.st_mode & stat.S_ISVTX:
            os.close(self._fd)
            raise UnsafePathError(f"the ring {self.directory} can be written by other users "
                                  f"(mode {stat.S_IMODE(info.st_mode):04o})",
                                  "A ring's directory is private (0700): the engine makes it so.")

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> Ring:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def segments(self) -> list[Segment]:
        return list_segments(self._fd)

    def open_segment(self, segment: Segment) -> BinaryIO:
        """A segment's file, checked on its descriptor: a regular file of the ring's owner."""
        try:
            fd = os.open(segment.name, _SEGMENT, dir_fd=self._fd)
        except FileNotFoundError:
            raise
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise UnsafePathError(f"{self._path(segment)} is a symbolic link; kvtrace "
                                      "reads none in a ring") from None
            raise RingError(f"cannot read {self._path(segment)}: {error.strerror}") from None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid not in (self.owner, 0):
            os.close(fd)
            raise UnsafePathError(f"{self._path(segment)} is not a regular file of the ring's "
                                  f"owner (uid {self.owner}); kvtrace did not read it")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")

    def reader(self, segment: Segment) -> TraceReader:
        return TraceReader(self._path(segment), source=self.open_segment(segment))

    def _path(self, segment: Segment) -> str:
        return os.path.join(self.directory, segment.name)

    def keyframes(self) -> tuple[list[Keyframe], int]:
        """The newest session's segments that still exist, with their keyframes' times,
        oldest first; and how many older sessions the ring holds."""
        segments = self.segments()
        if not segments:
            raise RingError(f"the ring {self.directory} holds no segment yet",
                            "A ring's first segment appears when the engine's first step "
                            "after arming comes; wait for it.")
        session = segments[-1].session
        keyframes = []
        for segment in segments:
            if segment.session != session:
                continue
            try:
                keyframes.append(Keyframe(segment, self._keyframe_ns(segment)))
            except FileNotFoundError:
                continue  # removed by the engine as it fell out of the ring
            except TraceFormatError:
                if segment is not segments[-1]:
                    raise
                # the newest, its keyframe not yet written whole: not in the ring yet
        if not keyframes:
            raise RingError(f"the ring {self.directory}'s newest segment holds no keyframe "
                            "yet", "Try again in a moment.")
        return keyframes, len({segment.session for segment in segments}) - 1

    def _keyframe_ns(self, segment: Segment) -> int:
        reader = self.reader(segment)
        for batch in reader.batches():
            for record in batch.records():
                if type(record) is SnapshotStarted:
                    reader.close()
                    return reader.header.created_ns + record.ts_ns
                break
            break
        reader.close()
        raise TraceFormatError(f"{self._path(segment)} does not open with a keyframe")


def choose(keyframes: list[Keyframe], since_ns: int | None,
           until_ns: int | None) -> list[Keyframe]:
    """The segments that cover ``since_ns`` .. ``until_ns`` (wall clock; None: the ring's
    start, its end): from the last keyframe at or before the start (the oldest there is, if
    none), to the last keyframe at or before the end."""
    first = 0
    if since_ns is not None:
        first = max((i for i, keyframe in enumerate(keyframes) if keyframe.wall_ns <= since_ns),
                    default=0)
    last = len(keyframes) - 1
    if until_ns is not None:
        last = max((i for i, keyframe in enumerate(keyframes) if keyframe.wall_ns <= until_ns),
                   default=first)
    return keyframes[first:max(first, last) + 1]


def dump(directory: str | os.PathLike, output: str | os.PathLike, *,
         last_s: float | None = None, since_ns: int | None = None,
         until_ns: int | None = None) -> Dump:
    """Write the ring's last ``last_s`` seconds (or ``since_ns`` .. ``until_ns``; neither:
    all of it) as one trace at ``output`` (atomically: nothing there until it is whole)."""
    if last_s is not None:
        since_ns = time.time_ns() - int(last_s * 1e9)
    with Ring(directory) as ring:
        keyframes, older_sessions = ring.keyframes()
        chosen = choose(keyframes, since_ns, until_ns)
        writer = None
        keyframes_skipped = KeyframeSkip()
        num_dropped = last_ts_ns = 0
        try:
            for index, keyframe in enumerate(chosen):
                try:
                    reader = ring.reader(keyframe.segment)
                except FileNotFoundError:
                    if index == 0:  # removed meanwhile: the ring moved on; start later
                        continue
                    raise RingError(f"{keyframe.segment.name} left the ring while it was "
                                    "dumped", "Dump a shorter --last, or again.") from None
                if writer is not None:  # the first segment's keyframe stays
                    keyframes_skipped.start_segment()
                else:
                    header = msgspec.structs.replace(reader.header, params={
                        **reader.header.params, "dumped_from": ring.directory,
                        "segment": str(keyframe.segment.seq)})
                    writer = TraceWriter(output, header, atomic=True)
                for batch in reader.batches():
                    if len(batch):
                        last_ts_ns = max(last_ts_ns, _last_ts(batch))
                    batch = keyframes_skipped.past(batch)
                    if batch is not None:
                        writer.write_many(batch.records())
                if keyframes_skipped.inside:
                    raise TraceFormatError(f"{reader.path}: its keyframe does not end")
                num_dropped += reader.closing.num_dropped if reader.closing else 0
            if writer is None:
                raise RingError(f"every segment of {ring.directory} chosen left the ring "
                                "while it was dumped", "Dump again.")
            writer.close(num_dropped=num_dropped)
        except BaseException:
            if writer is not None:
                writer.abandon()
            raise
        return Dump(os.fspath(output), chosen, writer.num_records, num_dropped,
                    chosen[0].wall_ns, writer.header.created_ns + last_ts_ns, older_sessions)


def _last_ts(batch) -> int:
    """The time of the batch's last step start (as every record's, from the session's)."""
    if StepStarted not in batch.types:
        return 0
    return batch.columns[batch.types.index(StepStarted)][1][-1]
