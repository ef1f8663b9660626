"""``kvtrace dump``: write one trace out of a flight recorder's ring."""

from __future__ import annotations

import click

from kvtrace.cli.capture import parse_duration
from kvtrace.cli.common import wall_clock


@click.command("dump")
@click.argument("ring_dir", metavar="DIR", type=click.Path(file_okay=False))
@click.option("--last", metavar="DURATION",
              help="Only the last DURATION (10m): from the last keyframe at or before it. "
                   "Default: all the ring holds.")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              help="Trace file to write (it appears once whole).")
def command(ring_dir: str, last: str | None, output: str) -> None:
    """Write the ring in DIR (`kvtrace capture --ring ... --dir DIR`) as one trace.

    Safe while the ring records: the segment being written is read up to its last whole
    frame. The trace opens with the keyframe of the first segment it holds, so it replays from
    there, in lockstep and in every variant, and loads like any capture. When the ring holds
    segments of an earlier capture (its controller restarted), only the newest capture's are
    dumped, and a line says so.

    \b
    Example:
        kvtrace dump /var/lib/kvtrace/ring --last 10m -o incident.kvtrace
        kvtrace replay incident.kvtrace --variant fixed --variant unfixed -o runs/
    """
    from kvtrace.capture.dump import dump
    from kvtrace.files import check_output_dir

    check_output_dir(output, "-o")
    written = dump(ring_dir, output, last_s=parse_duration(last, "--last"))
    if written.older_sessions:
        click.echo(f"kvtrace: the ring also holds {written.older_sessions} earlier capture(s) "
                   "(its controller restarted); dumped the newest only", err=True)
    first, last_seq = written.keyframes[0].segment.seq, written.keyframes[-1].segment.seq
    click.echo(f"dumped segments {first}-{last_seq}: {written.num_records:,} records, "
               f"{(written.last_ns - written.first_ns) / 1e9:.1f} s from "
               f"{wall_clock(written.first_ns)}, {written.num_dropped:,} dropped -> {output}")
