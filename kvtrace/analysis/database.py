"""The forensics database: one DuckDB file holding any number of traces ("runs").

Layout (schema version ``DB_SCHEMA_VERSION``):

* one table per record kind, named by its tag (``block_stored``, ``computed_blocks_found``...),
  because kinds have different fields and a per-family table would be wide and mostly NULL.
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
"""

from __future__ import annotations

import enum
import functools
import os
import typing

from kvtrace.analysis.attribution import ROW_COLUMNS
from kvtrace.analysis.sql_access import connect
from kvtrace.errors import KvtraceError
from kvtrace.events import RECORD_TYPES, tag_of

DB_SCHEMA_VERSION = 2
ATTRIBUTION_SCHEMA_VERSION = 2  # the first schema with the miss_attribution table
ATTRIBUTION_TABLE = "miss_attribution"

RENAMED_FIELDS = {"group": "group_id", "step": "engine_step"}
RUN_COLUMNS = "run INTEGER, variant VARCHAR, backend VARCHAR, seq BIGINT, step BIGINT"
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


def _sql_type(field_type: object) -> str:
    if is_enum_field(field_type):
        return "VARCHAR"  # a name, or the number of a value this kvtrace does not know
    return {int: "BIGINT", bool: "BOOLEAN", str: "VARCHAR", bytes: "BLOB"}[field_type]


def schema_statements() -> list[str]:
    """DDL for every table, before any view."""
    statements = []
    statements.append(f"CREATE TABLE {ATTRIBUTION_TABLE} "
                      f"({', '.join(f'{name} {sql_type}' for name, sql_type in ROW_COLUMNS)})")
    for record_type in RECORD_TYPES:
        tag = tag_of(record_type)
        columns = [RUN_COLUMNS]
        for name, field_type in record_fields(record_type):
            if is_list_field(field_type):
                columns.append(f"num_{name} INTEGER")
                statements.append(
                    f"CREATE TABLE {child_table(tag, name)} (run INTEGER, seq BIGINT, req BIGINT, "
                    f"pos INTEGER, {element_column(name)} BIGINT)"
                )
            else:
                columns.append(f"{column_name(name)} {_sql_type(field_type)}")
        statements.append(f"CREATE TABLE {tag} ({', '.join(columns)})")
    statements += [
        """CREATE TABLE runs (
            run INTEGER PRIMARY KEY, path VARCHAR, source VARCHAR, variant VARCHAR,
            backend VARCHAR, mode VARCHAR, source_key VARCHAR, kvtrace_version VARCHAR,
            vllm_version VARCHAR, created_ns BIGINT, hash_block_size BIGINT,
            num_gpu_blocks BIGINT, retention_interval BIGINT, block_sizes BIGINT[],
            group_kinds VARCHAR[], num_records BIGINT, truncated BOOLEAN, num_dropped BIGINT,
            header_json VARCHAR, digest VARCHAR)""",
        "CREATE TABLE kvtrace_meta (key VARCHAR PRIMARY KEY, value VARCHAR)",
        SWEEP_TABLE,
    ]
    return statements


# Tables derived once all runs are loaded: used several times per query, so built once.
DERIVED_TABLES = {
    # One row per cache entry: a hash stored on a block, until it was removed (NULL: still
    # cached when the trace ended). ``position_class`` of a CHECKPOINT entry comes from the
    # request's latest CheckpointRecorded at that position and group.
    "cache_entries": """
        SELECT s.run, s.variant, s.backend, s.seq AS stored_seq, s.step AS stored_step,
               s.block_id, s.hash_id, s.group_id, s.num_tokens, s.kind, s.req,
               r.seq AS removed_seq, r.step AS removed_step, r.reason AS removed_reason,
               CASE WHEN s.kind = 'CHECKPOINT' THEN c.position_class END AS position_class,
               coalesce(s.kind = 'CHECKPOINT' AND c.position_class = 'TRANSIENT', false) AS transient
        FROM block_stored s
        ASOF LEFT JOIN block_removed r
            ON s.run = r.run AND s.block_id = r.block_id AND s.hash_id = r.hash_id
               AND s.group_id = r.group_id AND r.seq > s.seq
        ASOF LEFT JOIN checkpoint_recorded c
            ON s.run = c.run AND s.req = c.req AND s.group_id = c.group_id
               AND s.num_tokens = c.position AND c.seq < s.seq""",
}

# Views the shipped queries build on. Definitions of what is counted live here, once.
VIEWS = {
    # Every prefix lookup (get_computed_blocks). ``admitted``: the next allocate_slots of the
    # request, before its next lookup, succeeded (a failed admission is looked up again later,
    # and only the admitted lookup decides what gets prefilled). ``admission`` numbers a
    # request's admitted lookups (a preempted request is admitted again) for pairing variants.
    "lookups": """
        WITH found AS (
            SELECT c.*, lead(c.seq) OVER (PARTITION BY c.run, c.req ORDER BY c.seq) AS next_lookup_seq
            FROM computed_blocks_found c),
        judged AS (
            SELECT f.run, f.variant, f.backend, f.seq, f.step, f.req, f.num_hit_tokens,
                   f.shared_prefix_boundary, s.num_tokens AS num_query_tokens,
                   coalesce(s.success AND s.seq < coalesce(f.next_lookup_seq, 9223372036854775807),
                            false) AS admitted
            FROM found f ASOF LEFT JOIN slots_allocated s
                ON f.run = s.run AND f.req = s.req AND s.seq > f.seq)
        SELECT *, CASE WHEN admitted THEN row_number() OVER (
                      PARTITION BY run, req, admitted ORDER BY seq) END AS admission
        FROM judged""",
    # Every hash unit a request is known to have: its prompt units, then those decode added.
    # ``unit`` i covers tokens [0, (i + 1) * hash_block_size).
    "request_hashes": """
        SELECT run, req, pos AS unit, hash_id FROM request_arrived_hash_ids
        UNION ALL
        SELECT e.run, e.req,
               coalesce(a.num_hash_ids, 0)
                 + row_number() OVER (PARTITION BY e.run, e.req ORDER BY e.seq, e.pos) - 1,
               e.hash_id
        FROM hashes_extended_hash_ids e
        LEFT JOIN request_arrived a ON a.run = e.run AND a.req = e.req""",
    # Hits per cache entry: a BlockTouched counts for the entry most recently stored on that
    # block, if it was still there (blocks rarely hold two keys; then the newer one is credited).
    "entry_hits": """
        SELECT e.run, e.stored_seq, count(*) AS hits, max(t.seq) AS last_hit_seq,
               max(t.step) AS last_hit_step
        FROM block_touched t
        ASOF JOIN block_stored s ON t.run = s.run AND t.block_id = s.block_id AND s.seq < t.seq
        JOIN cache_entries e ON e.run = s.run AND e.stored_seq = s.seq
        WHERE e.removed_seq IS NULL OR e.removed_seq > t.seq
        GROUP BY e.run, e.stored_seq""",
    # The state of a block after each event that changes it: ``in_use`` (ref_cnt > 0: allocated
    # or touched, until freed to 0), ``num_keys`` (hashes on it), ``transient`` (its newest key is
    # a TRANSIENT checkpoint); ``key_epoch`` counts the keys stored on it so far and ``is_touch``
    # marks hits, so that hits since the newest key are a sum over (block_id, key_epoch).
    "block_states": """
        WITH events AS (
            SELECT run, seq, step, block_id, true AS in_use, 0 AS key_delta,
                   NULL::BOOLEAN AS transient, 0 AS is_store, 0 AS is_touch
            FROM block_allocated
            UNION ALL SELECT run, seq, step, block_id, true, 0, NULL, 0, 1 FROM block_touched
            UNION ALL SELECT run, seq, step, block_id, ref_cnt > 0, 0, NULL, 0, 0 FROM block_freed
            UNION ALL SELECT run, stored_seq, stored_step, block_id, NULL, 1, transient, 1, 0
                      FROM cache_entries
            UNION ALL SELECT run, seq, step, block_id, NULL, -1, NULL, 0, 0 FROM block_removed),
        running AS (
            SELECT run, seq, step, block_id, is_touch,
                   coalesce(last_value(in_use IGNORE NULLS) OVER w, false) AS in_use,
                   sum(key_delta) OVER w AS num_keys,
                   coalesce(last_value(transient IGNORE NULLS) OVER w, false) AS transient,
                   sum(is_store) OVER w AS key_epoch
            FROM events
            WINDOW w AS (PARTITION BY run, block_id ORDER BY seq ROWS UNBOUNDED PRECEDING))
        SELECT run, seq, step, block_id, in_use, num_keys, transient AND num_keys > 0 AS transient,
               key_epoch, is_touch
        FROM running""",
}


# Table macros shared by several shipped queries: definitions that take the queries' parameters.
MACROS = {
    # Every hot prefix entry evicted by LRU reuse while at least ``min_transient`` transient
    # checkpoints sat cached in the free queue (had they not been cached, they would have been
    # reused first), once with each later lookup that needed it and hit less, or once with NULL
    # lookup columns when none did. Definitions: kvtrace/sql/checkpoint_pushouts.sql.
    "checkpoint_pushout_lookups(min_hits, min_transient)": """
        WITH hot_evictions AS (
            SELECT e.*, h.hits
            FROM cache_entries e
            JOIN entry_hits h ON h.run = e.run AND h.stored_seq = e.stored_seq
            WHERE e.removed_reason = 'LRU_REUSE' AND h.hits >= min_hits),
        transient_flags AS (
            SELECT run, seq, block_id, (NOT in_use AND transient)::INTEGER AS evictable_transient
            FROM block_states),
        transient_deltas AS (
            SELECT run, seq, evictable_transient - coalesce(lag(evictable_transient)
                       OVER (PARTITION BY run, block_id ORDER BY seq), 0) AS delta
            FROM transient_flags),
        transient_series AS (
            SELECT run, seq, sum(delta) OVER (PARTITION BY run ORDER BY seq
                                              ROWS UNBOUNDED PRECEDING) AS cached_transient
            FROM transient_deltas
            WHERE delta <> 0),
        pushouts AS (
            SELECT * FROM (
                SELECT v.*, coalesce(s.cached_transient, 0) AS cached_transient,
                       coalesce(n.seq, 9223372036854775807) AS restored_seq
                FROM hot_evictions v
                ASOF LEFT JOIN transient_series s ON v.run = s.run AND s.seq < v.removed_seq
                ASOF LEFT JOIN block_stored n
                    ON v.run = n.run AND v.hash_id = n.hash_id AND v.group_id = n.group_id
                       AND n.seq > v.removed_seq)
            WHERE cached_transient >= min_transient),
        missed AS (
            SELECT p.run, p.removed_seq, l.seq AS lookup_seq, l.req AS lookup_req,
                   l.num_hit_tokens
            FROM pushouts p
            JOIN runs r ON r.run = p.run
            JOIN request_hashes owner
                ON owner.run = p.run AND owner.req = p.req
                   AND owner.unit = p.num_tokens // r.hash_block_size - 1
            JOIN request_hashes other
                ON other.run = p.run AND other.unit = owner.unit AND other.hash_id = owner.hash_id
            JOIN lookups l
                ON l.run = p.run AND l.req = other.req AND l.admitted
                   AND l.seq > p.removed_seq AND l.seq < p.restored_seq
            WHERE l.num_hit_tokens < p.num_tokens)
        SELECT p.*, m.lookup_seq, m.lookup_req, m.num_hit_tokens
        FROM pushouts p
        LEFT JOIN missed m ON m.run = p.run AND m.removed_seq = p.removed_seq""",
}


def create_macros(connection) -> None:
    for signature, body in MACROS.items():
        connection.execute(f"CREATE OR REPLACE TEMP MACRO {signature} AS TABLE {body}")


def create_views(connection) -> None:
    for name, body in VIEWS.items():
        connection.execute(f"CREATE OR REPLACE VIEW {name} AS {body}")


def build_derived_tables(connection) -> None:
    """Fill the derived tables from everything loaded (they are views over data that no
    longer changes, stored once)."""
    for name, body in DERIVED_TABLES.items():
        connection.execute(f"CREATE OR REPLACE TABLE {name} AS {body}")


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
        if int(version[0]) < ATTRIBUTION_SCHEMA_VERSION:
            _stand_in_for_attribution(connection, path, int(version[0]))
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


def _stand_in_for_attribution(connection, path: str, version: int) -> None:
    """A temporary view named like the missing table that fails, when read, with what to do."""
    message = (f"{path} was loaded by an older kvtrace (database schema v{version}) and has no "
               f"{ATTRIBUTION_TABLE} table; reload its traces with `kvtrace load TRACE ... -o DB`")
    columns = ", ".join(f"NULL::{'VARCHAR' if sql_type.startswith('ENUM') else sql_type} AS {name}"
                        for name, sql_type in ROW_COLUMNS[1:])
    quoted = "'" + message.replace("'", "''") + "'"
    connection.execute(f"CREATE TEMP VIEW {ATTRIBUTION_TABLE} AS SELECT "
                       f"error({quoted})::INTEGER AS run, {columns} FROM range(1)")


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0]
