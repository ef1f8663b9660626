"""Loading traces into the forensics database, or into a directory of Parquet partitions:
every run in order, each trace by the one pass of ``load_trace``, duplicates dropped.

A fleet (many traces) loads in worker processes (``workers``) or on a ``runner`` of the
caller's (Ray tasks): each worker reads one trace by the same pass, and writes each chunk of
rows as a Parquet file instead of inserting it, a *part* (``load_parts``); the parent, the one
writer a DuckDB file allows, takes the parts in, in run order, a batch at a time.
``load_partitions`` keeps the parts instead of a database (a directory with
``PARTS_MANIFEST``), and a later load takes such a directory in as it takes its own parts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import resource
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvtrace import __version__
from kvtrace.analysis.database import (
    DB_SCHEMA_VERSION,
    SWEEP_COLUMNS,
    SWEEP_TABLE,
    cache_entries_insert_sql,
    create_views,
    open_database,
    run_labels,
    schema_statements,
    stored_tables,
)
from kvtrace.analysis.load_parts import (
    InProcess,
    LocalWorkers,
    Part,
    PartRunner,
    part_tables,
    stored_parts,
    write_manifest,
)
from kvtrace.analysis.load_trace import (
    LOAD_MEMORY_LIMIT,
    LoadedRun,
    OpenTrace,
    delete_run,
    load_trace,
    needs_sql_twin,
)
from kvtrace.analysis.part_files import PartTask, part_file
from kvtrace.analysis.sql_access import sql_string
from kvtrace.analysis.trace_paths import trace_paths
from kvtrace.analysis.vllm_counters import load_vllm_counters
from kvtrace.files import (
    OutputError,
    StagedOutput,
    cannot_write,
    refuse_overwrite,
    refuse_planted_dir,
)

# Records of the parts a database takes in at once (a few GB of Parquet on disk at most).
MERGE_BATCH_RECORDS = 100_000_000


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


class _Sources:
    """The runs to load, in run order: traces, each opened once and its header read, before the
    output is made, and the runs of directories of partitions, which keep their numbers (their
    gaps too: None), after those before them; the same file given twice is kept once
    (``summary.duplicates``)."""

    def __init__(self, paths: list[str], summary: LoadSummary) -> None:
        self.items: list[OpenTrace | Part | None] = []
        self.labels: list[tuple[str, str]] = []  # per run number: its variant and backend
        _allow_open_files(len(paths))
        files: dict[tuple[int, int], str] = {}  # (device, inode) -> the first path of that file
        try:
            for path in paths:
                if os.path.isdir(path):  # a directory of partitions (trace_paths)
                    first = len(self.items)
                    for part in stored_parts(path):
                        gap = first + part.run - len(self.items)
                        self.items += [None] * gap
                        self.labels += [("", "")] * gap
                        self.items.append(part)
                        self.labels.append((part.loaded.variant, part.loaded.backend))
                    continue
                trace = OpenTrace(path)
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
        return sum(isinstance(item, OpenTrace) for item in self.items)

    def close(self) -> None:
        for item in self.items:
            if isinstance(item, OpenTrace):
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
              if isinstance(item, OpenTrace)]
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

    def task(self, run: int, trace: OpenTrace) -> PartTask:
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

    def load_in_place(self, run: int, trace: OpenTrace) -> LoadedRun:
        loaded = load_trace(self.connection, run, trace, self.scratch)
        if needs_sql_twin(trace):
            self.twins.append(run)
        return loaded

    def add(self, run: int, part: Part) -> None:
        self.batch.append((run, part))
        if sum(part.loaded.num_records for _, part in self.batch) >= MERGE_BATCH_RECORDS:
            self._insert_batch()

    def _insert_batch(self) -> None:
        """Every table's rows of the batch's parts, in run order, each part's rows under its
        run here (``run`` is in a part's path, not in its files)."""
        for table in part_tables():
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
            delete_run(self.connection, run)
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
        write_manifest(self.directory, runs, self.tables)


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

