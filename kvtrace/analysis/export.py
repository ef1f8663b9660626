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
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from kvtrace.analysis.database import open_database
from kvtrace.errors import KvtraceError

MANIFEST = "_kvtrace_export.json"
# Partition column by table kind, in order of preference.
PARTITION_COLUMNS = ("run", "sweep_id")


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
    """Write every table of ``db_path`` as Parquet under ``outdir`` (see the module doc)."""
    import duckdb

    started = time.perf_counter()
    target = Path(outdir)
    if target.exists() and not target.is_dir():
        raise KvtraceError(f"{outdir} is a file", "Give --parquet a directory.")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise KvtraceError(f"{outdir} is not empty",
                           "Export into a new directory, or add --overwrite to replace it.")
    if target.is_dir() and _inside(db_path, target):
        raise KvtraceError(f"{db_path} is inside {outdir}, which the export replaces",
                           "Export into a directory that does not hold the database.")
    connection = open_database(db_path)
    summary = ExportSummary(db_path, outdir)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial",
                                        dir=target.parent))
    except OSError as error:
        connection.close()
        raise KvtraceError(f"cannot write {outdir}: {error.strerror or error}",
                           "Check the free space and permissions of the target.") from None
    try:
        for table in _tables(connection):
            summary.tables.append(_export_table(connection, table, partial))
        manifest = {"db": os.path.abspath(db_path), "db_schema_version": _meta(
            connection, "db_schema_version"), "tables": {
                t.name: {"partition_by": t.partition_by, "columns": t.columns, "rows": t.rows}
                for t in summary.tables}}
        (partial / MANIFEST).write_bytes(
            msgspec.json.format(msgspec.json.encode(manifest), indent=2) + b"\n")
        _replace_dir(partial, target)
    except duckdb.Error as error:
        shutil.rmtree(partial, ignore_errors=True)
        raise KvtraceError(f"cannot export {db_path}: {str(error).splitlines()[0]}",
                           "Check the free space and permissions of the target.") from None
    except OSError as error:
        shutil.rmtree(partial, ignore_errors=True)
        raise KvtraceError(f"cannot write {outdir}: {error}",
                           "Check the free space and permissions of the target.") from None
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    finally:
        connection.close()
    summary.seconds = time.perf_counter() - started
    return summary


def _tables(connection) -> list[str]:
    return [name for (name,) in connection.execute(
        "SELECT table_name FROM duckdb_tables() WHERE schema_name = 'main' AND NOT temporary "
        "ORDER BY table_name").fetchall()]


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
    if partition is None:
        rows = {"": connection.execute(f'SELECT count(*) FROM "{table}"').fetchone()[0]}
        _copy(connection, table, directory / "data_0.parquet", "")
    else:
        rows = {str(value): count for value, count in connection.execute(
            f'SELECT "{partition}", count(*) FROM "{table}" GROUP BY ALL ORDER BY 1').fetchall()}
        if rows:
            _copy(connection, table, directory, f', PARTITION_BY ("{partition}")')
    return ExportedTable(table, partition, columns, rows)


def _copy(connection, table: str, path: Path, options: str) -> None:
    quoted = str(path).replace("'", "''")
    connection.execute(f"COPY \"{table}\" TO '{quoted}' (FORMAT PARQUET{options})")


def _inside(path: str, directory: Path) -> bool:
    """Whether ``path`` lies in ``directory`` or below it (links resolved)."""
    return Path(os.path.realpath(directory)) in Path(os.path.realpath(path)).parents


def _replace_dir(partial: Path, target: Path) -> None:
    """Put the finished export at ``target``; an old one there is removed once replaced."""
    if not target.exists():
        os.replace(partial, target)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
    os.replace(target, old / target.name)
    os.replace(partial, target)
    shutil.rmtree(old, ignore_errors=True)
