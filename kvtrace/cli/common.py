"""Helpers shared by command modules."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import re
import sys
import time
from collections import Counter
from collections.abc import Iterator

import click

from kvtrace.errors import KvtraceError, TraceTruncatedError
from kvtrace.files import write_atomically  # noqa: F401  (the commands' one way to write a file)
from kvtrace.traceio import TraceReader


# What a terminal acts on rather than shows: C0 controls but newline and tab, DEL, C1 controls
# (ESC and CSI start escape sequences: a title, a hyperlink, a rewritten screen), and the
# bidirectional overrides that make text read other than it is.
_TERMINAL_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e"
                                r"\u2066-\u2069]")


# vLLM's scheduler class a run uses; the source's (its header's engine config) by default.
async_scheduling_option = click.option(
    "--async-scheduling/--sync-scheduling", "async_scheduling", default=None,
    help="Schedule as vLLM's AsyncScheduler (a step scheduled before the previous one's "
         "tokens are known; vLLM's default on GPUs) or its synchronous Scheduler (default: "
         "as the source's engine did).")


# An MTP/EAGLE engine's choice of vLLM 0.33's lookahead block hashes or the dropped last block;
# the source's by default.
lookahead_block_hashes_option = click.option(
    "--lookahead-block-hashes/--no-lookahead-block-hashes", "lookahead_block_hashes",
    default=None,
    help="With MTP drafting: hash each block with the token after it (vLLM 0.33's lookahead "
         "block hashes, its default) or drop the last matched block of every hit instead "
         "(disable_lookahead_block_hashes; EAGLE's drop, as releases before 0.33 do). "
         "Default: as the source's engine did.")


def terminal_safe(text: str) -> str:
    """``text`` with every terminal control shown as its escape (``\\x1b``, ``\\u202e``): a
    trace's header or a database's strings are input, and must not drive root's terminal."""
    return _TERMINAL_CONTROLS.sub(lambda match: ascii(match.group())[1:-1], text)


def wall_clock(wall_ns: int) -> str:
    """A wall-clock time (ns since the epoch) in this machine's time zone, to the second, as
    the commands' lines show it (when a ring's dump starts, when a trigger fired)."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(wall_ns / 1e9))


def raise_if_truncated(reader: TraceReader) -> None:
    """After a full read: a cut-off trace is an error, raised once its records were used."""
    if reader.truncated:
        raise TraceTruncatedError(
            f"{reader.path} is truncated: {reader.num_records} records recovered, "
            "no closing frame",
            offset=reader.truncated_at,
        )


def unknown_value_warnings(path: str, unknown_values: Counter) -> list[str]:
    """One line per record field holding enum values this kvtrace does not know."""
    by_field: dict[tuple[str, str], Counter] = {}
    for (tag, name, value), count in unknown_values.items():
        by_field.setdefault((tag, name), Counter())[value] = count
    return [f"{path}: {counts.total():,} {tag} record(s) have a {name} this kvtrace does not "
            f"know ({', '.join(f'{value}: {n:,}' for value, n in sorted(counts.items()))}), "
            "written by a newer kvtrace; kept as numbers"
            for (tag, name), counts in sorted(by_field.items())]


def warn_of_unknown_values(reader: TraceReader) -> None:
    for line in unknown_value_warnings(reader.path, reader.unknown_values):
        click.echo(f"kvtrace: warning: {line}", err=True)


@contextlib.contextmanager
def stdout_failures() -> Iterator[None]:
    """A write to standard output that fails (a full disk, /dev/full) as one error; what is
    still buffered is dropped, so that the exit does not fail on it again. A closed pipe is
    left to click (a reader such as `head` that stopped early is not an error)."""
    try:
        yield
        sys.stdout.flush()
    except OSError as error:
        if error.errno == errno.EPIPE:
            raise
        with contextlib.suppress(OSError, ValueError, io.UnsupportedOperation):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise KvtraceError(f"cannot write to standard output: {error.strerror or error}",
                           "Check the free space where the output goes.") from None
