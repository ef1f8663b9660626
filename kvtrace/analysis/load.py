"""Loading traces into the forensics database, column by column, in one pass per trace.

A trace is opened once (``traceio.open_trace_file``: a regular file, or refused) and that one
descriptor serves everything: its bytes go through the digest (``runs.digest``) as the reader
reads them, every batch already holds its records as fixed-width int columns (which
``numpy.frombuffer`` views without copying), and the same batches feed the streaming pass of
``kvtrace.analysis.stream`` (the miss attribution and the cache entries; its C core where it is
built). No record is ever turned into a Python object. Each table's rows gather in fixed-size
column buffers (``CHUNK_ROWS``) handed to DuckDB as numpy arrays by a second thread while the
next batches are read, so the memory a load holds does not grow with the trace.
"""

from __future__ import annotations

import functools
import hashlib
import os
import queue
import resource
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import msgspec
import numpy as np

from kvtrace import __version__
from kvtrace.analysis import stream
from kvtrace.analysis.attribution import CAUSES, SHORTFALL_CAUSES, cyclic_gc_paused
from kvtrace.analysis.database import (
    ATTRIBUTION_TABLE,
    cache_entries_insert_sql,
    DB_SCHEMA_VERSION,
    SWEEP_COLUMNS,
    SWEEP_TABLE,
    DatabaseError,
    child_table,
    column_name,
    create_views,
    element_column,
    is_list_field,
    is_map_field,
    narrow_columns,
    open_database,
    past_32_bits,
    record_fields,
    schema_statements,
    stored_column,
    stored_tables,
)
from kvtrace.errors import TraceFormatError
from kvtrace.events import RECORD_TYPES, StepStarted, TraceHeader, tag_of
from kvtrace.files import OutputError, StagedOutput, refuse_overwrite
from kvtrace.traceio import ListColumn, TraceReader, open_trace_file

TRACE_SUFFIX = ".kvtrace"
# Rows per table handed to DuckDB at a time: a table's buffer holds at most this many rows
# (about 1 MB a column), so a load's memory is bounded whatever the trace's length. DuckDB's
# row group: an insert of another size leaves a partial group behind and costs twice as much.
CHUNK_ROWS = 122_880
INSERT_THREADS = 2  # DuckDB's appends to different tables run side by side
INSERTS_IN_FLIGHT = 4  # chunks waiting for each inserting thread (each at most CHUNK_ROWS rows)
# DuckDB's own buffers while it builds a database (it writes what does not fit to the file).
LOAD_MEMORY_LIMIT = "512MB"


@dataclass
class LoadedRun:
    run: int
    path: str
    variant: str
    backend: str
    num_records: int
    truncated: bool
    unknown_values: Counter  # enum values this kvtrace does not know: (tag, field, value) -> n
    digest: str = ""


@dataclass
class LoadSummary:
    db_path: str
    runs: list[LoadedRun] = field(default_factory=list)
    seconds: float = 0.0
    # Traces not loaded because a run already holds the same content: (path, that run's path).
    duplicates: list[tuple[str, str]] = field(default_factory=list)

    @property
    def num_records(self) -> int:
        return sum(run.num_records for run in self.runs)


def trace_paths(paths: list[str | os.PathLike]) -> list[str]:
    """Expand directories (replay output dirs) to the ``*.kvtrace`` files they hold."""
    found = []
    for path in map(os.fspath, paths):
        if os.path.isdir(path):
            inside = sorted(
                os.path.join(path, name) for name in os.listdir(path) if name.endswith(TRACE_SUFFIX)
            )
            if not inside:
                raise DatabaseError(
                    f"{path} holds no *{TRACE_SUFFIX} traces",
                    hint="Pass trace files, or the output directory of `kvtrace replay`.",
                )
            found.extend(inside)
        else:
            found.append(path)
    if not found:
        raise DatabaseError("no traces given", hint="kvtrace load TRACE|OUTDIR ... -o DB.duckdb")
    return found


def load_traces(paths: list[str | os.PathLike], db_path: str | os.PathLike,
                option: str = "-o") -> LoadSummary:
    """Load traces (files or replay output directories) into a new DuckDB file at ``db_path``
    (the command's ``option``).

    An existing file there is replaced, atomically: the DB is built beside it and renamed only
    once every trace loaded, so a bad trace leaves nothing half-written. ``db_path`` must not
    be one of the traces. A trace whose content (sha256) a run already holds is not kept
    (``duplicates``): its records would count twice."""
    started = time.perf_counter()
    traces = trace_paths(paths)
    refuse_overwrite([(option, db_path)], traces)
    summary = LoadSummary(os.fspath(db_path))
    _allow_open_files(len(traces))
    opened: list[_OpenTrace] = []
    try:  # every trace opened once, and its header read, before the database is made
        files: dict[tuple[int, int], str] = {}  # (device, inode) -> the first path of that file
        for trace in traces:
            candidate = _OpenTrace(trace)
            if candidate.identity in files:  # the same file again (a directory and a trace in it)
                candidate.reader.close()
                summary.duplicates.append((trace, files[candidate.identity]))
            else:
                files[candidate.identity] = trace
                opened.append(candidate)

        def fill(connection, scratch: str) -> None:
            loaded: dict[str, str] = {}  # digest -> path
            without_pool: list[int] = []  # runs whose header gives no engine config
            for run, trace in enumerate(opened):
                loaded_run = _load_trace(connection, run, trace, scratch)
                if loaded_run.digest in loaded:  # a copy: its run number stays unused
                    _delete_run(connection, run)
                    summary.duplicates.append((trace.path, loaded[loaded_run.digest]))
                    continue
                loaded[loaded_run.digest] = trace.path
                summary.runs.append(loaded_run)
                if trace.reader.header.config is None:
                    without_pool.append(run)
            # The cache entries by their SQL twin, once every run is in: of every run without the
            # C core, else of those whose pool it was not told (it follows none of theirs).
            if not stream.core:
                connection.execute(cache_entries_insert_sql())
            elif without_pool:
                connection.execute(cache_entries_insert_sql(without_pool))

        labels = [run_labels(trace.reader.header)[:2] for trace in opened]
        _new_database(summary.db_path, fill, labels)
    finally:
        for trace in opened:
            trace.reader.close()
    summary.seconds = time.perf_counter() - started
    return summary


def _allow_open_files(count: int) -> None:
    """Raise this process's soft limit of open files (to at most its hard limit) so that
    ``count`` traces can be open at once, each read from its one descriptor."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = count + 64  # DuckDB's own files, the interpreter's
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE,
                           (wanted if hard == resource.RLIM_INFINITY else min(wanted, hard), hard))


class _OpenTrace:
    """A trace opened once (one descriptor for its header, records and digest), its header
    read."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.file = _Digesting(open_trace_file(path))
        status = os.fstat(self.file.file.fileno())
        self.identity = (status.st_dev, status.st_ino)
        self.reader = TraceReader(path, source=self.file)


def _new_database(db_path: str, fill, labels: list[tuple[str, str]] = ()) -> None:
    """Create a forensics DB at ``db_path`` (replacing one there) for runs of these ``labels``
    (per run number, its variant and backend) with what ``fill(connection, scratch)`` inserts:
    built in a private scratch directory beside it (``scratch``, where the load's spill file
    goes too) and renamed once complete."""
    import duckdb

    with StagedOutput(db_path) as staged:
        try:
            connection = duckdb.connect(staged.path, config={"memory_limit": LOAD_MEMORY_LIMIT})
        except duckdb.Error as error:
            raise OutputError(f"cannot create the database {db_path}: "
                              f"{str(error).splitlines()[0]}") from None
        try:
            for statement in schema_statements(list(labels)):
                connection.execute(statement)
            connection.executemany(
                "INSERT INTO kvtrace_meta VALUES (?, ?)",
                [("db_schema_version", str(DB_SCHEMA_VERSION)), ("kvtrace_version", __version__),
                 ("created_ns", str(time.time_ns()))],
            )
            fill(connection, os.path.dirname(staged.path))
            create_views(connection)
            connection.execute("CHECKPOINT")
        except duckdb.IOException as error:
            raise OutputError(f"cannot write the database {db_path}: "
                              f"{str(error).splitlines()[0]}") from None
        finally:
            connection.close()


def load_sweep(sweep: dict, db_path: str | os.PathLike, *, replace: bool = False) -> int:
    """Add the rows of a sweep (``sweep.json``) to the ``sweep`` table of ``db_path`` and
    return their ``sweep_id``. A missing DB (or any, with ``replace``) is created; an existing
    one gets the rows in one transaction (and the table, if it predates sweeps)."""
    db_path = os.fspath(db_path)
    if replace or not os.path.exists(db_path):
        _new_database(db_path, lambda connection, _: _insert_sweep(connection, 0, sweep))
        return 0
    connection = open_database(db_path, read_only=False)
    try:
        connection.execute("BEGIN TRANSACTION")
        connection.execute(SWEEP_TABLE)
        sweep_id = connection.execute(
            "SELECT coalesce(max(sweep_id) + 1, 0) FROM sweep").fetchone()[0]
        _insert_sweep(connection, sweep_id, sweep)
        connection.execute("COMMIT")
    finally:
        connection.close()
    return sweep_id


def _insert_sweep(connection, sweep_id: int, sweep: dict) -> None:
    names = [name for name, _ in SWEEP_COLUMNS]
    own = [sweep_id, sweep["source"], sweep["source_digest"], sweep["backend"]]
    connection.executemany(
        f"INSERT INTO sweep ({', '.join(names)}) VALUES ({', '.join('?' * len(names))})",
        [own + [row[name] for name in names[len(own):]] for row in sweep["rows"]])


def run_labels(header: TraceHeader) -> tuple[str, str, str]:
    """(variant, backend, mode) of a trace: its replay info, or its source for other traces."""
    if header.replay is not None:
        return header.replay.variant, header.replay.backend, header.replay.mode
    return header.source, "live" if header.source == "capture" else "none", ""


def _load_trace(connection, run: int, trace: _OpenTrace, scratch: str) -> LoadedRun:
    """One trace as run ``run``: its records, its miss attribution and its cache entries, in
    one pass over its one descriptor (which also makes its digest); the pass's state that grows
    with the trace spills to a file in ``scratch``."""
    path, reader = trace.path, trace.reader
    variant, backend, mode = run_labels(reader.header)
    inserts = _Inserts(connection, run, path)
    try:
        analysis = stream.new_pass(reader.header, path, spill_dir=scratch)
        sink = _RunSink(inserts, analysis.shaped_types if analysis else frozenset())
        with reader, cyclic_gc_paused():
            for batch in reader.batches():
                if analysis is not None:
                    analysis.feed(batch)
                    _take_analysis(analysis, inserts, CHUNK_ROWS)
                sink.add_batch(batch)
        if analysis is not None:
            analysis.finish()
            _take_analysis(analysis, inserts, 0)
        sink.flush_all()
        inserts.finish()
    finally:
        inserts.close()
    digest = trace.file.hexdigest()
    _insert_run_row(connection, run, path, reader, variant, backend, mode, digest)
    return LoadedRun(run, path, variant, backend, reader.num_records, reader.truncated,
                     reader.unknown_values, digest)


class _Digesting:
    """A file whose bytes go through sha256 as they are read (the trace's digest, from the
    same descriptor and the same bytes as its records)."""

    def __init__(self, file) -> None:
        self.file, self.sha = file, hashlib.sha256()

    def read(self, size: int = -1) -> bytes:
        data = self.file.read(size)
        self.sha.update(data)
        return data

    def close(self) -> None:
        self.file.close()

    def hexdigest(self) -> str:
        """The digest of every byte read: the whole file once the reader reached its end."""
        return f"sha256:{self.sha.hexdigest()}"


def _take_analysis(analysis, inserts: _Inserts, chunk: int) -> None:
    """What the pass made, to the inserting thread: every whole chunk of every table (0: all)."""
    for table, columns in analysis.take_tables(chunk):
        inserts.put(table, columns)


def _delete_run(connection, run: int) -> None:
    """Remove what a run inserted (a trace found to duplicate another once read)."""
    for table in (*stored_tables().values(), "runs"):
        connection.execute(f"DELETE FROM {table} WHERE run = ?", [run])


def _insert_run_row(connection, run, path, reader, variant, backend, mode, digest) -> None:
    header = reader.header
    config = header.config
    replay = header.replay
    source_key = (replay.source_digest or replay.source_path) if replay else ""
    connection.execute(
        f"INSERT INTO runs VALUES ({', '.join('?' * 20)})",
        [run, os.path.abspath(path), header.source, variant, backend, mode,
         source_key or os.path.abspath(path), header.kvtrace_version, header.vllm_version,
         header.created_ns,
         config.hash_block_size if config else None,
         config.num_gpu_blocks if config else None,
         config.retention_interval if config else None,
         [g.block_size for g in config.kv_cache_groups] if config else None,
         [g.kind for g in config.kv_cache_groups] if config else None,
         reader.num_records, reader.truncated, reader.num_dropped,
         msgspec.json.encode(header).decode(), digest],
    )


class _Inserts:
    """Chunks of one run's rows, inserted by ``INSERT_THREADS`` threads (each on its own cursor,
    each table on one of them, so its rows go in in order) while the next batches are read:
    DuckDB works without the interpreter lock, so reading and inserting overlap. At most
    ``INSERTS_IN_FLIGHT`` chunks wait for each thread; an insert's error comes back on the next
    ``put`` or on ``finish``."""

    def __init__(self, connection, run: int, path: str) -> None:
        self.run, self.path = run, path
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
        cursor.execute(_insert_sql(table, tuple(columns)), {"run": self.run})

    def finish(self) -> None:
        """Wait for every chunk put so far; raise an insert's error."""
        self.close()
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        for worker in self.workers:
            worker.stop()


class _InsertThread:
    """One of ``_Inserts``' threads: its chunks, in the order put."""

    def __init__(self, inserts: _Inserts, connection) -> None:
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


class _Buffer:
    """One table's pending rows: a fixed-size array per column, filled batch by batch."""

    def __init__(self, columns: dict[str, np.ndarray]) -> None:
        self.arrays = {name: np.empty(CHUNK_ROWS, dtype=_buffer_dtype(values))
                       for name, values in columns.items()}
        self.num_rows = 0

    def append(self, columns: dict[str, np.ndarray], start: int, stop: int) -> None:
        end = self.num_rows + stop - start
        for name, values in columns.items():
            self.arrays[name][self.num_rows:end] = values[start:stop]
        self.num_rows = end

    def take(self) -> dict[str, np.ndarray]:
        taken = {name: array[:self.num_rows].copy() for name, array in self.arrays.items()}
        self.num_rows = 0
        return taken


def _buffer_dtype(values: np.ndarray) -> np.dtype:
    return values.dtype if values.dtype.kind in "bO" else np.dtype(np.int64)


class _RunSink:
    """Gathers one run's columns per table and hands them to ``_Inserts`` a chunk at a time:
    the Python twin of the C core's record tables, for the kinds it does not make (``skip``)."""

    def __init__(self, inserts: _Inserts, skip: frozenset = frozenset()) -> None:
        self.inserts = inserts
        self.skip = skip
        self.buffers: dict[str, _Buffer] = {}
        self.steps_before = 0

    def add_batch(self, batch) -> None:
        """A batch's records of the kinds not skipped, each kind as columns, with its sequence
        number and step (the ``StepStarted`` records at or before it)."""
        wanted = [index for index, record_type in enumerate(batch.types)
                  if record_type is not None and record_type not in self.skip]
        step_kind = batch.types.index(StepStarted) if StepStarted in batch.types else None
        if not wanted:  # the C core made every row of this batch: count its steps only
            self.steps_before += batch.kinds.count(step_kind) if step_kind is not None else 0
            return
        kinds = np.frombuffer(batch.kinds, dtype=np.uint8)
        starts = (np.flatnonzero(kinds == step_kind) if step_kind is not None
                  else np.empty(0, dtype=np.int64))
        for index in wanted:
            record_type = batch.types[index]
            rows = (np.arange(len(kinds)) if len(batch.types) == 1
                    else np.flatnonzero(kinds == index))
            steps = self.steps_before + np.searchsorted(starts, rows, side="right")
            self.add(record_type, batch.first_seq + rows, steps, batch.columns[index])
        self.steps_before += len(starts)

    def add(self, record_type, seqs: np.ndarray, steps: np.ndarray, columns: list) -> None:
        tag = tag_of(record_type)
        chunk = {"seq": seqs, "step": steps}
        for (name, field_type), column in zip(record_fields(record_type), columns):
            if is_list_field(field_type):
                chunk[f"num_{name}"] = self._add_children(tag, name, seqs, chunk, column)
            else:
                chunk[stored_column(name, field_type)] = _as_numpy(column, field_type)
        self._queue(tag, chunk)

    def _add_children(self, tag: str, name: str, seqs: np.ndarray, parent: dict,
                      column: ListColumn) -> np.ndarray:
        lengths = np.frombuffer(column.lengths, dtype=column.lengths.typecode).astype(np.int64)
        values = np.frombuffer(column.values, dtype=column.values.typecode)
        starts = np.cumsum(lengths) - lengths
        parent_reqs = parent.get("req", np.full(len(lengths), -1, dtype=np.int64))
        children = {
            "seq": np.repeat(seqs, lengths),
            "req": np.repeat(parent_reqs, lengths),
            "pos": np.arange(len(values), dtype=np.int64) - np.repeat(starts, lengths),
            element_column(name): values,
        }
        self._queue(child_table(tag, name), children)
        return lengths

    def _queue(self, table: str, chunk: dict[str, np.ndarray]) -> None:
        """Copy ``chunk`` into the table's buffer, a chunk of ``CHUNK_ROWS`` rows going to
        DuckDB each time it fills."""
        buffer = self.buffers.get(table)
        if buffer is None:
            buffer = self.buffers[table] = _Buffer(chunk)
        num_rows, start = len(chunk["seq"]), 0
        while start < num_rows:
            stop = min(num_rows, start + CHUNK_ROWS - buffer.num_rows)
            buffer.append(chunk, start, stop)
            start = stop
            if buffer.num_rows == CHUNK_ROWS:
                self.inserts.put(table, buffer.take())

    def flush_all(self) -> None:
        for table, buffer in self.buffers.items():
            if buffer.num_rows:
                self.inserts.put(table, buffer.take())


def _as_numpy(column, field_type) -> np.ndarray:
    if not isinstance(column, list):  # an array.array of fixed-width ints
        values = np.frombuffer(column, dtype=column.typecode)
        return values.astype(bool) if field_type is bool else values
    if field_type in (str, bytes):
        return np.array(column, dtype=object)
    if is_map_field(field_type):
        return np.array([msgspec.json.encode(v).decode() for v in column], dtype=object)
    return np.asarray([int(v) for v in column], dtype=np.int64 if field_type is not bool else bool)


_BOOL_COLUMNS = {(tag_of(record_type), column_name(name))
                 for record_type in RECORD_TYPES
                 for name, field_type in record_fields(record_type) if field_type is bool}
# The streaming pass's columns: int64, NULL as stream.NONE; flags as 0/1.
_PASS_TABLES = {ATTRIBUTION_TABLE: stream.ATTRIBUTION_COLUMNS,
                "cache_entry_figures": stream.ENTRY_COLUMNS}
_FLAGS = {"in_flight"}


@functools.cache
def _insert_sql(table: str, columns: tuple[str, ...]) -> str:
    """INSERT of a chunk of ``table`` for the run ``$run`` (its labels are computed from it).
    Enum fields go in as codes (``<name>_code``)."""
    targets, expressions = ["run"], ["$run"]
    if table == ATTRIBUTION_TABLE:
        causes = ", ".join(f"'{cause}'" for cause in CAUSES)
        targets += ["resumed", "in_shortfall"]
        expressions += ["lookup > 1", f"cause < {len(SHORTFALL_CAUSES)}"]
    for name in columns:
        value = f"nullif({name}, {stream.NONE})" if table in _PASS_TABLES else name
        if table == ATTRIBUTION_TABLE and name == "cause":
            value = f"[{causes}][{name} + 1]"
        elif (name in _FLAGS and table in _PASS_TABLES) or (table, name) in _BOOL_COLUMNS:
            value = f"{name}::BOOLEAN"  # from the C core, 0 or 1
        targets.append(name)
        expressions.append(value)
    return (f"INSERT INTO {stored_tables()[table]} ({', '.join(targets)}) "
            f"SELECT {', '.join(expressions)} FROM kvtrace_chunk")
