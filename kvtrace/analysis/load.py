"""Loading traces into the forensics database, column by column, in one pass per trace.

A trace is opened once (``traceio.open_trace_file``: a regular file, or refused) and that one
descriptor serves everything: its bytes go through the digest (``runs.digest``) as the reader
reads them, every batch already holds its records as fixed-width int columns (which
``numpy.frombuffer`` views without copying), and the same batches feed the streaming pass of
``kvtrace.analysis.stream`` (the miss attribution and the cache entries; its C core where it is
built). No record is ever turned into a Python object. Each table's rows gather in fixed-size
column buffers (``CHUNK_ROWS``) handed to DuckDB as numpy arrays by a second thread while the
next batches are read, so the memory a load holds does not grow with the trace.

A fleet (many traces) loads in worker processes (``workers``) or on a ``runner`` of the
caller's (Ray tasks): each worker reads one trace by the same pass, and writes each chunk of
rows as a Parquet file instead of inserting it, a *part* (``<table>/run=<n>/data_<i>.parquet``);
the parent, the one writer a DuckDB file allows, takes the parts in, in run order, a batch at a
time. DuckDB holds the interpreter lock while it scans a chunk's numpy columns (two threads
inserting into two tables take as long as one), so one process reads and inserts little more
than a core's worth; processes of their own read side by side, and DuckDB reads Parquet on all
its threads (docs/performance.md#fleet-loading). ``load_partitions`` keeps the parts instead of
a database (a directory with ``PARTS_MANIFEST``), and a later load takes such a directory in as
it takes its own parts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import os
import queue
import resource
import shutil
import signal
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
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
    run_labels,
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
from kvtrace.analysis.sql_access import sql_string
from kvtrace.analysis.vllm_counters import load_vllm_counters
from kvtrace.errors import KvtraceError, error_class
from kvtrace.events import RECORD_TYPES, StepStarted, tag_of
from kvtrace.files import (
    OutputError,
    StagedOutput,
    cannot_write,
    refuse_overwrite,
    refuse_planted_dir,
    write_failure,
)
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
# A part: one run's rows of a table, as ``<table>/run=<n>/data_<i>.parquet`` under its
# directory (the hive layout: ``run`` is in the path, not in the files). A directory of parts written to be kept
# (``load_partitions``) says what it holds in PARTS_MANIFEST.
PART_FILE = "data_{}.parquet"
# Records of the parts a database takes in at once (a few GB of Parquet on disk at most).
MERGE_BATCH_RECORDS = 100_000_000
PARTS_MANIFEST = "_kvtrace_partitions.json"
RUNS_TABLE = "runs"


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
    db_path: str  # the database, or the directory of partitions
    runs: list[LoadedRun] = field(default_factory=list)
    seconds: float = 0.0
    # Traces not loaded because a run already holds the same content: (path, that run's path).
    duplicates: list[tuple[str, str]] = field(default_factory=list)
    workers: str = "this process"  # where the traces were read: the runner's description

    @property
    def num_records(self) -> int:
        return sum(run.num_records for run in self.runs)


def trace_paths(paths: list[str | os.PathLike]) -> list[str]:
    """Expand directories (replay output dirs) to the ``*.kvtrace`` files they hold; a
    directory of partitions (``PARTS_MANIFEST``) stays as it is."""
    found = []
    for path in map(os.fspath, paths):
        if os.path.isdir(path) and not is_partitions(path):
            inside = sorted(
                os.path.join(path, name) for name in os.listdir(path) if name.endswith(TRACE_SUFFIX)
            )
            if not inside:
                raise DatabaseError(
                    f"{path} holds no *{TRACE_SUFFIX} traces",
                    hint="Pass trace files, the output directory of `kvtrace replay`, or one "
                         "that `kvtrace load --parquet` wrote.",
                )
            found.extend(inside)
        else:
            found.append(path)
    if not found:
        raise DatabaseError("no traces given", hint="kvtrace load TRACE|OUTDIR ... -o DB.duckdb")
    return found


def is_partitions(path: str) -> bool:
    """Whether ``path`` is a directory of parts that ``load_partitions`` wrote."""
    return os.path.isfile(os.path.join(path, PARTS_MANIFEST))


def load_traces(paths: list[str | os.PathLike], db_path: str | os.PathLike,
                option: str = "-o", *, workers: int = 1,
                runner: PartRunner | None = None) -> LoadSummary:
    """Load traces (files, replay output directories, or directories of partitions) into a new
    DuckDB file at ``db_path`` (the command's ``option``): in this process, or, with
    ``workers`` > 1 or a ``runner``, each trace in a worker, as a part the database then takes
    in (one database for every way: the same rows, runs and duplicates).

    An existing file there is replaced, atomically: the DB is built beside it and renamed only
    once every trace loaded, so a bad trace leaves nothing half-written. ``db_path`` must not
    be one of the traces. A trace whose content (sha256) a run already holds is not kept
    (``duplicates``): its records would count twice."""
    started = time.perf_counter()
    traces = trace_paths(paths)
    refuse_overwrite([(option, db_path)], traces)
    summary = LoadSummary(os.fspath(db_path))
    with _Sources(traces, summary) as sources:
        runner = _runner_for(runner, workers, sources)

        def fill(connection, scratch: str) -> None:
            _load_runs(sources, summary, _IntoDatabase(connection, scratch), runner)

        with runner or contextlib.nullcontext():  # workers forked before DuckDB's threads start
            _new_database(summary.db_path, fill, sources.labels)
    summary.seconds = time.perf_counter() - started
    return summary


def load_partitions(paths: list[str | os.PathLike], outdir: str | os.PathLike,
                    option: str = "--parquet", *, workers: int = 1,
                    runner: PartRunner | None = None) -> LoadSummary:
    """Load traces as ``load_traces`` does, keeping each run's tables as Parquet partitions in
    a new directory ``outdir`` (``<table>/run=<n>/data_0.parquet``, ``run`` numbered as a
    database would number it, and ``PARTS_MANIFEST``) instead of one database: the parts the
    workers wrote, without the step that takes them into a database. ``outdir`` must not exist
    yet, or be an empty directory; it is built beside itself and renamed into place once
    complete. ``load_traces`` takes such a directory back (``kvtrace load DIR -o DB``)."""
    started = time.perf_counter()
    traces = trace_paths(paths)
    refuse_overwrite([(option, outdir)], traces)
    summary = LoadSummary(os.fspath(outdir))
    with _Sources(traces, summary) as sources, _StagedDirectory(outdir, option) as staged:
        with _runner_for(runner, workers, sources) or InProcess() as runner:
            _load_runs(sources, summary, _IntoPartitions(staged), runner)
    summary.seconds = time.perf_counter() - started
    return summary


def _runner_for(runner: PartRunner | None, workers: int, sources: _Sources
                ) -> PartRunner | None:
    """The caller's runner, else ``workers`` local processes where more than one trace is
    read; None: every trace read in this process, in place."""
    if runner is None and workers > 1 and sources.num_traces > 1:
        return LocalWorkers(min(workers, sources.num_traces))
    return runner


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
    read. ``file``: where its bytes are, when not at ``path`` (a worker's copy on another
    host); ``absolute``: its path as the ``runs`` table records it."""

    def __init__(self, path: str, file: str | None = None, absolute: str | None = None) -> None:
        self.path = path
        self.absolute = absolute or os.path.abspath(path)
        self.file = _Digesting(open_trace_file(file or path))
        status = os.fstat(self.file.file.fileno())
        self.identity = (status.st_dev, status.st_ino)
        self.reader = TraceReader(path, source=self.file)


class _Sources:
    """The runs to load, in run order: traces, each opened once and its header read, before the
    output is made, and the runs of directories of partitions, which keep their numbers (their
    gaps too: None), after those before them; the same file given twice is kept once
    (``summary.duplicates``)."""

    def __init__(self, paths: list[str], summary: LoadSummary) -> None:
        self.items: list[_OpenTrace | Part | None] = []
        self.labels: list[tuple[str, str]] = []  # per run number: its variant and backend
        _allow_open_files(len(paths))
        files: dict[tuple[int, int], str] = {}  # (device, inode) -> the first path of that file
        try:
            for path in paths:
                if os.path.isdir(path):  # a directory of partitions (trace_paths)
                    first = len(self.items)
                    for part in _stored_parts(path):
                        gap = first + part.run - len(self.items)
                        self.items += [None] * gap
                        self.labels += [("", "")] * gap
                        self.items.append(part)
                        self.labels.append((part.loaded.variant, part.loaded.backend))
                    continue
                trace = _OpenTrace(path)
                if trace.identity in files:  # the same file again (a directory and a trace in it)
                    trace.reader.close()
                    summary.duplicates.append((path, files[trace.identity]))
                    continue
                files[trace.identity] = path
                self.items.append(trace)
                self.labels.append(run_labels(trace.reader.header)[:2])
        except BaseException:
            self.close()
            raise

    @property
    def num_traces(self) -> int:
        return sum(isinstance(item, _OpenTrace) for item in self.items)

    def close(self) -> None:
        for item in self.items:
            if isinstance(item, _OpenTrace):
                item.reader.close()

    def __enter__(self) -> _Sources:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _load_runs(sources: _Sources, summary: LoadSummary, target, runner: PartRunner | None
               ) -> None:
    """Every run of ``sources`` into ``target`` in run order: a trace read in place (no
    ``runner``) or as a part by the ``runner``'s workers, a stored part as it is. A run whose
    content (digest) an earlier one holds is dropped, its run number left unused. On a failure
    the workers are stopped before the output is discarded."""
    traces = [(run, item) for run, item in enumerate(sources.items)
              if isinstance(item, _OpenTrace)]
    parts: Iterator[Part] = iter(())
    if runner is not None:
        summary.workers = runner.description
        parts = runner.map([target.task(run, trace) for run, trace in traces])
    loaded: dict[str, str] = {}  # digest -> path
    try:
        for run, item in enumerate(sources.items):
            if item is None:  # a run number a directory of partitions left unused
                continue
            if isinstance(item, Part):
                part = item
            elif runner is None:
                part = None
                loaded_run = target.load_in_place(run, item)
            else:
                part = next(parts)
            if part is not None:
                loaded_run = dataclasses.replace(part.loaded, run=run)
            if loaded_run.digest in loaded:  # a copy: its run number stays unused
                target.drop(run, part)
                summary.duplicates.append((loaded_run.path, loaded[loaded_run.digest]))
                continue
            loaded[loaded_run.digest] = loaded_run.path
            if part is not None:
                target.add(run, part)
            summary.runs.append(loaded_run)
        target.finish(summary.runs)
    except BaseException:
        if runner is not None:
            runner.stop()
        raise


class _Target:
    """Where runs go: a worker writes a trace's part into ``directory``, compressed so, its
    spill files in ``scratch``."""

    compression: str
    directory: str
    scratch: str

    def task(self, run: int, trace: _OpenTrace) -> PartTask:
        return PartTask(run, trace.path, trace.absolute, self.directory, self.scratch,
                        self.compression)


class _IntoDatabase(_Target):
    """Runs into the database being built (``connection``): a trace read in place; parts
    inserted a batch at a time, each table's rows of the batch by one statement over their
    Parquet files (DuckDB reads the files side by side: half the time of a statement per part),
    as soon as the batch holds ``MERGE_BATCH_RECORDS`` (which bounds the parts kept on disk),
    else at the end. Parts cross only this machine's disk: uncompressed, the cheapest to write
    and to read back."""

    compression = "uncompressed"

    def __init__(self, connection, scratch: str) -> None:
        self.connection, self.scratch = connection, scratch
        self.directory = os.path.join(scratch, "parts")
        os.mkdir(self.directory)
        self.twins: list[int] = []  # runs read in place whose cache entries need the SQL twin
        self.batch: list[tuple[int, Part]] = []  # parts not inserted yet, with their runs

    def load_in_place(self, run: int, trace: _OpenTrace) -> LoadedRun:
        loaded = _load_trace(self.connection, run, trace, self.scratch)
        if _needs_sql_twin(trace):
            self.twins.append(run)
        return loaded

    def add(self, run: int, part: Part) -> None:
        self.batch.append((run, part))
        if sum(part.loaded.num_records for _, part in self.batch) >= MERGE_BATCH_RECORDS:
            self._insert_batch()

    def _insert_batch(self) -> None:
        """Every table's rows of the batch's parts, in run order, each part's rows under its
        run here (``run`` is in a part's path, not in its files)."""
        for table in _part_tables():
            parts = [(run, part.paths(table)) for run, part in self.batch if table in part.files]
            if not parts:
                continue
            runs = " ".join(f"WHEN {sql_string(os.path.dirname(paths[0]))} THEN {int(run)}"
                            for run, paths in parts)
            files = ", ".join(sql_string(path) for _, paths in parts for path in paths)
            self.connection.execute(
                f"INSERT INTO {stored_tables().get(table, table)} BY NAME "
                f"SELECT (CASE parse_dirpath(filename, 'forward_slash') {runs} END)::INTEGER "
                f"AS run, * EXCLUDE (filename) FROM read_parquet([{files}], filename = true, "
                "hive_partitioning = false)")
        for _, part in self.batch:
            part.discard()
        self.batch = []

    def drop(self, run: int, part: Part | None) -> None:
        if part is None:
            _delete_run(self.connection, run)
            if run in self.twins:
                self.twins.remove(run)
        else:
            part.discard()

    def finish(self, runs: list[LoadedRun]) -> None:
        """The parts still pending; then the cache entries by their SQL twin, once every run
        is in: of the runs read in place without the C core, or whose pool it was not told (it
        follows none of theirs); a part holds its own. Then each run's vLLM counters."""
        self._insert_batch()
        if self.twins:
            self.connection.execute(cache_entries_insert_sql(self.twins))
        for run in runs:  # vLLM's counters, where a capture recorded them beside its trace
            load_vllm_counters(self.connection, run.run, run.path)


class _IntoPartitions(_Target):
    """Runs into a directory of partitions (``load_partitions``): a worker's part is written
    there already, a stored part is copied in under its new run number; the manifest last.
    Compressed: such a directory is kept, and copied between hosts."""

    compression = "snappy"

    def __init__(self, staged: _StagedDirectory) -> None:
        self.directory, self.scratch = staged.path, staged.scratch
        self.tables: dict[int, dict[str, int]] = {}  # per run kept: its files per table

    def add(self, run: int, part: Part) -> None:
        if (part.directory, part.run) != (self.directory, run):
            for table in part.files:
                for index, path in enumerate(part.paths(table)):
                    target = part_file(self.directory, table, run, index)
                    os.makedirs(os.path.dirname(target), exist_ok=True)
                    shutil.copyfile(path, target)
        self.tables[run] = part.files

    def drop(self, run: int, part: Part | None) -> None:
        if part is not None and part.directory == self.directory:
            part.discard()

    def finish(self, runs: list[LoadedRun]) -> None:
        manifest = {"db_schema_version": DB_SCHEMA_VERSION, "kvtrace_version": __version__,
                    "runs": [{"run": run.run, "path": run.path, "variant": run.variant,
                              "backend": run.backend, "num_records": run.num_records,
                              "truncated": run.truncated, "digest": run.digest,
                              "tables": self.tables[run.run]}
                             for run in runs]}
        with open(os.path.join(self.directory, PARTS_MANIFEST), "wb") as file:
            file.write(msgspec.json.format(msgspec.json.encode(manifest), indent=2) + b"\n")


class _StagedDirectory:
    """A directory output built beside its final name (``path``, with ``scratch`` its private
    parent, where the load's spill files go too) and renamed into place once complete; the
    final name must be new or an empty directory."""

    def __init__(self, final: str | os.PathLike, option: str) -> None:
        self.final = os.path.abspath(final)
        label = f"{option} {os.fspath(final)}"
        refuse_planted_dir(self.final, label)
        if os.path.islink(self.final) or (os.path.lexists(self.final) and not (
                os.path.isdir(self.final) and not os.listdir(self.final))):
            raise OutputError(f"{label} exists and is not an empty directory",
                              f"Give {option} a new directory.")
        try:
            self.scratch = tempfile.mkdtemp(prefix=f".{os.path.basename(self.final)}.",
                                            suffix=".partial", dir=os.path.dirname(self.final))
        except OSError as error:
            raise cannot_write(final, error) from None
        self.path = os.path.join(self.scratch, os.path.basename(self.final))
        os.mkdir(self.path)

    def __enter__(self) -> _StagedDirectory:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                try:
                    os.replace(self.path, self.final)  # onto nothing, or an empty directory
                except OSError as error:
                    raise cannot_write(self.final, error) from None
        finally:
            shutil.rmtree(self.scratch, ignore_errors=True)


def _needs_sql_twin(trace: _OpenTrace) -> bool:
    """Whether a run's cache entries come from their SQL twin: without the C core, or for a
    trace whose header names no pool (the core follows none)."""
    return not stream.core or trace.reader.header.config is None


# --- parts: one trace loaded by a worker -----------------------------------------------------


def part_file(directory: str, table: str, run: int, index: int = 0) -> str:
    """Where a part keeps a table's rows of a run (``table`` by its name in the main schema),
    its ``index``-th file."""
    return os.path.join(directory, table, f"run={int(run)}", PART_FILE.format(index))


def _make_part_directory(path: str) -> None:
    """The directories of a part's file; never the part's own directory: gone, the load was
    stopped and cleaned up behind the worker."""
    try:
        os.mkdir(os.path.dirname(os.path.dirname(path)))
    except FileExistsError:
        pass
    os.mkdir(os.path.dirname(path))


@dataclass(frozen=True)
class PartTask:
    """What a worker loads: the trace of run ``run`` into ``directory``, its spill files in
    ``scratch``; ``file``: where its bytes are, when not at ``path`` (a copy shipped to another
    host)."""

    run: int
    path: str
    absolute: str
    directory: str
    scratch: str
    compression: str
    file: str | None = None


@dataclass
class Part:
    """One run's tables as Parquet files (``part_file``): what a worker made, or what a
    directory of partitions holds (``owned`` False: never removed)."""

    loaded: LoadedRun
    files: dict[str, int]  # per table with rows: its number of files
    directory: str
    run: int  # its run number there
    owned: bool = True

    def paths(self, table: str) -> list[str]:
        return [part_file(self.directory, table, self.run, index)
                for index in range(self.files.get(table, 0))]

    def discard(self) -> None:
        if self.owned:
            for table in self.files:
                shutil.rmtree(os.path.dirname(part_file(self.directory, table, self.run)),
                              ignore_errors=True)


def load_part(task: PartTask) -> Part:
    """A worker's task: the trace loaded by the same pass as in place, each chunk of rows
    written as the next file of its table's part. A run whose cache entries come from their
    SQL twin (SQL over the run's tables) is loaded into a database in memory first (DuckDB
    spills what does not fit to ``scratch``), and its tables written from there."""
    import duckdb

    trace = _OpenTrace(task.path, task.file, task.absolute)
    written: Counter = Counter()
    try:
        connection = duckdb.connect(":memory:", config={
            "memory_limit": LOAD_MEMORY_LIMIT, "temp_directory": os.path.join(
                task.scratch, f"duckdb-{task.run}")})
        try:
            for statement in schema_statements():
                connection.execute(statement)
            if _needs_sql_twin(trace):
                loaded = _load_trace(connection, task.run, trace, task.scratch)
                connection.execute(cache_entries_insert_sql([task.run]))
                tables = _part_tables()
            else:
                loaded = _load_trace(connection, task.run, trace, task.scratch, task, written)
                tables = (RUNS_TABLE,)
            for table in tables:
                stored = stored_tables().get(table, table)
                if connection.execute(f"SELECT count(*) FROM {stored}").fetchone()[0]:
                    path = part_file(task.directory, table, task.run)
                    _make_part_directory(path)
                    connection.execute(
                        f"COPY (SELECT * EXCLUDE (run) FROM {stored}) TO {sql_string(path)} "
                        f"(FORMAT PARQUET, COMPRESSION {task.compression})")
                    written[table] = 1
        except duckdb.Error as error:
            raise write_failure(error) or OutputError(
                f"cannot write the part of {task.path}: {str(error).splitlines()[0]}") from None
        finally:
            connection.close()
    finally:
        trace.reader.close()
    return Part(loaded, dict(written), task.directory, task.run)


def _part_tables() -> tuple[str, ...]:
    """The tables a part holds, by their names in the main schema: every table of runs' rows,
    and ``runs``."""
    return (*stored_tables(), RUNS_TABLE)


def _stored_parts(directory: str) -> list[Part]:
    """The runs of a directory of partitions, from its manifest, in run order."""
    path = os.path.join(directory, PARTS_MANIFEST)
    try:
        with open(path, "rb") as file:
            manifest = msgspec.json.decode(file.read())
        if manifest["db_schema_version"] != DB_SCHEMA_VERSION:
            raise DatabaseError(
                f"{directory} holds partitions of database schema "
                f"v{manifest['db_schema_version']} (kvtrace {manifest.get('kvtrace_version')}); "
                f"this kvtrace reads v{DB_SCHEMA_VERSION}",
                "Load its traces again with this kvtrace.")
        return [Part(LoadedRun(int(row["run"]), row["path"], row["variant"], row["backend"],
                               int(row["num_records"]), bool(row["truncated"]), Counter(),
                               row["digest"]),
                     {table: int(count) for table, count in row["tables"].items()
                      if table in _part_tables()},
                     directory, int(row["run"]), owned=False)
                for row in sorted(manifest["runs"], key=lambda row: row["run"])]
    except (OSError, msgspec.DecodeError, KeyError, TypeError, ValueError) as error:
        raise DatabaseError(f"{path} is not a partitions manifest kvtrace can read: {error}",
                            "Write the directory again with `kvtrace load TRACE ... --parquet "
                            "DIR`.") from None


# --- where the parts are made ------------------------------------------------------------------


class PartRunner:
    """Runs ``load_part`` for each task: ``map`` yields the parts in the order of the tasks,
    raising a failed task's own error where its part would be; ``stop`` stops what is still
    running. A context manager that holds its workers."""

    description = "this process"

    def map(self, tasks: list[PartTask]) -> Iterator[Part]:
        raise NotImplementedError

    def stop(self) -> None:
        """Stop every task still running (the load failed)."""

    def __enter__(self) -> PartRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class InProcess(PartRunner):
    """The parts made here, one after the other."""

    def map(self, tasks: list[PartTask]) -> Iterator[Part]:
        return map(load_part, tasks)


class LocalWorkers(PartRunner):
    """``count`` worker processes, forked (where the system forks) when entered: before this
    process opens the database, so that no DuckDB thread of its is forked into them. A worker
    that dies (killed, out of memory) fails the load with an error, not a wait."""

    def __init__(self, count: int) -> None:
        self.count, self.executor = count, None
        self.description = f"{count} local processes"

    def __enter__(self) -> LocalWorkers:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
        self.executor = ProcessPoolExecutor(
            self.count, mp_context=multiprocessing.get_context(method),
            initializer=_become_worker, initargs=(os.getpid(),))
        self.executor.submit(int).result()  # every worker started now (forked: all at once)
        return self

    def map(self, tasks: list[PartTask]) -> Iterator[Part]:
        from concurrent.futures.process import BrokenProcessPool

        futures = [self.executor.submit(run_part, task) for task in tasks]
        for task, future in zip(tasks, futures):
            try:
                outcome = future.result()
            except BrokenProcessPool:
                raise KvtraceError(
                    f"a worker process died while the traces loaded ({task.path} and those "
                    "after it are not loaded)",
                    "Look for the kernel's out-of-memory killer (dmesg); load with fewer "
                    "--workers, or in this process (--workers 1).") from None
            yield outcome.part()

    def stop(self) -> None:
        """The workers killed, their tasks dropped: a failed load must not wait for them, and
        they must not write into its scratch directory once it is removed."""
        if self.executor is not None:
            processes = list((self.executor._processes or {}).values())  # no public handle
            self.executor.shutdown(wait=False, cancel_futures=True)
            for process in processes:
                process.kill()
                process.join()
            self.executor = None


def _become_worker(parent: int) -> None:
    """A worker dies with its parent (even a SIGKILLed one) and leaves Ctrl-C to it."""
    from kvtrace.children import die_with_parent

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not die_with_parent(parent):
        os._exit(1)


@dataclass
class PartOutcome:
    """A worker's answer, as it crosses to the parent: the part, or its ``KvtraceError``'s class
    name, message and hint (an exception's pickle would lose the hint); ``files``: the part's
    Parquet files' bytes, by table, from a worker that shares no file system with the parent."""

    made: Part | None = None
    error: tuple[str, str, str] | None = None
    files: dict[str, list[bytes]] | None = None

    def part(self) -> Part:
        if self.error is not None:
            name, message, hint = self.error
            raise error_class(name)(message, hint=hint)
        return self.made


def run_part(task: PartTask) -> PartOutcome:
    """``load_part`` in a worker: its ``KvtraceError`` as an answer."""
    try:
        return PartOutcome(load_part(task))
    except KvtraceError as error:
        return PartOutcome(error=(type(error).__name__, str(error), error.hint))


def run_shipped_part(task: PartTask, data: bytes) -> PartOutcome:
    """``load_part`` on a host of its own (a Ray task): the trace's bytes come with the task,
    and the part's files go back with the answer."""
    with tempfile.TemporaryDirectory(prefix="kvtrace-part-") as scratch:
        copy = os.path.join(scratch, "trace" + TRACE_SUFFIX)
        with open(copy, "wb") as file:
            file.write(data)
        here = dataclasses.replace(task, directory=os.path.join(scratch, "parts"),
                                   scratch=scratch, file=copy)
        os.mkdir(here.directory)
        outcome = run_part(here)
        if outcome.made is not None:
            outcome.files = {table: [_read(path) for path in outcome.made.paths(table)]
                             for table in outcome.made.files}
        return outcome


def _read(path: str) -> bytes:
    with open(path, "rb") as file:
        return file.read()


def land_part(task: PartTask, outcome: PartOutcome) -> Part:
    """A shipped part's files written where ``task`` wanted them; its error raised."""
    part = dataclasses.replace(outcome.part(), directory=task.directory)
    for table, files in outcome.files.items():
        for path, data in zip(part.paths(table), files):
            if path == part_file(task.directory, table, part.run):
                _make_part_directory(path)
            with open(path, "wb") as file:
                file.write(data)
    return part


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


def _load_trace(connection, run: int, trace: _OpenTrace, scratch: str,
                part: PartTask | None = None, written: Counter | None = None) -> LoadedRun:
    """One trace as run ``run``: its records, its miss attribution and its cache entries, in
    one pass over its one descriptor (which also makes its digest); the pass's state that grows
    with the trace spills to a file in ``scratch``. The rows go into ``connection``'s tables,
    or, with a ``part``, into its files (``written``: how many per table); the ``runs`` row
    into ``connection`` either way."""
    path, reader = trace.path, trace.reader
    variant, backend, mode = run_labels(reader.header)
    inserts = _Inserts(connection, run, path, part, written)
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


def _take_analysis(analysis, inserts: _Inserts, chunk: int) -> None:
    """What the pass made, to the inserting thread: every whole chunk of every table (0: all)."""
    for table, columns in analysis.take_tables(chunk):
        inserts.put(table, columns)


def _delete_run(connection, run: int) -> None:
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


class _Inserts:
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
            _make_part_directory(path)
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
    """INSERT of a chunk of ``table`` for the run ``$run`` (its labels are computed from it)."""
    return f"INSERT INTO {stored_tables()[table]} BY NAME {_chunk_select(table, columns, True)}"


@functools.cache
def _chunk_select(table: str, columns: tuple[str, ...], with_run: bool) -> str:
    """The rows of a chunk of ``table`` as they are stored, each column under its name, with
    the run ``$run`` (``with_run``) or without (a part's file: its run is in its path). Enum
    fields go in as codes (``<name>_code``)."""
    targets, expressions = (["run"], ["$run"]) if with_run else ([], [])
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
    return ("SELECT " + ", ".join(f"{expression} AS {target}"
                                  for expression, target in zip(expressions, targets))
            + " FROM kvtrace_chunk")
