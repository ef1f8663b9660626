"""Reading and writing kvtrace trace files.

Layout (all integers little-endian)::

    b"KVTRACE\\0"  u16 format_major  u16 format_minor
    frame*        u32 payload_len  u32 crc32(payload)  payload
    payload       one type byte, then msgpack: H = TraceHeader, B = record batch (columns),
                  R = record batch (rows, format 1.1), C = TraceClosed

The first frame is the header; a cleanly closed trace ends with the closing frame. Records travel
in batches stored column by column (ints at the narrowest fixed width that holds them), because
bulk analysis wants columns and fixed-width columns cost a fraction of per-record msgpack to
write, read and turn into Arrow (reference/environment-notes.md section 4). A batch keeps the
exact order of its records in ``kinds`` (one byte per record: an index into its ``tags``).

A capture writes R batches instead: the records as one msgpack array of tagged rows, which
msgspec encodes in C at a few tens of ns per record (columns cost several times more to build,
in Python). The capture hook encodes records itself, in batches of engine steps
(``encode_rows``), and the writer only frames the chunks (``write_encoded_rows``), so the writer
thread holds the engine's interpreter lock as briefly as possible. Readers turn R batches into
the same columns, so nothing downstream sees the difference.

A writer cut off anywhere loses at most its last, incomplete frame: the reader recovers every
complete frame, sets ``truncated`` and never fails on the cut. Bytes that fail their checksum or
do not decode raise ``TraceFormatError`` naming the frame's offset, as do columns whose values
do not have their field's type. Kinds the reader does not know are skipped and counted; frame
types it does not know likewise. Enum values it does not know (a newer writer's) are kept as
plain ints and counted (``unknown_values``); ``events.enum_label`` names them by number.
"""

from __future__ import annotations

import enum
import io
import os
import stat
import struct
import sys
import time
import typing
import zlib
from array import array
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from operator import attrgetter, itemgetter
from typing import Any, BinaryIO, Union

import msgspec

from kvtrace import events, native
from kvtrace.errors import TraceFormatError, TraceNotFoundError, TraceVersionError
from kvtrace.files import StagedOutput, cannot_write
from kvtrace.events import (
    FORMAT_MAJOR,
    FORMAT_MINOR,
    TAG_TO_TYPE,
    Record,
    TraceClosed,
    TraceHeader,
    tag_of,
)

MAGIC = b"KVTRACE\0"
_PREAMBLE = struct.Struct("<8sHH")
_FRAME_HEAD = struct.Struct("<II")
FRAME_HEADER, FRAME_BATCH, FRAME_ROWS, FRAME_CLOSED = b"H", b"B", b"R", b"C"
# A frame longer than this is damage, not data: batches are a few hundred KiB.
MAX_FRAME_BYTES = 1 << 30
DEFAULT_BATCH_SIZE = 8192


class HeaderCutError(TraceFormatError):
    """A file that ends before its header is complete: empty, cut off at once, or a trace whose
    writer has only just begun (a follower waits for it: ``kvtrace.analysis.live``)."""


_INT_CODES = ((1, "b"), (2, "h"), (4, "i"), (8, "q"))
_INT_CODES_NARROW_FIRST = tuple(code for _, code in _INT_CODES)
_WIDTH_OF_CODE = {code: w for w, code in _INT_CODES}
_SWAP = sys.byteorder == "big"  # columns are little-endian on disk


# --- column codec ------------------------------------------------------------------------------
# A column is a tuple: ("i", code, raw) fixed-width ints; ("l", lengths, values) a list of
# int lists as two int columns; ("o", msgpack) anything else (strings, bytes, None).

_OBJECT_ENCODER = msgspec.msgpack.Encoder()
_OBJECT_DECODER = msgspec.msgpack.Decoder()


def _int_column(values: list[int]) -> tuple:
    # Try the narrowest width first: array() stops at the first value that does not fit,
    # which is cheaper than scanning for min and max.
    for code in _INT_CODES_NARROW_FIRST:
        try:
            column = array(code, values)
        except OverflowError:
            continue
        if _SWAP:
            column.byteswap()
        return ("i", code, column.tobytes())
    raise OverflowError("integer column value does not fit in 64 bits")


def _encode_column(values: list, annotation: Any) -> tuple:
    if annotation == "list[int]":
        return ("l", _int_column([len(v) for v in values]), _int_column([x for v in values for x in v]))
    if annotation in _INT_ANNOTATIONS:
        return _int_column(values)
    return ("o", _OBJECT_ENCODER.encode(values))


def _decode_int_column(column: Any) -> array:
    kind, code, raw = column
    if kind != "i" or code not in _WIDTH_OF_CODE or len(raw) % _WIDTH_OF_CODE[code]:
        raise ValueError("bad int column")
    values = array(code)
    values.frombytes(raw)
    if _SWAP:
        values.byteswap()
    return values


def decode_column(column: Any) -> Any:
    """Decode one column to an ``array`` of ints, a ``ListColumn`` or a list of objects."""
    kind = column[0]
    if kind == "i":
        return _decode_int_column(column)
    if kind == "l":
        lengths, values = _decode_int_column(column[1]), _decode_int_column(column[2])
        if sum(lengths) != len(values) or (lengths and min(lengths) < 0):
            raise ValueError("bad list column")
        return ListColumn(lengths, values)
    if kind == "o":
        return _OBJECT_DECODER.decode(column[1])
    raise ValueError(f"unknown column kind {kind!r}")


@dataclass(frozen=True)
class ListColumn:
    """A column of int lists, Arrow-style: each row's length, and all values back to back."""

    lengths: array
    values: array

    def __len__(self) -> int:
        return len(self.lengths)

    def to_lists(self) -> list[list[int]]:
        values = self.values.tolist()
        rows, start = [], 0
        for length in self.lengths:
            rows.append(values[start : start + length])
            start += length
        return rows


# Fields stored as int columns: ints, bools and the schema's IntEnums.
_INT_ANNOTATIONS = {"int", "bool"} | {
    name for name, value in vars(events).items()
    if isinstance(value, type) and issubclass(value, enum.IntEnum) and value is not enum.IntEnum
}


def _field_annotations(record_type: type[Record]) -> list[str]:
    annotations = {}
    for klass in reversed(record_type.__mro__):
        annotations.update(getattr(klass, "__annotations__", {}))
    return [str(annotations[name]) for name in record_type.__struct_fields__]


def _field_codecs(record_type: type[Record]) -> list[tuple[Any, str]]:
    """(getter, annotation) per field, in order: how to pull and encode each column."""
    fields = record_type.__struct_fields__
    return list(zip(map(attrgetter, fields), _field_annotations(record_type)))


_FIELD_CODECS = {cls: _field_codecs(cls) for cls in TAG_TO_TYPE.values()}
_OBJECT_FIELD_TYPES = {"str": str, "bytes": bytes, "dict[str, int]": dict,
                       "dict[str, list[int]]": dict}
# Object fields whose contents are typed too (a snapshot's maps): checked with msgspec.
_TYPED_OBJECT_FIELDS = {"dict[str, int]": list[dict[str, int]],
                        "dict[str, list[int]]": list[dict[str, list[int]]]}
# Per kind, its enum fields: (field index, name, the values this reader knows as bytes; a
# column of only known values is an int8 column, since the writer picks the narrowest width).
_ENUM_FIELDS = {
    cls: [(index, name, getattr(events, annotation),
           bytes(sorted(m.value for m in getattr(events, annotation))))
          for index, (name, (_, annotation)) in enumerate(zip(cls.__struct_fields__, codecs))
          if annotation not in ("int", "bool", "list[int]", *_OBJECT_FIELD_TYPES)]
    for cls, codecs in _FIELD_CODECS.items()
}


def _lenient_twin(record_type: type[Record]) -> type[msgspec.Struct]:
    """``record_type`` with its enum fields typed as plain ints, to decode rows with: a value a
    newer writer added to an enum is kept as its number, not refused. Every other field keeps
    its type, so an ill-typed row is still refused."""
    fields = record_type.__struct_fields__
    defaults = record_type.__struct_defaults__
    first_default = len(fields) - len(defaults)
    enums = {name for _, name, _, _ in _ENUM_FIELDS[record_type]}
    hints = typing.get_type_hints(record_type, vars(events))
    spec = [(name, int if name in enums else hints[name],
             *((defaults[i - first_default],) if i >= first_default else ()))
            for i, name in enumerate(fields)]
    return msgspec.defstruct(record_type.__name__, spec, tag=tag_of(record_type),
                             array_like=True, frozen=True, gc=False)


_TWINS = {cls: _lenient_twin(cls) for cls in TAG_TO_TYPE.values()}
_FIELD_CODECS.update((twin, _FIELD_CODECS[cls]) for cls, twin in _TWINS.items())


class _Batch(msgspec.Struct, array_like=True):
    tags: list[str]
    kinds: bytes
    columns: list[list[Any]]


def encode_batch(records: list[Record]) -> tuple[bytes, dict[str, int]]:
    """Encode records (in order) as one batch payload, without the frame type byte.

    Returns the payload and the number of records per tag."""
    by_type: dict[type[Record], list[Record]] = {}
    for record in records:
        rows = by_type.get(type(record))
        if rows is None:
            rows = by_type[type(record)] = []
        rows.append(record)
    index = {record_type: i for i, record_type in enumerate(by_type)}
    kinds = bytes(map(index.__getitem__, map(type, records)))
    columns = [
        [_encode_column(list(map(getter, rows)), annotation)
         for getter, annotation in _FIELD_CODECS[record_type]]
        for record_type, rows in by_type.items()
    ]
    counts = {record_type.__struct_config__.tag: len(rows) for record_type, rows in by_type.items()}
    return _BATCH_ENCODER.encode(_Batch(list(counts), kinds, columns)), counts


_BATCH_ENCODER = msgspec.msgpack.Encoder()
encode_rows = _BATCH_ENCODER.encode  # records -> an R batch payload (msgpack array of rows)
_BATCH_DECODER = msgspec.msgpack.Decoder(_Batch)
_ROWS_DECODER = msgspec.msgpack.Decoder(list[Union[tuple(_TWINS.values())]])  # type: ignore[misc]
_HEADER_DECODER = msgspec.msgpack.Decoder(TraceHeader)
_CLOSED_DECODER = msgspec.msgpack.Decoder(TraceClosed)


@dataclass
class RecordBatch:
    """One decoded batch: ``kinds[i]`` indexes ``types`` (None = unknown kind) for record i;
    ``columns[j]`` holds the field columns of ``types[j]`` (rows in file order).
    ``unknown_values`` counts enum values this reader does not know, by (tag, field, value):
    the records keep them as plain ints."""

    types: list[type[Record] | None]
    tags: list[str]
    kinds: bytes
    columns: list[list[Any]]
    first_seq: int
    unknown_values: Counter = field(default_factory=Counter)

    def __len__(self) -> int:
        return len(self.kinds)

    def records(self) -> Iterator[Record]:
        """The batch's records of known kinds, in file order."""
        row_iters = []
        for record_type, columns in zip(self.types, self.columns):
            if record_type is None:
                row_iters.append(None)
                continue
            values = [c.to_lists() if isinstance(c, ListColumn) else c for c in columns]
            row_iters.append(iter([record_type(*row) for row in zip(*values)]))
        if len(row_iters) == 1 and row_iters[0] is not None:
            yield from row_iters[0]
            return
        for kind in self.kinds:
            rows = row_iters[kind]
            if rows is not None:
                yield next(rows)

    def field_rows(self, wanted: tuple[type[Record], ...]) -> Iterator[tuple]:
        """``(type, *field values)`` of the batch's records of the ``wanted`` kinds, in file
        order, without building records: a list field comes as an ``array`` slice, so that a
        large trace is read at a few bytes per list element."""
        indices = [i for i, record_type in enumerate(self.types) if record_type in wanted]
        rows = {i: zip(*map(_column_rows, self.columns[i])) for i in indices}
        others = bytes(i for i in range(len(self.types)) if i not in rows)
        for kind in self.kinds.translate(None, others) if others else self.kinds:
            yield (self.types[kind], *next(rows[kind]))


def _column_rows(column: Any) -> Iterable:
    """A decoded column's values row by row; a list column's rows as array slices."""
    if not isinstance(column, ListColumn):
        return column
    return _list_rows(column)


def _list_rows(column: ListColumn) -> Iterator[array]:
    values, start = column.values, 0
    for length in column.lengths:
        yield values[start:start + length]
        start += length


def _decode_batch(payload: memoryview, first_seq: int) -> tuple[RecordBatch, Counter]:
    raw = _BATCH_DECODER.decode(payload)
    num_tags = len(raw.tags)
    if (num_tags != len(raw.columns) or num_tags > 256
            or raw.kinds.translate(None, bytes(range(num_tags)))):
        raise ValueError("batch kinds do not match its tags")
    # Per kind its number of records, counted in C (bytes.count), not byte by byte.
    counts = [raw.kinds.count(index) for index in range(num_tags)]
    types: list[type[Record] | None] = []
    columns: list[list[Any]] = []
    unknown: Counter = Counter()
    for i, (tag, raw_columns) in enumerate(zip(raw.tags, raw.columns)):
        record_type = TAG_TO_TYPE.get(tag)
        if record_type is None:
            unknown[tag] += counts[i]
            types.append(None)
            columns.append([])
            continue
        decoded = [decode_column(c) for c in raw_columns[: len(record_type.__struct_fields__)]]
        if any(len(c) != counts[i] for c in decoded):
            raise ValueError(f"column lengths of {tag!r} do not match its record count")
        _check_column_types(record_type, decoded)
        decoded.extend(_default_columns(record_type, len(decoded), counts[i]))
        types.append(record_type)
        columns.append(decoded)
    batch = RecordBatch(types, raw.tags, raw.kinds, columns, first_seq)
    for record_type, decoded in zip(types, columns):
        if record_type is not None:
            _count_unknown_values(record_type, decoded, batch.unknown_values)
    return batch, unknown


def _check_column_types(record_type: type[Record], columns: list) -> None:
    """Refuse a column whose values do not have its field's type (int fields must be int
    columns, lists of ints list columns, strings and bytes lists of them)."""
    for column, (_, annotation), name in zip(columns, _FIELD_CODECS[record_type],
                                              record_type.__struct_fields__):
        object_type = _OBJECT_FIELD_TYPES.get(annotation)
        if annotation == "list[int]":
            fits = isinstance(column, ListColumn)
        elif object_type is None:
            fits = isinstance(column, array)
        else:
            fits = isinstance(column, list) and set(map(type, column)) <= {object_type}
            if fits and annotation in _TYPED_OBJECT_FIELDS:
                try:
                    msgspec.convert(column, _TYPED_OBJECT_FIELDS[annotation], strict=True)
                except msgspec.ValidationError:
                    fits = False
        if not fits:
            raise ValueError(f"{tag_of(record_type)}.{name} holds values that are not "
                             f"{annotation}")


def _count_unknown_values(record_type: type[Record], columns: list, counts: Counter) -> None:
    """Count the values of enum columns this reader does not know (cheap when there are none:
    such a column is int8 and holds only known bytes)."""
    for index, name, enum_type, known in _ENUM_FIELDS[record_type]:
        column = columns[index]
        if not isinstance(column, array):
            continue  # a default column of an older writer's trace
        if column.typecode == "b" and not column.tobytes().translate(None, known):
            continue
        tag = tag_of(record_type)
        known_values = enum_type._value2member_map_
        counts.update((tag, name, value) for value in column if value not in known_values)


def _decode_rows(payload: memoryview, first_seq: int) -> tuple[RecordBatch, Counter]:
    """An R batch as the columns a B batch of the same records decodes to. Rows of kinds this
    reader does not know are skipped and counted (and, unlike in a B batch, not kept in the
    batch: records after them in the same batch number one lower than a newer reader's)."""
    unknown: Counter = Counter()
    try:
        records = _ROWS_DECODER.decode(payload)
    except msgspec.ValidationError:  # a kind from a newer writer: convert the rest row by row
        records = []
        for row in _OBJECT_DECODER.decode(payload):
            record_type = TAG_TO_TYPE.get(row[0]) if isinstance(row, list) and row else None
            if record_type is None:
                unknown[row[0] if isinstance(row, list) and row else "?"] += 1
            else:
                records.append(msgspec.convert(row, _TWINS[record_type]))
    batch, _ = _decode_batch(memoryview(encode_batch(records)[0]), first_seq)
    return batch, unknown


def _default_columns(record_type: type[Record], num_present: int, num_rows: int) -> list[list]:
    """Columns for trailing fields an older writer did not know: their defaults."""
    fields = record_type.__struct_fields__
    defaults = record_type.__struct_defaults__
    first_default = len(fields) - len(defaults)
    if num_present < first_default:
        missing = fields[num_present]
        raise ValueError(f"{record_type.__name__} lacks required field {missing!r}")
    return [[defaults[i - first_default]] * num_rows for i in range(num_present, len(fields))]


# --- writer -------------------------------------------------------------------------------------

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
        self._file.write(_PREAMBLE.pack(MAGIC, FORMAT_MAJOR, FORMAT_MINOR))
        self._write_frame(FRAME_HEADER, msgspec.msgpack.encode(header))
        self.closed = False

    def _write_frame(self, frame_type: bytes, body: bytes) -> None:
        payload = frame_type + body
        self._file.write(_FRAME_HEAD.pack(len(payload), zlib.crc32(payload)))
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


# --- reader -------------------------------------------------------------------------------------


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
        preamble = self._read(_PREAMBLE.size)
        if not preamble:
            raise HeaderCutError(
                f"{self.path} is empty", hint="The writer never started; capture the trace again."
            )
        if not MAGIC.startswith(preamble[: len(MAGIC)]):
            raise TraceFormatError(f"{self.path} is not a kvtrace trace (bad magic bytes)", 0)
        if len(preamble) < _PREAMBLE.size:
            raise HeaderCutError(
                f"{self.path} ends before its header is complete",
                hint="Nothing can be recovered from it; capture the trace again.",
            )
        _, major, _minor = _PREAMBLE.unpack(preamble)
        if major > FORMAT_MAJOR:
            raise TraceVersionError(
                f"{self.path} is trace format v{major}, newer than this kvtrace reads "
                f"(v{FORMAT_MAJOR})"
            )
        if major < 1:
            raise TraceFormatError(f"{self.path} has invalid format version {major}", 8)
        self._offset = _PREAMBLE.size

    def _next_frame(self) -> tuple[bytes, memoryview, int] | None:
        """The next complete frame as (type, body, offset); None at the end or a cut."""
        offset = self._offset
        head = self._read(_FRAME_HEAD.size)
        if not head:
            return None
        if len(head) < _FRAME_HEAD.size:
            return self._cut(offset)
        length, checksum = _FRAME_HEAD.unpack(head)
        if length == 0 or length > MAX_FRAME_BYTES:
            raise TraceFormatError(f"{self.path}: frame has impossible length {length}", offset)
        payload = self._read(length)
        if len(payload) < length:
            return self._cut(offset)
        if zlib.crc32(payload) != checksum:
            raise TraceFormatError(f"{self.path}: frame checksum mismatch (corrupt bytes)", offset)
        self._offset = offset + _FRAME_HEAD.size + length
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
                decode = _decode_batch if frame_type == FRAME_BATCH else _decode_rows
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


def write_trace(path: str | os.PathLike | io.BufferedIOBase, header: TraceHeader,
                records: Iterable[Record], *, atomic: bool = True) -> None:
    """Write a whole trace at once."""
    with TraceWriter(path, header, atomic=atomic) as writer:
        writer.write_many(records)
