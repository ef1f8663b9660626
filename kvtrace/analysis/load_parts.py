"""A fleet's traces loaded as parts: each trace read by a worker (a local process, a Ray task,
or this process) by the same pass as a load in place (``load_trace``), its rows written as
Parquet files (``part_files``) instead of inserted; the one process that writes the database
takes the parts in (``load``). A directory of partitions (``load_partitions``) keeps parts,
described by its manifest (``PARTS_MANIFEST``).

DuckDB holds the interpreter lock while it scans a chunk's numpy columns (two threads
inserting into two tables take as long as one), so one process reads and inserts little more
than a core's worth; processes of their own read side by side, and DuckDB reads Parquet on all
its threads (docs/performance.md#fleet-loading).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec

from kvtrace import __version__
from kvtrace.analysis.database import (
    DB_SCHEMA_VERSION,
    DatabaseError,
    cache_entries_insert_sql,
    schema_statements,
    stored_tables,
)
from kvtrace.analysis.load_trace import (
    LOAD_MEMORY_LIMIT,
    LoadedRun,
    OpenTrace,
    load_trace,
    needs_sql_twin,
)
from kvtrace.analysis.part_files import PARTS_MANIFEST, PartTask, make_part_directory, part_file
from kvtrace.analysis.sql_access import sql_string
from kvtrace.children import become_pool_worker
from kvtrace.errors import KvtraceError, error_class
from kvtrace.files import OutputError, write_failure
from kvtrace.analysis.trace_paths import TRACE_SUFFIX

RUNS_TABLE = "runs"


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

    trace = OpenTrace(task.path, task.file, task.absolute)
    written: Counter = Counter()
    try:
        connection = duckdb.connect(":memory:", config={
            "memory_limit": LOAD_MEMORY_LIMIT, "temp_directory": os.path.join(
                task.scratch, f"duckdb-{task.run}")})
        try:
            for statement in schema_statements():
                connection.execute(statement)
            if needs_sql_twin(trace):
                loaded = load_trace(connection, task.run, trace, task.scratch)
                connection.execute(cache_entries_insert_sql([task.run]))
                tables = part_tables()
            else:
                loaded = load_trace(connection, task.run, trace, task.scratch, task, written)
                tables = (RUNS_TABLE,)
            for table in tables:
                stored = stored_tables().get(table, table)
                if connection.execute(f"SELECT count(*) FROM {stored}").fetchone()[0]:
                    path = part_file(task.directory, table, task.run)
                    make_part_directory(path)
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


def part_tables() -> tuple[str, ...]:
    """The tables a part holds, by their names in the main schema: every table of runs' rows,
    and ``runs``."""
    return (*stored_tables(), RUNS_TABLE)


def write_manifest(directory: str, runs: list[LoadedRun], tables: dict[int, dict[str, int]]
                   ) -> None:
    """The manifest of a directory of partitions: its ``runs`` and, per run, its files per
    table (``tables``)."""
    manifest = {"db_schema_version": DB_SCHEMA_VERSION, "kvtrace_version": __version__,
                "runs": [{"run": run.run, "path": run.path, "variant": run.variant,
                          "backend": run.backend, "num_records": run.num_records,
                          "truncated": run.truncated, "digest": run.digest,
                          "tables": tables[run.run]}
                         for run in runs]}
    with open(os.path.join(directory, PARTS_MANIFEST), "wb") as file:
        file.write(msgspec.json.format(msgspec.json.encode(manifest), indent=2) + b"\n")


def stored_parts(directory: str) -> list[Part]:
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
                      if table in part_tables()},
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
        self.processes: list = []  # the pool's processes (multiprocessing.Process)
        self.description = f"{count} local processes"

    def __enter__(self) -> LocalWorkers:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
        others = set(multiprocessing.active_children())
        self.executor = ProcessPoolExecutor(
            self.count, mp_context=multiprocessing.get_context(method),
            initializer=become_pool_worker, initargs=(os.getpid(),))
        self.executor.submit(int).result()  # every worker started now (forked: all at once)
        # The pool does not name its processes (publicly): the children started with it.
        self.processes = [process for process in multiprocessing.active_children()
                          if process not in others]
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
            self.executor.shutdown(wait=False, cancel_futures=True)
            for process in self.processes:
                process.kill()
                process.join()
            self.executor, self.processes = None, []


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
                make_part_directory(path)
            with open(path, "wb") as file:
                file.write(data)
    return part
