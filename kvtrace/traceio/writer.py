"""Writing a trace: the preamble and header at once, records in batches, the closing frame on
``close``; written in place (readable while written) or published whole (``atomic``)."""

from __future__ import annotations

import io
import os
import struct
import time
from collections import Counter
from collections.abc import Iterable
from operator import itemgetter
from typing import BinaryIO

import msgspec

from kvtrace import native
from kvtrace.events import Record, TraceClosed, TraceHeader, tag_of
from kvtrace.files import StagedOutput, cannot_write
from kvtrace.traceio.batches import encode_batch, encode_rows
from kvtrace.traceio.frames import (
    FRAME_BATCH,
    FRAME_CLOSED,
    FRAME_HEADER,
    FRAME_ROWS,
    frame_head,
    preamble,
)

DEFAULT_BATCH_SIZE = 8192

_ARRAY32 = struct.Struct(">BI")  # msgpack array32 header
_FIRST = itemgetter(0)


class TraceWriter:
    """Writes a trace: the header at once, records in batches, the closing frame on ``close``.

    One thread owns a writer (the capture hook gives it to its writer thread). With
    ``atomic=True`` the file appears under its name only when closed cleanly, so a failed run
    leaves nothing half-written; otherwise it grows in place, readable while written.
    """

    def __init__(
        self,
        destination: str | os.PathLike | BinaryIO,
        header: TraceHeader,
        *,
        batch_size: int = DEFAULT_BATCH_SIZE,
        atomic: bool = False,
        rows: bool = False,
    ) -> None:
        self.header = header
        self.batch_size = batch_size
        self.rows = rows  # R batches (cheap to write) instead of B (columns)
        self.counts: Counter = Counter()
        self.num_records = 0
        self._pending: list[Record] = []
        self._chunks: list[tuple[int, bytes]] = []  # encoded rows: (number, msgpack array)
        self._num_chunk_records = 0
        self._staged: StagedOutput | None = None
        if isinstance(destination, (str, os.PathLike)):
            path = os.fspath(destination)
            if atomic:
                self._staged = StagedOutput(path)
                path = self._staged.path
            try:
                self._file: BinaryIO = open(path, "wb")
            except OSError as error:
                if self._staged is not None:
                    self._staged.discard()
                raise cannot_write(destination, error) from None
            self._owns_file = True
        else:
            self._file, self._owns_file = destination, False
        # Frames of pre-encoded rows go straight to the file descriptor with the native core.
        self._native_fd = (self._file.fileno()
                           if native.core is not None and self._owns_file else None)
        self._file.write(preamble())
        self._write_frame(FRAME_HEADER, msgspec.msgpack.encode(header))
        self.closed = False

    def _write_frame(self, frame_type: bytes, body: bytes) -> None:
        payload = frame_type + body
        self._file.write(frame_head(payload))
        self._file.write(payload)

    def write(self, record: Record) -> None:
        if self._chunks:
            self._flush_chunks()
        self._pending.append(record)
        if len(self._pending) >= self.batch_size:
            self.flush_batch()

    def write_many(self, records: Iterable[Record]) -> None:
        if self._chunks:
            self._flush_chunks()
        pending = self._pending
        pending.extend(records)
        size = self.batch_size
        num_whole = len(pending) - len(pending) % size
        if num_whole:
            for start in range(0, num_whole, size):
                self._write_batch(pending[start:start + size])
            self._pending = pending[num_whole:]

    def write_encoded_rows(self, chunks: list[tuple[int, bytes]]) -> int:
        """Write records encoded elsewhere, as ``(number of records, encode_rows(records))``
        pairs; return how many records. The chunks are joined, not decoded, into R batches of
        at least ``batch_size`` records; the closing frame's per-kind ``counts`` leave them out
        (readers count them)."""
        if self._pending:
            self.flush_batch()
        self._chunks.extend(chunks)
        num_taken = sum(map(_FIRST, chunks))
        self._num_chunk_records += num_taken
        if self._num_chunk_records >= self.batch_size:
            self._flush_chunks()
        return num_taken

    def _flush_chunks(self) -> None:
        chunks, num_records = self._chunks, self._num_chunk_records
        self._chunks, self._num_chunk_records = [], 0
        if self._native_fd is not None:  # joined, checksummed, written without the GIL
            self._file.flush()
            native.core.write_rows_frame(self._native_fd, chunks)
        else:  # each chunk without its msgpack array header (fixarray, array16 or array32)
            self._write_frame(FRAME_ROWS, b"".join([
                _ARRAY32.pack(0xDD, num_records),
                *[chunk[1:] if size < 16 else chunk[3:] if size < 65536 else chunk[5:]
                  for size, chunk in chunks]]))
        self.num_records += num_records

    def write_batch(self, payload: bytes, counts: dict[str, int]) -> None:
        """Write one batch encoded elsewhere, as ``encode_batch`` encodes it (the model
        backend's C core writes its records so), with its number of records per tag."""
        self.flush_batch()
        self._write_frame(FRAME_BATCH, payload)
        self.num_records += sum(counts.values())
        self.counts.update(counts)

    def flush_batch(self) -> None:
        """Write all pending records as one batch frame."""
        if self._chunks:
            self._flush_chunks()
        if self._pending:
            batch, self._pending = self._pending, []
            self._write_batch(batch)

    def _write_batch(self, batch: list[Record]) -> None:
        if self.rows:
            payload = encode_rows(batch)
            counts = {tag_of(t): n for t, n in Counter(map(type, batch)).items()}
        else:
            payload, counts = encode_batch(batch)
        self._write_frame(FRAME_ROWS if self.rows else FRAME_BATCH, payload)
        self.num_records += len(batch)
        self.counts.update(counts)

    def flush(self) -> None:
        self.flush_batch()
        self._file.flush()

    def close(self, num_dropped: int = 0) -> None:
        """Write what is pending and the closing frame; publish the file if ``atomic``."""
        if self.closed:
            return
        self.flush_batch()
        closing = TraceClosed(
            num_records=self.num_records,
            num_dropped=num_dropped,
            ended_ns=time.time_ns(),
            counts=dict(self.counts),
        )
        self._write_frame(FRAME_CLOSED, msgspec.msgpack.encode(closing))
        self._file.flush()
        if self._owns_file:
            self._file.close()
        if self._staged is not None:
            self._staged.publish()
        self.closed = True

    def abandon(self) -> None:
        """Stop without a closing frame; an atomic writer removes its partial file. The
        buffered tail of a file being thrown away may fail to flush (the disk that filled up
        and failed the write); that must not keep the partial file from being removed."""
        if self.closed:
            return
        self.closed = True
        try:
            if self._owns_file:
                self._file.close()
        except OSError:
            if self._staged is None:
                raise  # a kept trace whose tail is lost: the caller must hear of it
        finally:
            if self._staged is not None:
                self._staged.discard()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and self._staged is not None:
            self.abandon()
            return
        try:
            self.close()
        except BaseException:
            self.abandon()  # an atomic trace that failed to close leaves nothing behind
            raise


def write_trace(path: str | os.PathLike | io.BufferedIOBase, header: TraceHeader,
                records: Iterable[Record], *, atomic: bool = True) -> None:
    """Write a whole trace at once."""
    with TraceWriter(path, header, atomic=atomic) as writer:
        writer.write_many(records)
