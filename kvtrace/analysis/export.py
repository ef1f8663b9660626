"""A forensics database as Parquet files, for analysis off the host that captured.

Every table becomes a directory of Parquet files written by DuckDB's own ``COPY ... (FORMAT
PARQUET, PARTITION_BY ...)``, hive-style: ``DIR/<table>/run=<n>/data_0.parquet`` for the
tables with a ``run`` column (record kinds, their child tables, ``runs``, derived tables),
``DIR/sweep/sweep_id=<n>/...`` for sweeps, and one ``DIR/<table>/data_0.parquet`` for the rest
(``kvtrace_meta``). The partition column lives in the path, not in the files (the hive
convention DuckDB, Spark and Trino read). A table without rows gets an empty directory.
``DIR/_kvtrace_export.json`` lists every table with its layout, columns and row counts per
partition (a leading underscore: Spark and Trino skip it when they read the directories).

Views and macros are not exported: they are SQL over the tables (kvtrace/analysis/database.py).
The export is written into a fresh directory beside ``DIR`` and renamed into place at the end.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from kvtrace.analysis.database import ROWS_SCHEMA, open_database
from kvtrace.analysis.sql_access import sql_identifier, sql_string
from kvtrace.errors import KvtraceError
from kvtrace.files import OutputError, cannot_write, refuse_planted_dir, write_failure

MANIFEST = "_kvtrace_export.json"
# Partition column by table kind, in order of preference.
PARTITION_COLUMNS = ("run", "sweep_id")
# A table's directory: kvtrace's own names, never a path (no "/", "..", leading dot).
_DIRECTORY_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]*")


@dataclass
class ExportedTable:
    name: str
    partition_by: str | None
    columns: dict[str, str]  # name -> DuckDB type
    rows: dict[str, int]  # partition value ("" when not partitioned) -> rows

    @property
    def num_rows(self) -> int:
        return sum(self.rows.values())


@dataclass
class ExportSummary:
    db_path: str
    outdir: str
    tables: list[ExportedTable] = field(default_factory=list)
    seconds: float = 0.0


def export_parquet(db_path: str, outdir: str, *, overwrite: bool = False) -> ExportSummary:
    """Write every table of ``db_path`` as Parquet under ``outdir`` (see the module doc).

    The database's SQL reaches only the private scratch directory the export is built in
    (``sql_access``): its table names are quoted as identifiers, and a name that cannot be a
    directory name is refused, so a crafted database cannot make the export write elsewhere."""
    import duckdb

    started = time.perf_counter()
    target = Path(os.path.abspath(outdir))
    _check_target(db_path, outdir, target, overwrite)
    refuse_planted_dir(target, f"--parquet {outdir}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial",
                                        dir=target.parent))
    except OSError as error:
        raise cannot_write(outdir, error) from None
    summary = ExportSummary(db_path, outdir)
    try:
        connection = open_database(db_path, writable_dirs=(str(partial),))
        try:
            for table in _tables(connection):
                summary.tables.append(_export_table(connection, table, partial))
            manifest = {"db": os.path.abspath(db_path), "db_schema_version": _meta(
                connection, "db_schema_version"), "tables": {
                    t.name: {"partition_by": t.partition_by, "columns": t.columns,
                             "rows": t.rows} for t in summary.tables}}
        finally:
            connection.close()
        (partial / MANIFEST).write_bytes(
            msgspec.json.format(msgspec.json.encode(manifest), indent=2) + b"\n")
        _replace_dir(partial, target)
    except duckdb.Error as error:
        raise write_failure(error) or KvtraceError(
            f"cannot export {db_path}: {str(error).strip().splitlines()[0]}",
            "Check the free space and permissions of the target.") from None
    except OSError as error:
        raise cannot_write(outdir, error) from None
    finally:
        shutil.rmtree(partial, ignore_errors=True)  # gone already once renamed into place
    summary.seconds = time.perf_counter() - started
    return summary


def _check_target(db_path: str, outdir: str, target: Path, overwrite: bool) -> None:
    """Refuse, before any work, a ``--parquet`` the export must not replace: a link or
    anything but a directory, a directory with files (unless ``overwrite``), one that holds
    the database or this process's working directory."""
    try:
        info = os.lstat(target)
    except FileNotFoundError:
        return
    except OSError as error:
        raise cannot_write(outdir, error) from None
    if stat.S_ISLNK(info.st_mode):
        raise OutputError(f"{outdir} is a symbolic link: the export replaces only a directory, "
                          "never a link", "Give --parquet the directory itself, or a new path.")
    if not stat.S_ISDIR(info.st_mode):
        raise OutputError(f"{outdir} is not a directory", "Give --parquet a directory.")
    if any(target.iterdir()) and not overwrite:
        raise OutputError(f"{outdir} is not empty",
                          "Export into a new directory, or add --overwrite to replace it.")
    if _inside(db_path, target):
        raise OutputError(f"{db_path} is inside {outdir}, which the export replaces",
                          "Export into a directory that does not hold the database.")
    cwd = Path(os.path.realpath(os.getcwd()))
    if cwd == Path(os.path.realpath(target)) or _inside(str(cwd), target):
        raise OutputError(f"{outdir} holds the working directory, which the export would "
                          "replace", "Export into a new directory (e.g. --parquet export/).")


def _tables(connection) -> list[str]:
    names = [name for (name,) in connection.execute(
        "SELECT DISTINCT table_name FROM duckdb_tables() WHERE database_name = current_database() "
        "AND schema_name IN ('main', ?) AND NOT temporary ORDER BY table_name",
        [ROWS_SCHEMA]).fetchall()]  # a table stored there is read through its view in main
    for name in names:
        if not _DIRECTORY_NAME.fullmatch(name):
            raise KvtraceError(f"the database has a table named {name!r}, which cannot be a "
                               "directory name: it was not written by kvtrace",
                               "Export a database made by `kvtrace load`.")
    return names


def _meta(connection, key: str) -> str | None:
    row = connection.execute("SELECT value FROM kvtrace_meta WHERE key = ?", [key]).fetchone()
    return row[0] if row else None


def _export_table(connection, table: str, root: Path) -> ExportedTable:
    columns = dict(connection.execute(
        "SELECT column_name, data_type FROM duckdb_columns() WHERE schema_name = 'main' "
        "AND table_name = ? ORDER BY column_index", [table]).fetchall())
    partition = next((c for c in PARTITION_COLUMNS if c in columns), None)
    directory = root / table
    directory.mkdir()
    name = sql_identifier(table)
    if partition is None:
        rows = {"": connection.execute(f"SELECT count(*) FROM {name}").fetchone()[0]}
        _copy(connection, name, directory / "data_0.parquet", "")
    else:
        column = sql_identifier(partition)
        rows = {str(value): count for value, count in connection.execute(
            f"SELECT {column}, count(*) FROM {name} GROUP BY ALL ORDER BY 1").fetchall()}
        if rows:
            _copy(connection, name, directory, f", PARTITION_BY ({column})")
    return ExportedTable(table, partition, columns, rows)


def _copy(connection, name: str, path: Path, options: str) -> None:
    """``COPY`` the table ``name`` (quoted already) to ``path``."""
    connection.execute(f"COPY {name} TO {sql_string(str(path))} (FORMAT PARQUET{options})")


def _inside(path: str, directory: Path) -> bool:
    """Whether ``path`` lies in ``directory`` or below it (links resolved)."""
    return Path(os.path.realpath(directory)) in Path(os.path.realpath(path)).parents


def _replace_dir(partial: Path, target: Path) -> None:
    """Put the finished export at ``target``; an old one there is removed once replaced, and
    put back if the new one cannot take its place (a mount point: EBUSY)."""
    if not os.path.lexists(target):
        os.replace(partial, target)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
    try:
        os.replace(target, old / target.name)
        try:
            os.replace(partial, target)
        except OSError:
            os.replace(old / target.name, target)
            raise
    finally:
        shutil.rmtree(old, ignore_errors=True)
