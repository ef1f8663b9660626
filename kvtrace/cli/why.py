"""``kvtrace why``: why one request's prefix lookups missed, in plain sentences."""

from __future__ import annotations

import os

import click

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
    from kvtrace.analysis.explain import describe
    from kvtrace.cli.common import terminal_safe
    from kvtrace.errors import KvtraceError

    paths = _traces(source, set(variants))
    wanted: int | str = int(request) if request.isascii() and request.isdigit() else request
    sections = []
    for path in paths:
        traced = attribute_trace(path, request=wanted, explain=True)
        if traced.lookups:
            sections.append(describe(traced.path, traced.header, traced.lookups,
                                     incomplete=traced.truncated or traced.dropped_events > 0))
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
    from kvtrace.analysis.database import run_labels
    from kvtrace.analysis.trace_paths import trace_paths
    from kvtrace.errors import KvtraceError
    from kvtrace.traceio import TraceReader

    from kvtrace.analysis.database import is_database_file

    paths = (_database_traces(source) if is_database_file(source, "kvtrace why reads it more "
                                                                  "than once")
             else trace_paths([source]))
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
