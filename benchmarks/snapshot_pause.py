"""How long a capture's start snapshot holds vLLM's scheduler thread, against one scheduler step.

A capture arms at the start of the engine's next step, on the scheduler thread: it reads the
whole cache (every keyed or held block, every key, every request in flight with its blocks in
each group) and only then lets the step run. This measures that pause on a full pool of a
model preset's geometry as vLLM 0.33 builds it for an H200 (``kvtrace geometry``), with vLLM's
own ``Scheduler`` and ``KVCacheManager`` (``kvtrace engine``'s) serving the #56794 seed scenario
until no block is left that is neither held nor cached.

Two baselines in the same state and the same process: the scheduler steps that follow (vLLM's
``schedule()`` plus ``update_from_output()``, cache work only: a GPU step also runs the model),
timed (median and range of ``--repeats``), and, where valgrind is installed, counted in
instructions under callgrind (``benchmarks/callgrind.py``), which the machine's load does not
move.

With ``--keyframe``, the pause measured is a flight recorder's keyframe instead
(``kvtrace capture --ring``): the same snapshot, taken while the capture's probes record, after
they report the requests in flight and hand over the step that ended
(``snapshot.take_keyframe``). Issue #32's goal for it: at most half a step, on the default
model's full pool.

    .venv/bin/python benchmarks/snapshot_pause.py [--models kimi-k3,qwen3-next-80b-a3b]
                                                  [--keyframe] [--repeats 15] [--no-count]
                                                  [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import callgrind  # noqa: E402

from kvtrace.events import HashInterner  # noqa: E402
from kvtrace.probes import CacheProbes, snapshot  # noqa: E402

DEFAULT_MODELS = ("kimi-k3", "qwen3-next-80b-a3b")  # the default model; the largest pool
COUNTED_STEPS = 5


def full_engine(model: str, directory: str):
    """vLLM's scheduler on ``model``'s full-size pool, run until the pool is full; returns it."""
    from kvtrace.engine.core import EngineOptions, VllmScheduler, load_workload
    from kvtrace.workloads.synth import synthesize
    from kvtrace.workloads.workload import EngineShape, write_workload

    geometry = EngineShape(model=model).geometry
    shape = EngineShape(model=model, num_gpu_blocks=geometry.num_gpu_blocks)
    blocks_needed = geometry.num_gpu_blocks * geometry.block_size
    workload = synthesize("documents", max(64, blocks_needed // 12_000), 0,
                          shape.hash_block_size, {"rate": 1000.0})
    path = os.path.join(directory, f"{model}.kvtrace")
    write_workload(path, workload, shape)
    loaded = load_workload(EngineOptions(path, variant="unfixed"))
    engine = VllmScheduler(loaded.config, loaded.settings, "unfixed")
    for arrival in loaded.arrivals:
        engine.add_request(arrival)
    pool = engine.scheduler.kv_cache_manager.block_pool
    for _ in range(100_000):
        unkeyed_free = sum(block.block_hash is None
                           for block in pool.free_block_queue.get_all_free_blocks())
        if not unkeyed_free or not engine.has_requests():
            break
        engine.step()
    return engine


class Pauses:
    """What holds the scheduler: a capture's arming, reading the start snapshot (its records
    are made later, on the capture's writer thread); or, with ``keyframe``, a ring's keyframe,
    taken by a probe set that records the steps in between, as a capture's does."""

    def __init__(self, keyframe: bool) -> None:
        self.keyframe = keyframe
        self.records: list = []
        self.probes = None
        if keyframe:
            self.probes = CacheProbes(self.records.append, HashInterner(),
                                      sink_many=self.records.extend).arm()

    def take(self, engine):
        manager = engine.scheduler.kv_cache_manager
        if not self.keyframe:
            probes = CacheProbes(lambda record: None, HashInterner(), emit_hash_bytes=True)
            return snapshot.take(manager, engine.scheduler, probes)
        taken = snapshot.take_keyframe(manager, engine.scheduler, self.probes)
        self.records.clear()
        return taken

    def close(self) -> None:
        if self.probes is not None:
            self.probes.disarm()


def describe(engine, pauses: Pauses) -> dict:
    manager = engine.scheduler.kv_cache_manager
    pool = manager.block_pool
    records = pauses.take(engine).records()
    return {"blocks": pool.num_gpu_blocks, "groups": len(manager.coordinator.single_type_managers),
            "held": sum(block.ref_cnt > 0 for block in pool.blocks),
            "keys": len(pool.cached_block_hash_to_block),
            "running": len(engine.scheduler.running), "waiting": len(engine.scheduler.waiting),
            "records": len(records)}


def timed(model: str, repeats: int, keyframe: bool) -> dict:
    """Wall times: snapshots and steps alternating, in the same (full) state."""
    with tempfile.TemporaryDirectory() as directory:
        engine = full_engine(model, directory)
        taker = Pauses(keyframe)
        engine.step()  # the probes have seen a step
        shape = describe(engine, taker)
        pauses, steps = [], []
        for _ in range(repeats):
            started = time.perf_counter_ns()
            taker.take(engine)
            pauses.append(time.perf_counter_ns() - started)
            started = time.perf_counter_ns()
            engine.step()
            steps.append(time.perf_counter_ns() - started)
        taker.close()
    return {**shape, "pause_ms": _spread(pauses), "step_ms": _spread(steps),
            "ratio": statistics.median(pauses) / statistics.median(steps)}


def _spread(values_ns: list[int]) -> dict:
    return {"median": statistics.median(values_ns) / 1e6, "min": min(values_ns) / 1e6,
            "max": max(values_ns) / 1e6}


def counted_child(model: str, keyframe: bool) -> None:
    """Under callgrind: ``COUNTED_STEPS`` snapshots and steps, each region counted."""
    regions = callgrind.Regions()
    with tempfile.TemporaryDirectory() as directory:
        engine = full_engine(model, directory)
        taker = Pauses(keyframe)
        engine.step()
        for index in range(COUNTED_STEPS):
            with regions.count(f"snapshot-{index}"):
                taker.take(engine)
            with regions.count(f"step-{index}"):
                engine.step()
        taker.close()


def counted(model: str, keyframe: bool) -> dict:
    with tempfile.TemporaryDirectory() as directory:
        counts, _ = callgrind.count_regions(
            [sys.executable, __file__, "--child", model, *["--keyframe"] * keyframe],
            directory)
    snapshots = [n for name, n in counts.items() if name.startswith("snapshot")]
    steps = [n for name, n in counts.items() if name.startswith("step")]
    return {"snapshot_instructions": _count_spread(snapshots),
            "step_instructions": _count_spread(steps),
            "ratio": statistics.median(snapshots) / statistics.median(steps)}


def _count_spread(values: list[int]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS))
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--no-count", action="store_true", help="skip the callgrind counts")
    parser.add_argument("--keyframe", action="store_true",
                        help="a flight recorder's keyframe instead of the start snapshot")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        counted_child(args.child, args.keyframe)
        return
    results = {}
    for model in args.models.split(","):
        result = timed(model, args.repeats, args.keyframe)
        if not args.no_count:
            try:
                result["instructions"] = counted(model, args.keyframe)
            except callgrind.CallgrindUnavailable as error:
                result["instructions"] = f"not counted: {error}"
        results[model] = result
        if not args.json:
            print(f"{model}: {result['blocks']} blocks x {result['groups']} groups, "
                  f"{result['held']} held, {result['keys']} keys, {result['running']} running + "
                  f"{result['waiting']} waiting requests -> {result['records']} records")
            pause, step = result["pause_ms"], result["step_ms"]
            print(f"  wall: {'keyframe' if args.keyframe else 'snapshot'} {pause['median']:.2f} ms ({pause['min']:.2f}-"
                  f"{pause['max']:.2f}), scheduler step {step['median']:.2f} ms "
                  f"({step['min']:.2f}-{step['max']:.2f}): {result['ratio']:.2f} steps")
            counts = result.get("instructions")
            if isinstance(counts, dict):
                snap, step = counts["snapshot_instructions"], counts["step_instructions"]
                print(f"  instructions: snapshot {snap['median'] / 1e6:.1f} M "
                      f"({snap['min'] / 1e6:.1f}-{snap['max'] / 1e6:.1f}), step "
                      f"{step['median'] / 1e6:.1f} M ({step['min'] / 1e6:.1f}-"
                      f"{step['max'] / 1e6:.1f}): {counts['ratio']:.2f} steps")
            elif counts:
                print(f"  instructions: {counts}")
    if args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
