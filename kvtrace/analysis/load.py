"""Loading traces into the forensics database, column by column.

Traces are read with ``TraceReader.batches()``: every batch already holds its records as
fixed-width int columns, which ``numpy.frombuffer`` views without copying. Rows of one kind are
gathered into chunks of about a million and handed to DuckDB as a dict of numpy arrays (its
replacement scan reads them in bulk), so no record is ever turned into a Python object.
The same pass feeds the miss attribution (``kvtrace.analysis.attribution``), whose rows go to
the ``miss_attribution`` table. For a large trace the attribution (Python, a few microseconds
a record) runs in a child interpreter (``python -m kvtrace.analysis.load``) reading the same
file while this one loads the records, so on two cores the two overlap instead of adding up.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from enum import IntEnum

import msgspec
import numpy as np

from kvtrace import __version__
from kvtrace.analysis.attribution import (
    ROW_COLUMNS,
    attribute_trace,
    cyclic_gc_paused,
    iter_rows,
    new_attributor,
)
from kvtrace.analysis.database import (
    ATTRIBUTION_TABLE,
    DB_SCHEMA_VERSION,
    SWEEP_COLUMNS,
    SWEEP_TABLE,
    DatabaseError,
    build_derived_tables,
    child_table,
    column_name,
    create_views,
    element_column,
    is_enum_field,
    is_list_field,
    is_map_field,
    open_database,
    record_fields,
    schema_statements,
)
from kvtrace.errors import KvtraceError, error_class
from kvtrace.events import RECORD_TYPES, StepStarted, TraceHeader, tag_of
from kvtrace.files import (
    OutputError,
    StagedOutput,
    file_digest,
    refuse_overwrite,
    require_regular_file,
)
from kvtrace.traceio import ListColumn, TraceReader

TRACE_SUFFIX = ".kvtrace"
CHUNK_ROWS = 1 << 20
# Traces at least this large are attributed in a child process (starting one costs about
# 0.3 s; a trace of this size takes seconds to attribute).
PARALLEL_ATTRIBUTION_BYTES = 16 << 20


@dataclass
class LoadedRun:
    run: int
    path: str
    variant: str
    backend: str
    num_records: int
    truncated: bool
    unknown_values: Counter  # enum values this kvtrace does not know: (tag, field, value) -> n


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
    be one of the traces. A trace whose content (sha256) a run already holds is not loaded
    again (``duplicates``): its records would count twice."""
    started = time.perf_counter()
    traces = trace_paths(paths)
    for trace in traces:
        require_regular_file(trace, "kvtrace load reads it twice (its digest, then its records)")
    refuse_overwrite([(option, db_path)], traces)
    summary = LoadSummary(os.fspath(db_path))

    def fill(connection) -> None:
        loaded: dict[str, str] = {}  # digest -> path
        for trace in traces:
            with TraceReader(trace):  # the reader's own error for a missing or foreign file
                digest = file_digest(trace)
            if digest in loaded:
                summary.duplicates.append((trace, loaded[digest]))
                continue
            loaded[digest] = trace
            summary.runs.append(_load_trace(connection, len(summary.runs), trace, digest))

    _new_database(summary.db_path, fill)
    summary.seconds = time.perf_counter() - started
    return summary


def _new_database(db_path: str, fill) -> None:
    """Create a forensics DB at ``db_path`` (replacing one there) with what ``fill(connection)``
    inserts: built in a private scratch directory beside it and renamed once complete."""
    import duckdb

    with StagedOutput(db_path) as staged:
        try:
            connection = duckdb.connect(staged.path)
        except duckdb.Error as error:
            raise OutputError(f"cannot create the database {db_path}: "
                              f"{str(error).splitlines()[0]}") from None
        try:
            for statement in schema_statements():
                connection.execute(statement)
            connection.executemany(
                "INSERT INTO kvtrace_meta VALUES (?, ?)",
                [("db_schema_version", str(DB_SCHEMA_VERSION)), ("kvtrace_version", __version__),
                 ("created_ns", str(time.time_ns()))],
            )
            fill(connection)
            build_derived_tables(connection)
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
        _new_database(db_path, lambda connection: _insert_sweep(connection, 0, sweep))
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


def _load_trace(connection, run: int, path: str, digest: str) -> LoadedRun:
    reader = TraceReader(path)
    variant, backend, mode = run_labels(reader.header)
    labels = (run, variant, backend)
    aside = attributor = None  # a child interpreter attributing while this one loads, or not
    if reader.header.config is not None:
        if os.path.getsize(path) >= PARALLEL_ATTRIBUTION_BYTES:
            aside = subprocess.Popen(
                [sys.executable, "-m", __name__, path, *map(str, labels)],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
        else:
            attributor = new_attributor(reader.header, path)
    try:
        sink = _RunSink(connection, run, variant, backend)
        with cyclic_gc_paused():
            for batch in reader.batches():
                if attributor is not None:
                    attributor.feed(batch)
                sink.add_batch(batch)
        sink.flush_all()
        if aside is not None:
            _insert_attribution(connection, _rows_or_raise(_collect(aside, path)))
        elif attributor is not None:
            _insert_attribution(connection, list(iter_rows(*labels, attributor.lookups)))
    finally:
        if aside is not None and aside.poll() is None:
            aside.kill()
            aside.wait()
    _insert_run_row(connection, run, path, reader, variant, backend, mode, digest)
    return LoadedRun(run, path, variant, backend, reader.num_records, reader.truncated,
                     reader.unknown_values)


def attribution_rows(path: str, run: int, variant: str, backend: str) -> bytes:
    """What the child of ``_load_trace`` hands back: the miss-attribution rows of one trace,
    msgpack-encoded; or, for a ``KvtraceError``, its class name, message and hint (so that the
    loading process raises the same error)."""
    try:
        rows = list(iter_rows(run, variant, backend, attribute_trace(path).lookups))
    except KvtraceError as error:
        return msgspec.msgpack.encode({"error": [type(error).__name__, str(error), error.hint]})
    return msgspec.msgpack.encode({"rows": rows})


def _collect(aside: subprocess.Popen, path: str) -> bytes:
    output, _ = aside.communicate()
    if aside.returncode != 0:
        raise DatabaseError(
            f"attributing the misses of {path} failed in a child process "
            f"(exit status {aside.returncode})",
            hint="Its error is printed above; run with -vv, or report it with the trace.")
    return output


def _rows_or_raise(encoded: bytes) -> list[tuple]:
    result = msgspec.msgpack.decode(encoded)
    if "error" in result:
        name, message, hint = result["error"]
        raise error_class(name)(message, hint=hint)
    return [tuple(row) for row in result["rows"]]


def _insert_attribution(connection, rows: list[tuple]) -> None:
    if not rows:
        return
    names = [name for name, _ in ROW_COLUMNS]
    columns = {name: np.array(values, dtype=object) for name, values in zip(names, zip(*rows))}
    connection.register("kvtrace_chunk", columns)
    try:
        connection.execute(f"INSERT INTO {ATTRIBUTION_TABLE} ({', '.join(names)}) "
                           f"SELECT {', '.join(names)} FROM kvtrace_chunk")
    finally:
        connection.unregister("kvtrace_chunk")


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


class _RunSink:
    """Gathers one run's columns per kind and inserts them a chunk at a time."""

    def __init__(self, connection, run: int, variant: str, backend: str) -> None:
        self.connection = connection
        self.constants = {"run": run, "variant": variant, "backend": backend}
        self.pending: dict[str, list[dict[str, np.ndarray]]] = {}
        self.pending_rows: dict[str, int] = {}
        self.child_tables: set[str] = set()
        self.steps_before = 0

    def add_batch(self, batch) -> None:
        """A batch's records, each kind as columns, with its sequence number and step."""
        kinds = np.frombuffer(batch.kinds, dtype=np.uint8)
        seqs = batch.first_seq + np.arange(len(kinds), dtype=np.int64)
        steps = np.full(len(kinds), self.steps_before, dtype=np.int64)
        for index, record_type in enumerate(batch.types):
            if record_type is StepStarted:
                steps += np.cumsum(kinds == index)
                self.steps_before = int(steps[-1])
        for index, record_type in enumerate(batch.types):
            if record_type is None:
                continue
            rows = slice(None) if len(batch.types) == 1 else np.flatnonzero(kinds == index)
            self.add(record_type, seqs[rows], steps[rows], batch.columns[index])

    def add(self, record_type, seqs: np.ndarray, steps: np.ndarray, columns: list) -> None:
        tag = tag_of(record_type)
        chunk = {"seq": seqs, "step": steps}
        for (name, field_type), column in zip(record_fields(record_type), columns):
            if is_list_field(field_type):
                chunk[f"num_{name}"] = self._add_children(tag, name, seqs, chunk, column)
            else:
                chunk[column_name(name)] = _as_numpy(column, field_type)
        self._queue(tag, chunk, len(seqs))

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
        self.child_tables.add(child_table(tag, name))
        self._queue(child_table(tag, name), children, len(values))
        return lengths

    def _queue(self, table: str, chunk: dict[str, np.ndarray], num_rows: int) -> None:
        self.pending.setdefault(table, []).append(chunk)
        self.pending_rows[table] = self.pending_rows.get(table, 0) + num_rows
        if self.pending_rows[table] >= CHUNK_ROWS:
            self._flush(table)

    def _flush(self, table: str) -> None:
        chunks = self.pending.pop(table, [])
        self.pending_rows.pop(table, None)
        if not chunks or not any(len(c["seq"]) for c in chunks):
            return
        merged = {name: np.concatenate([c[name] for c in chunks]) for name in chunks[0]}
        self.connection.register("kvtrace_chunk", merged)
        labelled = table not in self.child_tables
        constants = self.constants if labelled else {"run": self.constants["run"]}
        try:
            self.connection.execute(_insert_sql(table, tuple(merged), labelled), constants)
        finally:
            self.connection.unregister("kvtrace_chunk")

    def flush_all(self) -> None:
        for table in list(self.pending):
            self._flush(table)


def _as_numpy(column, field_type) -> np.ndarray:
    if not isinstance(column, list):  # an array.array of fixed-width ints
        values = np.frombuffer(column, dtype=column.typecode)
        return values.astype(bool) if field_type is bool else values
    if field_type in (str, bytes):
        return np.array(column, dtype=object)
    if is_map_field(field_type):
        return np.array([msgspec.json.encode(v).decode() for v in column], dtype=object)
    return np.asarray([int(v) for v in column], dtype=np.int64 if field_type is not bool else bool)


_ENUM_OF_COLUMN = {
    (tag_of(record_type), column_name(name)): field_type
    for record_type in RECORD_TYPES
    for name, field_type in record_fields(record_type)
    if is_enum_field(field_type)
}


def _insert_sql(table: str, columns: tuple[str, ...], labelled: bool) -> str:
    """INSERT of a chunk: the run's constants first, enum codes mapped to their names (a code
    this kvtrace does not know is kept as its number).

    Child tables of list fields carry only ``run`` (join to the parent on run and seq)."""
    run_columns = "$variant, $backend, " if labelled else ""
    expressions = []
    for name in columns:
        enum: type[IntEnum] | None = _ENUM_OF_COLUMN.get((table, name))
        if enum is None:
            expressions.append(name)
        else:
            cases = " ".join(f"WHEN {member.value} THEN '{member.name}'" for member in enum)
            expressions.append(f"CASE {name} {cases} ELSE {name}::VARCHAR END")
    target = "run, " + ("variant, backend, " if labelled else "") + ", ".join(columns)
    return (f"INSERT INTO {table} ({target}) SELECT $run, {run_columns}{', '.join(expressions)} "
            f"FROM kvtrace_chunk")


if __name__ == "__main__":  # the child of ``_load_trace``: PATH RUN VARIANT BACKEND
    sys.stdout.buffer.write(attribution_rows(sys.argv[1], int(sys.argv[2]), *sys.argv[3:5]))
