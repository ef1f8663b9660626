"""A live CPU engine to capture from: a workload through vLLM 0.33's real ``KVCacheManager``.

Capture attaches to a running vLLM engine core; tests and the demo need one without a GPU or a
model. ``kvtrace engine`` is that process. It looks like vLLM's engine core where capture looks:

* its process title is ``VLLM::EngineCore`` (vLLM's own ``set_process_title``), set before
  ``vllm.plugins.load_general_plugins()`` runs, as in ``EngineCoreProc.run_engine_core`` and
  ``EngineCore.__init__``, so an installed kvtrace plugin starts exactly as in production;
* when idle, its main thread blocks in ``queue.get()``, as the idle ``EngineCore`` blocks in
  ``input_queue.get()``: a debugger-based attach must cope with a main thread that runs no
  bytecode. Work ("start", "quit") comes from a stdin-reader thread;
* SIGTERM and SIGINT raise out of whatever the main thread is doing, as vLLM's handler does;
* its cache arms no probes of its own (``VllmBackend(sink=None)``), so a capture's process-wide
  probes see every call; requests carry wall-clock arrival times, as the front end stamps them.

Steps follow kvtrace's scheduler model (vLLM's ``Scheduler`` cannot be built offline; see
``scheduler``) in accelerated real time: the step the model starts at virtual time ``t`` starts
``t / speed`` seconds after "start" (a step that takes longer just runs late); speed 0 runs as
fast as it can. A step is only scheduling and cache work: there is no model forward.

The figures are counted from what the cache answered, the way ``run.ReplaySummary`` counts them
from records, so they equal ``kvtrace replay``'s for the same workload and variant.
"""

from __future__ import annotations

import math
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvtrace.errors import ConfigError, KvtraceError
from kvtrace.events import EngineConfig, FinishStatus
from kvtrace.replay.run import CAPTURED_VARIANT, KEEP, ReplayOptions, config_for
from kvtrace.replay.scheduler import Arrival, Scheduler, SchedulerSettings, arrivals_of
from kvtrace.replay.variants import get_variant
from kvtrace.traceio import TraceReader

# vLLM's name for the process (``run_engine_core``, without data parallelism).
ENGINE_CORE_PROCESS_NAME = "EngineCore"
START, QUIT = "start", "quit"
END_OF_INPUT = "end of input"  # queued by the stdin reader at EOF: stop, as for quit


class Shutdown(BaseException):
    """Raised in the main thread by SIGTERM/SIGINT. A BaseException like vLLM's SystemExit, so
    that no ``except Exception`` on the way (a probe wrapper's, say) swallows it."""


@dataclass(frozen=True)
class EngineOptions:
    source: str
    variant: str = CAPTURED_VARIANT
    num_gpu_blocks: int | None = None
    retention_interval: Any = KEEP  # KEEP, None (dense) or an int
    speed: float = 1.0  # virtual seconds per wall second; 0: as fast as possible


@dataclass(frozen=True)
class EngineWorkload:
    config: EngineConfig
    settings: SchedulerSettings
    arrivals: list[Arrival]


def load_workload(options: EngineOptions) -> EngineWorkload:
    """Read and check everything before the engine starts (a bad input fails fast)."""
    if not (options.speed >= 0 and math.isfinite(options.speed)):
        raise ConfigError(f"--speed {options.speed} is not a finite number >= 0",
                          "Use 1 for real time, 10 for ten times faster, 0 for no waiting.")
    get_variant(options.variant)
    reader = TraceReader(options.source)
    records = list(reader)
    config = config_for(reader.header, ReplayOptions(
        source=options.source, outdir="", num_gpu_blocks=options.num_gpu_blocks,
        retention_interval=options.retention_interval))
    arrivals = arrivals_of(records)
    if not arrivals:
        raise KvtraceError(f"{options.source} has no requests (no request_arrived records)",
                           "Run a workload (kvtrace synth / import) or a captured trace.")
    return EngineWorkload(config, SchedulerSettings.from_config(config), arrivals)


class _Quit(Exception):
    """A quit (or end of input) heard while a workload runs: abandons the run."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class EngineCache:
    """The engine's ``CacheBackend``: the real cache, paced to the wall clock.

    Before each step it waits (through ``wait_until``) for the step's wall time; it stamps each
    arrival with the wall clock; and it counts prefix hits as ``ReplaySummary`` does: the hit of
    the lookup that a request's first successful allocation followed, later ones (after a
    preemption) apart."""

    def __init__(self, backend: Any, speed: float, wait_until: Callable[[float], None]) -> None:
        self.backend = backend
        self.num_gpu_blocks = backend.num_gpu_blocks
        self.speed = speed
        self.wait_until = wait_until
        self.origin = time.monotonic()
        self.hit_tokens = 0
        self.resumed_hit_tokens = 0
        self._lookups: dict[int, int] = {}
        self._admitted: set[int] = set()

    def new_step(self, step: int, ts_ns: int) -> None:
        self.wait_until(self.origin + ts_ns / 1e9 / self.speed if self.speed else -math.inf)
        self.backend.new_step(step, ts_ns)

    def add_request(self, req: int, prompt_len: int, hash_ids: list[int], max_tokens: int,
                    output_hash_ids: list[int] | None = None) -> None:
        self.backend.add_request(req, prompt_len, hash_ids, max_tokens, output_hash_ids)
        self.backend.request(req).arrival_time = time.time()

    def get_computed_blocks(self, req: int) -> tuple[int, int]:
        num_hit_tokens, shared_prefix_boundary = self.backend.get_computed_blocks(req)
        self._lookups[req] = num_hit_tokens
        return num_hit_tokens, shared_prefix_boundary

    def allocate_slots(self, req: int, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       num_lookahead_tokens: int = 0) -> bool:
        success = self.backend.allocate_slots(req, num_new_tokens, num_new_computed_tokens,
                                              num_lookahead_tokens)
        if success and req in self._lookups:
            hit = self._lookups.pop(req)
            if req in self._admitted:
                self.resumed_hit_tokens += hit
            else:
                self._admitted.add(req)
                self.hit_tokens += hit
        return success

    def advance(self, req: int, num_tokens: int) -> None:
        self.backend.advance(req, num_tokens)

    def free(self, req: int, status: FinishStatus = FinishStatus.FINISHED) -> None:
        self.backend.free(req, status)

    def preempt(self, req: int) -> None:
        self.backend.preempt(req)

    def num_free_blocks(self) -> int:
        return self.backend.num_free_blocks()


class Engine:
    """One engine core: a cache, a workload, and a command queue its main thread serves."""

    def __init__(self, options: EngineOptions, workload: EngineWorkload,
                 on_done: Callable[[dict[str, Any]], None] | None = None) -> None:
        from kvtrace.replay.vllm_backend import VllmBackend

        self.options = options
        self.workload = workload
        self.on_done = on_done
        self.commands: queue.Queue[str] = queue.Queue()
        self.backend = VllmBackend(workload.config, options.variant, sink=None)
        self.summary: dict[str, Any] | None = None
        self.input_ended = False  # heard during a run

    def describe(self) -> str:
        config = self.workload.config
        retention = "none" if config.retention_interval is None else config.retention_interval
        speed = "max" if not self.options.speed else f"{self.options.speed:g}x"
        return (f"variant {self.options.variant}, {len(self.workload.arrivals)} requests, "
                f"{config.num_gpu_blocks} blocks, retention {retention}, speed {speed}")

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
        arrivals = self.workload.arrivals
        say(f"running {len(arrivals)} requests")
        cache = EngineCache(self.backend, self.options.speed, self._wait_until)
        started = time.perf_counter()
        try:
            stats = Scheduler(cache, self.workload.config, self.workload.settings).run(arrivals)
        except _Quit as stop:
            return stop.reason
        wall_s = time.perf_counter() - started
        prompt_tokens = sum(a.prompt_len for a in arrivals)
        self.summary = {
            "variant": self.options.variant,
            "requests": len(arrivals),
            "prompt_tokens": prompt_tokens,
            "hit_tokens": cache.hit_tokens,
            "hit_rate": cache.hit_tokens / prompt_tokens if prompt_tokens else 0.0,
            "resumed_hit_tokens": cache.resumed_hit_tokens,
            "preemptions": stats.preemptions,
            "steps": stats.steps,
            "virtual_s": stats.virtual_ns / 1e9,
            "speed": self.options.speed,
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
            try:
                command = (self.commands.get(timeout=remaining) if remaining > 0
                           else self.commands.get_nowait())
            except queue.Empty:
                return
            if command == QUIT:
                raise _Quit(command)
            if command == END_OF_INPUT:
                self.input_ended = True
            else:
                say("already running")

    def close(self) -> None:
        self.backend.close()


def read_commands(stream: Any, commands: queue.Queue[str],
                  complain: Callable[[str], None]) -> None:
    """The stdin-reader thread: one command per line; end of input means quit."""
    for line in stream:
        command = line.strip().lower()
        if command in (START, QUIT):
            commands.put(command)
        elif command:
            complain(f"unknown command {command!r} (send start or quit)")
    commands.put(END_OF_INPUT)


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
    raise Shutdown(signal.Signals(signum).name)


def run_engine(options: EngineOptions, autostart: bool = False,
               on_done: Callable[[dict[str, Any]], None] | None = None) -> str:
    """The whole engine process: check the workload, become an engine core, build the cache,
    say "ready", serve until quit / end of input / SIGTERM / SIGINT; returns why it stopped.
    ``on_done(summary)`` runs when the workload has finished."""
    previous = {signum: signal.signal(signum, _raise_shutdown)
                for signum in (signal.SIGTERM, signal.SIGINT)}
    engine = None
    try:
        workload = load_workload(options)
        become_engine_core()
        engine = Engine(options, workload, on_done)
        if autostart:
            engine.commands.put(START)
        threading.Thread(target=read_commands, name="kvtrace-engine-stdin", daemon=True,
                         args=(sys.stdin, engine.commands,
                               lambda message: say(message, file=sys.stderr))).start()
        say(f"pid {os.getpid()} ready ({engine.describe()})")
        reason = engine.serve()
    except Shutdown as shutdown:
        reason = str(shutdown)
    finally:
        if engine is not None:
            engine.close()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    say(f"exiting ({reason})")
    return reason
