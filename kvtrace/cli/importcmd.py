"""``kvtrace import``: turn public or in-house request logs into workload traces."""

from __future__ import annotations

import sys

import click

from kvtrace.cli.synth import LazyOptionsCommand, engine_options, engine_shape, report_written


@click.group("import")
def command() -> None:
    """Import a request log as a workload trace that `kvtrace replay` drives.

    \b
    Example:
        kvtrace import mooncake conversation_trace.jsonl -o conversation.kvtrace
    """


@command.command("mooncake", cls=LazyOptionsCommand, make_options=engine_options)
@click.argument("log", type=click.Path(dir_okay=False))
@click.option("--source-block-size", type=click.IntRange(min=1), default=512, show_default=True,
              help="Tokens per hash_ids entry in the log (Mooncake 512, Qwen-Bailian 16).")
@click.option("-o", "--output", type=click.Path(dir_okay=False), required=True,
              help="Workload trace to write (written atomically).")
def mooncake(log: str, source_block_size: int, output: str, **options) -> None:
    """Import a Mooncake `hash_ids` JSONL request log (FAST'25 trace format).

    Each line: {"timestamp": ms, "input_length": N, "output_length": M, "hash_ids": [...]},
    one prefix-block id per source block. Each block id becomes (block / hash unit) unit ids,
    only for full units up to input_length; the same prefix always maps to the same ids.
    Requests are ordered by timestamp. A malformed line stops the import with its line
    number, and no output is written.

    \b
    Example:
        kvtrace import mooncake conversation_trace.jsonl -o conversation.kvtrace
        kvtrace import mooncake trace.jsonl --hash-unit 64 --attention-block-size 64 \\
            --mamba-block-size 256 -o trace.kvtrace
    """
    from kvtrace.files import refuse_overwrite
    from kvtrace.workloads.mooncake import import_mooncake
    from kvtrace.workloads.workload import write_workload

    refuse_overwrite([("-o", output)], [log])
    shape = engine_shape(options)
    workload = import_mooncake(log, shape.hash_block_size, source_block_size)
    header = write_workload(output, workload, shape, cmdline=sys.argv)
    report_written(output, workload, header)
