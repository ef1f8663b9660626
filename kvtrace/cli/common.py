"""Helpers shared by command modules."""

from __future__ import annotations

import os

from kvtrace.errors import KvtraceError, TraceTruncatedError
from kvtrace.traceio import TraceReader


def raise_if_truncated(reader: TraceReader) -> None:
    """After a full read: a cut-off trace is an error, raised once its records were used."""
    if reader.truncated:
        raise TraceTruncatedError(
            f"{reader.path} is truncated: {reader.num_records} records recovered, "
            "no closing frame",
            offset=reader.truncated_at,
        )


def write_atomically(path: str, data: bytes) -> None:
    """Write a small output file so that it appears whole or not at all."""
    try:
        with open(f"{path}.partial", "wb") as file:
            file.write(data)
        os.replace(f"{path}.partial", path)
    except OSError as error:
        raise KvtraceError(f"cannot write {path}: {error.strerror}",
                           "Check that its directory exists and is writable.") from None
