"""Helpers shared by command modules."""

from __future__ import annotations

from kvtrace.errors import TraceTruncatedError
from kvtrace.traceio import TraceReader


def raise_if_truncated(reader: TraceReader) -> None:
    """After a full read: a cut-off trace is an error, raised once its records were used."""
    if reader.truncated:
        raise TraceTruncatedError(
            f"{reader.path} is truncated: {reader.num_records} records recovered, "
            "no closing frame",
            offset=reader.truncated_at,
        )
