"""Records to and from a batch frame's payload: B batches (column by column, each int column at
the narrowest fixed width that holds it) and R batches (msgpack rows, what a capture writes),
both decoded to the same columns (``RecordBatch``). Columns whose values do not have their
field's type are refused; kinds and enum values this reader does not know are counted."""

from __future__ import annotations

import enum
import sys
import typing
from array import array
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, Union

import msgspec

from kvtrace import events
from kvtrace.events import TAG_TO_TYPE, Record, tag_of

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


def decode_batch(payload: memoryview, first_seq: int) -> tuple[RecordBatch, Counter]:
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


def decode_rows(payload: memoryview, first_seq: int) -> tuple[RecordBatch, Counter]:
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
    batch, _ = decode_batch(memoryview(encode_batch(records)[0]), first_seq)
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

