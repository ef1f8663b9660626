"""The streaming pass over one trace that `kvtrace load` and `kvtrace why` make: the miss
attribution and the cache entries, from the trace's record batches, in one pass.

``new_pass`` gives the C core (``csrc/forensics_core.c``, ``kvtrace._forensics_core``) where it
is built and on, else its twins: the attribution's Python reference (``MissAttributor``), the
SQL of ``database.CACHE_ENTRIES_SQL`` for the cache entries (the loader runs it once every run's
records are in) and the loader's own table sink (``load._RunSink``). Either hands over:

* ``take_tables(chunk)``: every whole chunk of rows made so far (0: all), per table, as int64
  columns (``NONE`` for NULL): the ``miss_attribution`` rows (``ATTRIBUTION_COLUMNS``) and, by
  the C core, the ``cache_entry_figures`` rows (``ENTRY_COLUMNS``) and the rows of the record
  tables of ``shaped_types`` (``TABLES``);
* ``lookups`` once the trace ended (``keep_lookups``): the attributed lookups as
  ``LookupAttribution`` objects, for ``why``.

tests/test_attribution.py holds the C core to its twins, row for row.
"""

from __future__ import annotations

import dataclasses
import operator
import os
import tempfile
from collections.abc import Callable, Iterable

import numpy as np

from kvtrace.analysis.attributor import MissAttributor, new_attributor
from kvtrace.analysis.causes import CAUSES, DEFINITIONS
from kvtrace.analysis.database import (
    ENTRY_FIGURE_COLUMNS,
    child_table,
    element_column,
    is_enum_field,
    is_list_field,
    narrow_columns,
    past_32_bits,
    record_fields,
    stored_column,
)
from kvtrace.analysis.lookups import LookupAttribution, LostKey, Removal, Segment
from kvtrace.analysis.miss_table import (
    ATTRIBUTION_COLUMNS,
    ATTRIBUTION_TABLE,
    lookup_columns,
)
from kvtrace.errors import TraceFormatError
from kvtrace.files import OutputError
from kvtrace.events import (
    RECORD_TYPES,
    CheckpointClass,
    RemoveReason,
    RequestQueue,
    StoreKind,
    TraceHeader,
    tag_of,
)
from kvtrace.traceio import RecordBatch

try:
    from kvtrace import _forensics_core as built
except ImportError:
    built = None

core = built if os.environ.get("KVTRACE_NATIVE") != "0" else None

_SKIP = 255  # a batch kind no record spec describes


def _field_kind(field_type: object) -> str:
    if is_list_field(field_type):
        return "l"
    if field_type in (int, bool) or is_enum_field(field_type):
        return "i"
    return "s" if field_type in (str, bytes) else "o"


def _spec(record_type: type) -> tuple:
    """A record kind as the C core is told of it (csrc/forensics_core.c, parse_specs): its tag
    and its fields' names, by which the core finds the kinds and fields it reads, their kinds
    (``_field_kind``), and whether it makes the kind's rows."""
    fields = record_fields(record_type)
    kinds = "".join(_field_kind(field_type) for _, field_type in fields)
    return (tag_of(record_type), tuple(name for name, _ in fields), kinds, "o" not in kinds)


_SPECS = tuple(map(_spec, RECORD_TYPES))
_INDEX = {record_type: index for index, record_type in enumerate(RECORD_TYPES)}
# The kinds whose rows the C core makes (every field an int, an int list, a str or bytes), and
# its tables in its order: each such kind's table, then a child table per list field.
SHAPED_TYPES = frozenset(t for t, spec in zip(RECORD_TYPES, _SPECS) if spec[3])
TABLES: list[tuple[str, tuple[str, ...]]] = []
for _record_type in RECORD_TYPES:
    if _record_type in SHAPED_TYPES:
        _tag, _fields = tag_of(_record_type), record_fields(_record_type)
        TABLES.append((_tag, ("seq", "step", *(
            f"num_{name}" if is_list_field(field_type) else stored_column(name, field_type)
            for name, field_type in _fields))))
        TABLES += [(child_table(_tag, name), ("seq", "req", "pos", element_column(name)))
                   for name, field_type in _fields if is_list_field(field_type)]

# The cache_entry_figures columns (but run, the loader's); the C core finds each by name.
ENTRY_COLUMNS = tuple(name for name, _ in ENTRY_FIGURE_COLUMNS if name != "run")
# The causes as the C core is told of them: each by name, and whether it is in the shortfall
# (the order of those is the waterfall's; a cause's index here is its value in the rows).
_CAUSES = tuple((cause.name, cause.in_shortfall) for cause in DEFINITIONS)
# The enum values the C core compares with, by name.
_ENUMS = {f"{type(value).__name__}.{value.name}": int(value) for value in (
    StoreKind.CHECKPOINT, CheckpointClass.TRANSIENT, RemoveReason.LRU_REUSE,
    RemoveReason.STALE_CHECKPOINT, RemoveReason.REKEY, RequestQueue.RUNNING)}
_CORE_TABLES = [*TABLES, (ATTRIBUTION_TABLE, ATTRIBUTION_COLUMNS),
                ("cache_entry_figures", ENTRY_COLUMNS)]
# Per table, its columns the C core hands over as int32s (the database stores them so).
_NARROW = tuple(tuple(index for index, column in enumerate(columns)
                      if column in narrow_columns(table)) for table, columns in _CORE_TABLES)
Columns = dict[str, np.ndarray]
# The bytes of its spill file the C core may hold mapped in memory: past them it hands the pages
# back to the kernel (they stay in the file) after a batch (docs/performance.md, Memory).
SPILL_RESIDENT = 64 << 20


def new_pass(header: TraceHeader, path: str, *, request: int | str | None = None,
             explain: bool = False, keep_lookups: bool = False, make_rows: bool = True,
             native: bool | None = None, spill_dir: str | None = None
             ) -> NativePass | PythonPass | None:
    """The pass over the trace ``header`` heads (``path`` names it in messages): the C core
    where it is built and on (``native`` None), else the Python twin. ``request`` limits the
    attribution to one request (its number, or the engine's request id). A trace without an
    engine config is not attributed: the C core then makes only the record tables, and without
    it there is nothing to pass (None). With ``spill_dir``, the C core keeps its state that grows
    with the trace (a key per hash id stored, how each was last removed) in an unnamed file there,
    and only a bounded share of it in memory."""
    attributor = (new_attributor(header, path, request=request, explain=explain)
                  if header.config is not None or keep_lookups else None)
    use_core = core is not None if native is None else native
    if use_core:
        return NativePass(attributor, path, keep_lookups=keep_lookups, make_rows=make_rows,
                          spill_dir=spill_dir)
    if attributor is None:
        return None
    return PythonPass(attributor, path, keep_lookups=keep_lookups, make_rows=make_rows)


class PythonPass:
    """The twins: the attribution's Python reference (the record tables and the cache entries
    are left to the loader's sink and to SQL)."""

    shaped_types: frozenset = frozenset()

    def __init__(self, attributor: MissAttributor, path: str, *, keep_lookups: bool,
                 make_rows: bool) -> None:
        self.attributor, self.path = attributor, path
        self.keep_lookups = keep_lookups
        self.lookups: list[LookupAttribution] = []
        self._taken = 0  # lookups already handed over as rows

    def feed(self, batch: RecordBatch) -> None:
        try:
            self.attributor.feed(batch)
        except ValueError as error:  # a record the header contradicts
            raise TraceFormatError(f"{self.path}: {error}", hint=_CONTRADICTION_HINT) from None

    def finish(self) -> None:
        self.lookups = self.attributor.lookups if self.keep_lookups else []

    @property
    def dropped_events(self) -> int:
        return self.attributor.dropped_events

    def take_tables(self, chunk: int = 0) -> list[tuple[str, Columns]]:
        lookups = self.attributor.lookups
        if len(lookups) - self._taken < max(chunk, 1):
            return []
        new = lookups[self._taken:]
        self._taken = len(lookups)
        if not self.keep_lookups:  # the rows are all that is kept
            del lookups[:]
            self._taken = 0
        return [(ATTRIBUTION_TABLE, lookup_columns(new))]


class NativePass:
    """The C core (see module docstring); it also makes the rows of ``SHAPED_TYPES``' tables
    (``take_tables``)."""

    shaped_types = SHAPED_TYPES

    def __init__(self, attributor: MissAttributor | None, path: str, *, keep_lookups: bool,
                 make_rows: bool, spill_dir: str | None = None) -> None:
        self.path, self.spill_dir = path, spill_dir
        self.keep_lookups = keep_lookups
        self.lookups: list[LookupAttribution] = []
        geometry = None
        if attributor is not None:
            geometry = {**dataclasses.asdict(attributor.geometry),  # by name (Core_init)
                        "is_mamba": tuple(map(int, attributor.is_mamba)),
                        "num_blocks": attributor.num_blocks}
        spill = self._spill_file() if spill_dir is not None else None
        try:
            self.core = core.ForensicsCore(
                _SPECS, _CAUSES, (ATTRIBUTION_COLUMNS, ENTRY_COLUMNS), geometry, _ENUMS,
                attributor.only_request if attributor else None,
                attributor.request_id if attributor else None,
                bool(attributor and attributor.explain), keep_lookups, make_rows,
                not keep_lookups, not keep_lookups, _NARROW,
                (spill.fileno() if spill else -1, SPILL_RESIDENT))
        except ValueError as error:  # a header the C core cannot follow (a pool past 2^31)
            raise TraceFormatError(f"{path}: the engine config in its header cannot be analysed: {error}",
                                   hint=_CONTRADICTION_HINT) from None
        except OSError as error:
            raise self._spill_error(error) from None
        finally:
            if spill is not None:
                spill.close()  # the core holds its own descriptor
        self._records: dict[tuple, bytes] = {}

    def feed(self, batch: RecordBatch) -> None:
        key = tuple(batch.types)
        records = self._records.get(key)
        if records is None:
            records = self._records[key] = bytes(_INDEX.get(t, _SKIP) for t in batch.types)
        try:
            self.core.feed(batch.kinds, batch.first_seq, records, batch.columns)
        except ValueError as error:
            raise TraceFormatError(f"{self.path}: {error}", hint=_CONTRADICTION_HINT) from None
        except OSError as error:  # the spill file could not grow
            raise self._spill_error(error) from None

    def _spill_file(self):
        """An unnamed file in ``spill_dir`` (O_TMPFILE; else a new name, unlinked at once): no
        path of it for another user to replace or follow."""
        try:
            return tempfile.TemporaryFile(dir=self.spill_dir)
        except OSError as error:
            raise self._spill_error(error) from None

    def _spill_error(self, error: OSError) -> OutputError:
        return OutputError(f"{self.path}: cannot spill the analysis' state to a file in "
                           f"{self.spill_dir}: {error.strerror or error}",
                           "It needs about 50 bytes a distinct hash id and KV-cache group of the "
                           "trace: free space there, or use another disk (kvtrace load: the "
                           "database's directory; kvtrace why: TMPDIR).")

    def finish(self) -> None:
        self.core.finish()
        if self.keep_lookups:
            self.lookups = [_lookup(row) for row in self.core.take_lookups()]

    @property
    def dropped_events(self) -> int:
        return self.core.dropped_events

    def take_tables(self, chunk: int = 0) -> list[tuple[str, Columns]]:
        """Every whole chunk of ``chunk`` rows made so far of every table (0: all of them): the
        record tables, the attribution's rows, the cache entries' figures."""
        try:
            taken = self.core.take_tables(chunk)
        except OverflowError as error:
            if len(error.args) != 3:
                raise
            table, column, value = error.args  # a narrow column's value past 32 bits
            name, columns = _CORE_TABLES[table]
            raise past_32_bits(self.path, name, columns[column], value) from None
        return [(_CORE_TABLES[index][0], _as_columns(index, data)) for index, data in taken]


_CONTRADICTION_HINT = ("The trace's records contradict its header (edited, or written by a "
                       "broken writer); it cannot be attributed.")


def _as_columns(table: int, data: tuple[bytes | list, ...]) -> Columns:
    """A table's columns as the C core took them (``_CORE_TABLES[table]``): int64s, int32s
    where narrow, objects (a str or bytes field) as a list."""
    narrow = _NARROW[table]
    return {name: np.array(column, dtype=object) if isinstance(column, list)
            else np.frombuffer(column, dtype=np.int32 if index in narrow else np.int64)
            for index, (name, column) in enumerate(zip(_CORE_TABLES[table][1], data))}


def _picker(published: tuple[str, ...], wanted: Iterable[str]) -> Callable[[tuple], tuple]:
    """The fields ``wanted`` of a tuple the C core lays out as its module ``published``, by
    name."""
    return operator.itemgetter(*map(published.index, wanted))


if built is not None:  # the tuples take_lookups hands over, read by name
    _LOOKUP = _picker(built.LOOKUP_FIELDS,
                      [field.name for field in dataclasses.fields(LookupAttribution)])
    _SEGMENT = _picker(built.SEGMENT_FIELDS, ("cause", "start", "end", "keys"))
    _KEY = _picker(built.KEY_FIELDS, ("group", "depth_tokens", "hash_id", "removal"))
    _REMOVAL = _picker(built.REMOVAL_FIELDS, Removal._fields)


def _lookup(row: tuple) -> LookupAttribution:
    """A lookup the C core kept, as the Python twin makes it."""
    lookup = LookupAttribution(*_LOOKUP(row))  # its segments as the core laid them out, so:
    lookup.segments = [Segment(CAUSES[cause], start, end, tuple(
        LostKey(group, depth, hash_id, None if removal is None else Removal(*_REMOVAL(removal)))
        for group, depth, hash_id, removal in map(_KEY, keys)))
        for cause, start, end, keys in map(_SEGMENT, lookup.segments)]
    return lookup
