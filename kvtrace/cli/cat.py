"""``kvtrace cat``: a trace's records as JSON lines."""

from __future__ import annotations

import enum
import functools
import sys
import typing

import click


@click.command("cat")
@click.argument("trace", type=click.Path(dir_okay=False))
@click.option("--kind", "kinds", multiple=True, metavar="KIND",
              help="Only records of this kind (tag, e.g. block_stored); repeatable.")
@click.option("--limit", type=click.IntRange(min=0), default=None, help="Stop after N records.")
@click.option("--header", "show_header", is_flag=True, help="Print the header first.")
def command(trace: str, kinds: tuple[str, ...], limit: int | None, show_header: bool) -> None:
    """Print a trace's records as JSON lines: {"seq", "record": KIND, fields...}.

    Enum fields are printed by name (by number, with a warning, for a value this kvtrace does
    not know). Exits 1 if the trace is truncated, after printing what was recovered.

    \b
    Example:
        kvtrace cat prod.kvtrace --kind block_removed --limit 20
    """
    from kvtrace.cli.common import raise_if_truncated, stdout_failures, warn_of_unknown_values
    from kvtrace.errors import KvtraceError
    from kvtrace.events import TAG_TO_TYPE
    from kvtrace.traceio import TraceReader

    unknown = [k for k in kinds if k not in TAG_TO_TYPE]
    if unknown:
        raise KvtraceError(f"unknown record kind {unknown[0]!r}",
                           hint="Known kinds: " + ", ".join(sorted(TAG_TO_TYPE)))
    wanted = {TAG_TO_TYPE[k] for k in kinds} or None
    reader = TraceReader(trace)
    with reader, stdout_failures():
        complete = _print_records(reader, wanted, limit, show_header)
    warn_of_unknown_values(reader)
    if complete:
        raise_if_truncated(reader)


def _print_records(reader, wanted: set[type] | None, limit: int | None,
                   show_header: bool) -> bool:
    """Print the records as JSON lines; whether the whole trace was read (no --limit stop)."""
    import msgspec

    from kvtrace.events import enum_label

    encoder = msgspec.json.Encoder()
    stdout = sys.stdout
    if show_header:
        stdout.write(encoder.encode({"header": reader.header}).decode() + "\n")
    printed = 0
    for seq, record in enumerate(reader):
        if wanted is not None and type(record) not in wanted:
            continue
        if limit is not None and printed >= limit:
            return False
        row = {"seq": seq, "record": record.__struct_config__.tag}
        enums = enum_fields(type(record))
        for name in record.__struct_fields__:
            value = getattr(record, name)
            row[name] = enum_label(enums[name], value) if name in enums else value
        stdout.write(encoder.encode(row).decode() + "\n")
        printed += 1
    return True


@functools.cache
def enum_fields(record_type: type) -> dict[str, type[enum.Enum]]:
    """The record's enum-typed fields (columns store them as plain ints)."""
    from kvtrace import events

    hints = typing.get_type_hints(record_type, vars(events))
    return {name: hint for name, hint in hints.items()
            if isinstance(hint, type) and issubclass(hint, enum.Enum)}
