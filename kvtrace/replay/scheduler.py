"""A model of vLLM 0.33.0's v1 scheduler that drives any ``CacheBackend`` from a workload.

Reschedule replay compares checkpoint variants under *equal scheduling*: the same arrivals go
through the same scheduling rules, and only the cache's answers (hits, failed allocations) may
make the runs diverge. vLLM's own ``Scheduler`` (which ``kvtrace engine`` runs) builds its own
``KVCacheManager``, so it can drive no other backend, and a step of it costs about twice this
model's. ``tests/test_scheduler_vs_vllm.py`` holds the model to it: on the same workload and
cache, both make the same cache calls in the same order.

Reproduced from ``vllm/v1/core/sched/scheduler.py`` (0.33.0), in our own code:

* a step first serves RUNNING requests in order, then admits WAITING ones FCFS;
* one token budget per step (``max_num_batched_tokens``) and at most ``max_num_seqs`` running;
* chunked prefill; ``long_prefill_token_threshold`` caps a chunk, and applies only when more
  than one request is running or waiting;
* ``max_model_len`` caps positions (a request never schedules past ``max_model_len - 1``);
* the Mamba block-aligned split (``_mamba_block_aligned_split``) for ``align``-mode Mamba
  groups: chunk ends on block boundaries, the last cacheable boundary, the prompt's
  hash-aligned tail checkpoint (fine-grained hits) and the shared-prefix junction, with the
  internal-checkpoint exemption; ``scheduling_rules.MambaAlignedSplit``;
* a prefix lookup (``get_computed_blocks``) for every waiting request at the head of the queue,
  each step it is tried; admission asks ``allocate_slots`` for the whole sequence to fit
  (``scheduler_reserve_full_isl``, on by default); a failed admission stops admissions for the
  step;
* a running request whose ``allocate_slots`` fails preempts the last running request (FCFS
  policy), repeatedly, until it fits or has preempted itself; a preempted request is prepended
  to the waiting queue with its computed tokens reset and is recomputed on resume (its output
  tokens are kept, so the resumed prefill covers them); no admissions in a step that preempted;
* a chunk that reaches the request's last known token samples one output token; the request
  finishes (and is freed) when it has ``max_tokens`` outputs or reaches ``max_model_len``;
* async scheduling (``AsyncScheduler`` with the engine core's batch queue, two batches in
  flight): output placeholders, tokens in flight, stale output of a preempted request, each
  step's output taken after the next step is scheduled, ``update_from_output``'s
  ``cache_blocks``;
* speculative decoding: drafts scheduled with the sampled token, an admitted one-token decode
  padded with them, the verifier's answer drawn (``accepted_drafts``), rejected drafts rolled
  back, the next drafts proposed (synchronously) or held by placeholders (async); for a drafter
  with a forward pass of its own (EAGLE, single-module MTP), the lookahead slots every
  allocation reserves, and the Mamba checkpoint positions under lookahead block hashes or
  EAGLE's dropped block (the hashes themselves are the backend's: ``num_hashed_units``).

Not reproduced: priority scheduling, KV connectors and async loads, multi-module MTP's prefill
lookahead (a chunk never ending within it: refused), structured output, encoder inputs and LoRA limits, pipeline
parallelism, the DP / local prefill cadence, stop strings or EOS (a captured request decodes as
far as the capture saw it; a workload's, ``max_tokens``), deferred frees, the adaptive
long-prefill threshold and the opt-in ``enable_mamba_shared_prefix_checkpoint``.

Time is virtual: requests arrive at ``arrival_ns``; a step lasts ``step_overhead_ns`` plus
``ns_per_token`` per scheduled token; an idle engine jumps to the next arrival. This only
orders arrivals against steps; it is not a latency model. A capture's replay counts steps
instead (``SchedulerSettings.step_clock``: its arrivals join on the captured steps).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvtrace.engine_config import SchedulerSettings, check_fits_model_len
from kvtrace.errors import ConfigError
from kvtrace.events import EngineConfig
from kvtrace.replay.arrivals import Arrival, InFlight
from kvtrace.replay.backend import CacheBackend
from kvtrace.replay.scheduling_rules import (
    ASYNC_BATCHES,
    MambaAlignedSplit,
    accepted_drafts,
)


class _Request:
    """A request's scheduling state. ``num_tokens`` (prompt + outputs) is kept as outputs come,
    not derived: every step reads it for every running request."""

    __slots__ = ("spec", "req", "num_computed_tokens", "num_output_tokens", "num_tokens",
                 "shared_prefix_boundary", "num_output_placeholders", "num_in_flight_tokens",
                 "num_stale_output_tokens", "finished", "num_drafts", "is_prefill_chunk")

    def __init__(self, spec: Arrival) -> None:
        self.spec = spec
        self.req = spec.req
        self.num_computed_tokens = 0
        self.num_output_tokens = 0
        self.num_tokens = spec.prompt_len
        self.shared_prefix_boundary = 0
        # vLLM's counters, kept with async scheduling or drafts: the tokens steps in flight
        # will sample, the tokens scheduled in them, those of them a preemption made stale; and
        # whether the request finished while a step of it was still in flight.
        self.num_output_placeholders = 0
        self.num_in_flight_tokens = 0
        self.num_stale_output_tokens = 0
        self.finished = False
        # Speculative decoding: the draft tokens it holds for its next decode step (vLLM's
        # ``spec_token_ids``), and whether its last scheduled chunk left it prefilling.
        self.num_drafts = 0
        self.is_prefill_chunk = True


@dataclass
class SchedulerStats:
    """What the scheduler did, independent of the cache's own records."""

    steps: int = 0
    scheduled_tokens: int = 0
    preemptions: int = 0
    finished: int = 0
    virtual_ns: int = 0


@dataclass
class Scheduler:
    """Runs a workload to completion against ``backend`` (one ``run`` per backend)."""

    backend: CacheBackend
    config: EngineConfig
    settings: SchedulerSettings = field(default_factory=SchedulerSettings)
    stats: SchedulerStats = field(default_factory=SchedulerStats)

    def __post_init__(self) -> None:
        self.split = MambaAlignedSplit.for_config(self.config, self.settings)
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []
        self.clock_ns = 0
        # Async scheduling: the engine core's batch queue (steps scheduled, outputs not yet
        # taken), and whether an output finished a request since the last schedule (vLLM's
        # ``finished_req_ids``: the engine schedules once more to report it).
        self.in_flight: deque[list[tuple[_Request, int, bool, int, int]]] | None = (
            deque() if self.config.async_scheduling else None)
        self.finished_unreported = False
        self.num_speculative_tokens = self.config.num_speculative_tokens
        self.num_lookahead_tokens = self.config.num_lookahead_tokens
        if self.config.num_prefill_lookahead_tokens > 1:
            raise ConfigError(
                "the engine drafts with multi-module MTP (num_prefill_lookahead_tokens "
                f"{self.config.num_prefill_lookahead_tokens}), whose prefill chunking the "
                "rescheduled replay does not reproduce",
                "Verify its capture with --lockstep, which replays the captured calls.")

    def has_requests(self) -> bool:
        """vLLM's ``Scheduler.has_requests``: unfinished requests, or finished ones to report."""
        return bool(self.waiting or self.running or self.finished_unreported)

    def run(self, requests: list[Arrival], on_step: Callable[[int], None] | None = None,
            in_flight: Sequence[InFlight] = (), start_ns: int = 0) -> SchedulerStats:
        """Schedule every request until all have finished; ``on_step(num_finished)`` after each
        step (progress reporting). ``in_flight``: requests already running or waiting at
        ``start_ns`` (the backend holds them: ``CacheBackend.restore``), in their queues' order."""
        pending = deque(sorted(requests, key=lambda r: r.arrival_ns))
        for request in pending:
            check_fits_model_len(self.settings, request.req, request.prompt_len)
        step_in_flight = []
        for held in in_flight:
            request = _Request(held.spec)
            request.num_computed_tokens = held.num_computed_tokens
            request.num_tokens = held.num_tokens
            request.num_output_tokens = held.num_tokens - held.spec.prompt_len
            request.shared_prefix_boundary = held.shared_prefix_boundary
            request.num_output_placeholders = held.num_output_placeholders
            request.num_in_flight_tokens = held.num_in_flight_tokens
            request.num_stale_output_tokens = held.num_stale_output_tokens
            # Decoding: its last step sampled (async: one in flight will), and the drafter
            # proposed its next drafts then.
            request.is_prefill_chunk = not (request.num_output_tokens and (
                request.num_computed_tokens >= request.num_tokens - 1))
            if held.running and not request.is_prefill_chunk:
                request.num_drafts = self.num_speculative_tokens
            (self.running if held.running else self.waiting).append(request)
            if held.num_in_flight_tokens:
                # It samples if it holds a placeholder; a stale share, if it was decoding.
                step_in_flight.append((request, held.num_in_flight_tokens,
                                       held.num_output_placeholders > 0
                                       or (held.num_stale_output_tokens > 0
                                           and request.num_output_tokens > 0), 0, 0))
        if step_in_flight:  # the one step in flight at a step's start (async engines only)
            if self.in_flight is not None:
                self.in_flight.append(step_in_flight)
            else:  # replayed synchronously: its output comes before the first step
                self._update_from_output(step_in_flight)
        self.clock_ns = max(self.clock_ns, start_ns)
        while pending or self.has_requests() or self.in_flight:
            if not self.has_requests() and not self.in_flight:
                self.clock_ns = max(self.clock_ns, pending[0].arrival_ns)
            while pending and pending[0].arrival_ns <= self.clock_ns:
                spec = pending.popleft()
                self.backend.add_request(
                    spec.req, spec.prompt_len, list(spec.hash_ids), spec.max_tokens,
                    None if spec.output_hash_ids is None else list(spec.output_hash_ids))
                self.waiting.append(_Request(spec))
            self.step()
            if on_step is not None:
                on_step(self.stats.finished)
        self.stats.virtual_ns = self.clock_ns
        return self.stats

    # --- one scheduler step ------------------------------------------------------------------

    def step(self) -> None:
        """One engine step. Synchronous: ``schedule()``, then the model output it is answered
        with (``EngineCore.step``). Async (``step_with_batch_queue``, two batches in flight):
        schedule the next step, then take the output of the one before it."""
        in_flight = self.in_flight
        if in_flight is None:
            if not self.num_speculative_tokens:
                self._apply_outputs(self._schedule())
                return
            scheduled = self._schedule()  # drafting: vLLM's counters, its output at once
            self._update_after_schedule(scheduled)
            self._update_from_output(scheduled)
            return
        if self.has_requests():
            scheduled = self._schedule()
            self._update_after_schedule(scheduled)
            in_flight.appendleft(scheduled)
            if len(in_flight) < ASYNC_BATCHES and (scheduled or self.has_requests()):
                return
        if in_flight:
            self._update_from_output(in_flight.pop())

    def _schedule(self) -> list:
        """One ``Scheduler.schedule()``: the requests it scheduled and their tokens."""
        settings = self.settings
        self.backend.new_step(self.stats.steps, self.clock_ns)
        budget = settings.max_num_batched_tokens
        threshold = (settings.long_prefill_token_threshold
                     if len(self.running) + len(self.waiting) > 1 else 0)
        scheduled: list[tuple[_Request, int, int]] = []  # a request at most once a step
        budget, preempted = self._schedule_running(budget, threshold, scheduled)
        if not preempted:
            budget = self._admit_waiting(budget, threshold, scheduled)
        self.backend.end_schedule()
        self.finished_unreported = False
        if not scheduled and not self.running and self.waiting:
            head = self.waiting[0].spec
            raise ConfigError(
                f"the pool of {self.backend.num_gpu_blocks} blocks cannot hold request "
                f"{head.req} ({head.prompt_len} prompt tokens) even with nothing else running",
                hint="Give the replay more blocks with --num-gpu-blocks.",
            )
        num_tokens = settings.max_num_batched_tokens - budget
        self.stats.steps += 1
        self.stats.scheduled_tokens += num_tokens
        if settings.step_clock:
            self.clock_ns += 1
        elif num_tokens:  # a step that schedules nothing (async: outputs awaited) runs nothing
            self.clock_ns += settings.step_overhead_ns + num_tokens * settings.ns_per_token
        return scheduled

    def _chunk(self, request: _Request, start: int, threshold: int, budget: int,
               end: int | None = None) -> int:
        """Tokens to schedule for ``request`` from ``start`` to ``end`` (default: its last
        known token; drafts and placeholders go beyond): threshold, budget, model length, then
        the Mamba split."""
        num_new = (request.num_tokens if end is None else end) - start
        if 0 < threshold < num_new:
            num_new = threshold
        num_new = min(num_new, budget)
        if self.settings.max_model_len:
            num_new = min(num_new, self.settings.max_model_len - start - 1)
        if self.split is not None:
            num_new = self.split.clip(num_new, start, request.spec.prompt_len, request.num_tokens,
                                      request.shared_prefix_boundary)
        return max(num_new, 0)

    def _schedule_running(self, budget: int, threshold: int,
                          scheduled: list[tuple[_Request, int, int]]) -> tuple[int, bool]:
        running = self.running
        allocate_slots = self.backend.allocate_slots
        preempted = False
        index = 0
        while index < len(running) and budget > 0:
            request = running[index]
            start = request.num_computed_tokens
            placeholders = request.num_output_placeholders
            if placeholders and (start + 2 - placeholders
                                 >= request.spec.prompt_len + request.spec.max_tokens):
                index += 1  # async: the step in flight samples its last token
                continue
            end = request.num_tokens + request.num_drafts + placeholders
            if start == end - 1 and (request.num_output_tokens or placeholders):
                # Decoding: one token, which no threshold or split cuts; nor the model length
                # synchronously (a running request finishes on reaching it), but async, a step
                # in flight may have reached it.
                num_new = 1
                if placeholders and self.settings.max_model_len and (
                        start + 1 >= self.settings.max_model_len):
                    index += 1
                    continue
            else:
                num_new = self._chunk(request, start, threshold, budget, end)
                if num_new == 0:
                    index += 1
                    continue
            while not allocate_slots(request.req, num_new,
                                     num_lookahead_tokens=self.num_lookahead_tokens):
                victim = running.pop()  # FCFS: the last running request
                self._preempt(victim)
                preempted = True
                if victim is request:
                    if not running:
                        raise ConfigError(
                            f"the pool of {self.backend.num_gpu_blocks} blocks cannot hold "
                            f"request {request.spec.req} ({request.spec.prompt_len} prompt "
                            f"tokens, {request.spec.max_tokens} output) on its own",
                            hint="Give the replay more blocks with --num-gpu-blocks.",
                        )
                    return budget, preempted
            num_drafts = 0
            if request.num_drafts:  # the drafts this chunk reaches are verified; all go
                num_drafts = min(request.num_drafts,
                                 max(0, start + num_new - request.num_tokens - placeholders))
                request.num_drafts = 0
            scheduled.append((request, num_new, num_drafts))
            budget -= num_new
            index += 1
        return budget, preempted

    def _preempt(self, request: _Request) -> None:
        self.backend.preempt(request.req)
        request.num_computed_tokens = 0
        # Async: the output of its steps in flight arrives stale (kept, counting nothing).
        request.num_stale_output_tokens = request.num_in_flight_tokens
        request.num_output_placeholders = 0
        request.num_drafts = 0
        self.waiting.appendleft(request)
        self.stats.preemptions += 1

    def _admit_waiting(self, budget: int, threshold: int,
                       scheduled: list[tuple[_Request, int, int]]) -> int:
        """Admit waiting requests FCFS while they fit; the budget left."""
        running = scheduled[:]  # the running requests this step scheduled
        while budget > 0 and self.waiting and len(self.running) < self.settings.max_num_seqs:
            request = self.waiting[0]
            num_hit, request.shared_prefix_boundary = self.backend.get_computed_blocks(request.req)
            num_drafts = self._padded_drafts(request, num_hit, running)
            if num_drafts > budget - 1:
                break  # vLLM schedules a padded decode whole or not at all
            num_new = self._chunk(request, num_hit, threshold, budget,
                                  request.num_tokens + num_drafts)
            if num_drafts and num_new != 1 + num_drafts:  # a split cut it: unpadded
                num_new, num_drafts = 1, 0
            if num_new == 0:  # no block-aligned chunk fits the budget: vLLM stops admitting
                break
            if not self.backend.allocate_slots(
                    request.req, num_new, num_new_computed_tokens=num_hit,
                    num_lookahead_tokens=self.num_lookahead_tokens,
                    full_sequence_must_fit=self.settings.reserve_full_sequence):
                break
            self.waiting.popleft()
            self.running.append(request)
            request.num_computed_tokens = num_hit
            scheduled.append((request, num_new, num_drafts))
            budget -= num_new
        return budget

    def _padded_drafts(self, request: _Request, num_hit: int, running: list) -> int:
        """Draft rows vLLM pads an admitted request's one-token decode with, so that the step
        stays uniform (``pad_spec_decode``): a drafting engine's, when no running request
        scheduled this step (``running``) is prefilling and it has room for them."""
        num_drafts = self.num_speculative_tokens
        limit = self.settings.max_model_len
        if (not num_drafts or request.num_tokens - num_hit != 1
                or any(entry[0].is_prefill_chunk for entry in running)
                or not (running or num_hit > 0)
                or (limit and num_hit + 1 + num_drafts + 1 > limit)):
            return 0
        return num_drafts

    def _reached_end(self, request: _Request) -> bool:
        """vLLM's ``check_stop`` for a request that decodes to its end: ``max_tokens`` outputs,
        or ``max_model_len`` tokens."""
        limit = self.settings.max_model_len
        return request.num_output_tokens >= request.spec.max_tokens or bool(
            limit and request.num_tokens >= limit)

    def _apply_outputs(self, scheduled: list[tuple[_Request, int, int]]) -> None:
        """The forward pass ran: advance computed tokens, sample, finish and free."""
        advance = self.backend.advance
        for request, num_new, _ in scheduled:
            request.num_computed_tokens += num_new
            advance(request.req, num_new)
            if request.num_computed_tokens < request.num_tokens:
                continue  # a prefill chunk short of the last token samples nothing
            request.num_output_tokens += 1
            request.num_tokens += 1
            if self._reached_end(request):
                self.running.remove(request)
                self.backend.free(request.req)
                self.stats.finished += 1

    # --- async scheduling: outputs a step late -----------------------------------------------

    def _update_after_schedule(self, scheduled: list) -> None:
        """``Scheduler._update_after_schedule`` (with vLLM's counters: async scheduling or
        drafts): the scheduled tokens count as computed at once; a chunk that reaches the last
        known token samples. Async, it adds output placeholders for its sampled token and its
        drafts, and holds placeholders for the next drafts. ``scheduled`` entries gain whether
        the step samples and how many of their drafts the verifier will accept."""
        sync_request = self.backend.sync_request
        is_async = self.in_flight is not None
        num_speculative_tokens = self.num_speculative_tokens
        for index, (request, num_new, num_drafts) in enumerate(scheduled):
            request.num_computed_tokens += num_new
            request.num_in_flight_tokens += num_new
            request.is_prefill_chunk = request.num_computed_tokens < (
                request.num_tokens + request.num_output_placeholders)
            samples = not request.is_prefill_chunk
            accepted = 0
            if samples:
                if num_drafts:
                    accepted = self._verify(request, num_drafts)
                if is_async:
                    request.num_output_placeholders += 1 + num_drafts
                    request.num_drafts = num_speculative_tokens
            scheduled[index] = (request, num_new, samples, num_drafts, accepted)
            sync_request(request.req, request.num_computed_tokens, request.num_tokens,
                         request.num_in_flight_tokens)

    def _verify(self, request: _Request, num_drafts: int) -> int:
        """The verifier's answer to a step's drafts: the capture's own for this request at
        this position where it has one (``SchedulerSettings.draft_answers``), else drawn."""
        settings = self.settings
        answer = settings.draft_answers.get((request.req, request.num_tokens))
        if answer is not None:
            return min(answer, num_drafts)
        return accepted_drafts(str(request.req), request.num_output_tokens, num_drafts,
                               settings.draft_acceptance)

    def _update_from_output(self, scheduled: list) -> None:
        """``Scheduler.update_from_output`` of a step (async: scheduled one step ago): roll
        back the rejected drafts, append the sampled and accepted tokens (a stop trims them);
        cache the blocks they completed up to what no step in flight may still change; finish
        and free. A preempted request's stale output is appended but changes none of its
        counters, nor caches. Synchronously, the drafter then proposes each decoding request's
        next drafts (``EngineCore.post_step``)."""
        backend = self.backend
        is_async = self.in_flight is not None
        num_speculative_tokens = self.num_speculative_tokens
        for request, num_new, samples, num_drafts, accepted in scheduled:
            request.num_in_flight_tokens -= num_new
            stale = request.num_stale_output_tokens > 0
            if stale:
                request.num_stale_output_tokens -= num_new
            if request.finished:
                continue
            stopped = False
            if samples:
                if num_drafts and not stale:
                    rejected = num_drafts - accepted
                    if request.num_computed_tokens > 0:
                        request.num_computed_tokens -= rejected
                    if request.num_output_placeholders > 0:
                        request.num_output_placeholders -= rejected
                had_placeholders = request.num_output_placeholders > 0
                new_tokens = 1 + accepted
                for appended in range(1, new_tokens + 1):
                    request.num_output_tokens += 1
                    request.num_tokens += 1
                    if self._reached_end(request):
                        stopped = True
                        if not stale:  # computed covers all new tokens but the last one
                            request.num_computed_tokens -= new_tokens - appended
                        break
                if not stale and had_placeholders:
                    request.num_output_placeholders -= new_tokens
            backend.sync_request(request.req, request.num_computed_tokens, request.num_tokens,
                                 request.num_in_flight_tokens)
            if not samples:
                continue
            if not stale and (had_placeholders or num_speculative_tokens):
                backend.cache_blocks(request.req, request.num_computed_tokens
                                     - request.num_in_flight_tokens)
            if stopped:
                (self.waiting if stale else self.running).remove(request)
                backend.free(request.req)
                request.finished = True
                self.finished_unreported = True
                self.stats.finished += 1
            elif num_speculative_tokens and not is_async:
                request.num_drafts = num_speculative_tokens
