"""Reading a trace frame by frame in constant memory, whatever its writer left: a writer cut
off anywhere loses at most its last, incomplete frame (the reader recovers every complete one,
sets ``truncated`` and never fails on the cut); damaged bytes are a ``TraceFormatError`` naming
their offset."""

from __future__ import annotations

import os
import stat
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import msgspec

from kvtrace.errors import TraceFormatError, TraceNotFoundError, TraceVersionError
from kvtrace.events import FORMAT_MAJOR, Record, TraceClosed, TraceHeader
from kvtrace.traceio.batches import RecordBatch, decode_batch, decode_rows
from kvtrace.traceio.frames import (
    FRAME_BATCH,
    FRAME_CLOSED,
    FRAME_HEAD,
    FRAME_HEADER,
    FRAME_ROWS,
    MAGIC,
    MAX_FRAME_BYTES,
    PREAMBLE,
)

_HEADER_DECODER = msgspec.msgpack.Decoder(TraceHeader)
_CLOSED_DECODER = msgspec.msgpack.Decoder(TraceClosed)


class HeaderCutError(TraceFormatError):
    """A file that ends before its header is complete: empty, cut off at once, or a trace whose
    writer has only just begun (a follower waits for it: ``kvtrace.analysis.live``)."""


@dataclass
class TraceReader:
    """Streams a trace frame by frame in constant memory.

    The header is read on open. Iterate ``batches()`` (columns) or the reader itself (records);
    after the stream ends, ``closing``, ``truncated`` and ``unknown_kinds`` tell how it ended,
    and ``unknown_values`` counts enum values it does not know (kept as ints), by (tag, field,
    value). ``source``: the file already open (the reader reads it from where it stands, and
    closes it), so that a caller that checked a descriptor reads those very bytes; ``path`` then
    only names it in messages.
    """

    path: str
    source: BinaryIO | None = field(default=None, repr=False)
    header: TraceHeader = field(init=False)
    closing: TraceClosed | None = field(init=False, default=None)
    truncated: bool = field(init=False, default=False)
    truncated_at: int | None = field(init=False, default=None)
    num_records: int = field(init=False, default=0)
    unknown_kinds: Counter = field(init=False, default_factory=Counter)
    unknown_frames: int = field(init=False, default=0)
    unknown_values: Counter = field(init=False, default_factory=Counter)
    _file: BinaryIO = field(init=False, repr=False)
    _offset: int = field(init=False, default=0)
    _consumed: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self._file = self._open() if self.source is None else self.source
        try:
            self._read_preamble()
            frame = self._next_frame()
            if frame is None or frame[0] != FRAME_HEADER:
                if self.truncated or frame is None:
                    raise HeaderCutError(
                        f"{self.path} ends before its header is complete",
                        hint="Nothing can be recovered from it; capture the trace again.",
                    )
                raise TraceFormatError(f"{self.path} does not start with a header frame", 0)
            self.header = self._decode(_HEADER_DECODER, frame)
        except BaseException:
            self._file.close()
            raise

    def _open(self) -> BinaryIO:
        try:
            return open(self.path, "rb")
        except FileNotFoundError:
            raise TraceNotFoundError(f"no such trace: {self.path}") from None
        except IsADirectoryError:
            raise TraceNotFoundError(f"{self.path} is a directory, not a trace") from None
        except OSError as error:
            raise TraceNotFoundError(f"cannot open {self.path}: {error.strerror}") from None
    def _read(self, size: int) -> bytes:
        """Up to ``size`` bytes; a file that fails to read (EIO: ``/proc/self/mem``, a failing
        disk) is one error."""
        try:
            return self._file.read(size)
        except OSError as error:
            raise TraceNotFoundError(f"cannot read {self.path}: {error.strerror or error}",
                                     "Check that it is a trace file, and the disk.") from None

    def _read_preamble(self) -> None:
        preamble = self._read(PREAMBLE.size)
        if not preamble:
            raise HeaderCutError(
                f"{self.path} is empty", hint="The writer never started; capture the trace again."
            )
        if not MAGIC.startswith(preamble[: len(MAGIC)]):
            raise TraceFormatError(f"{self.path} is not a kvtrace trace (bad magic bytes)", 0)
        if len(preamble) < PREAMBLE.size:
            raise HeaderCutError(
                f"{self.path} ends before its header is complete",
                hint="Nothing can be recovered from it; capture the trace again.",
            )
        _, major, _minor = PREAMBLE.unpack(preamble)
        if major > FORMAT_MAJOR:
            raise TraceVersionError(
                f"{self.path} is trace format v{major}, newer than this kvtrace reads "
                f"(v{FORMAT_MAJOR})"
            )
        if major < 1:
            raise TraceFormatError(f"{self.path} has invalid format version {major}", 8)
        self._offset = PREAMBLE.size

    def _next_frame(self) -> tuple[bytes, memoryview, int] | None:
        """The next complete frame as (type, body, offset); None at the end or a cut."""
        offset = self._offset
        head = self._read(FRAME_HEAD.size)
        if not head:
            return None
        if len(head) < FRAME_HEAD.size:
            return self._cut(offset)
        length, checksum = FRAME_HEAD.unpack(head)
        if length == 0 or length > MAX_FRAME_BYTES:
            raise TraceFormatError(f"{self.path}: frame has impossible length {length}", offset)
        payload = self._read(length)
        if len(payload) < length:
            return self._cut(offset)
        if zlib.crc32(payload) != checksum:
            raise TraceFormatError(f"{self.path}: frame checksum mismatch (corrupt bytes)", offset)
        self._offset = offset + FRAME_HEAD.size + length
        view = memoryview(payload)
        return bytes(view[:1]), view[1:], offset

    def _cut(self, offset: int) -> None:
        self.truncated, self.truncated_at = True, offset
        return None

    def _decode(self, decoder: msgspec.msgpack.Decoder, frame: tuple[bytes, memoryview, int]) -> Any:
        try:
            return decoder.decode(frame[1])
        except (msgspec.DecodeError, ValueError, TypeError) as error:
            raise TraceFormatError(f"{self.path}: undecodable frame ({error})", frame[2]) from None

    def batches(self) -> Iterator[RecordBatch]:
        """Decoded batches in file order. A reader can be consumed once."""
        if self._consumed:
            raise RuntimeError("a TraceReader can be iterated once; open the trace again")
        self._consumed = True
        try:
            yield from self._decoded_batches()
            if self.closing is None and not self.truncated:
                self._cut(self._offset)
        finally:
            self._file.close()

    def new_batches(self) -> Iterator[RecordBatch]:
        """The batches written since the last call, for a trace still being written (a regular
        file): up to its end, or to a frame not yet whole, where the next call resumes. The
        file stays open (``close``); ``closing`` is set once its writer closed it."""
        self._file.seek(self._offset)  # back to the start of a frame read only in part
        self.truncated, self.truncated_at = False, None
        yield from self._decoded_batches()

    def _decoded_batches(self) -> Iterator[RecordBatch]:
        """Decode frames from ``_offset`` on, until the end or a frame cut short."""
        while (frame := self._next_frame()) is not None:
            frame_type, body, offset = frame
            if self.closing is not None:
                raise TraceFormatError(f"{self.path}: data after the closing frame", offset)
            if frame_type in (FRAME_BATCH, FRAME_ROWS):
                decode = decode_batch if frame_type == FRAME_BATCH else decode_rows
                try:
                    batch, unknown = decode(body, self.num_records)
                except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as e:
                    raise TraceFormatError(f"{self.path}: undecodable batch ({e})", offset) from None
                if unknown:
                    self.unknown_kinds.update(unknown)
                if batch.unknown_values:
                    self.unknown_values.update(batch.unknown_values)
                # A B batch keeps unknown kinds' rows (typeless); an R batch drops them.
                self.num_records += len(batch) + (
                    unknown.total() if frame_type == FRAME_ROWS else 0)
                yield batch
            elif frame_type == FRAME_CLOSED:
                self.closing = self._decode(_CLOSED_DECODER, frame)
            elif frame_type == FRAME_HEADER:
                raise TraceFormatError(f"{self.path}: a second header frame", offset)
            else:
                self.unknown_frames += 1

    def __iter__(self) -> Iterator[Record]:
        for batch in self.batches():
            yield from batch.records()

    @property
    def num_dropped(self) -> int:
        return self.closing.num_dropped if self.closing else 0

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> TraceReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_trace_file(path: str | os.PathLike) -> BinaryIO:
    """``path`` opened once, for a command that reads everything of a trace from one descriptor
    (its digest and its records): a regular file, else refused (a FIFO would block or change
    between reads, a device never end). Opened without blocking on a FIFO, checked on the
    descriptor, so the file checked is the file read."""
    path = os.fspath(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise TraceNotFoundError(f"no such trace: {path}") from None
    except OSError as error:
        raise TraceNotFoundError(f"cannot open {path}: {error.strerror}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        if stat.S_ISDIR(mode):
            raise TraceNotFoundError(f"{path} is a directory, not a trace")
        raise TraceNotFoundError(f"{path} is not a regular file (a FIFO, socket or device)",
                                 "Save the stream to a file first.")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def count_kinds(path: str | os.PathLike) -> Counter:
    """Records per kind (tag) in the trace at ``path``, counted batch by batch (in C)."""
    counts: Counter = Counter()
    for batch in TraceReader(os.fspath(path)).batches():
        for index, tag in enumerate(batch.tags):
            counts[tag] += batch.kinds.count(index)
    return counts


def read_records(path: str | os.PathLike) -> tuple[TraceReader, list[Record]]:
    """Read a whole (small) trace: its reader (for header and status) and all its records."""
    reader = TraceReader(os.fspath(path))
    return reader, list(reader)


