"""What a capture tells a rescheduled replay beyond its arrivals: how far each request got, and
how long the engine's steps took.

A live request stops at its end of sequence, not at ``max_tokens``, and a capture ends while
requests still run: ``CaptureEnds`` reads how many tokens each request held after its last
chunk, so that a rescheduled replay decodes each as far as the capture saw it and cuts those
that outlived the window where the window ended.

A capture's arrival times are the engine's clock, so the replay's steps must last what the
engine's did, or arrivals meet a different queue. ``StepClock`` puts each arrival on the
engine's own steps instead (a live engine's step times jitter, so no fitted step time puts
every arrival on the right step): a request joins the queue before the step the engine first
looked it up in, unless the steps just before that one were blocked (an admission failed in
them: the request may have waited behind it), back to the first step that started after its
arrival stamp. The stamp alone is no better: the front end stamps the arrival before the
request reaches the engine core, which takes new requests in between two steps, one to a few
(short) steps later on a real ``vllm serve``. ``StepCosts`` fits the engine's step time (a fixed part plus a part per scheduled
token) to the capture's own steps, busy ones only, for what the step count cannot say.

Both are fed a trace's batches and read its columns with numpy, never record by record.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from kvtrace.events import (BlocksCached, ComputedBlocksFound, RequestArrived,
                            RequestPreempted, SlotsAllocated, StepStarted)
from kvtrace.replay.snapshot_checks import StatePlacement
from kvtrace.traceio import RecordBatch


def allocation_columns(columns: list) -> list[np.ndarray]:
    """A batch's ``SlotsAllocated`` columns up to ``success``, as int64 arrays."""
    return [np.asarray(column, dtype=np.int64) for column in columns[:8]]


def reaches_last_token(num_computed, num_new_computed, num_new, num_tokens):
    """Whether a successful ``SlotsAllocated`` scheduled its request up to its last known
    token, so that the step samples one more (ints, or numpy columns element by element)."""
    return num_computed + num_new_computed + num_new >= num_tokens


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
         success) = allocation_columns(columns)
        ok = (success != 0) & (req >= 0)
        req, num_tokens = req[ok], num_tokens[ok]
        after = num_tokens + reaches_last_token(num_computed[ok], num_new_computed[ok],
                                                num_new[ok], num_tokens)
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


_STEP_RECORDS = (SlotsAllocated, BlocksCached, RequestPreempted)


class DraftAcceptance:
    """How often a drafting engine's verifier accepted its drafts, read off the capture: over
    the consecutive decode steps of a request that carried drafts, the tokens a step added
    beyond its sampled one are the drafts it accepted. ``rate`` turns that into the chance of
    accepting each draft in turn (``scheduler.accepted_drafts``' model) that gives as many.

    ``answers`` (kept for an engine that drafts, as the header says: no other is asked) holds
    the verifier's answer of each step by (request, its tokens when the step was scheduled),
    where the scheduler model asks for it: each step whose chunk reached the request's last
    token (a successful ``SlotsAllocated``) is paired, in order, with the next output the
    scheduler cached for it (``BlocksCached``, in ``update_from_output``); the output added
    1 + the accepted drafts to what the request held before it. A preemption makes the
    outputs of the request's steps in flight stale: vLLM appends them but caches nothing, so
    what they added shows only when the request is admitted again."""

    def __init__(self, drafting: bool = True) -> None:
        self._rows: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # req, num_tokens, new
        self.drafting = drafting
        self.answers: dict[tuple[int, int], int] = {}
        self._scheduled: dict[int, deque[int]] = {}  # req -> its sampling steps in flight
        self._held: dict[int, int] = {}  # req -> its tokens after its last output
        self._stale: dict[int, list[int]] = {}  # req -> its steps a preemption made stale

    def add_batch(self, batch: RecordBatch) -> None:
        if self.drafting:
            for row in batch.field_rows(_STEP_RECORDS):
                self._pair(row)
        if SlotsAllocated not in batch.types:
            return
        req, num_new, num_computed, _, _, _, num_tokens, success = allocation_columns(
            batch.columns[batch.types.index(SlotsAllocated)])
        drafting = (success != 0) & (num_new > 1) & (num_computed + 1 >= num_tokens)
        if drafting.any():
            self._rows.append((req[drafting], num_tokens[drafting], num_new[drafting]))

    def _pair(self, row: tuple) -> None:
        kind, req = row[0], row[1]
        if kind is SlotsAllocated:
            _, _, num_new, num_computed, num_new_computed, _, _, num_tokens, success = row[:9]
            if not success:
                return
            stale = self._stale.pop(req, None)
            if stale:  # resumed: the stale outputs were appended meanwhile, uncached
                extra = num_tokens - max(self._held.get(req, 0), stale[0]) - len(stale)
                for scheduled_at in stale:  # only their sum matters: none counts or caches
                    self.answers[(req, scheduled_at)] = max(extra, 0)
                    extra = 0
                self._held[req] = num_tokens
            if reaches_last_token(num_computed, num_new_computed, num_new, num_tokens):
                self._scheduled.setdefault(req, deque()).append(num_tokens)
        elif kind is BlocksCached:
            num_tokens = row[4]
            scheduled = self._scheduled.get(req)
            if scheduled:
                scheduled_at = scheduled.popleft()
                before = max(self._held.get(req, 0), scheduled_at)
                if num_tokens > before:
                    self.answers[(req, scheduled_at)] = num_tokens - before - 1
            self._held[req] = num_tokens
        else:  # RequestPreempted: the outputs of its steps in flight arrive stale
            scheduled = self._scheduled.pop(req, None)
            if scheduled:
                self._stale[req] = list(scheduled)

    def rate(self) -> float | None:
        """The per-draft acceptance, or None where no request made two drafting steps."""
        if not self._rows:
            return None
        req, num_tokens, num_new = (np.concatenate(part) for part in zip(*self._rows))
        order = np.argsort(req, kind="stable")  # each request's steps, in file order
        req, num_tokens, num_new = req[order], num_tokens[order], num_new[order]
        same = req[1:] == req[:-1]
        if not same.any():
            return None
        accepted = float(np.mean(np.diff(num_tokens)[same])) - 1
        num_drafts = max(1, round(float(np.mean(num_new[:-1][same])) - 1))
        # Accepting each draft in turn with p accepts p + p^2 + ... + p^d on average.
        low, high = 0.0, 1.0
        for _ in range(50):
            middle = (low + high) / 2
            if sum(middle ** i for i in range(1, num_drafts + 1)) < accepted:
                low = middle
            else:
                high = middle
        return round((low + high) / 2, 4)


@dataclass(frozen=True)
class StepClock:
    """A capture's steps as a clock (see the module docstring). ``step_of(ts_ns)`` is the
    number of captured steps that started before ``ts_ns``: the first step that may take in a
    request stamped then."""

    starts: np.ndarray  # StepStarted.ts_ns, in order
    first_lookups: dict[int, int]  # req -> the step of its first lookup (RequestArrived)
    blocked: frozenset[int]  # the steps in which an admission failed

    def step_of(self, ts_ns: int) -> int:
        return int(np.searchsorted(self.starts, ts_ns, side="left"))

    def join_step(self, req: int, arrival_ns: int) -> int:
        """The step before which request ``req``, stamped at ``arrival_ns``, joins the queue."""
        after_stamp = self.step_of(arrival_ns)
        step = self.first_lookups.get(req, after_stamp)
        while step > after_stamp and step - 1 in self.blocked:
            step -= 1
        return step


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
        self._arrived: list[tuple[np.ndarray, np.ndarray]] = []  # RequestArrived: req, step
        self._blocked: list[np.ndarray] = []  # the steps of failed admissions
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
        if RequestArrived in types:
            index = types.index(RequestArrived)
            self._arrived.append((np.asarray(batch.columns[index][0], dtype=np.int64),
                                  step_of[kinds == index]))
        if SlotsAllocated in types:
            index = types.index(SlotsAllocated)
            columns = batch.columns[index]
            success = np.asarray(columns[7], dtype=np.int64) != 0
            self._steps.append(step_of[kinds == index][success])
            self._tokens.append(np.asarray(columns[1], dtype=np.int64)[success])
            if ComputedBlocksFound in types:  # an admission: the allocation after a lookup
                failed = np.flatnonzero(kinds == index)[~success]
                failed = failed[failed > 0]
                admissions = failed[kinds[failed - 1] == types.index(ComputedBlocksFound)]
                self._blocked.append(step_of[admissions])

    def clock(self) -> StepClock | None:
        """The captured steps as a clock, or None when the capture holds no step."""
        if not self._num_steps:
            return None
        first_lookups: dict[int, int] = {}
        for reqs, steps in self._arrived:
            for req, step in zip(reqs.tolist(), steps.tolist()):
                first_lookups.setdefault(req, step)  # a resumed request is reported again
        blocked = frozenset(np.concatenate(self._blocked).tolist()) if self._blocked else frozenset()
        return StepClock(np.concatenate(self._starts), first_lookups, blocked)

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
