"""A run's rows, a chunk of a table at a time, into DuckDB: inserted into the database's tables
by threads of their own while the trace is read on, or, in a worker, written as the Parquet
files of the run's part (``part_files``). Each chunk goes in as it is stored: narrow columns
as 32-bit ints, enums as codes, the streaming pass's NULLs and flags as SQL's."""

from __future__ import annotations

import functools
import queue
import threading
from collections import Counter

import numpy as np

from kvtrace.analysis import stream
from kvtrace.analysis.causes import CAUSES, SHORTFALL_CAUSES
from kvtrace.analysis.miss_table import ATTRIBUTION_COLUMNS, NONE
from kvtrace.analysis.database import (
    ATTRIBUTION_TABLE,
    column_name,
    narrow_columns,
    past_32_bits,
    record_fields,
    stored_tables,
)
from kvtrace.analysis.part_files import PartTask, make_part_directory, part_file
from kvtrace.analysis.sql_access import sql_string
from kvtrace.events import RECORD_TYPES, tag_of

INSERT_THREADS = 2  # DuckDB's appends to different tables run side by side
INSERTS_IN_FLIGHT = 4  # chunks waiting for each inserting thread (each at most CHUNK_ROWS rows)


class Inserts:
    """Chunks of one run's rows, inserted by ``INSERT_THREADS`` threads (each on its own cursor,
    each table on one of them, so its rows go in in order) while the next batches are read:
    DuckDB stores what it scanned without the interpreter lock, so reading and inserting
    overlap in part. At most
    ``INSERTS_IN_FLIGHT`` chunks wait for each thread; an insert's error comes back on the next
    ``put`` or on ``finish``. With a ``part``, each chunk is written as the next Parquet file of
    its table's part instead (``written`` counts them per table): a worker keeps no database."""

    def __init__(self, connection, run: int, path: str, part: PartTask | None = None,
                 written: Counter | None = None) -> None:
        self.run, self.path, self.part, self.written = run, path, part, written
        self.error: BaseException | None = None
        self.workers = [_InsertThread(self, connection) for _ in range(INSERT_THREADS)]
        self.worker_of: dict[str, _InsertThread] = {}

    def put(self, table: str, columns: dict[str, np.ndarray]) -> None:
        if self.error is not None:
            raise self.error
        num_rows = len(next(iter(columns.values()), ()))
        if num_rows:
            worker = self.worker_of.get(table)
            if worker is None:  # a table's first chunk: to the thread given the fewest rows
                worker = self.worker_of[table] = min(self.workers, key=lambda w: w.num_rows)
            worker.num_rows += num_rows
            worker.queue.put((table, _narrowed(table, columns, self.path)))

    def insert(self, cursor, table: str, columns: dict[str, np.ndarray]) -> None:
        # DuckDB reads the chunk by its replacement scan of this frame's variables: registering
        # and unregistering it instead cost about 2 ms of CPU a chunk.
        kvtrace_chunk = columns  # noqa: F841 (read by the SQL)
        if self.part is None:
            cursor.execute(_insert_sql(table, tuple(columns)), {"run": self.run})
            return
        index = self.written[table]  # each table on one thread: its files in order
        path = part_file(self.part.directory, table, self.part.run, index)
        if index == 0:
            make_part_directory(path)
        cursor.execute(f"COPY ({_chunk_select(table, tuple(columns), False)}) TO "
                       f"{sql_string(path)} (FORMAT PARQUET, COMPRESSION {self.part.compression})")
        self.written[table] = index + 1

    def finish(self) -> None:
        """Wait for every chunk put so far; raise an insert's error."""
        self.close()
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        for worker in self.workers:
            worker.stop()


class _InsertThread:
    """One of ``Inserts``' threads: its chunks, in the order put."""

    def __init__(self, inserts: Inserts, connection) -> None:
        self.inserts, self.cursor, self.num_rows = inserts, connection.cursor(), 0
        self.queue: queue.Queue = queue.Queue(INSERTS_IN_FLIGHT)
        self.thread = threading.Thread(target=self._insert_all, name="kvtrace-load", daemon=True)
        self.thread.start()

    def _insert_all(self) -> None:
        while (item := self.queue.get()) is not None:
            if self.inserts.error is not None:
                continue  # drain: the reader stops at its next put
            try:
                self.inserts.insert(self.cursor, *item)
            except BaseException as error:  # handed to the reading thread
                self.inserts.error = error

    def stop(self) -> None:
        if self.thread.is_alive():
            self.queue.put(None)
            self.thread.join()
            self.cursor.close()


_INT32 = np.iinfo(np.int32)


def _narrowed(table: str, columns: dict[str, np.ndarray], path: str) -> dict[str, np.ndarray]:
    """``columns`` with those ``table`` stores as 32-bit ints (``narrow_columns``) made so; a
    value past 32 bits is refused (no engine makes one: a step, a request, a block...). The C
    core hands its narrow columns over as int32s, checked."""
    narrow = [name for name in narrow_columns(table).intersection(columns)
              if columns[name].dtype != np.int32]
    if not narrow:
        return columns
    columns = dict(columns)
    for name in narrow:
        values = columns[name]
        low, high = int(values.min()), int(values.max())
        if low < _INT32.min or high > _INT32.max:
            raise past_32_bits(path, table, name, high if high > _INT32.max else low)
        columns[name] = values.astype(np.int32)
    return columns


_BOOL_COLUMNS = {(tag_of(record_type), column_name(name))
                 for record_type in RECORD_TYPES
                 for name, field_type in record_fields(record_type) if field_type is bool}
# The streaming pass's columns: int64, NULL as NONE; flags as 0/1.
_PASS_TABLES = {ATTRIBUTION_TABLE: ATTRIBUTION_COLUMNS,
                "cache_entry_figures": stream.ENTRY_COLUMNS}
_FLAGS = {"in_flight"}


@functools.cache
def _insert_sql(table: str, columns: tuple[str, ...]) -> str:
    """INSERT of a chunk of ``table`` for the run ``$run`` (its labels are computed from it)."""
    return f"INSERT INTO {stored_tables()[table]} BY NAME {_chunk_select(table, columns, True)}"


# The shortfall's causes by their codes (a cause's code is its place in CAUSES), by name: the
# causes' order is theirs to choose.
_SHORTFALL_CODES = ", ".join(str(CAUSES.index(cause)) for cause in SHORTFALL_CAUSES)


@functools.cache
def _chunk_select(table: str, columns: tuple[str, ...], with_run: bool) -> str:
    """The rows of a chunk of ``table`` as they are stored, each column under its name, with
    the run ``$run`` (``with_run``) or without (a part's file: its run is in its path). Enum
    fields go in as codes (``<name>_code``)."""
    targets, expressions = (["run"], ["$run"]) if with_run else ([], [])
    if table == ATTRIBUTION_TABLE:
        causes = ", ".join(f"'{cause}'" for cause in CAUSES)
        targets += ["resumed", "in_shortfall"]
        expressions += ["lookup > 1", f"cause IN ({_SHORTFALL_CODES})"]
    for name in columns:
        value = f"nullif({name}, {NONE})" if table in _PASS_TABLES else name
        if table == ATTRIBUTION_TABLE and name == "cause":
            value = f"[{causes}][{name} + 1]"
        elif (name in _FLAGS and table in _PASS_TABLES) or (table, name) in _BOOL_COLUMNS:
            value = f"{name}::BOOLEAN"  # from the C core, 0 or 1
        targets.append(name)
        expressions.append(value)
    return ("SELECT " + ", ".join(f"{expression} AS {target}"
                                  for expression, target in zip(expressions, targets))
            + " FROM kvtrace_chunk")
