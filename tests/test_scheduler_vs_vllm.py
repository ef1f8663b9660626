"""Differential test of kvtrace's scheduler model against vLLM 0.33's own ``Scheduler``.

The same workload runs through vLLM's scheduler (``kvtrace engine``'s ``VllmScheduler``, with a
process-wide capture's probes) and through the model over the same real cache (``VllmBackend``
with its own probes). Every call the two make on the cache, in order, and every effect must be
the same record. Step records are left out: vLLM also runs a step that only reports finished
requests, which schedules nothing and touches no block.
"""

from __future__ import annotations

import dataclasses

import pytest
from msgspec.structs import replace

from kvtrace.events import HashInterner, RequestArrived, SlotsAllocated, StepStarted
from kvtrace.replay.scheduler import Scheduler
from kvtrace.workloads.workload import EngineShape, write_workload
from kvtrace.workloads.synth import synthesize
from third_party_data import MOONCAKE_SYNTHETIC


def through_vllm(workload) -> list:
    from kvtrace.probes import CacheProbes
    from kvtrace.engine.core import VllmScheduler

    engine = VllmScheduler(workload.config, workload.settings, "unfixed")
    records: list = []
    probes = CacheProbes(records.append, HashInterner(), req_number=int, created_ns=0).arm()
    try:
        engine.run(workload.arrivals)
    finally:
        probes.disarm()
    assert probes.num_failures == 0
    return records


def through_model(workload) -> list:
    from kvtrace.replay.vllm_backend import VllmBackend

    records: list = []
    # Dense hash ids in order of first appearance, as the capture above numbers them.
    with VllmBackend(workload.config, "unfixed", records.append,
                     hash_ids_from_bytes=False) as backend:
        Scheduler(backend, workload.config, workload.settings).run(list(workload.arrivals))
    return records


def comparable(records: list) -> list:
    """Inputs and effects without step records. Cleared: arrival times (the engine stamps the
    wall clock, the model its virtual one) and ``has_scheduled_reqs`` (it only matters with a
    watermark, vLLM's default has none, and the model does not pass it)."""
    cleared = {RequestArrived: {"arrival_ns": 0}, SlotsAllocated: {"has_scheduled_reqs": False}}
    return [replace(record, **cleared[type(record)]) if type(record) in cleared else record
            for record in records
            if not isinstance(record, StepStarted) and record.family in ("input", "effect")]


def assert_same_schedule(workload) -> list:
    """Both schedulers on ``workload``: the same records, in the same order; returns them."""
    expected, got = comparable(through_vllm(workload)), comparable(through_model(workload))
    first = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), None)
    assert first is None, f"record {first}: vLLM {expected[first]!r}, model {got[first]!r}"
    assert len(expected) == len(got)
    return expected


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("preset, num_requests, num_gpu_blocks, reserve_full_sequence", [
    ("shared-prompt", 60, None, True),
    ("shared-prompt", 60, 30, True),  # tight: preemptions, admissions the whole prompt must fit
    ("shared-prompt", 60, 30, False),  # scheduler_reserve_full_isl off: admission by chunk
    ("chat", 60, 22, True),
    ("agent", 60, None, True),
])
def test_the_model_schedules_exactly_as_vllm(tmp_path, preset, num_requests, num_gpu_blocks,
                                             reserve_full_sequence, async_scheduling):
    """Synchronously (vLLM's ``Scheduler``), and async (``AsyncScheduler`` with the engine
    core's batch queue: outputs a step late, blocks cached by ``update_from_output``)."""
    from kvtrace.engine_config import SchedulerSettings
    from kvtrace.engine.core import EngineOptions, load_workload

    path = tmp_path / "workload.kvtrace"
    shape = EngineShape(num_gpu_blocks=num_gpu_blocks)
    write_workload(path, synthesize(preset, num_requests, 0, shape.hash_block_size), shape)
    workload = load_workload(EngineOptions(str(path), variant="unfixed", speed=0))
    config = replace(workload.config, reserve_full_sequence=reserve_full_sequence,
                     async_scheduling=async_scheduling)
    workload = dataclasses.replace(workload, config=config,
                                   settings=SchedulerSettings.from_config(config))

    kinds = {type(r).__name__ for r in assert_same_schedule(workload)}
    assert {"SlotsAllocated", "ComputedBlocksFound", "BlockStored", "CheckpointRecorded"} <= kinds
    if num_gpu_blocks is not None:
        assert "RequestPreempted" in kinds
    assert ("BlocksCached" in kinds) == async_scheduling


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_the_model_schedules_the_mooncake_trace_exactly_as_vllm(tmp_path, async_scheduling):
    """A real request log's first 400 requests, imported with default settings: long prompts,
    no output units named (decode makes hash ids up), many shared prefixes."""
    from click.testing import CliRunner

    from kvtrace.cli import cli
    from kvtrace.engine.core import EngineOptions, load_workload

    log = tmp_path / "mooncake-400.jsonl"
    with open(MOONCAKE_SYNTHETIC) as full:
        log.write_text("".join(line for _, line in zip(range(400), full)))
    path = tmp_path / "mooncake.kvtrace"
    result = CliRunner().invoke(cli, ["import", "mooncake", str(log), "--hash-unit", "128",
                                      "-o", str(path)],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    workload = load_workload(EngineOptions(str(path), variant="unfixed", speed=0))
    workload = dataclasses.replace(workload, config=replace(workload.config,
                                                            async_scheduling=async_scheduling))
    records = assert_same_schedule(workload)
    assert sum(type(r).__name__ == "BlockTouched" for r in records) > 300  # prefix hits
