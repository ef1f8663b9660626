"""``kvtrace why``: why one request's prefix lookups missed, in plain sentences."""

from __future__ import annotations

import os

import click

DUCKDB_MAGIC_OFFSET, DUCKDB_MAGIC = 8, b"DUCK"


@click.command("why")
@click.argument("source", type=click.Path(exists=True))
@click.option("-r", "--request", "request", required=True, metavar="ID",
              help="The request: its number in the trace (0, 1, ...) or the engine's request id.")
@click.option("--variant", "variants", multiple=True, metavar="NAME",
              help="Only the runs of this variant (repeatable; default: every run in SOURCE).")
def command(source: str, request: str, variants: tuple[str, ...]) -> None:
    """Explain why request ID hit what it hit, lookup by lookup.

    SOURCE is a trace (a replay output or a capture), a `kvtrace replay` output directory, or
    a database made by `kvtrace load` (whose traces must still be where they were loaded
    from). For each admitted lookup (the first admission, then each resumption after a
    preemption): the hit, the ideal (what an unbounded cache under the same schedule would have
    hit), each group's own hit, and every lost range of tokens with its cause - for an
    eviction, when it happened, to make room for which request, and which transient
    checkpoints sat cached behind it. docs/miss-attribution.md defines the causes.

    \b
    Examples:
        kvtrace why runs/ --request 17 --variant unfixed
        kvtrace why prod.duckdb --request chatcmpl-4f1c
    """
    from kvtrace.analysis.attribution import attribute_trace
    from kvtrace.cli.common import terminal_safe
    from kvtrace.errors import KvtraceError

    paths = _traces(source, set(variants))
    wanted: int | str = int(request) if request.isascii() and request.isdigit() else request
    sections = []
    for path in paths:
        traced = attribute_trace(path, request=wanted, explain=True)
        if traced.lookups:
            sections.append(describe(traced))
    if not sections:
        raise KvtraceError(
            f"request {request} has no admitted lookup in {source}"
            + (f" (variant {', '.join(variants)})" if variants else ""),
            "Requests are numbered from 0 in arrival order; `kvtrace sql DB --query "
            "miss_attribution` lists every lookup.")
    click.echo(terminal_safe("\n".join(sections)), nl=False)  # paths and names are input


def _traces(source: str, variants: set[str]) -> list[str]:
    """The trace files SOURCE names (a trace, a replay directory, or a database's runs),
    keeping only ``variants`` when given."""
    from kvtrace.analysis.load import run_labels, trace_paths
    from kvtrace.errors import KvtraceError
    from kvtrace.traceio import TraceReader

    paths = _database_traces(source) if _is_database(source) else trace_paths([source])
    if not variants:
        return paths
    kept = []
    for path in paths:
        with TraceReader(path) as reader:
            if run_labels(reader.header)[0] in variants:
                kept.append(path)
    if not kept:
        raise KvtraceError(f"no run of variant {', '.join(sorted(variants))} in {source}",
                           "Drop --variant to see every run, or name a variant it has.")
    return kept


def _is_database(path: str) -> bool:
    from kvtrace.files import require_regular_file
    from kvtrace.errors import TraceNotFoundError

    if os.path.isdir(path):
        return False
    require_regular_file(path, "kvtrace why reads it more than once")
    try:
        with open(path, "rb") as file:
            head = file.read(DUCKDB_MAGIC_OFFSET + len(DUCKDB_MAGIC))
    except OSError as error:
        raise TraceNotFoundError(f"cannot open {path}: {error.strerror}") from None
    return head[DUCKDB_MAGIC_OFFSET:] == DUCKDB_MAGIC


def _database_traces(db: str) -> list[str]:
    from kvtrace.analysis.database import open_database
    from kvtrace.analysis.queries import execute
    from kvtrace.errors import KvtraceError
    from kvtrace.files import require_regular_file

    connection = open_database(db)
    try:
        rows = execute(connection, "SELECT path FROM runs ORDER BY run").rows
    finally:
        connection.close()
    paths = [path for (path,) in rows]
    if not all(isinstance(path, str) and path for path in paths):
        raise KvtraceError(f"{db} has a run without a trace path (runs.path)",
                           "Pass the trace or the replay directory instead.")
    missing = [path for path in paths if not os.path.exists(path)]
    if missing:
        raise KvtraceError(
            f"{db} was loaded from {missing[0]}, which is no longer there"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""),
            "kvtrace why reads the traces themselves: pass the trace or the replay directory.")
    for path in paths:  # the database's word only: a FIFO there would hang the read
        require_regular_file(path, f"{db} names it as a loaded trace")
    return paths


# --- sentences ------------------------------------------------------------------------------------


def describe(traced) -> str:
    """Every lookup of one trace's request, as text."""
    from kvtrace.analysis.load import run_labels

    header = traced.header
    config = header.config
    variant, backend, _ = run_labels(header)
    groups = ", ".join(f"{_kind(g.kind)} {g.block_size}" for g in config.kv_cache_groups)
    lookups = traced.lookups
    lines = [f"{traced.path}: variant {variant}, backend {backend}; hash unit "
             f"{config.hash_block_size}, block sizes: {groups}"]
    if traced.truncated or traced.dropped_events:
        lines.append("  (the trace is incomplete - truncated, or events were dropped - so the "
                     "causes below are approximate)")
    lines.append(f"request {lookups[0].req}: {len(lookups)} admitted lookup"
                 f"{'s' if len(lookups) != 1 else ''}")
    for lookup in lookups:
        lines += _describe_lookup(lookup, config)
    return "\n".join(lines) + "\n"


def _describe_lookup(lookup, config) -> list[str]:
    from kvtrace.analysis.attribution import DESCRIPTIONS, SHORTFALL_CAUSES

    kind = "first admission" if lookup.lookup == 1 else f"resumption {lookup.lookup - 1}"
    query = "prompt" if lookup.lookup == 1 else "tokens so far"
    lines = [f"lookup {lookup.lookup} ({kind}) at step {lookup.step}: "
             f"{lookup.query_tokens:,} {query} tokens",
             f"  hit {lookup.hit_tokens:,} tokens; ideal {lookup.ideal_tokens:,} (what an "
             f"unbounded cache under the same schedule would have hit)"]
    per_group = []
    if lookup.attention_hit is not None:
        per_group.append(f"full attention alone {lookup.attention_hit:,}")
    if lookup.mamba_hit is not None:
        per_group.append(f"Mamba alone {lookup.mamba_hit:,} (its deepest state below the last "
                         "token)")
    if per_group:
        lines.append(f"  per group (ideal {lookup.ideal_tokens:,} in each): "
                     + "; ".join(per_group))
    if lookup.shared_prefix_boundary:
        lines.append(f"  shared-prefix junction: {lookup.shared_prefix_boundary:,} tokens")
    shortfall = sorted((s for s in lookup.segments if s.cause in SHORTFALL_CAUSES),
                       key=lambda s: s.start)
    beyond = [s for s in lookup.segments if s.cause not in SHORTFALL_CAUSES]
    for title, segments in ((f"missed {lookup.shortfall:,} tokens of the ideal", shortfall),
                            ("beyond the ideal", beyond)):
        if segments:
            lines.append(f"  {title}:")
        for segment in segments:
            lines.append(f"    tokens {segment.start:,}-{segment.end:,} ({segment.tokens:,}"
                         f"{_blocks(segment, config)}): {segment.cause} - "
                         f"{DESCRIPTIONS[segment.cause]}.")
            lines += [f"      {_describe_key(key, config)}" for key in segment.keys]
    return lines


def _blocks(segment, config) -> str:
    attention = [g for g in config.kv_cache_groups if g.kind != "mamba"]
    if not attention:
        return ""
    size = attention[0].block_size
    first, last = segment.start // size, (segment.end - 1) // size
    return f"; block {first}" if first == last else f"; blocks {first}-{last}"


def _describe_key(key, config) -> str:
    from kvtrace.events import RemoveReason, enum_label

    group = config.kv_cache_groups[key.group]
    what = (f"{_kind(group.kind)} {'state' if group.kind == 'mamba' else 'key'} at "
            f"{key.depth_tokens:,} tokens (group {key.group}, hash {key.hash_id})")
    removal = key.removal
    if removal is None:
        return f"{what}: never stored before this lookup."
    if removal.reason != RemoveReason.LRU_REUSE:
        return (f"{what}: removed ({enum_label(RemoveReason, removal.reason)}) from block "
                f"{removal.block_id} at step {removal.step} (seq {removal.seq}).")
    by = f" to make room for request {removal.by_req}" if removal.by_req >= 0 else ""
    sentence = (f"{what}: evicted from block {removal.block_id} at step {removal.step} "
                f"(seq {removal.seq}){by}")
    if not removal.transient_behind:
        return sentence + "; no transient checkpoint sat cached behind it."
    examples = ", ".join(f"request {req}'s at {position:,} tokens (block {block})"
                         for req, position, block in removal.behind)
    count = removal.transient_behind
    return (f"{sentence}, while {count} transient checkpoint{'s' if count != 1 else ''} sat "
            f"cached in the free queue behind it" + (f", e.g. {examples}" if examples else "")
            + ".")


def _kind(kind: str) -> str:
    return "Mamba" if kind == "mamba" else kind.replace("_", " ")
