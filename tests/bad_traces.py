"""Hand-built traces for the hardening and fuzz tests: valid frames and checksums around
contents that are ill-typed, impossible or from a newer writer.

``write_frames`` writes frames as the format defines them (docs/trace-format.md: preamble,
then ``u32 length, u32 crc32, type byte + msgpack``), so a test can put anything inside a
frame whose framing is correct."""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path

import msgspec

from kvtrace.events import (
    FORMAT_MAJOR,
    FORMAT_MINOR,
    BlockRemoved,
    BlockStored,
    EngineConfig,
    HashesExtended,
    KVCacheGroup,
    RequestArrived,
    StoreKind,
    TraceClosed,
    TraceHeader,
)
from kvtrace.traceio import MAGIC, encode_batch

UNIT, BLOCK = 16, 64
SMALL_CONFIG = EngineConfig(
    kv_cache_groups=[
        KVCacheGroup(kind="full_attention", block_size=BLOCK),
        KVCacheGroup(kind="mamba", block_size=BLOCK, mamba_cache_mode="align",
                     num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=UNIT),
    ],
    hash_block_size=UNIT, num_gpu_blocks=200, retention_interval=0,
    max_num_batched_tokens=256, max_num_seqs=4)


def header(config: EngineConfig | None = SMALL_CONFIG, **fields) -> TraceHeader:
    return TraceHeader(**{"kvtrace_version": "test", "created_ns": 0, "source": "synth",
                          "config": config, **fields})


def requests(count: int = 6, prompt_len: int = 160) -> list:
    """``count`` requests sharing a 64-token prefix, one second apart."""
    records = []
    for req in range(count):
        units = prompt_len // UNIT
        hash_ids = [0, 1, 2, 3] + [100 * (req + 1) + i for i in range(units - 4)]
        records.append(RequestArrived(req=req, prompt_len=prompt_len, hash_ids=hash_ids,
                                      max_tokens=3, arrival_ns=req * 10**9))
        records.append(HashesExtended(req=req, hash_ids=[]))
    return records


def frame(frame_type: bytes, body: bytes) -> bytes:
    payload = frame_type + body
    return struct.pack("<II", len(payload), zlib.crc32(payload)) + payload


def write_frames(path: Path, *frames: bytes, major: int = FORMAT_MAJOR) -> Path:
    path.write_bytes(struct.pack("<8sHH", MAGIC, major, FORMAT_MINOR) + b"".join(frames))
    return path


def header_frame(trace_header: TraceHeader | dict) -> bytes:
    return frame(b"H", msgspec.msgpack.encode(trace_header))


def closing_frame(num_records: int = 0) -> bytes:
    return frame(b"C", msgspec.msgpack.encode(TraceClosed(num_records=num_records,
                                                          num_dropped=0, ended_ns=0)))


def batch_frame(records: list) -> bytes:
    """A B (columns) batch of ``records``, as the writer encodes it."""
    return frame(b"B", encode_batch(records)[0])


def rows_frame(rows: list) -> bytes:
    """An R (rows) batch: each row ``[tag, field values...]``, encoded as msgpack as is."""
    return frame(b"R", msgspec.msgpack.encode(rows))


def column_batch_frame(tag: str, columns: list, count: int) -> bytes:
    """A B batch of ``count`` records of kind ``tag`` with hand-made ``columns`` (each as
    traceio's column codec: ("i", code, bytes), ("l", lengths, values) or ("o", msgpack))."""
    return frame(b"B", msgspec.msgpack.encode([[tag], bytes(count), [columns]]))


def object_column(values: list) -> tuple:
    return ("o", msgspec.msgpack.encode(values))


def int_column(values: list[int]) -> tuple:
    from array import array

    return ("i", "q", array("q", values).tobytes())


def trace(path: Path, records: list, trace_header: TraceHeader | None = None) -> Path:
    """A well-formed trace (B batches) of ``records``."""
    return write_frames(path, header_frame(trace_header or header()), batch_frame(records),
                        closing_frame(len(records)))


def unknown_enum_records() -> list:
    """Effects whose enum values a newer writer added (removal reason 9, store kind 7)."""
    return [BlockStored(block_id=3, hash_id=1, group=0, num_tokens=16, kind=StoreKind.FULL,
                        req=0),
            BlockRemoved(block_id=3, hash_id=1, group=0, num_tokens=16, reason=9),
            BlockStored(block_id=4, hash_id=2, group=0, num_tokens=16, kind=7, req=0),
            BlockRemoved(block_id=4, hash_id=2, group=0, num_tokens=16, reason=0)]


def impossible_configs() -> dict[str, EngineConfig]:
    """Engine configs that decode (every field has its type) but that no engine can have."""
    replace = msgspec.structs.replace
    attention, mamba = SMALL_CONFIG.kv_cache_groups
    return {
        "no groups": replace(SMALL_CONFIG, kv_cache_groups=[]),
        "zero hash unit": replace(SMALL_CONFIG, hash_block_size=0),
        "negative hash unit": replace(SMALL_CONFIG, hash_block_size=-16),
        "zero block size": replace(SMALL_CONFIG, kv_cache_groups=[
            replace(attention, block_size=0), mamba]),
        "unknown group kind": replace(SMALL_CONFIG, kv_cache_groups=[
            replace(attention, kind="sliding_window"), mamba]),
        "negative pool": replace(SMALL_CONFIG, num_gpu_blocks=-5),
        "huge pool": replace(SMALL_CONFIG, num_gpu_blocks=2**62),
        "negative retention": replace(SMALL_CONFIG, retention_interval=-64),
        "odd retention": replace(SMALL_CONFIG, retention_interval=70),
        "negative budget": replace(SMALL_CONFIG, max_num_batched_tokens=-1),
        "too many groups": replace(SMALL_CONFIG,
                                   kv_cache_groups=SMALL_CONFIG.kv_cache_groups * 200),
    }


def ill_typed_traces(directory: Path) -> dict[str, Path]:
    """Traces whose frames are sound and whose records are not: values of the wrong type in
    columns and rows, too few columns, a header of the wrong shape."""
    empty_list = ("l", int_column([0]), int_column([]))
    arrived = [int_column([0]), int_column([160]), empty_list, int_column([3])]
    cases = {
        "str in an int column": [object_column(["zero"]), *arrived[1:]],
        "int in a list column": [*arrived[:2], int_column([5]), arrived[3]],
        "list in an int column": [arrived[0], empty_list, *arrived[2:]],
        "int where a string goes": [*arrived, int_column([0]), int_column([0]), int_column([7])],
        "too few columns": arrived[:2],
    }
    paths = {name: write_frames(directory / f"{name.replace(' ', '_')}.kvtrace",
                                header_frame(header()),
                                column_batch_frame("request_arrived", columns, 1),
                                closing_frame(1))
             for name, columns in cases.items()}
    paths["str in a row"] = write_frames(
        directory / "row.kvtrace", header_frame(header()),
        rows_frame([["request_arrived", "zero", 160, [], 3]]), closing_frame(1))
    paths["a header of the wrong shape"] = write_frames(
        directory / "header.kvtrace", header_frame({"kvtrace_version": 1, "created_ns": "x",
                                                   "source": "synth"}), closing_frame(0))
    return paths


# --- crafted databases and outputs (issue "Hardening, round three") -------------------------

# A string that drives a terminal: sets the window title, then a hyperlink; and a bidi override.
TERMINAL_ESCAPE = "\x1b]0;pwned\x07\x1b]8;;http://x\x1b\\\u202e"


# A variant and a file name that forge a line: a heading, a table row, HTML, code and a link.
MARKUP_INJECTION = "\n# H1 | forged | row |\n<svg onload=alert(1)>`x` *y* [l](http://x) &amp;"
FORGED_FILE_NAME = "x<svg onload=alert(1)>|\n# H1.kvtrace"


def crafted_databases(directory: Path, sound: Path, secret: Path) -> dict[str, Path]:
    """Copies of the sound forensics database ``sound`` changed as an attacker would: table and
    column names that are SQL, a view that reads ``secret``, ``runs.path`` a FIFO or NULL,
    schema versions newer, older and negative; strings that drive a terminal or forge
    Markdown."""
    import shutil

    import duckdb

    def crafted(name: str, *statements: str) -> Path:
        path = directory / f"{name}.duckdb"
        shutil.copy(sound, path)
        with duckdb.connect(str(path)) as connection:
            for statement in statements:
                connection.execute(statement)
        return path

    quoted_secret = "'" + str(secret).replace("'", "''") + "'"
    pwned = "'" + str(directory / "pwned").replace("'", "''") + "'"
    fifo = directory / "runs.fifo"
    if not fifo.exists():
        os.mkfifo(fifo)
    return {
        "table named as SQL": crafted(
            "table-sql", f'CREATE TABLE "x""; COPY runs TO {pwned.replace(chr(34), chr(34) * 2)} '
            f'(FORMAT CSV); SELECT count(*) FROM ""x" (a INTEGER)'),
        "columns named as SQL": crafted(
            "column-sql", 'CREATE TABLE odd ("run" INTEGER, "a""b; DROP TABLE runs; --" '
            'VARCHAR, "' + TERMINAL_ESCAPE.replace('"', '""') + '" INTEGER)',
            "INSERT INTO odd VALUES (0, 'x', 1)"),
        "partition value as a path": crafted(
            "partition-path", "CREATE TABLE hop (run VARCHAR, a INTEGER)",
            "INSERT INTO hop VALUES ('../../../../../../tmp/kvtrace-hop', 1)"),
        "a view that reads a file": crafted(
            "view-reads", "DROP VIEW lookups",
            f"CREATE VIEW lookups AS SELECT * FROM read_text({quoted_secret})"),
        "runs.path a FIFO": crafted(
            "runs-fifo", f"UPDATE runs SET path = '{fifo}'"),
        "runs.path NULL": crafted("runs-null", "UPDATE runs SET path = NULL"),
        "strings that drive a terminal": crafted("escapes",
                                                 *_variants_set_to(sound, TERMINAL_ESCAPE)),
        "strings that forge markup": crafted(
            "markup", *_variants_set_to(sound, MARKUP_INJECTION),
            "UPDATE runs SET variant = variant || run",  # still distinct: the runs pair
            *_source_names_set_to(directory / FORGED_FILE_NAME)),
        "a newer schema": crafted(
            "schema-99", "UPDATE kvtrace_meta SET value = '99' WHERE key = 'db_schema_version'"),
        "schema v1": crafted(
            "schema-1", "UPDATE kvtrace_meta SET value = '1' WHERE key = 'db_schema_version'"),
        "a negative schema": crafted(
            "schema-neg", "UPDATE kvtrace_meta SET value = '-2' WHERE key = 'db_schema_version'"),
    }


def _variants_set_to(db: Path, value: str) -> list[str]:
    """Statements that make every ``variant`` column of ``db`` read ``value``: a stored one
    (``runs``, ``sweep``) updated, a computed one (schema v4: the views in front of the tables
    stored in kvtrace_rows) defined anew."""
    import duckdb

    with duckdb.connect(str(db), read_only=True) as connection:
        tables = connection.execute(
            "SELECT table_name FROM duckdb_columns() WHERE column_name = 'variant' AND table_name "
            "IN (SELECT table_name FROM duckdb_tables() WHERE schema_name = 'main')").fetchall()
        views = connection.execute(
            "SELECT view_name, sql FROM duckdb_views() WHERE view_name IN (SELECT table_name "
            "FROM duckdb_tables() WHERE schema_name = 'kvtrace_rows')").fetchall()
    return ([f"UPDATE {table} SET variant = '{value}'" for (table,) in tables]
            + [f"CREATE OR REPLACE VIEW {view} AS SELECT * REPLACE ('{value}' AS variant) "
               f"FROM ({sql.split(' AS ', 1)[1].rstrip().rstrip(';')})" for view, sql in views])


def _source_names_set_to(path: Path) -> list[str]:
    """Statements that make every run's trace, and the source a replay names, ``path``."""
    import json

    def literal(text: str) -> str:
        return "'" + text.replace("'", "''") + "'"

    patch = literal(json.dumps({"replay": {"source_path": str(path)}}))
    return [f"UPDATE runs SET path = {literal(str(path))}",
            f"UPDATE runs SET header_json = json_merge_patch(header_json, {patch}) "
            "WHERE json_type(header_json, '$.replay') = 'OBJECT'"]


SPECIAL_OUTPUTS = ("character device", "link to a file", "link to standard output", "FIFO",
                   "socket")


def special_output(kind: str, path: Path, victim: Path) -> Path:
    """Something other than a regular file at an output's path: a character device (like
    /dev/null: mknod, root only), a link (to ``victim``, or where /dev/stdout points), a FIFO,
    a socket."""
    import socket
    import stat

    if kind == "character device":
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # what /dev/null is
    elif kind == "link to a file":
        path.symlink_to(victim)
    elif kind == "link to standard output":
        path.symlink_to("/proc/self/fd/1")
    elif kind == "FIFO":
        os.mkfifo(path)
    else:
        with socket.socket(socket.AF_UNIX) as listener:
            listener.bind(str(path))
    return path


def node_kind(path: Path) -> tuple:
    """What sits at ``path``, not followed: its type, device numbers and link target."""
    import stat

    info = path.lstat()
    return (stat.S_IFMT(info.st_mode), info.st_rdev, info.st_ino,
            os.readlink(path) if path.is_symlink() else None)


def ring(directory: Path, num_segments: int = 3, session: int = 10**18,
         keyframe_every_ns: int = 10**9) -> Path:
    """A flight recorder's ring directory (0700) as the engine writes one: segments of one
    session, each a whole trace opening with a keyframe (an empty pool's), then steps."""
    from kvtrace.events import SnapshotEnded, SnapshotStarted, StepStarted
    from kvtrace.ring import segment_name

    directory.mkdir(mode=0o700)
    for seq in range(1, num_segments + 1):
        start_ns = (seq - 1) * keyframe_every_ns
        records = [SnapshotStarted(start_ns, 0, 0, 0), SnapshotEnded(1000),
                   *(StepStarted(10 * seq + step, start_ns + step * 10**8) for step in range(3))]
        trace(directory / segment_name(session, seq), records,
              header(created_ns=session, source="capture"))
    return directory
