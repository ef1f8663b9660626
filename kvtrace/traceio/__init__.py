"""Reading and writing kvtrace trace files.

Layout (all integers little-endian)::

    b"KVTRACE\\0"  u16 format_major  u16 format_minor
    frame*        u32 payload_len  u32 crc32(payload)  payload
    payload       one type byte, then msgpack: H = TraceHeader, B = record batch (columns),
                  R = record batch (rows, format 1.1), C = TraceClosed

The first frame is the header; a cleanly closed trace ends with the closing frame. Records travel
in batches stored column by column (ints at the narrowest fixed width that holds them), because
bulk analysis wants columns and fixed-width columns cost a fraction of per-record msgpack to
write, read and turn into Arrow (reference/environment-notes.md section 4). A batch keeps the
exact order of its records in ``kinds`` (one byte per record: an index into its ``tags``).

A capture writes R batches instead: the records as one msgpack array of tagged rows, which
msgspec encodes in C at a few tens of ns per record (columns cost several times more to build,
in Python). The capture hook encodes records itself, in batches of engine steps
(``encode_rows``), and the writer only frames the chunks (``write_encoded_rows``), so the writer
thread holds the engine's interpreter lock as briefly as possible. Readers turn R batches into
the same columns, so nothing downstream sees the difference.

A writer cut off anywhere loses at most its last, incomplete frame: the reader recovers every
complete frame, sets ``truncated`` and never fails on the cut. Bytes that fail their checksum or
do not decode raise ``TraceFormatError`` naming the frame's offset, as do columns whose values
do not have their field's type. Kinds the reader does not know are skipped and counted; frame
types it does not know likewise. Enum values it does not know (a newer writer's) are kept as
plain ints and counted (``unknown_values``); ``events.enum_label`` names them by number.

The package by job: ``frames`` (the preamble and the frame layout), ``batches`` (records to and
from a batch's payload), ``writer`` (``TraceWriter``), ``reader`` (``TraceReader``, which survives
truncation). The names every stage uses are imported from here.
"""

from kvtrace.traceio.batches import ListColumn, RecordBatch, encode_batch, encode_rows
from kvtrace.traceio.frames import MAGIC
from kvtrace.traceio.reader import (
    HeaderCutError,
    TraceReader,
    count_kinds,
    open_trace_file,
    read_records,
)
from kvtrace.traceio.writer import TraceWriter, write_trace

__all__ = ["MAGIC", "HeaderCutError", "ListColumn", "RecordBatch", "TraceReader", "TraceWriter",
           "count_kinds", "encode_batch", "encode_rows", "open_trace_file", "read_records",
           "write_trace"]
