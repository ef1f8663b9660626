"""What a capture tells a rescheduled replay beyond its arrivals: how far each request got, and
how long the engine's steps took.

A live request stops at its end of sequence, not at ``max_tokens``, and a capture ends while
requests still run: ``CaptureEnds`` reads how many tokens each request held after its last
chunk, so that a rescheduled replay decodes each as far as the capture saw it and cuts those
that outlived the window where the window ended.

A capture's arrival times are the engine's clock, so the replay's steps must last what the
engine's did, or arrivals meet a different queue: ``StepCosts`` fits the engine's step time
(a fixed part plus a part per scheduled token) to the capture's own steps, busy ones only.

Both are fed a trace's batches and read its columns with numpy, never record by record.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtrace.events import SlotsAllocated, StepStarted
from kvtrace.replay.snapshot_checks import StatePlacement
from kvtrace.traceio import RecordBatch


class CaptureEnds:
    """How far each request of a capture got: the tokens it held after its last successful
    chunk (``SlotsAllocated``; a chunk that reaches the last token samples one more).

    Reading every batch of a source once, it also refuses a start snapshot that does not open
    the trace (``StatePlacement``), before any backend could start from it."""

    def __init__(self) -> None:
        self._num_tokens = np.zeros(0, dtype=np.int64)  # by req
        self._placement = StatePlacement()

    def add_batch(self, batch: RecordBatch) -> None:
        self._placement.add_batch(batch)
        for record_type, columns in zip(batch.types, batch.columns):
            if record_type is SlotsAllocated:
                self._add_allocations(columns)

    def _add_allocations(self, columns: list) -> None:
        (req, num_new, num_computed, num_new_computed, _, _, num_tokens,
         success) = (np.asarray(column, dtype=np.int64) for column in columns[:8])
        ok = (success != 0) & (req >= 0)
        req, num_tokens = req[ok], num_tokens[ok]
        after = num_tokens + (num_computed[ok] + num_new_computed[ok] + num_new[ok] >= num_tokens)
        if not len(req):
            return
        if req.max() >= len(self._num_tokens):
            grown = np.zeros(int(req.max()) + 1, dtype=np.int64)
            grown[:len(self._num_tokens)] = self._num_tokens
            self._num_tokens = grown
        np.maximum.at(self._num_tokens, req, after)

    def decode_length(self, req: int, prompt_len: int, tokens_before: int = 0) -> int | None:
        """The outputs request ``req`` had when it finished, or when the capture ended (a
        request that outlived the window is cut there); None when no chunk of it was seen and
        it held nothing before (``tokens_before``: its tokens at the snapshot)."""
        seen = int(self._num_tokens[req]) if 0 <= req < len(self._num_tokens) else 0
        num_tokens = max(seen, tokens_before)
        if not num_tokens:
            return None
        return max(1, num_tokens - prompt_len)


@dataclass(frozen=True)
class StepFit:
    """A step's time on the engine's clock: ``overhead_ns + ns_per_token * scheduled tokens``,
    fitted to ``num_steps`` steps (``spread_ns``: the median distance of a step from it)."""

    overhead_ns: int
    ns_per_token: int
    num_steps: int
    spread_ns: int


class StepCosts:
    """Collects each captured step's start time and scheduled tokens; ``fit`` then gives the
    engine's step costs. A step's time is the gap to the next step's start, so an engine that
    idled (waiting for requests) shows a long gap: those gaps are trimmed as outliers."""

    MIN_STEPS = 20  # fewer busy steps than this fit nothing

    def __init__(self) -> None:
        self._starts: list[np.ndarray] = []  # StepStarted.ts_ns, in order
        self._steps: list[np.ndarray] = []  # the step of each successful allocation
        self._tokens: list[np.ndarray] = []  # and its tokens
        self._num_steps = 0

    def add_batch(self, batch: RecordBatch) -> None:
        types = batch.types
        kinds = np.frombuffer(batch.kinds, dtype=np.uint8)
        step_of = np.full(len(kinds), self._num_steps - 1, dtype=np.int64)
        if StepStarted in types:
            is_step = kinds == types.index(StepStarted)
            step_of += np.cumsum(is_step)
            self._starts.append(np.asarray(batch.columns[types.index(StepStarted)][1],
                                           dtype=np.int64))
            self._num_steps += int(is_step.sum())
        if SlotsAllocated in types:
            index = types.index(SlotsAllocated)
            columns = batch.columns[index]
            success = np.asarray(columns[7], dtype=np.int64) != 0
            self._steps.append(step_of[kinds == index][success])
            self._tokens.append(np.asarray(columns[1], dtype=np.int64)[success])

    def fit(self) -> StepFit | None:
        """The engine's step costs, or None when too few busy steps were captured."""
        if self._num_steps <= self.MIN_STEPS:
            return None
        starts = np.concatenate(self._starts)
        steps = np.concatenate(self._steps) if self._steps else np.zeros(0, dtype=np.int64)
        tokens = np.concatenate(self._tokens) if self._tokens else np.zeros(0, dtype=np.int64)
        counted = steps >= 0  # allocations before the first step (none in a capture)
        per_step = np.bincount(steps[counted], weights=tokens[counted],
                               minlength=self._num_steps)[:-1]
        durations = np.diff(starts).astype(np.float64)
        busy = per_step > 0
        durations, per_step = durations[busy], per_step[busy]
        keep = np.ones(len(durations), dtype=bool)
        for _ in range(3):  # least squares, then again without the outliers (idle gaps)
            if keep.sum() < self.MIN_STEPS:
                return None
            design = np.column_stack([np.ones(int(keep.sum())), per_step[keep]])
            (overhead, per_token), *_ = np.linalg.lstsq(design, durations[keep], rcond=None)
            residuals = np.abs(durations - overhead - per_token * per_step)
            spread = float(np.median(residuals[keep]))
            keep = residuals <= 3 * spread + 1
        return StepFit(max(0, round(overhead)), max(0, round(per_token)), int(keep.sum()),
                       round(spread))
