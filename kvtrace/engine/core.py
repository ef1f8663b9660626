"""A live CPU engine to capture from: a workload through vLLM 0.33's own scheduler and cache.

Capture attaches to a running vLLM engine core; tests and the demo need one without a GPU or a
model. ``kvtrace engine`` is that process. It looks like vLLM's engine core where capture looks:

* its process title is ``VLLM::EngineCore`` (vLLM's own ``set_process_title``), set before
  ``vllm.plugins.load_general_plugins()`` runs, as in ``EngineCoreProc.run_engine_core`` and
  ``EngineCore.__init__``, so an installed kvtrace plugin starts exactly as in production;
* when idle, its main thread blocks in ``queue.get()``, as the idle ``EngineCore`` blocks in
  ``input_queue.get()``: a debugger-based attach must cope with a main thread that runs no
  bytecode. Work ("start", "quit") comes from a stdin-reader thread;
* SIGTERM and SIGINT raise out of whatever the main thread is doing, as vLLM's handler does;
* its cache arms no probes of its own, so a capture's process-wide probes see every call;
  requests carry wall-clock arrival times, as the front end stamps them.

A step is vLLM's own: ``Scheduler.schedule()``, then ``update_from_output()`` with what the model
runner would answer (``VllmScheduler``). The scheduler is built offline: its ``ModelConfig``
reads a bundled ``config.json`` (``engine_model/``; no weights, no tokenizer), and it builds its
``KVCacheManager`` from the workload's ``KVCacheConfig`` with the checkpoint variant installed.
There is no model forward, so a step is only scheduling and cache work. Steps run in
accelerated real time: virtual time advances as in ``kvtrace replay``'s scheduler model (a fixed
overhead plus a cost per scheduled token), and the step that starts at virtual time ``t`` starts
``t / speed`` seconds after "start" (a step that takes longer just runs late); speed 0 runs as
fast as it can.

The figures are vLLM's own: a request's hit is the local cached tokens of its first prefill
(``PrefillStats``, reported when that prefill completes), which is what ``ReplaySummary``
counts from a capture's records; preemptions are the requests' ``num_preemptions``. ``kvtrace
replay`` schedules with kvtrace's model of this scheduler, which makes the same calls on the
cache (``tests/test_scheduler_vs_vllm.py``), so its figures for a workload equal the engine's.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtrace.engine_config import (Overrides, SchedulerSettings, check_fits_model_len,
                                   check_pool_fits, check_request, derive, describe_retention,
                                   speculative_method)
from kvtrace.errors import ConfigError, KvtraceError
from kvtrace.events import EngineConfig
from kvtrace.replay.arrivals import Arrival, arrivals_of
from kvtrace.replay.options import CAPTURED_VARIANT
from kvtrace.replay.scheduling_rules import ASYNC_BATCHES, accepted_drafts
from kvtrace.replay.variants import get_variant
from kvtrace.replay.vllm_backend import (UNLIMITED_MODEL_LEN, MadeUpHashIds, kv_cache_config_of,
                                          new_request)
from kvtrace.traceio import TraceReader
from kvtrace.vllm_releases import running_vllm_version

# vLLM's name for the process (``run_engine_core``, without data parallelism).
ENGINE_CORE_PROCESS_NAME = "EngineCore"
START, QUIT = "start", "quit"
ENGINE_MODEL_DIR = Path(__file__).with_name("engine_model")
END_OF_INPUT = "end of input"  # queued by the stdin reader at EOF: stop, as for quit
COMMAND_LINE_BYTES = 4096  # the longest command line read whole


class Shutdown(BaseException):
    """Raised in the main thread by SIGTERM/SIGINT. A BaseException like vLLM's SystemExit, so
    that no ``except Exception`` on the way (a probe wrapper's, say) swallows it."""


@dataclass(frozen=True)
class EngineOptions:
    source: str
    variant: str = CAPTURED_VARIANT
    overrides: Overrides = Overrides()  # the pool and the retention; scheduler limits too
    speed: float = 1.0  # virtual seconds per wall second; 0: as fast as possible
    # With drafts (--num-speculative-tokens): the chance the verifier accepts each draft token,
    # in order (a rejected one ends the step's accepted run).
    draft_acceptance: float = SchedulerSettings.draft_acceptance


@dataclass(frozen=True)
class EngineWorkload:
    config: EngineConfig
    settings: SchedulerSettings
    arrivals: list[Arrival]
    model: str = ""  # the model the workload was written for (its header's), if it names one


def load_workload(options: EngineOptions) -> EngineWorkload:
    """Read and check everything before the engine starts (a bad input fails fast)."""
    if not (options.speed >= 0 and math.isfinite(options.speed)):
        raise ConfigError(f"--speed {options.speed} is not a finite number >= 0",
                          "Use 1 for real time, 10 for ten times faster, 0 for no waiting.")
    if not 0 <= options.draft_acceptance <= 1:
        raise ConfigError(f"--draft-acceptance {options.draft_acceptance} is not a probability",
                          "Use a number from 0 (every draft rejected) to 1 (every one accepted).")
    get_variant(options.variant)
    reader = TraceReader(options.source)
    config, settings = derive(reader.header.config, options.source, options.overrides)
    settings = dataclasses.replace(settings, draft_acceptance=options.draft_acceptance)
    arrivals = arrivals_of(reader.batches())  # in arrival order
    if not arrivals:
        raise KvtraceError(f"{options.source} has no requests (no request_arrived records)",
                           "Run a workload (kvtrace synth / import) or a captured trace.")
    for arrival in arrivals:  # vLLM's scheduler would wait forever for a request that never fits
        check_request(arrival.req, arrival.prompt_len, arrival.max_tokens, arrival.hash_ids,
                      config.hash_block_size, config.num_hash_lookahead_tokens)
        check_fits_model_len(settings, arrival.req, arrival.prompt_len)
        check_pool_fits(config, arrival.req, arrival.prompt_len + arrival.max_tokens)
    return EngineWorkload(config, settings, arrivals, reader.header.params.get("model", ""))


class _Quit(Exception):
    """A quit (or end of input) heard while a workload runs: abandons the run."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class VllmScheduler:
    """vLLM's ``Scheduler`` over a workload's cache, answered each step as a model runner would.

    The runner's answer: one sampled token for each request whose scheduled chunk reached its
    last token; nothing for a chunk that ends inside the prompt (the runner discards it)."""

    def __init__(self, config: EngineConfig, settings: SchedulerSettings, variant: str,
                 model: str = "") -> None:
        """``model``: the name the engine serves as (vLLM's ``served_model_name``, which a
        capture records): the workload's model, whose geometry the cache has; without one,
        ``kvtrace-engine`` (never the bundled stand-in config's path)."""
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        vllm_config = _vllm_config(config, settings, model)
        self.config = config
        self.settings = settings
        # Async: the engine core's batch queue, as many batches in flight as vLLM allows.
        self.in_flight: collections.deque | None = (
            collections.deque() if config.async_scheduling else None)
        scheduler_class = AsyncScheduler if config.async_scheduling else Scheduler
        try:
            self.scheduler = scheduler_class(vllm_config, kv_cache_config_of(config),
                                       StructuredOutputManager(vllm_config),
                                       block_size=config.scheduler_block_size,
                                       hash_block_size=config.hash_block_size)
        except (AssertionError, ValueError) as error:
            raise ConfigError("vLLM's scheduler rejected the engine config: "
                              f"{error or type(error).__name__}") from error
        check_drafter(config, self.scheduler)
        installed = get_variant(variant)
        for manager in self.scheduler.kv_cache_manager.coordinator.single_type_managers:
            installed.install(manager)
        self.requests: dict[str, Any] = {}  # the unfinished ones
        self.num_steps = 0
        self.hit_tokens = 0  # vLLM's own count: each request's first prefill, its cached tokens
        self.preemptions = 0  # of finished requests
        self._made_up_hash_id = MadeUpHashIds()

    def add_request(self, arrival: Arrival) -> None:
        request = new_request(arrival.req, arrival.prompt_len, arrival.max_tokens,
                              [*arrival.hash_ids, *(arrival.output_hash_ids or ())],
                              self.config, self._made_up_hash_id)
        request.arrival_time = time.time()
        self.requests[request.request_id] = request
        self.scheduler.add_request(request)

    def has_requests(self) -> bool:
        """Requests unfinished, or a step in flight whose output is still to be taken."""
        return self.scheduler.has_requests() or bool(self.in_flight)

    def run(self, arrivals: list[Arrival],
            before_step: Callable[[int], None] | None = None) -> int:
        """Run ``arrivals`` (sorted by arrival time) to the end on the virtual clock; returns the
        clock's end in ns. ``before_step(virtual_ns)`` runs before each step (pacing)."""
        pending, clock_ns = collections.deque(arrivals), 0
        while pending or self.has_requests():
            if not self.has_requests():
                clock_ns = max(clock_ns, pending[0].arrival_ns)
            if before_step is not None:
                before_step(clock_ns)
            while pending and pending[0].arrival_ns <= clock_ns:
                self.add_request(pending.popleft())
            num_tokens = self.step()
            if num_tokens:  # not the step that only reports the last requests finished
                clock_ns += (self.settings.step_overhead_ns
                             + num_tokens * self.settings.ns_per_token)
        return clock_ns

    def step(self) -> int:
        """One engine step; returns the number of tokens it scheduled. Synchronous: schedule,
        then the step's output (``EngineCore.step``). Async (``step_with_batch_queue`` with two
        batches in flight): schedule the next step, then take the output of the one before, so
        that a step is scheduled before its predecessor's tokens are known."""
        if self.in_flight is None:
            output = self._schedule()
            self._update(*output)
            return output[0].total_num_scheduled_tokens
        num_tokens = 0
        if self.scheduler.has_requests():
            output = self._schedule()
            self.in_flight.appendleft(output)
            num_tokens = output[0].total_num_scheduled_tokens
            if len(self.in_flight) < ASYNC_BATCHES and (num_tokens
                                                        or self.scheduler.has_requests()):
                return num_tokens
        if self.in_flight:
            self._update(*self.in_flight.pop())
        return num_tokens

    def _schedule(self) -> tuple[Any, Any]:
        """``schedule()``, and the model runner's answer to it, decided now: one sampled token
        for each request whose chunk reached its last known token (not a prefill chunk)."""
        from vllm.v1.outputs import ModelRunnerOutput

        output = self.scheduler.schedule()
        self.num_steps += 1
        req_ids = list(output.num_scheduled_tokens)
        requests = self.requests
        drafts = output.scheduled_spec_decode_tokens
        sampled = [[] if requests[req_id].is_prefill_chunk
                   else [0] * (1 + accepted_drafts(req_id, requests[req_id].num_output_tokens,
                                                   len(drafts.get(req_id, ())),
                                                   self.settings.draft_acceptance))
                   for req_id in req_ids]
        self._check_admits(output)
        return output, ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled)

    def _update(self, output: Any, model_output: Any) -> None:
        """``update_from_output``: vLLM appends the tokens, finishes and frees; the figures.
        Synchronously, the drafter then proposes each decoding request's next drafts
        (``EngineCore.post_step``); async, the scheduler keeps placeholders for them."""
        from vllm.v1.outputs import DraftTokenIds

        requests = self.requests
        outputs = self.scheduler.update_from_output(output, model_output)
        num_drafts = self.config.num_speculative_tokens
        if num_drafts and self.in_flight is None:
            decoding = [req_id for req_id, tokens in zip(model_output.req_ids,
                                                         model_output.sampled_token_ids)
                        if tokens]
            self.scheduler.update_draft_token_ids(
                DraftTokenIds(decoding, [[0] * num_drafts for _ in decoding]))
        for engine_outputs in outputs.values():
            for request_output in engine_outputs.outputs:
                if request_output.prefill_stats is not None:  # the first prefill's, once
                    self.hit_tokens += request_output.prefill_stats.num_local_cached_tokens
                finished = (requests.pop(request_output.request_id, None)
                            if request_output.finished else None)
                if finished is not None:  # forgotten: a long workload's tokens add up
                    self.preemptions += finished.num_preemptions

    def _check_admits(self, output: Any) -> None:
        """A step that schedules nothing while requests wait and none runs never ends."""
        if (not output.total_num_scheduled_tokens and not self.scheduler.running
                and self.scheduler.waiting):
            head = self.scheduler.waiting.peek_request()
            raise ConfigError(
                f"vLLM's scheduler cannot admit request {head.request_id} "
                f"({head.num_tokens} tokens) even with nothing else running",
                "Give the engine more blocks with --num-gpu-blocks.")


def _vllm_config(config: EngineConfig, settings: SchedulerSettings, model: str) -> Any:
    """A ``VllmConfig`` for scheduling only: the bundled model config (served under ``model``'s
    name), CPU, the trace's limits."""
    from vllm.config import (CacheConfig, DeviceConfig, ModelConfig, ParallelConfig,
                             SchedulerConfig, SpeculativeConfig, VllmConfig)

    max_model_len = settings.max_model_len or UNLIMITED_MODEL_LEN
    model_config = ModelConfig(model=str(ENGINE_MODEL_DIR), skip_tokenizer_init=True,
                               max_model_len=max_model_len, dtype="float32",
                               served_model_name=model or "kvtrace-engine")
    scheduler_config = SchedulerConfig(
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_num_seqs=settings.max_num_seqs, max_model_len=max_model_len,
        enable_chunked_prefill=True, is_encoder_decoder=False,
        long_prefill_token_threshold=settings.long_prefill_token_threshold,
        scheduler_reserve_full_isl=settings.reserve_full_sequence,
        async_scheduling=config.async_scheduling)
    cache_config = CacheConfig(block_size=config.cache_block_size or config.scheduler_block_size,
                               enable_prefix_caching=config.enable_caching,
                               mamba_cache_mode="align")
    speculative_config = None
    if config.num_speculative_tokens:
        # n-gram drafting needs no draft model, so it builds offline; like MTP it proposes
        # drafts the step after a decode, which the verifier then accepts or rejects.
        speculative_config = SpeculativeConfig(
            method="ngram", num_speculative_tokens=config.num_speculative_tokens,
            prompt_lookup_min=1, prompt_lookup_max=1, target_model_config=model_config,
            target_parallel_config=ParallelConfig())
    vllm_config = VllmConfig(device_config=DeviceConfig(device="cpu"), model_config=model_config,
                             scheduler_config=scheduler_config, cache_config=cache_config,
                             speculative_config=speculative_config)
    if speculative_method(config) == "mtp":
        # MTP needs a draft model, which no bundled config has; the scheduler and cache read
        # only the method and the hashing choice of it (VllmScheduler checks what they made).
        speculative_config.method = "mtp"
        if hasattr(speculative_config, "disable_lookahead_block_hashes"):  # 0.33 on
            speculative_config.disable_lookahead_block_hashes = (
                not config.num_hash_lookahead_tokens)
    vllm_config.cache_config.num_gpu_blocks = config.num_gpu_blocks  # as the engine core sets it
    return vllm_config


def check_drafter(config: EngineConfig, scheduler: Any) -> None:
    """vLLM's scheduler derived the drafter fields ``config`` says (``drafter_fields``), as a
    capture would read them, or a ``ConfigError`` naming the first it did not."""
    from kvtrace.probes.signatures import drafter_fields_of

    made = drafter_fields_of(scheduler.kv_cache_manager, scheduler)
    for name, value in made.items():
        if value != getattr(config, name):
            raise ConfigError(
                f"vLLM's scheduler drafts with {name} {value} where the workload's engine "
                f"had {getattr(config, name)}", "kvtrace engine runs n-gram and single-module "
                "MTP drafting (MTP before vLLM 0.33 with --no-lookahead-block-hashes: those "
                "releases drop the last block); replay other drafters' captures with "
                "kvtrace replay.")


class Engine:
    """One engine core: a cache, a workload, and a command queue its main thread serves."""

    def __init__(self, options: EngineOptions, workload: EngineWorkload,
                 on_done: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.options = options
        self.workload = workload
        self.on_done = on_done
        self.commands: queue.Queue[str] = queue.Queue()
        # Built before "ready": a config vLLM rejects fails the start, not the run.
        self.scheduler = VllmScheduler(workload.config, workload.settings, options.variant,
                                       workload.model)
        self.summary: dict[str, Any] | None = None
        self.input_ended = False  # heard during a run

    def describe(self) -> str:
        config = self.workload.config
        retention = describe_retention(config.retention_interval)
        speed = "max" if not self.options.speed else f"{self.options.speed:g}x"
        return (f"variant {self.options.variant}, {len(self.workload.arrivals)} requests, "
                f"{config.num_gpu_blocks} blocks, retention {retention}, speed {speed}, "
                f"vLLM {running_vllm_version()}")

    def serve(self) -> str:
        """Serve commands until told to quit; returns why it stopped. Blocks in ``get()`` while
        idle, like vLLM's ``EngineCore._process_input_queue``."""
        while True:
            command = self.commands.get()
            if command != START:
                return command
            if self.summary is not None:
                say("the workload already ran; send quit")
                continue
            reason = self.run_workload()
            if reason is not None:
                return reason
            if self.input_ended:
                return END_OF_INPUT

    def run_workload(self) -> str | None:
        """Run every request; returns why it stopped early (a quit), or None when done."""
        workload, options = self.workload, self.options
        arrivals = workload.arrivals
        say(f"running {len(arrivals)} requests")
        engine = self.scheduler
        origin = time.monotonic()
        started = time.perf_counter()
        try:
            clock_ns = engine.run(arrivals, lambda step_ns: self._wait_until(
                origin + step_ns / 1e9 / options.speed if options.speed else -math.inf))
        except _Quit as stop:
            return stop.reason
        wall_s = time.perf_counter() - started
        prompt_tokens = sum(a.prompt_len for a in arrivals)
        hit_tokens = engine.hit_tokens
        self.summary = {
            "variant": options.variant,
            "requests": len(arrivals),
            "prompt_tokens": prompt_tokens,
            "hit_tokens": hit_tokens,
            "hit_rate": hit_tokens / prompt_tokens if prompt_tokens else 0.0,
            "preemptions": engine.preemptions,
            "steps": engine.num_steps,
            "virtual_s": clock_ns / 1e9,
            "speed": options.speed,
            "wall_s": round(wall_s, 3),
        }
        if self.on_done is not None:
            self.on_done(self.summary)  # before "done", so whoever waits for it finds the file
        say(f"done ({len(arrivals)} requests, hit rate {self.summary['hit_rate']:.4f})")
        return None

    def _wait_until(self, deadline: float) -> None:
        """Wait for a step's wall time in ``get()``, so that a quit is heard mid-run. A start
        that comes now is answered at once; the end of input is kept for after the run, so that
        ``--autostart < /dev/null`` runs the workload and then exits."""
        while True:
            remaining = deadline - time.monotonic()
            try:  # a deadline may lie beyond what a wait takes (--speed 1e-300): wait in parts
                command = (self.commands.get(timeout=min(remaining, threading.TIMEOUT_MAX))
                           if remaining > 0 else self.commands.get_nowait())
            except queue.Empty:
                if time.monotonic() >= deadline:
                    return
                continue
            if command == QUIT:
                raise _Quit(command)
            if command == END_OF_INPUT:
                self.input_ended = True
            else:
                say("already running")

def read_commands(read: Callable[[int], bytes], commands: queue.Queue[str],
                  complain: Callable[[str], None]) -> None:
    """The stdin-reader thread: one command per line of what ``read(n)`` returns (at most n
    bytes; b"" at the end); end of input means quit. Lines are cut from chunks here: a line
    without end (``< /dev/zero``) is skipped with one complaint and costs no memory, and no
    buffered reader's lock is left held by this thread when the engine exits."""
    pending, skipping = b"", False
    while True:
        try:
            chunk = read(COMMAND_LINE_BYTES)
        except OSError:
            chunk = b""  # no standard input at all: its end
        if not chunk:
            break
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            if skipping:  # the end of a line too long to read
                skipping = False
            else:
                _command(line, commands, complain)
        if len(pending) >= COMMAND_LINE_BYTES:
            if not skipping:
                complain(f"a line longer than {COMMAND_LINE_BYTES} bytes, skipped (send start "
                         "or quit)")
            pending, skipping = b"", True
    if pending and not skipping:
        _command(pending, commands, complain)
    commands.put(END_OF_INPUT)


def _command(line: bytes, commands: queue.Queue[str], complain: Callable[[str], None]) -> None:
    command = line.decode(errors="replace").strip().lower()
    if command in (START, QUIT):
        commands.put(command)
    elif command:
        complain(f"unknown command {command!r} (send start or quit)")


def become_engine_core() -> None:
    """Take vLLM's engine-core process title, then load vLLM's general plugins, in
    ``run_engine_core``'s order (a plugin may look at the title)."""
    from vllm.plugins import load_general_plugins
    from vllm.utils.system_utils import set_process_title

    set_process_title(ENGINE_CORE_PROCESS_NAME)
    load_general_plugins()


def say(message: str, file: Any = None) -> None:
    """One status line, flushed at once: a driver waits for "ready" and "done"."""
    print(f"kvtrace engine: {message}", file=file or sys.stdout, flush=True)


def _raise_shutdown(signum: int, _frame: Any) -> None:
    for stop in (signal.SIGTERM, signal.SIGINT):  # a second one must not cut the exit short
        signal.signal(stop, signal.SIG_IGN)
    raise Shutdown(signal.Signals(signum).name)


def run_engine(options: EngineOptions, autostart: bool = False,
               on_done: Callable[[dict[str, Any]], None] | None = None) -> str:
    """The whole engine process: check the workload, become an engine core, build the cache,
    say "ready", serve until quit / end of input / SIGTERM / SIGINT; returns why it stopped.
    ``on_done(summary)`` runs when the workload has finished."""
    previous = {signum: signal.signal(signum, _raise_shutdown)
                for signum in (signal.SIGTERM, signal.SIGINT)}
    stopped = False
    try:
        workload = load_workload(options)
        become_engine_core()
        engine = Engine(options, workload, on_done)
        if autostart:
            engine.commands.put(START)
        threading.Thread(target=read_commands, name="kvtrace-engine-stdin", daemon=True,
                         args=(functools.partial(os.read, 0), engine.commands,  # standard input
                               lambda message: say(message, file=sys.stderr))).start()
        say(f"pid {os.getpid()} ready ({engine.describe()})")
        reason = engine.serve()
    except Shutdown as shutdown:
        reason, stopped = str(shutdown), True
    finally:
        if not stopped:  # once stopped, stop signals stay ignored: the exit goes on
            for signum, handler in previous.items():
                signal.signal(signum, handler)
    say(f"exiting ({reason})")
    return reason
