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
"""

from __future__ import annotations

import enum
import functools
import os
import typing
from collections.abc import Sequence

from kvtrace.analysis.attribution import ROW_COLUMNS
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
ATTRIBUTION_TABLE = "miss_attribution"

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
    return [*statements, """CREATE TABLE runs (
            run INTEGER PRIMARY KEY, path VARCHAR, source VARCHAR, variant VARCHAR,
            backend VARCHAR, mode VARCHAR, source_key VARCHAR, kvtrace_version VARCHAR,
            vllm_version VARCHAR, created_ns BIGINT, hash_block_size BIGINT,
            num_gpu_blocks BIGINT, retention_interval BIGINT, block_sizes BIGINT[],
            group_kinds VARCHAR[], num_records BIGINT, truncated BOOLEAN, num_dropped BIGINT,
            header_json VARCHAR, digest VARCHAR)""",
            "CREATE TABLE kvtrace_meta (key VARCHAR PRIMARY KEY, value VARCHAR)", SWEEP_TABLE]


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
    entries: ``in_use`` (ref_cnt > 0: allocated or touched, until freed to 0; a start snapshot
    says so too), ``num_keys`` (hashes on it), ``transient`` (its newest key is a TRANSIENT
    checkpoint); ``key_epoch`` counts the keys stored on it so far and ``is_touch`` marks hits,
    so that hits since the newest key are a sum over (block_id, key_epoch)."""
    return f"""
        WITH events AS (
            SELECT run, seq, step, block_id, true AS in_use, 0 AS key_delta,
                   NULL::BOOLEAN AS transient, 0 AS is_store, 0 AS is_touch
            FROM block_allocated
            UNION ALL SELECT run, seq, step, block_id, true, 0, NULL, 0, 1 FROM block_touched
            UNION ALL SELECT run, seq, step, block_id, ref_cnt > 0, 0, NULL, 0, 0 FROM block_freed
            UNION ALL SELECT run, seq, step, block_id, ref_cnt > 0, 0, NULL, 0, 0 FROM block_state
            UNION ALL SELECT run, stored_seq, stored_step, block_id, NULL, 1, transient, 1, 0
                      FROM {entries}
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
        FROM running"""


# The cache entries: one row per key put on a block (a BlockStored, or a key a start snapshot
# found cached on it), until it was removed (NULL: still cached when the trace ended). What an
# entry adds to its store is kept in ``cache_entry_figures`` (ENTRY_FIGURE_COLUMNS), filled while
# each trace loads by the C core of the streaming pass (kvtrace/analysis/stream.py), or, without
# it, once every trace is in, by CACHE_ENTRIES_SQL below: its twin, and the definition. The
# ``cache_entries`` view joins the figures to their stores.
ENTRY_FIGURE_COLUMNS = (
    ("run", "INTEGER"), ("stored_seq", "BIGINT"), ("block_id", "BIGINT"),
    ("removed_seq", "BIGINT"), ("removed_step", "BIGINT"), ("removed_reason_code", "BIGINT"),
    ("position_class_code", "BIGINT"), ("hits", "BIGINT"), ("last_hit_seq", "BIGINT"),
    ("last_hit_step", "BIGINT"), ("transient_cached", "BIGINT"),
)
# ``position_class`` of a CHECKPOINT entry: the storing request's latest CheckpointRecorded at
# that position and group (``transient``: it says TRANSIENT). ``hits``: BlockTouched on its block
# while it was the block's newest entry and still there (a block rarely holds two keys; then the
# newer is credited). ``transient_cached``, for a removed entry: the transient checkpoint entries
# cached in the free queue just before the removal - blocks whose newest key is a TRANSIENT
# checkpoint, that hold a key and that no request holds (ref_cnt 0), the removed one included.
# ``from_snapshot``: cached when the capture began (no kind or request: the snapshot says none).
CACHE_ENTRIES_SQL = f"""
    WITH stored AS (
        SELECT run, variant, backend, seq AS stored_seq, step AS stored_step, block_id, hash_id,
               group_id, num_tokens, kind, req, false AS from_snapshot
        FROM block_stored
        UNION ALL
        SELECT k.run, k.variant, k.backend, k.seq, k.step, b.block_id, k.hash_id, k.group_id,
               k.num_tokens, NULL, NULL, true
        FROM key_cached k JOIN key_cached_block_ids b ON b.run = k.run AND b.seq = k.seq),
    entries AS (
        SELECT s.*, r.seq AS removed_seq, r.step AS removed_step, r.reason AS removed_reason,
               CASE WHEN s.kind = 'CHECKPOINT' THEN c.position_class END AS position_class,
               coalesce(s.kind = 'CHECKPOINT' AND c.position_class = 'TRANSIENT', false)
                   AS transient
        FROM stored s
        ASOF LEFT JOIN block_removed r
            ON s.run = r.run AND s.block_id = r.block_id AND s.hash_id = r.hash_id
               AND s.group_id = r.group_id AND r.seq > s.stored_seq
        ASOF LEFT JOIN checkpoint_recorded c
            ON s.run = c.run AND s.req = c.req AND s.group_id = c.group_id
               AND s.num_tokens = c.position AND c.seq < s.stored_seq),
    hits AS (
        SELECT e.run, e.stored_seq, e.block_id, count(*) AS hits, max(t.seq) AS last_hit_seq,
               max(t.step) AS last_hit_step
        FROM block_touched t
        ASOF JOIN entries e
            ON t.run = e.run AND t.block_id = e.block_id AND e.stored_seq < t.seq
        WHERE e.removed_seq IS NULL OR e.removed_seq > t.seq
        GROUP BY e.run, e.stored_seq, e.block_id),
    states AS ({block_states_sql("entries")}),
    changes AS (
        SELECT run, seq, sum(delta) AS delta
        FROM (SELECT run, seq, flag - coalesce(lag(flag) OVER (
                  PARTITION BY run, block_id ORDER BY seq), 0) AS delta
              FROM (SELECT run, seq, block_id, (NOT in_use AND transient)::INTEGER AS flag
                    FROM states))
        WHERE delta <> 0
        GROUP BY run, seq),
    series AS (
        SELECT run, seq, sum(delta) OVER (PARTITION BY run ORDER BY seq
                                          ROWS UNBOUNDED PRECEDING) AS cached
        FROM changes)
    SELECT e.run, e.variant, e.backend, e.stored_seq, e.stored_step, e.block_id, e.hash_id,
           e.group_id, e.num_tokens, e.kind, e.req, e.removed_seq, e.removed_step,
           e.removed_reason, e.position_class, e.transient, coalesce(h.hits, 0) AS hits,
           h.last_hit_seq, h.last_hit_step,
           CASE WHEN e.removed_seq IS NOT NULL THEN coalesce(s.cached, 0) END AS transient_cached,
           e.from_snapshot
    FROM entries e
    LEFT JOIN hits h
        ON h.run = e.run AND h.stored_seq = e.stored_seq AND h.block_id = e.block_id
    ASOF LEFT JOIN series s ON s.run = e.run AND s.seq < e.removed_seq"""

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
    """The cache entries: their figures with their stores' fields (CACHE_ENTRIES_SQL's columns)."""
    def figures(store: str) -> str:
        return f"""f.removed_seq, f.removed_step,
               {enum_name_sql("f.removed_reason_code", RemoveReason)} AS removed_reason,
               {enum_name_sql("f.position_class_code", CheckpointClass)} AS position_class,
               coalesce({store}.kind = 'CHECKPOINT'
                        AND f.position_class_code = {CheckpointClass.TRANSIENT.value}, false)
                   AS transient,
               f.hits, f.last_hit_seq, f.last_hit_step, f.transient_cached"""
    return f"""
        SELECT s.run, s.variant, s.backend, f.stored_seq, s.step AS stored_step, f.block_id,
               s.hash_id, s.group_id, s.num_tokens, s.kind, s.req, {figures("s")},
               false AS from_snapshot
        FROM cache_entry_figures f
        JOIN block_stored s ON s.run = f.run AND s.seq = f.stored_seq
        UNION ALL
        SELECT k.run, k.variant, k.backend, f.stored_seq, k.step, f.block_id, k.hash_id,
               k.group_id, k.num_tokens, NULL, NULL, {figures("k")}, true
        FROM cache_entry_figures f
        JOIN (SELECT *, NULL::VARCHAR AS kind FROM key_cached) k
            ON k.run = f.run AND k.seq = f.stored_seq"""


# Views the shipped queries build on. Definitions of what is counted live here, once.
VIEWS = {
    "cache_entries": _cache_entries_view(),
    # Every prefix lookup (get_computed_blocks). ``admitted``: the next allocate_slots of the
    # request, before its next lookup, succeeded (a failed admission is looked up again later,
    # and only the admitted lookup decides what gets prefilled). ``admission`` numbers a
    # request's admitted lookups (a preempted request is admitted again) for pairing variants;
    # a request in flight when the capture began (``in_flight``: in its start snapshot) counts
    # on from the admissions it had had (its first, one per preemption, none while waiting).
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
                ON f.run = s.run AND f.req = s.req AND s.seq > f.seq),
        prior AS (
            SELECT run, req, max(num_preemptions + (queue = 'RUNNING')::INTEGER) AS admissions
            FROM request_state
            GROUP BY run, req)
        SELECT j.*, CASE WHEN admitted THEN row_number() OVER (
                        PARTITION BY j.run, j.req, admitted ORDER BY j.seq)
                        + coalesce(p.admissions, 0) END AS admission,
               p.req IS NOT NULL AS in_flight
        FROM judged j
        LEFT JOIN prior p ON p.run = j.run AND p.req = j.req""",
    # Every hash unit a request is known to have: its prompt units (or, in flight when the
    # capture began, its units then), then those decode added. ``unit`` i covers tokens
    # [0, (i + 1) * hash_block_size).
    "request_hashes": """
        WITH known AS (
            SELECT run, req, pos, hash_id FROM request_arrived_hash_ids
            UNION ALL
            SELECT run, req, pos, hash_id FROM request_state_hash_ids),
        counts AS (
            SELECT run, req, num_hash_ids FROM request_arrived
            UNION ALL
            SELECT run, req, num_hash_ids FROM request_state)
        SELECT run, req, pos AS unit, hash_id FROM known
        UNION ALL
        SELECT e.run, e.req,
               coalesce(a.num_hash_ids, 0)
                 + row_number() OVER (PARTITION BY e.run, e.req ORDER BY e.seq, e.pos) - 1,
               e.hash_id
        FROM hashes_extended_hash_ids e
        LEFT JOIN counts a ON a.run = e.run AND a.req = e.req""",
    # Entries that were hit (the figures are cache_entries' own; kept for older queries).
    "entry_hits": """
        SELECT run, stored_seq, block_id, hits, last_hit_seq, last_hit_step
        FROM cache_entries WHERE hits > 0""",
    # The state of a block after each event that changes it (block_states_sql).
    "block_states": block_states_sql("cache_entries"),
}


# Table macros shared by several shipped queries: definitions that take the queries' parameters.
MACROS = {
    # Every hot prefix entry evicted by LRU reuse while at least ``min_transient`` transient
    # checkpoints sat cached in the free queue (had they not been cached, they would have been
    # reused first), once with each later lookup that needed it and hit less, or once with NULL
    # lookup columns when none did. Definitions: kvtrace/sql/checkpoint_pushouts.sql. The
    # eviction-time figures (hits, transient_cached) are cache_entries' own, made while loading.
    "checkpoint_pushout_lookups(min_hits, min_transient)": """
        WITH hot_evictions AS (
            SELECT *, transient_cached AS cached_transient
            FROM cache_entries
            WHERE removed_reason = 'LRU_REUSE' AND hits > 0 AND hits >= min_hits
                  AND transient_cached >= min_transient),
        pushouts AS (
            SELECT v.*, coalesce(n.seq, 9223372036854775807) AS restored_seq
            FROM hot_evictions v
            ASOF LEFT JOIN (SELECT run, hash_id, group_id, seq FROM block_stored
                            SEMI JOIN hot_evictions USING (run, hash_id, group_id)) n
                ON v.run = n.run AND v.hash_id = n.hash_id AND v.group_id = n.group_id
                   AND n.seq > v.removed_seq),
        windows AS MATERIALIZED (
            SELECT p.run, p.removed_seq, p.restored_seq, p.num_tokens, owner.unit,
                   owner.hash_id AS unit_hash
            FROM pushouts p
            JOIN runs r ON r.run = p.run
            JOIN request_hashes owner
                ON owner.run = p.run AND owner.req = p.req
                   AND owner.unit = p.num_tokens // r.hash_block_size - 1),
        -- each admitted lookup's units its hit did not reach (a prefix of depth d needs unit
        -- d // unit - 1, and a hit below d leaves it missed): joined by key, not by time
        missed_units AS MATERIALIZED (
            SELECT l.run, l.seq, l.req, l.num_hit_tokens, h.unit, h.hash_id
            FROM lookups l
            JOIN runs r ON r.run = l.run
            JOIN request_hashes h
                ON h.run = l.run AND h.req = l.req
                   AND (h.unit + 2) * r.hash_block_size > l.num_hit_tokens
            WHERE l.admitted),
        missed AS (
            SELECT w.run, w.removed_seq, m.seq AS lookup_seq, m.req AS lookup_req,
                   m.num_hit_tokens
            FROM windows w
            JOIN missed_units m
                ON m.run = w.run AND m.unit = w.unit AND m.hash_id = w.unit_hash
                   AND m.seq > w.removed_seq AND m.seq < w.restored_seq
                   AND m.num_hit_tokens < w.num_tokens)
        SELECT p.*, m.lookup_seq, m.lookup_req, m.num_hit_tokens
        FROM pushouts p
        LEFT JOIN missed m ON m.run = p.run AND m.removed_seq = p.removed_seq""",
}


# What prices each run's recomputed tokens (recompute_gpu_seconds, variant_verdict): the
# model's figures in the run's header (cost.*, written by kvtrace replay; execute.* by older
# versions), else the query's flops parameters when positive, else nothing (NULL).
MACROS["run_costs(flops_per_token, flops_per_position)"] = """
    WITH figures AS (
        SELECT run,
               coalesce(json_extract_string(header_json, '$.params."cost.model"'),
                        json_extract_string(header_json, '$.params."execute.model"')) AS model,
               TRY_CAST(coalesce(
                   json_extract_string(header_json, '$.params."cost.flops_per_token"'),
                   json_extract_string(header_json, '$.params."execute.flops_per_token"'))
                   AS DOUBLE) AS per_token,
               TRY_CAST(coalesce(
                   json_extract_string(header_json,
                                       '$.params."cost.flops_per_token_per_position"'),
                   json_extract_string(header_json,
                                       '$.params."execute.flops_per_token_per_position"'))
                   AS DOUBLE) AS per_position
        FROM runs)
    SELECT run,
           CASE WHEN per_token IS NOT NULL AND per_position IS NOT NULL THEN model
                WHEN flops_per_token > 0 THEN '(parameters)' END AS cost_model,
           CASE WHEN per_token IS NOT NULL AND per_position IS NOT NULL THEN per_token
                WHEN flops_per_token > 0 THEN flops_per_token END AS per_token,
           CASE WHEN per_token IS NOT NULL AND per_position IS NOT NULL THEN per_position
                WHEN flops_per_token > 0 THEN flops_per_position END AS per_position
    FROM figures"""


# Each run's admitted lookups and the prefill they recomputed, in FLOPs where the run is
# priced (variant_verdict, fleet: over a GPU's FLOP/s, GPU-seconds).
MACROS["run_prefill(flops_per_token, flops_per_position)"] = """
    SELECT l.run,
           count(*) FILTER (WHERE l.admission = 1) AS lookups,
           sum(l.num_query_tokens) FILTER (WHERE l.admission = 1) AS query_tokens,
           sum(l.num_hit_tokens) FILTER (WHERE l.admission = 1) AS hit_tokens,
           sum(l.num_query_tokens - l.num_hit_tokens) AS prefill_tokens,
           sum(c.per_token * (l.num_query_tokens - l.num_hit_tokens)
               + c.per_position * (l.num_query_tokens * (l.num_query_tokens + 1)
                                   - l.num_hit_tokens * (l.num_hit_tokens + 1)) / 2)
               AS prefill_flops,
           any_value(c.cost_model) AS cost_model
    FROM lookups l
    JOIN run_costs(flops_per_token, flops_per_position) c ON c.run = l.run
    WHERE l.admitted
    GROUP BY l.run"""

# Each run's span of traffic in hours: its first arrival to its last step (what figures per
# hour divide by: diagnosis, variant_verdict, fleet).
MACROS["run_hours()"] = """
    SELECT a.run, (max(s.ts_ns) - min(a.first_arrival)) / 3.6e12 AS hours
    FROM (SELECT run, min(arrival_ns) AS first_arrival FROM request_arrived GROUP BY run) a
    JOIN step_started s ON s.run = a.run
    GROUP BY a.run"""

def create_macros(connection) -> None:
    for signature, body in MACROS.items():
        connection.execute(f"CREATE OR REPLACE TEMP MACRO {signature} AS TABLE {body}")


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
