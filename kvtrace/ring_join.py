"""Joining the segments of a ring's session (``kvtrace.ring``) into one stream of records, as
``kvtrace dump`` writes it and ``kvtrace top`` follows it: every segment after the first opens
with a keyframe, a start snapshot of the state the records before it already say, which the
joined stream leaves out.

Both the operator's side (capture/dump.py) and the analysis (analysis/trace_tail.py) read it,
so it sits below both: events and traceio only.
"""

from __future__ import annotations

import dataclasses

from kvtrace.events import SnapshotEnded, SnapshotStarted
from kvtrace.traceio import ListColumn, RecordBatch


class KeyframeSkip:
    """Fed a segment's batches in order (``past``), hands them back less the keyframe that
    opens it (SnapshotStarted to SnapshotEnded, over as many batches as it spans).
    ``start_segment`` before each segment whose keyframe goes; one that opens without a
    keyframe is kept whole, and so is everything until the next ``start_segment``."""

    def __init__(self) -> None:
        self._state: str | None = None  # "start", "inside": skipping a segment's keyframe

    def start_segment(self) -> None:
        self._state = "start"

    @property
    def inside(self) -> bool:
        """A keyframe began and has not ended yet (its segment cut short, or still written)."""
        return self._state == "inside"

    def past(self, batch: RecordBatch) -> RecordBatch | None:
        """``batch`` less the keyframe's records in it; None when it is all keyframe."""
        if self._state is None:
            return batch
        if not batch.kinds:
            return None
        if self._state == "start":
            if batch.types[batch.kinds[0]] is not SnapshotStarted:
                self._state = None  # a segment that opens without one
                return batch
            self._state = "inside"
        ends = [index for index, kind in enumerate(batch.types) if kind is SnapshotEnded]
        if not ends:
            return None
        self._state = None
        return records_from(batch, batch.kinds.index(ends[0]) + 1)


def records_from(batch: RecordBatch, start: int) -> RecordBatch | None:
    """``batch`` from its record ``start`` on (None: nothing left), its kinds renumbered."""
    head, tail = batch.kinds[:start], batch.kinds[start:]
    if not tail:
        return None
    kept = [index for index in range(len(batch.types)) if tail.count(index)]
    columns = []
    for index in kept:
        skip = head.count(index)
        columns.append([_column_from(column, skip) for column in batch.columns[index]])
    renumber = bytes.maketrans(bytes(kept), bytes(range(len(kept))))
    return dataclasses.replace(
        batch, types=[batch.types[i] for i in kept], tags=[batch.tags[i] for i in kept],
        kinds=tail.translate(renumber), columns=columns, first_seq=batch.first_seq + start)


def _column_from(column, skip: int):
    if isinstance(column, ListColumn):
        return ListColumn(column.lengths[skip:], column.values[sum(column.lengths[:skip]):])
    return column[skip:]
