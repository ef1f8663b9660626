"""The trace file's framing, which the writer writes and the reader checks: the preamble
(magic and format version), then frames of ``u32 payload_len  u32 crc32(payload)  payload``, the
payload's first byte naming what it holds (``kvtrace.traceio``'s docstring has the layout)."""

from __future__ import annotations

import struct
import zlib

from kvtrace.events import FORMAT_MAJOR, FORMAT_MINOR

MAGIC = b"KVTRACE\0"
PREAMBLE = struct.Struct("<8sHH")  # magic, format major, format minor
FRAME_HEAD = struct.Struct("<II")  # payload length, its crc32
FRAME_HEADER, FRAME_BATCH, FRAME_ROWS, FRAME_CLOSED = b"H", b"B", b"R", b"C"
# A frame longer than this is damage, not data: batches are a few hundred KiB.
MAX_FRAME_BYTES = 1 << 30


def preamble() -> bytes:
    """The bytes a trace starts with: the magic and the format version this kvtrace writes."""
    return PREAMBLE.pack(MAGIC, FORMAT_MAJOR, FORMAT_MINOR)


def frame_head(payload: bytes) -> bytes:
    """What goes before a frame's payload: its length and checksum."""
    return FRAME_HEAD.pack(len(payload), zlib.crc32(payload))
