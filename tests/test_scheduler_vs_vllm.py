"""Differential test of kvtrace's scheduler model against vLLM 0.33's own ``Scheduler``.

The same workload runs through vLLM's scheduler (``kvtrace engine``'s ``VllmScheduler``, with a
process-wide capture's probes) and through the model over the same real cache (``VllmBackend``
with its own probes). Every call the two make on the cache, in order, and every effect must be
the same record. Step records are left out: vLLM also runs a step that only reports finished
requests, which schedules nothing and touches no block.

On the same async workloads, the model backend's twins (its C core and the pure-Python
reference) driven by the scheduler model make the ``vllm`` backend's records, record for record,
and count its summary without making records.
"""

from __future__ import annotations

import dataclasses

import pytest
from msgspec.structs import replace

from test_model_backend import TWINS, first_divergence, reschedule, summaries_both_ways

from kvtrace.engine_config import SchedulerSettings
from kvtrace.events import BlocksCached, HashInterner, RequestArrived, SlotsAllocated, StepStarted
from kvtrace.replay.scheduler import Scheduler
from kvtrace.replay.summary import ReplaySummary
from kvtrace.workloads.workload import EngineShape, write_workload
from kvtrace.workloads.synth import synthesize
from third_party_data import MOONCAKE_SYNTHETIC

# (preset, requests, pool blocks or None for the preset's, whole-sequence admission)
SYNTH_CASES = [
    ("shared-prompt", 60, None, True),
    ("shared-prompt", 60, 30, True),  # tight: preemptions, admissions the whole prompt must fit
    ("shared-prompt", 60, 30, False),  # scheduler_reserve_full_isl off: admission by chunk
    ("chat", 60, 22, True),
    ("agent", 60, None, True),
]


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


def synth_workload(tmp_path, preset, num_requests, num_gpu_blocks, reserve_full_sequence,
                   async_scheduling):
    """A ``SYNTH_CASES`` workload as ``kvtrace engine`` loads it, under vLLM's ``Scheduler`` or
    ``AsyncScheduler``."""
    from kvtrace.engine.core import EngineOptions, load_workload

    path = tmp_path / "workload.kvtrace"
    shape = EngineShape(num_gpu_blocks=num_gpu_blocks)
    write_workload(path, synthesize(preset, num_requests, 0, shape.hash_block_size), shape)
    workload = load_workload(EngineOptions(str(path), variant="unfixed", speed=0))
    config = replace(workload.config, reserve_full_sequence=reserve_full_sequence,
                     async_scheduling=async_scheduling)
    return dataclasses.replace(workload, config=config,
                               settings=SchedulerSettings.from_config(config))


def mooncake_workload(tmp_path, async_scheduling):
    """The Mooncake trace's first 400 requests, imported with default settings but a 128-token
    hash unit, as ``kvtrace engine`` loads them."""
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
    return dataclasses.replace(workload, config=replace(workload.config,
                                                        async_scheduling=async_scheduling))


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("preset, num_requests, num_gpu_blocks, reserve_full_sequence",
                         SYNTH_CASES)
def test_the_model_schedules_exactly_as_vllm(tmp_path, preset, num_requests, num_gpu_blocks,
                                             reserve_full_sequence, async_scheduling):
    """Synchronously (vLLM's ``Scheduler``), and async (``AsyncScheduler`` with the engine
    core's batch queue: outputs a step late, blocks cached by ``update_from_output``)."""
    workload = synth_workload(tmp_path, preset, num_requests, num_gpu_blocks,
                              reserve_full_sequence, async_scheduling)
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
    records = assert_same_schedule(mooncake_workload(tmp_path, async_scheduling))
    assert sum(type(r).__name__ == "BlockTouched" for r in records) > 300  # prefix hits


def assert_twins_cache_as_vllm(workload) -> None:
    """The scheduler model on ``workload`` (an async one): each twin of the model backend makes
    the ``vllm`` backend's records, record for record, tokens in flight and ``cache_blocks``
    calls included; and each, counting without records, the summary of those records."""
    config, arrivals = workload.config, list(workload.arrivals)
    reference = reschedule("vllm", config, "unfixed", arrivals)  # an error ends it as a tuple
    assert not any(isinstance(r, tuple) for r in reference), reference[-1]
    assert any(isinstance(r, BlocksCached) for r in reference)
    assert any(isinstance(r, SlotsAllocated) and r.num_in_flight_tokens for r in reference)
    summary = ReplaySummary(config)
    for record in reference:
        summary(record)

    def drive(cache):
        Scheduler(cache, config, SchedulerSettings.from_config(config)).run(arrivals)

    for twin in TWINS:
        divergence = first_divergence(reference, reschedule(twin, config, "unfixed", arrivals))
        assert divergence is None, f"{twin} twin:\n{divergence}"
        from_records, counted = summaries_both_ways(twin, config, "unfixed", drive)
        assert from_records == counted == summary.to_dict(), twin


@pytest.mark.slow
@pytest.mark.parametrize("preset, num_requests, num_gpu_blocks, reserve_full_sequence",
                         SYNTH_CASES)
def test_the_model_backends_twins_cache_async_schedules_as_vllm(
        tmp_path, preset, num_requests, num_gpu_blocks, reserve_full_sequence):
    """The async workloads above on the model backend's twins against the ``vllm`` backend."""
    assert_twins_cache_as_vllm(synth_workload(tmp_path, preset, num_requests, num_gpu_blocks,
                                              reserve_full_sequence, True))


@pytest.mark.slow
def test_the_model_backends_twins_cache_the_async_mooncake_schedule_as_vllm(tmp_path):
    assert_twins_cache_as_vllm(mooncake_workload(tmp_path, True))


# How drafts are made: n-gram (no lookahead), MTP with 0.33's lookahead block hashes (its
# default), MTP dropping the last matched block (disable_lookahead_block_hashes).
DRAFTERS = {"ngram": ("ngram", None), "mtp": ("mtp", True), "mtp-drop": ("mtp", False)}


def drafting_workload(tmp_path, preset, num_gpu_blocks, async_scheduling, drafter):
    """A ``synth`` workload under vLLM's scheduler drafting two tokens a step with
    ``drafter`` (a ``DRAFTERS`` key), each accepted in turn with probability 0.7."""
    from kvtrace.engine_config import SchedulerSettings, drafter_fields
    from kvtrace.engine.core import EngineOptions, load_workload

    path = tmp_path / "workload.kvtrace"
    shape = EngineShape(num_gpu_blocks=num_gpu_blocks)
    write_workload(path, synthesize(preset, 60, 0, shape.hash_block_size), shape)
    workload = load_workload(EngineOptions(str(path), variant="unfixed", speed=0))
    config = replace(workload.config, async_scheduling=async_scheduling,
                     num_speculative_tokens=2)
    config = replace(config, **drafter_fields(config, *DRAFTERS[drafter]))
    return dataclasses.replace(workload, config=config,
                               settings=SchedulerSettings.from_config(config))


@pytest.mark.slow
@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("preset, num_gpu_blocks, async_scheduling", [
    ("shared-prompt", 30, False),  # tight: preemptions
    ("shared-prompt", 30, True),
    ("chat", 26, True),
    ("agent", None, False),
])
def test_the_model_drafts_and_verifies_as_vllm(tmp_path, preset, num_gpu_blocks,
                                               async_scheduling, drafter):
    """Speculative decoding: two draft tokens a decode step, each accepted in turn with
    probability 0.7 (``accepted_drafts``, the one draw ``kvtrace engine`` answers vLLM's
    scheduler with). The model schedules the drafts (and pads an admitted one-token decode
    with them), rolls back the rejected ones, appends the accepted ones, caches the verified
    tokens' blocks as ``update_from_output`` does, and proposes the next drafts
    (synchronously) or keeps their placeholders (async): the same records as vLLM's. With
    MTP, every allocation also reserves the two lookahead slots, and the cache hashes each
    unit with the token after it, or drops the last matched block."""
    workload = drafting_workload(tmp_path, preset, num_gpu_blocks, async_scheduling, drafter)
    records = assert_same_schedule(workload)
    decodes = [r.num_new_tokens for r in records if isinstance(r, SlotsAllocated)
               and r.num_computed_tokens >= r.num_tokens - 1]
    assert decodes.count(3) > 100, "decode steps carry their two drafts"
    assert sum(isinstance(r, BlocksCached) for r in records) > 100
    lookahead = {r.num_lookahead_tokens for r in records if isinstance(r, SlotsAllocated)}
    assert lookahead == ({0} if drafter == "ngram" else {2})


@pytest.mark.parametrize("drafter, expected_hits", [
    ("ngram", (0, 32, 32)),
    ("mtp", (0, 16, 32)),  # the second unit is hashed once A's first output token exists
    ("mtp-drop", (0, 16, 16)),  # every hit drops its last matched block
])
def test_each_drafters_hits_by_hand(drafter, expected_hits):
    """Hand-computed, on one full-attention group of 16-token blocks: A (a 32-token prompt)
    and B (48 tokens, A's two units first) arrive together, C (B's prompt) long after. B is
    admitted in A's step, when vLLM has keyed A's blocks but A has no output yet: n-gram
    drafting hits both of A's units, lookahead block hashes cannot key A's second unit before
    the token after it exists, and EAGLE's drop loses the last matched block. C comes after A
    decoded: only the drop still loses a unit. vLLM and the model agree record for record."""
    from kvtrace.engine.core import EngineWorkload
    from kvtrace.engine_config import SchedulerSettings, drafter_fields
    from kvtrace.events import ComputedBlocksFound, EngineConfig, KVCacheGroup
    from kvtrace.replay.arrivals import Arrival

    config = EngineConfig(kv_cache_groups=[KVCacheGroup(kind="full_attention", block_size=16)],
                          hash_block_size=16, num_gpu_blocks=64, max_model_len=1024,
                          max_num_batched_tokens=2048, max_num_seqs=8,
                          num_speculative_tokens=2)
    config = replace(config, **drafter_fields(config, *DRAFTERS[drafter]))
    arrivals = [Arrival(0, 32, [1, 2], 4, 0), Arrival(1, 48, [1, 2, 3], 4, 0),
                Arrival(2, 48, [1, 2, 3], 4, 10**12)]
    workload = EngineWorkload(config, SchedulerSettings.from_config(config), arrivals)
    records = assert_same_schedule(workload)
    hits = [r.num_hit_tokens for r in records if isinstance(r, ComputedBlocksFound)]
    assert tuple(hits) == expected_hits


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("drafter", ["ngram", "mtp"])
def test_the_verifiers_answers_read_off_a_capture_replay_its_run(tmp_path, async_scheduling,
                                                                  drafter):
    """The answers a capture's verifier gave (``DraftAcceptance.answers``, read off its
    outputs) replace the draw: vLLM's scheduler ran with drafts accepted at 0.7, the model
    runs with a fallback rate of 0 (every drawn draft rejected), and still makes vLLM's
    records, record for record: every step's answer came from the capture."""
    from kvtrace.events import TraceHeader
    from kvtrace.replay.source import read_source
    from kvtrace.traceio import TraceWriter

    workload = drafting_workload(tmp_path, "chat", 26, async_scheduling, drafter)
    captured = through_vllm(workload)
    path = tmp_path / "capture.kvtrace"
    with open(path, "wb") as file:
        writer = TraceWriter(file, TraceHeader(kvtrace_version="test", created_ns=0,
                                               source="capture", config=workload.config))
        for record in captured:
            writer.write(record)
        writer.close()
    answers = read_source(str(path)).draft_answers
    assert sum(answers.values()) > 100, "the capture's verifier accepted drafts"
    replayed = dataclasses.replace(workload, settings=dataclasses.replace(
        workload.settings, draft_acceptance=0.0, draft_answers=answers))
    expected, got = comparable(captured), comparable(through_model(replayed))
    first = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), None)
    assert first is None, f"record {first}: vLLM {expected[first]!r}, model {got[first]!r}"
    assert len(expected) == len(got)
