"""What-if sweeps: one source replayed under a grid of pool sizes, retentions and variants.

A sweep answers "how big a pool, which retention, which fix?": every configuration of the grid
(variant x retention x pool size) is one replay of the same source, kept as one row of figures
(``ReplaySummary``), never as a trace. The whole grid is checked before any replay runs: every
variant known, every engine valid (``engine_config.derive``), every pool able to hold the
largest request (``engine_config.check_pool_fits``), no configuration twice.

Pool sizes are given in blocks, or as fractions of the source's *distinct attention blocks*:
the attention blocks its requests fill, a shared prefix block counted once (the rule
``kvtrace synth`` / ``kvtrace import`` size their default pool with,
``workloads.workload.distinct_attention_blocks``). A fraction of 1 holds the whole attention
working set; the Mamba pages come on top, so it still evicts a little.

Configurations run in this process (``jobs=1``), in local worker processes, or as Ray tasks
(``ray_address``); every way runs the same ``run_configuration`` and yields the same rows, in
grid order. A worker reads the source once and keeps it for the tasks that follow.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from math import ceil
from typing import Any

from kvtrace.children import become_pool_worker, stop_signals_deferred
from kvtrace.engine_config import (
    KEEP,
    Overrides,
    blocks_needed,
    check_pool_fits,
    derive,
    describe_retention,
)
from kvtrace.errors import ConfigError, KvtraceError
from kvtrace.ray_cluster import connect_to_ray, import_ray, shut_down_ray
from kvtrace.replay.backend import BACKENDS, open_backend
from kvtrace.replay.arrivals import Arrival
from kvtrace.replay.options import DEFAULT_VARIANTS, ReplayOptions
from kvtrace.replay.run import replay
from kvtrace.replay.source import Source, read_source
from kvtrace.workloads.workload import (
    Workload,
    WorkloadRequest,
    distinct_attention_blocks,
)

# The fast re-implementation when it is there, else the real vLLM cache.
PREFERRED_BACKENDS = ("model", "vllm")
# Figures a row keeps of a replay summary (``ReplaySummary.to_dict``), besides its evictions.
SUMMARY_FIGURES = ("requests", "prompt_tokens", "hit_tokens", "hit_rate", "checkpoints_published",
                   "checkpoints_suppressed", "stale_key_hazards", "preemptions")

RowCallback = Callable[[int, int, dict[str, Any]], None]  # (finished, total, row)


def default_backend() -> str:
    return next(name for name in PREFERRED_BACKENDS if name in BACKENDS)


@dataclass(frozen=True)
class SweepGrid:
    """What to sweep. Exactly one of ``pool_fractions`` / ``num_gpu_blocks`` is given;
    ``retentions`` holds ``KEEP`` (the source's), ``None`` (dense) or token intervals."""

    source: str
    variants: tuple[str, ...] = DEFAULT_VARIANTS
    retentions: tuple[object, ...] = (KEEP,)
    pool_fractions: tuple[float, ...] = ()
    num_gpu_blocks: tuple[int, ...] = ()
    backend: str = ""  # "": default_backend()


@dataclass(frozen=True)
class SweepTask:
    """One configuration of the grid; ``index`` is its row's place in grid order."""

    index: int
    variant: str
    retention_interval: int | None
    num_gpu_blocks: int
    pool_fraction: float | None


@dataclass
class SweepPlan:
    source: str
    digest: str
    backend: str
    tasks: list[SweepTask]
    distinct_attention_blocks: int | None  # the base of pool fractions
    notes: list[str]


@dataclass
class SweepResult:
    plan: SweepPlan
    rows: list[dict[str, Any]]
    runner: str  # where the configurations ran
    wall_s: float

    def to_json(self) -> dict[str, Any]:
        """The sweep as JSON builtins (``sweep.json``; what ``analysis`` loads)."""
        plan = self.plan
        return {"source": os.path.abspath(plan.source), "source_digest": plan.digest,
                "backend": plan.backend, "runner": self.runner,
                "distinct_attention_blocks": plan.distinct_attention_blocks,
                "wall_s": round(self.wall_s, 3), "notes": plan.notes, "rows": self.rows}


# --- the grid -----------------------------------------------------------------------------------


def plan_sweep(grid: SweepGrid) -> SweepPlan:
    """Every configuration of ``grid``, checked; nothing runs."""
    from kvtrace.replay.variants import get_variant

    if bool(grid.pool_fractions) == bool(grid.num_gpu_blocks):
        raise ConfigError("a sweep needs pool sizes: either fractions or block counts",
                          "Give --pool-fraction 0.05,0.1,... or --num-gpu-blocks N,M,...")
    if not grid.variants or not grid.retentions:
        raise ConfigError("a sweep needs at least one variant and one retention",
                          "Give --variant and --retention values, or leave them out.")
    for fraction in grid.pool_fractions:
        if not fraction > 0:
            raise ConfigError(f"pool fraction {fraction} is not positive",
                              "Fractions are shares of the distinct attention blocks, e.g. 0.1.")
    for name in grid.variants:
        get_variant(name)
    notes = []
    backend = grid.backend or default_backend()
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}", f"Known backends: {', '.join(BACKENDS)}.")
    if not grid.backend and backend != PREFERRED_BACKENDS[0]:
        notes.append(f"the {PREFERRED_BACKENDS[0]!r} backend is not available; "
                     f"running on {backend!r}")
    source = _source_for(grid.source)
    derive(source.header.config, grid.source)  # the source's own engine, before its geometry
    arrivals = source.arrivals
    if not arrivals:
        raise KvtraceError(f"{grid.source} has no requests (no request_arrived records)",
                           "Sweep a workload (kvtrace synth / import) or a captured trace.")
    distinct = _distinct_attention_blocks(source, arrivals) if grid.pool_fractions else None
    sizes = ([(ceil(f * distinct), f) for f in grid.pool_fractions] if distinct is not None
             else [(n, None) for n in grid.num_gpu_blocks])
    longest = max(arrivals, key=lambda a: a.prompt_len + a.max_tokens)
    tasks: list[SweepTask] = []
    seen: dict[tuple, SweepTask] = {}
    for variant in grid.variants:
        for retention in grid.retentions:
            for num_gpu_blocks, fraction in sizes:
                config, _ = derive(source.header.config, grid.source,
                                   Overrides(num_gpu_blocks, retention))
                _check_fits(config, longest, fraction, distinct)
                task = SweepTask(len(tasks), variant, config.retention_interval, num_gpu_blocks,
                                 fraction)
                key = (variant, config.retention_interval, num_gpu_blocks)
                if key in seen:
                    raise ConfigError(
                        f"the grid runs {_describe(task)} twice ({_describe_size(seen[key])} and "
                        f"{_describe_size(task)})", "Give each pool size and retention once.")
                seen[key] = task
                tasks.append(task)
    return SweepPlan(grid.source, source.digest, backend, tasks, distinct, notes)


def _distinct_attention_blocks(source: Source, arrivals: list[Arrival]) -> int:
    """The base of pool fractions; counted as the workload writers count it."""
    config = source.header.config
    attention = [g for g in config.kv_cache_groups if g.kind == "full_attention"]
    if not attention:
        raise ConfigError(f"{source.path} has no full-attention group, so a pool fraction has "
                          "no base", "Give pool sizes in blocks with --num-gpu-blocks.")
    workload = Workload("sweep", [
        WorkloadRequest(a.arrival_ns, a.prompt_len, a.hash_ids, a.max_tokens,
                        a.output_hash_ids or [], str(a.req))
        for a in arrivals], config.hash_block_size)
    return distinct_attention_blocks(workload, attention[0].block_size)


def _check_fits(config, longest: Arrival, fraction: float | None, distinct: int | None) -> None:
    """``check_pool_fits`` for the largest request, naming the smallest usable pool."""
    try:
        check_pool_fits(config, longest.req, longest.prompt_len + longest.max_tokens)
    except ConfigError as error:
        need = blocks_needed(config, longest.prompt_len + longest.max_tokens)
        if fraction is None:
            raise ConfigError(str(error), f"The smallest usable pool is {need} blocks.") from None
        raise ConfigError(
            f"pool fraction {fraction} ({config.num_gpu_blocks} of {distinct} distinct "
            f"attention blocks): {error}",
            f"The smallest usable pool is {need} blocks: use fractions of at least "
            f"{_round_up(need / distinct)}.") from None


def _round_up(value: float) -> float:
    """``value`` rounded up to 3 significant digits (a fraction that is surely enough)."""
    scale = 10 ** (2 - int(f"{value:e}".split("e")[1]))
    return ceil(value * scale) / scale


def _describe_size(task: SweepTask) -> str:
    if task.pool_fraction is None:
        return f"{task.num_gpu_blocks} blocks"
    return f"fraction {task.pool_fraction} = {task.num_gpu_blocks} blocks"


def _describe(task: SweepTask) -> str:
    return (f"{task.variant} at retention {describe_retention(task.retention_interval)} with "
            f"{task.num_gpu_blocks} blocks")


# --- one configuration --------------------------------------------------------------------------

_cached_source: Source | None = None  # this process's copy of the source being swept


def _source_for(path: str, digest: str = "", data: bytes | None = None) -> Source:
    """The source at ``path`` (or its bytes ``data``, shipped to a worker elsewhere), read once
    per process; a source whose digest is no longer ``digest`` changed during the sweep."""
    global _cached_source
    source = _cached_source
    if source is None or source.path != path or (digest and source.digest != digest):
        if data is None:
            source = read_source(path)
        else:
            with tempfile.NamedTemporaryFile(suffix=".kvtrace") as copy:
                copy.write(data)
                copy.flush()
                source = dataclasses.replace(read_source(copy.name), path=path)
        _cached_source = source
    if digest and source.digest != digest:
        raise KvtraceError(f"{path} changed while the sweep ran",
                           "Sweep a source that nothing writes to (copy it first).")
    return source


def run_configuration(path: str, digest: str, backend: str, task: SweepTask,
                      data: bytes | None = None) -> dict[str, Any]:
    """Replay one configuration of a sweep into its row (no trace is written)."""
    source = _source_for(path, digest, data)
    # Every point of a curve starts alike: a snapshot's cache fits one pool and retention only.
    options = ReplayOptions(
        source=path, outdir="", variants=(task.variant,), backend=backend, write_traces=False,
        overrides=Overrides(num_gpu_blocks=task.num_gpu_blocks,
                            retention_interval=task.retention_interval), warm_start=False)
    try:
        variant = replay(options, source=source).variants[0]
    except KvtraceError as error:
        raise SweepTaskError(f"{_describe(task)}: {error}", error.hint) from None
    summary = variant.summary
    return {"variant": task.variant, "retention_interval": task.retention_interval,
            "num_gpu_blocks": task.num_gpu_blocks, "pool_fraction": task.pool_fraction,
            **{name: summary[name] for name in SUMMARY_FIGURES},
            "evictions": summary["evictions"].get("lru_reuse", 0),
            "steps": variant.steps, "wall_s": round(variant.wall_s, 3)}


class SweepTaskError(KvtraceError):
    """A configuration failed in a worker; pickles with its hint (workers send it back)."""

    def __reduce__(self):
        return type(self), (str(self), self.hint)


# --- running the grid ---------------------------------------------------------------------------


def run_sweep(plan: SweepPlan, *, jobs: int = 1, ray_address: str | None = None,
              on_row: RowCallback | None = None) -> SweepResult:
    """Run every configuration of ``plan``: in this process (``jobs`` 1), in ``jobs`` local
    processes, or on Ray (``ray_address``: an address, ``auto``, or ``local`` for a private
    local instance of ``jobs`` CPUs). ``on_row(finished, total, row)`` as each one finishes."""
    started = time.perf_counter()
    rows: list[dict[str, Any] | None] = [None] * len(plan.tasks)

    def finished(task: SweepTask, row: dict[str, Any]) -> None:
        rows[task.index] = row
        if on_row is not None:
            on_row(sum(r is not None for r in rows), len(rows), row)

    if ray_address is not None:
        runner = _run_on_ray(plan, ray_address, jobs, finished)
    elif jobs > 1 and len(plan.tasks) > 1:
        runner = _run_in_processes(plan, min(jobs, len(plan.tasks)), finished)
    else:
        runner = "this process"
        for task in plan.tasks:
            finished(task, run_configuration(plan.source, plan.digest, plan.backend, task))
    return SweepResult(plan, rows, runner, time.perf_counter() - started)


def _run_in_processes(plan: SweepPlan, jobs: int,
                      finished: Callable[[SweepTask, dict[str, Any]], None]) -> str:
    """``jobs`` worker processes, forked once this one has read the source and built a backend
    (importing vLLM takes seconds), so that workers start with both; spawned where there is
    no fork (they then read and import once each). The workers live only as long as the
    sweep: stopped when it fails or is stopped, killed with it if it is killed."""
    import multiprocessing

    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    if method == "fork":
        _warm_up(plan)
    pool = None
    try:
        with stop_signals_deferred():
            pool = multiprocessing.get_context(method).Pool(
                jobs, initializer=become_pool_worker, initargs=(os.getpid(),))
        for index, row in pool.imap_unordered(
                _run_task, [(plan.source, plan.digest, plan.backend, task) for task in plan.tasks]):
            finished(plan.tasks[index], row)
    except BaseException:
        if pool is not None:
            pool.terminate()
        raise
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    return f"{jobs} local processes"


def _run_task(arguments: tuple[str, str, str, SweepTask]) -> tuple[int, dict[str, Any]]:
    """A worker's task: one configuration, and its place in the grid."""
    task = arguments[-1]
    return task.index, run_configuration(*arguments)


def _warm_up(plan: SweepPlan) -> None:
    """Build (and close) one backend of the sweep here: what it imports, workers inherit."""
    source = _source_for(plan.source, plan.digest)
    task = plan.tasks[0]
    config, _ = derive(source.header.config, plan.source,
                       Overrides(task.num_gpu_blocks, task.retention_interval))
    with open_backend(plan.backend, config, task.variant, lambda record: None):
        pass


def _run_on_ray(plan: SweepPlan, address: str, jobs: int,
                finished: Callable[[SweepTask, dict[str, Any]], None]) -> str:
    """The same tasks as Ray tasks; the source travels through Ray's object store, so workers
    on other hosts need no copy of it. A process already connected to Ray keeps using it."""
    ray = import_ray()
    started_here = not ray.is_initialized()
    done_with_ray = threading.Event()
    try:
        if started_here:
            connect_to_ray(ray, address, jobs, done_with_ray)
        with open(plan.source, "rb") as file:
            data = ray.put(file.read())
        remote = ray.remote(num_cpus=1)(run_configuration)
        task_of = {remote.remote(plan.source, plan.digest, plan.backend, task, data): task
                   for task in plan.tasks}
        pending = list(task_of)
        try:
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                try:
                    row = ray.get(done[0])
                except ray.exceptions.RayTaskError as error:
                    if isinstance(error.cause, KvtraceError):
                        raise error.cause from None
                    raise
                finished(task_of[done[0]], row)
        except BaseException:
            for ref in pending:
                ray.cancel(ref)
            raise
        if not started_here:
            return "the connected Ray cluster"
        return "a local Ray instance" if address == "local" else f"Ray at {address}"
    finally:
        if started_here:  # an instance started here, even half-way, is shut down
            shut_down_ray(ray)
            done_with_ray.set()
