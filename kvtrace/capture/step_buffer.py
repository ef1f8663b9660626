"""The hand-over of a capture's records from vLLM's scheduler thread to its writer thread; the
native core's twin is ``csrc/step_buffer.c``."""

from __future__ import annotations

import time
from typing import Callable

from kvtrace.events import Record


class StepBuffer:
    """A capture's hand-over of records from vLLM's scheduler thread to the writer thread.

    Called with one engine step's records (a list). They join ``pending``; every
    ``batch_records`` records, or once the oldest has waited ``max_delay_s``, the pending
    records are encoded at once (``encode_rows``, msgspec in C: one call for many steps costs
    far less than one per step) and ``(number of records, chunk)`` goes to ``chunks``, which the
    writer thread drains. Counts are in records; what would exceed ``capacity``, or arrives
    while drops wait for their marker, goes to ``overflow(records)``. Producers count what they
    put in, the writer what it took out: the difference is what the buffer holds, without a
    lock. The native core has the same type (``csrc/step_buffer.c``), used when it is on; there
    each call is one step under the interpreter lock."""

    def __init__(self, encode: Callable[[list[Record]], bytes], capacity: int,
                 overflow: Callable[[list[Record]], None], batch_records: int,
                 max_delay_s: float) -> None:
        self.chunks: list[tuple[int, bytes]] = []
        self.capacity = capacity
        self.num_buffered = self.num_drained = self.num_enqueued = self.unmarked_drops = 0
        self._pending: list[Record] = []
        self._pending_since_ns = 0
        self._encode = encode
        self._overflow = overflow
        self._batch_records = batch_records
        self._max_delay_ns = int(max_delay_s * 1e9)

    def __call__(self, records: list[Record]) -> None:
        num_records = len(records)
        if self.unmarked_drops or self.num_buffered - self.num_drained + num_records > self.capacity:
            self._overflow(records)
            return
        now = time.monotonic_ns()
        if not self._pending:
            self._pending_since_ns = now
        self._pending.extend(records)
        self.num_buffered += num_records
        self.num_enqueued += num_records
        if (len(self._pending) >= self._batch_records
                or now - self._pending_since_ns >= self._max_delay_ns):
            self.flush()

    def flush(self) -> None:
        """Encode the pending records now."""
        if self._pending:
            self.chunks.append((len(self._pending), self._encode(self._pending)))
            self._pending = []
