"""The forensics database: one DuckDB file holding any number of traces ("runs").

Layout (schema version ``DB_SCHEMA_VERSION``):

* one table per record kind, named by its tag (``block_stored``, ``computed_blocks_found``...),
  because kinds have different fields and a per-family table would be wide and mostly NULL.
  Since v4 it is a view in the main schema over the table of that name in ``ROWS_SCHEMA``,
  which stores all but the computed columns (``schema_statements``); ``miss_attribution`` too.
  Every row has ``run``, ``variant``, ``backend``, ``seq`` (position of the record in its trace)
  and ``step`` (number of ``StepStarted`` at or before it, so a step's own ``StepStarted`` row
  shares its step), then the record's fields. Renamed fields: ``group`` -> ``group_id`` (an SQL
  keyword) and ``StepStarted.step`` -> ``engine_step``. Enum fields hold their names
  (``'LRU_REUSE'``), or the number of a value this kvtrace does not know (a newer writer's).
* a list field (``hash_ids``) becomes a child table ``<kind>_<field>`` with one row per element
  (``run, seq, req, pos, hash_id``) and a ``num_<field>`` column on the parent row, so that SQL
  can join on "unit i of request r" directly.
* ``runs``: one row per loaded trace with its provenance, engine configuration and content
  digest (``digest``: sha256 of the file; added after v2 without a version bump, nothing reads
  it but the operator). No two runs hold the same content.
* ``kvtrace_meta``: key/value pairs, among them ``db_schema_version``.
* ``sweep``: one row per configuration of each ``kvtrace sweep`` loaded (``SWEEP_COLUMNS``),
  numbered by ``sweep_id``. Added after schema v1 without a version bump: nothing else reads
  it, and a v1 database gets the table when a sweep is first loaded into it.
* ``cache_entries``, derived once after loading (``DERIVED_TABLES``), and views shared by the
  shipped queries (``VIEWS``); table macros with parameters (``MACROS``) are defined on every
  connection (temporary, so a read-only or older database gets them too).
* ``miss_attribution`` (schema v2): one row per admitted lookup and cause of its missed tokens
  (``kvtrace.analysis.attribution``), computed while each trace loads. A v1 database lacks it;
  ``open_database`` then puts a view in its place that fails with a message to reload.

The SQL written by hand (the ``runs`` and ``kvtrace_meta`` tables, the cache entries' SQL twin,
the views, the macros) is in ``kvtrace/sql/schema/``, package data read once at import: not
shipped queries. What follows from the record kinds (their tables, enum names) is made here.
"""

from __future__ import annotations

import enum
import functools
import os
import typing
from collections.abc import Sequence
from importlib import resources

from kvtrace.analysis.miss_table import ATTRIBUTION_TABLE, ROW_COLUMNS
from kvtrace.analysis.sql_access import connect
from kvtrace.errors import KvtraceError, TraceFormatError
from kvtrace.events import RECORD_TYPES, CheckpointClass, RemoveReason, TraceHeader, tag_of

DB_SCHEMA_VERSION = 4
# vLLM's own counters, recorded beside a capture (analysis/vllm_counters.py loads them); a
# database loaded before kvtrace recorded them gets it empty, as a temporary table.
VLLM_COUNTERS_TABLE = ("vllm_counters",
                       "run INTEGER, ts_ns BIGINT, name VARCHAR, labels VARCHAR, value DOUBLE")
ATTRIBUTION_SCHEMA_VERSION = 2  # the first schema with the miss_attribution table
# v3: cache_entries carries each entry's hits and the transient checkpoints cached at its
# removal, made while loading; miss_attribution.in_flight; the start snapshot's tables
ENTRY_FIGURES_SCHEMA_VERSION = 3
# v4: the record kinds' and the attribution's rows stored in this schema, read through views
# (schema_statements); the same columns as v3, so a v3 database reads as it did.
ROWS_SCHEMA = "kvtrace_rows"

RENAMED_FIELDS = {"group": "group_id", "step": "engine_step"}

# The sweep table: the sweep's own columns, then one per figure of a ``sweep.json`` row.
SWEEP_COLUMNS = (
    ("sweep_id", "INTEGER"), ("source_path", "VARCHAR"), ("source_digest", "VARCHAR"),
    ("backend", "VARCHAR"), ("variant", "VARCHAR"), ("retention_interval", "INTEGER"),
    ("num_gpu_blocks", "INTEGER"), ("pool_fraction", "DOUBLE"), ("requests", "BIGINT"),
    ("prompt_tokens", "BIGINT"), ("hit_tokens", "BIGINT"), ("hit_rate", "DOUBLE"),
    ("evictions", "BIGINT"), ("checkpoints_published", "BIGINT"),
    ("checkpoints_suppressed", "BIGINT"), ("stale_key_hazards", "BIGINT"),
    ("preemptions", "BIGINT"), ("steps", "BIGINT"), ("wall_s", "DOUBLE"),
)
SWEEP_TABLE = ("CREATE TABLE IF NOT EXISTS sweep ("
               + ", ".join(f"{name} {sql_type}" for name, sql_type in SWEEP_COLUMNS) + ")")


class DatabaseError(KvtraceError):
    """A forensics database that cannot be opened or was written by a newer kvtrace."""

    default_hint = "Create it with `kvtrace load TRACE|OUTDIR ... -o DB.duckdb`."


def _schema_sql(name: str, **placeholders: str) -> str:
    """The SQL of ``kvtrace/sql/schema/<name>.sql`` (package data; not a shipped query), without
    its header of comments, each ``{placeholder}`` filled."""
    file = resources.files("kvtrace.sql").joinpath("schema", *f"{name}.sql".split("/"))
    text = file.read_text(encoding="utf-8")
    lines = text.splitlines()
    while lines and lines[0].startswith("--"):
        lines.pop(0)
    text = "\n".join(lines)
    for placeholder, value in placeholders.items():
        text = text.replace("{" + placeholder + "}", value)
    return text


# The tables of the database itself, beside the runs' rows.
_OWN_TABLES = (_schema_sql("runs"), _schema_sql("kvtrace_meta"))


def column_name(field_name: str) -> str:
    return RENAMED_FIELDS.get(field_name, field_name)


@functools.cache
def record_fields(record_type: type) -> tuple[tuple[str, object], ...]:
    """(field name, resolved type) of a record kind, in schema order."""
    hints = typing.get_type_hints(record_type)
    return tuple((name, hints[name]) for name in record_type.__struct_fields__)


def is_list_field(field_type: object) -> bool:
    return typing.get_origin(field_type) is list


def child_table(tag: str, field_name: str) -> str:
    return f"{tag}_{field_name}"


def element_column(field_name: str) -> str:
    """``hash_ids`` -> ``hash_id``: the name of one element of a list field."""
    return field_name[:-1] if field_name.endswith("s") else field_name


def is_enum_field(field_type: object) -> bool:
    return isinstance(field_type, type) and issubclass(field_type, enum.IntEnum)


def is_map_field(field_type: object) -> bool:
    """A snapshot's named values (``dict[str, ...]``): stored as JSON text."""
    return typing.get_origin(field_type) is dict


def stored_column(field_name: str, field_type: object) -> str:
    """The column a field's values are stored in: an enum field's codes go to ``<name>_code``
    (its name column is computed from it), the others to their own."""
    return column_name(field_name) + ("_code" if is_enum_field(field_type) else "")


def enum_name_sql(code: str, enum_type: type[enum.IntEnum]) -> str:
    """SQL naming an enum code: its member's name, or the number of a value this kvtrace does not
    know (a newer writer's)."""
    cases = " ".join(f"WHEN {member.value} THEN '{member.name}'" for member in enum_type)
    return f"CASE {code} {cases} ELSE {code}::VARCHAR END"


def enum_code_sql(name: str, enum_type: type[enum.IntEnum]) -> str:
    """SQL back from a name ``enum_name_sql`` made to its code."""
    cases = " ".join(f"WHEN '{member.name}' THEN {member.value}" for member in enum_type)
    return f"CASE {name} {cases} ELSE TRY_CAST({name} AS BIGINT) END"


def enum_columns(name: str, enum_type: type[enum.IntEnum]) -> list[tuple[str, str, str | None]]:
    """An enum field as two columns: its codes, stored (small ints cost a load a fraction of
    what a name a row would), and its names, computed when read."""
    return [(f"{name}_code", "BIGINT", None),
            (name, "VARCHAR", enum_name_sql(name + "_code", enum_type))]


def _sql_type(field_type: object) -> str:
    if is_map_field(field_type):
        return "VARCHAR"  # JSON
    return {int: "BIGINT", bool: "BOOLEAN", str: "VARCHAR", bytes: "BLOB"}[field_type]


def _quoted(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


# Columns computed from ``run`` when read: the run's labels (``runs``' own columns of that name).
_LABELS = ("variant", "backend")
# Columns of the record kinds' tables stored as 32-bit ints (a step, a request, a block, a
# group, a token count, a code) and read as BIGINT like the others: DuckDB takes a fifth less
# time to insert them. The load refuses a value past 32 bits (``narrowed``).
NARROW_COLUMNS = frozenset({"step", "req", "block_id", "group_id", "num_tokens", "ref_cnt",
                            "position", "block_idx", "kind_code", "reason_code",
                            "position_class_code", "status_code"})
_WIDENED = "widened"  # the computed SQL of a narrow column: its stored value, as BIGINT
Column = tuple[str, str, "str | None"]  # (name, SQL type, SQL computing it when read, or None)


def _layout() -> list[tuple[str, tuple[Column, ...]]]:
    """Every table's columns, as SQL reads them (the ``run`` labels' SQL is filled in by
    ``_computed``)."""
    def labelled(columns) -> tuple[Column, ...]:
        return tuple((name, sql_type, "" if name in _LABELS else None)
                     for name, sql_type, *_ in columns)

    tables = [(ATTRIBUTION_TABLE, labelled(ROW_COLUMNS)),
              ("cache_entry_figures", labelled(ENTRY_FIGURE_COLUMNS))]
    for record_type in RECORD_TYPES:
        tag = tag_of(record_type)
        columns = [("run", "INTEGER", None), ("variant", "VARCHAR", ""),
                   ("backend", "VARCHAR", ""), ("seq", "BIGINT", None), ("step", "BIGINT", None)]
        for name, field_type in record_fields(record_type):
            if is_list_field(field_type):
                columns.append((f"num_{name}", "INTEGER", None))
                tables.append((child_table(tag, name), labelled((
                    ("run", "INTEGER"), ("seq", "BIGINT"), ("req", "BIGINT"), ("pos", "INTEGER"),
                    (element_column(name), "BIGINT")))))
            elif is_enum_field(field_type):
                columns += enum_columns(column_name(name), field_type)
            else:
                columns.append((column_name(name), _sql_type(field_type), None))
        tables.append((tag, tuple((name, sql_type, _WIDENED if sql is None and name in
                                   NARROW_COLUMNS and sql_type == "BIGINT" else sql)
                                  for name, sql_type, sql in columns)))
    return tables


def _computed(name: str, sql: str, labels: list[tuple[str, str]] | None) -> str:
    """The SQL of a computed column; a run label's from ``labels`` (per run number, its variant
    and backend), or NULL without them."""
    if sql == _WIDENED:
        return f"{name}::BIGINT"
    if name not in _LABELS:
        return sql
    if labels is None:
        return "NULL::VARCHAR"
    values = ", ".join(_quoted(run_labels[name == "backend"]) for run_labels in labels)
    return f"([{values}]::VARCHAR[])[run + 1]"


def schema_statements(labels: list[tuple[str, str]] | None = None) -> list[str]:
    """The DDL of a new database's tables, before any other view. A table with computed columns
    (the record kinds' and ``miss_attribution``: ``variant`` and ``backend`` from ``run``, an
    enum's names from its codes) stores the others in ``ROWS_SCHEMA`` under its name, and a
    view of that name in the main schema adds them: DuckDB computes a generated column on every
    insert (to check it), which cost a load a third of its time. ``labels``: per run number,
    its (variant, backend)."""
    statements = [f"CREATE SCHEMA {ROWS_SCHEMA}"]
    for name, columns in _layout():
        stored = _column_list((column, "INTEGER" if sql == _WIDENED else sql_type)
                              for column, sql_type, sql in columns if sql in (None, _WIDENED))
        statements.append(f"CREATE TABLE {stored_tables()[name]} ({stored})")
        if stored_tables()[name] != name:
            selected = ", ".join(column if sql is None
                                 else f"{_computed(column, sql, labels)} AS {column}"
                                 for column, _, sql in columns)
            statements.append(f"CREATE VIEW {name} AS SELECT {selected} "
                              f"FROM {stored_tables()[name]}")
    return [*statements, *_OWN_TABLES, SWEEP_TABLE]


def stand_in_tables() -> list[tuple[str, str]]:
    """(table, DDL) of an empty temporary table of each table's columns as SQL reads them: for
    a database of an older schema, the kinds it predates (computed columns are generated)."""
    return [(name, f"CREATE TEMP TABLE {name} (" + ", ".join(
        f"{column} {sql_type}" + (f" GENERATED ALWAYS AS ({_computed(column, sql, None)}) VIRTUAL"
                                  if sql not in (None, _WIDENED) else "")
        for column, sql_type, sql in columns) + ")") for name, columns in _layout()]


@functools.cache
def narrow_columns(table: str) -> frozenset[str]:
    """The columns of ``table`` stored as 32-bit ints (``NARROW_COLUMNS``)."""
    return frozenset(column for name, columns in _layout() if name == table
                     for column, _, sql in columns if sql == _WIDENED)


def past_32_bits(path: str, table: str, column: str, value: int) -> TraceFormatError:
    """The load's refusal of a value a narrow column cannot hold."""
    return TraceFormatError(
        f"{path}: a {table} record holds {column} {value}, past the 32 bits the database keeps "
        "it in",
        hint="No engine makes such a value: the trace is damaged or was not written by "
             "kvtrace. `kvtrace replay` and `kvtrace why` still read it.")


@functools.cache
def stored_tables() -> dict[str, str]:
    """Every table holding runs' rows: its name to the name it is stored under."""
    return {name: name if all(sql is None for *_, sql in columns) else f"{ROWS_SCHEMA}.{name}"
            for name, columns in _layout()}


def _column_list(columns) -> str:
    return ", ".join(f"{column} {sql_type}" for column, sql_type in columns)


def block_states_sql(entries: str) -> str:
    """The state of a block after each event that changes it, given the relation of its cache
    entries (``kvtrace/sql/schema/block_states.sql``)."""
    return _schema_sql("block_states", entries=entries)


# What an entry adds to its store, kept in ``cache_entry_figures``: filled while each trace
# loads by the C core of the streaming pass (kvtrace/analysis/stream.py), or, without it, once
# every trace is in, by CACHE_ENTRIES_SQL, its twin and the definition
# (kvtrace/sql/schema/cache_entries_derived.sql).
ENTRY_FIGURE_COLUMNS = (
    ("run", "INTEGER"), ("stored_seq", "BIGINT"), ("block_id", "BIGINT"),
    ("removed_seq", "BIGINT"), ("removed_step", "BIGINT"), ("removed_reason_code", "BIGINT"),
    ("position_class_code", "BIGINT"), ("hits", "BIGINT"), ("last_hit_seq", "BIGINT"),
    ("last_hit_step", "BIGINT"), ("transient_cached", "BIGINT"),
)
CACHE_ENTRIES_SQL = _schema_sql("cache_entries_derived", block_states=block_states_sql("entries"))


def cache_entries_insert_sql(runs: Sequence[int] | None = None) -> str:
    """The cache entries' figures by their SQL twin, into their table (enums as codes): of every
    run, or of ``runs``."""
    values = {"removed_reason_code": enum_code_sql("removed_reason", RemoveReason),
              "position_class_code": enum_code_sql("position_class", CheckpointClass)}
    names = [name for name, _ in ENTRY_FIGURE_COLUMNS]
    where = "" if runs is None else f" WHERE run IN ({', '.join(map(str, map(int, runs)))})"
    return (f"INSERT INTO cache_entry_figures ({', '.join(names)}) "
            f"SELECT {', '.join(values.get(name, name) for name in names)} "
            f"FROM ({CACHE_ENTRIES_SQL}){where}")


def _cache_entries_view() -> str:
    """The cache entries: their figures with their stores' fields, their enums named by
    ``kvtrace.events``' own."""
    def figures(store: str) -> str:
        return _schema_sql(
            "cache_entry_figures", store=store,
            removed_reason=enum_name_sql("f.removed_reason_code", RemoveReason),
            position_class=enum_name_sql("f.position_class_code", CheckpointClass),
            transient_code=str(CheckpointClass.TRANSIENT.value))
    return _schema_sql("cache_entries", stored_figures=figures("s"),
                       snapshot_figures=figures("k"))


def _schema_folder(folder: str) -> dict[str, str]:
    """The SQL of each file of ``kvtrace/sql/schema/<folder>/``, by its name, in name order."""
    names = sorted(entry.name[:-len(".sql")] for entry in
                   resources.files("kvtrace.sql").joinpath("schema", folder).iterdir()
                   if entry.name.endswith(".sql"))
    return {name: _schema_sql(f"{folder}/{name}") for name in names}


# Views the shipped queries build on, in the order they are made: a view of each file of
# kvtrace/sql/schema/views/ (definitions of what is counted live there, once) between the two
# made from templates.
VIEWS = {
    "cache_entries": _cache_entries_view(),
    **_schema_folder("views"),
    "block_states": block_states_sql("cache_entries"),
}
# Table macros shared by several shipped queries, which take the queries' parameters: each file
# of kvtrace/sql/schema/macros/ makes one (temporary: every connection makes them anew).
MACROS = tuple(_schema_folder("macros").values())


def create_macros(connection) -> None:
    for statement in MACROS:
        connection.execute(statement)


def create_views(connection) -> None:
    for name, body in VIEWS.items():
        connection.execute(f"CREATE OR REPLACE VIEW {name} AS {body}")


DUCKDB_MAGIC_OFFSET, DUCKDB_MAGIC = 8, b"DUCK"


def is_database_file(path: str, purpose: str) -> bool:
    """Whether ``path`` is a DuckDB file rather than a trace or a replay directory (a regular
    file is required: ``purpose`` says why)."""
    from kvtrace.errors import TraceNotFoundError
    from kvtrace.files import require_regular_file

    if os.path.isdir(path):
        return False
    require_regular_file(path, purpose)
    try:
        with open(path, "rb") as file:
            head = file.read(DUCKDB_MAGIC_OFFSET + len(DUCKDB_MAGIC))
    except OSError as error:
        raise TraceNotFoundError(f"cannot open {path}: {error.strerror}") from None
    return head[DUCKDB_MAGIC_OFFSET:] == DUCKDB_MAGIC


def open_database(path: str | os.PathLike, *, read_only: bool = True, unsafe: bool = False,
                  writable_dirs: tuple[str, ...] = ()):
    """Open a forensics DB, refusing a missing file, a non-kvtrace file and a newer schema.
    Its SQL reaches nothing outside it (``sql_access``; ``unsafe`` lifts that)."""
    import duckdb

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise DatabaseError(f"no such database: {path}")
    try:
        connection = connect(path, read_only=read_only, unsafe=unsafe,
                             writable_dirs=writable_dirs)
    except duckdb.Error as error:
        raise DatabaseError(f"cannot open {path} as a DuckDB database: {_first_line(error)}") from None
    try:
        version = connection.execute(
            "SELECT value FROM kvtrace_meta WHERE key = 'db_schema_version'").fetchone()
    except duckdb.Error:  # no such table, or not the columns kvtrace writes
        version = None
    if version is None:
        connection.close()
        raise DatabaseError(f"{path} is a DuckDB file but not a kvtrace forensics database")
    if not (isinstance(version[0], str) and version[0].isdigit()):
        connection.close()
        raise DatabaseError(f"{path} has a damaged schema version ({version[0]!r} in "
                            "kvtrace_meta)", "Re-create it: `kvtrace load TRACE ... -o DB`.")
    if int(version[0]) > DB_SCHEMA_VERSION:
        writer = connection.execute(
            "SELECT value FROM kvtrace_meta WHERE key = 'kvtrace_version'").fetchone()
        connection.close()
        raise DatabaseError(
            f"{path} has database schema v{version[0]} (written by kvtrace "
            f"{writer[0] if writer else '?'}), newer than this kvtrace reads (v{DB_SCHEMA_VERSION})",
            hint="Upgrade kvtrace (pip install -U kvtrace), or re-create the database with this "
            "kvtrace: `kvtrace load TRACE ... -o DB.duckdb`.",
        )
    try:
        if int(version[0]) < ENTRY_FIGURES_SCHEMA_VERSION:
            _stand_ins_for_older(connection, path, int(version[0]))
        name, columns = VLLM_COUNTERS_TABLE
        if not connection.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name = ?",
                                  [name]).fetchone()[0]:
            connection.execute(f"CREATE TEMP TABLE {name} ({columns})")
        create_macros(connection)
    except duckdb.Error as error:  # views of its own that do not bind: not kvtrace's
        connection.close()
        raise DatabaseError(f"{path} cannot be read as a kvtrace database: "
                            f"{_first_line(error)}") from None
    return connection


def has_attribution(connection) -> bool:
    """Whether the database holds the ``miss_attribution`` table (not the v1 stand-in)."""
    return bool(connection.execute(
        "SELECT count(*) FROM duckdb_tables() WHERE table_name = ? AND NOT temporary",
        [ATTRIBUTION_TABLE]).fetchone()[0])


def _stand_ins_for_older(connection, path: str, version: int) -> None:
    """Temporary tables and views that give a database of an older schema what the shipped
    queries read: empty tables of the record kinds added since, the cache entries' figures
    computed by their SQL twin, the views as they are defined now, and for the attribution
    table, ``in_flight`` (false: older kvtraces read no start snapshot) or, before v2, a view
    that fails when read, with what to do."""
    catalog = connection.execute("SELECT current_database()").fetchone()[0]
    present = {name for (name,) in connection.execute(
        "SELECT table_name FROM duckdb_tables() WHERE NOT temporary").fetchall()}
    for name, ddl in stand_in_tables():
        if name not in present and name not in (ATTRIBUTION_TABLE, "cache_entry_figures"):
            connection.execute(ddl)
    if version >= ATTRIBUTION_SCHEMA_VERSION:
        connection.execute(f"CREATE TEMP VIEW {ATTRIBUTION_TABLE} AS SELECT *, false AS in_flight "
                           f'FROM "{catalog}".main.{ATTRIBUTION_TABLE}')
    else:
        message = (f"{path} was loaded by an older kvtrace (database schema v{version}) and has "
                   f"no {ATTRIBUTION_TABLE} table; reload its traces with `kvtrace load TRACE ... "
                   "-o DB`")
        columns = ", ".join(
            f"NULL::{'VARCHAR' if sql_type.startswith('ENUM') else sql_type} AS {name}"
            for name, sql_type in ROW_COLUMNS[1:])
        quoted = "'" + message.replace("'", "''") + "'"
        connection.execute(f"CREATE TEMP VIEW {ATTRIBUTION_TABLE} AS SELECT "
                           f"error({quoted})::INTEGER AS run, {columns} FROM range(1)")
    for name, body in VIEWS.items():
        body = CACHE_ENTRIES_SQL if name == "cache_entries" else body  # no figures table there
        connection.execute(f"CREATE OR REPLACE TEMP VIEW {name} AS {body}")


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0]


def run_labels(header: TraceHeader) -> tuple[str, str, str]:
    """(variant, backend, mode) of a trace: its replay info, or its source for other traces."""
    if header.replay is not None:
        return header.replay.variant, header.replay.backend, header.replay.mode
    return header.source, "live" if header.source == "capture" else "none", ""
