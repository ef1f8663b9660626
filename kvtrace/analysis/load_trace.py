"""One trace loaded as one run, in one pass over its one descriptor.

A trace is opened once (``traceio.open_trace_file``: a regular file, or refused) and that one
descriptor serves everything: its bytes go through the digest (``runs.digest``) as the reader
reads them, every batch already holds its records as fixed-width int columns (which
``numpy.frombuffer`` views without copying), and the same batches feed the streaming pass of
``kvtrace.analysis.stream`` (the miss attribution and the cache entries; its C core where it is
built). No record is ever turned into a Python object. Each table's rows gather in fixed-size
column buffers (``CHUNK_ROWS``) handed to DuckDB as numpy arrays by other threads
(``chunk_inserts``) while the next batches are read, so the memory a load holds does not grow
with the trace.
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from dataclasses import dataclass

import msgspec
import numpy as np

from kvtrace.analysis import stream
from kvtrace.analysis.attribution import cyclic_gc_paused
from kvtrace.analysis.chunk_inserts import Inserts
from kvtrace.analysis.database import (
    child_table,
    element_column,
    is_list_field,
    is_map_field,
    record_fields,
    run_labels,
    stored_column,
    stored_tables,
)
from kvtrace.analysis.part_files import PartTask
from kvtrace.events import StepStarted, tag_of
from kvtrace.traceio import ListColumn, TraceReader, open_trace_file

# Rows per table handed to DuckDB at a time: a table's buffer holds at most this many rows
# (about 1 MB a column), so a load's memory is bounded whatever the trace's length. DuckDB's
# row group: an insert of another size leaves a partial group behind and costs twice as much.
CHUNK_ROWS = 122_880
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


class OpenTrace:
    """A trace opened once (one descriptor for its header, records and digest), its header
    read. ``file``: where its bytes are, when not at ``path`` (a worker's copy on another
    host); ``absolute``: its path as the ``runs`` table records it."""

    def __init__(self, path: str, file: str | None = None, absolute: str | None = None) -> None:
        self.path = path
        self.absolute = absolute or os.path.abspath(path)
        self.file = _Digesting(open_trace_file(file or path))
        status = os.fstat(self.file.file.fileno())
        self.identity = (status.st_dev, status.st_ino)
        self.reader = TraceReader(path, source=self.file)


def needs_sql_twin(trace: OpenTrace) -> bool:
    """Whether a run's cache entries come from their SQL twin: without the C core, or for a
    trace whose header names no pool (the core follows none)."""
    return not stream.core or trace.reader.header.config is None


def load_trace(connection, run: int, trace: OpenTrace, scratch: str,
               part: PartTask | None = None, written: Counter | None = None) -> LoadedRun:
    """One trace as run ``run``: its records, its miss attribution and its cache entries, in
    one pass over its one descriptor (which also makes its digest); the pass's state that grows
    with the trace spills to a file in ``scratch``. The rows go into ``connection``'s tables,
    or, with a ``part``, into its files (``written``: how many per table); the ``runs`` row
    into ``connection`` either way."""
    path, reader = trace.path, trace.reader
    variant, backend, mode = run_labels(reader.header)
    inserts = Inserts(connection, run, path, part, written)
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
    _insert_run_row(connection, run, trace.absolute, reader, variant, backend, mode, digest)
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


def _take_analysis(analysis, inserts: Inserts, chunk: int) -> None:
    """What the pass made, to the inserting thread: every whole chunk of every table (0: all)."""
    for table, columns in analysis.take_tables(chunk):
        inserts.put(table, columns)


def delete_run(connection, run: int) -> None:
    """Remove what a run inserted (a trace found to duplicate another once read)."""
    for table in (*stored_tables().values(), "runs"):
        connection.execute(f"DELETE FROM {table} WHERE run = ?", [run])


def _insert_run_row(connection, run, absolute, reader, variant, backend, mode, digest) -> None:
    header = reader.header
    config = header.config
    replay = header.replay
    source_key = (replay.source_digest or replay.source_path) if replay else ""
    connection.execute(
        f"INSERT INTO runs VALUES ({', '.join('?' * 20)})",
        [run, absolute, header.source, variant, backend, mode,
         source_key or absolute, header.kvtrace_version, header.vllm_version,
         header.created_ns,
         config.hash_block_size if config else None,
         config.num_gpu_blocks if config else None,
         config.retention_interval if config else None,
         [g.block_size for g in config.kv_cache_groups] if config else None,
         [g.kind for g in config.kv_cache_groups] if config else None,
         reader.num_records, reader.truncated, reader.num_dropped,
         msgspec.json.encode(header).decode(), digest],
    )


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
    """Gathers one run's columns per table and hands them to ``Inserts`` a chunk at a time:
    the Python twin of the C core's record tables, for the kinds it does not make (``skip``)."""

    def __init__(self, inserts: Inserts, skip: frozenset = frozenset()) -> None:
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
