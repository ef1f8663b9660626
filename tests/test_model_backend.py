"""The ``model`` backend against the real vLLM 0.33.0 cache (the ``vllm`` backend).

Both twins of the model - pure Python (the reference) and its optional C core - are held to
vLLM. Differential, libCacheSim-style: seeded schedules drawn from the synth presets over varied
engines (geometry, Mamba groups, checkpoint settings, retention 0 / N / dense, pool pressure,
preemption, caching off, every variant) are replayed on both backends by the same scheduler
model, synchronously and with vLLM's async scheduling (outputs a step late: tokens in flight,
``cache_blocks`` calls), and the record streams must be equal record for record; a mismatch
reports the first divergence with the records before it. Lockstep re-issues of the vLLM streams
must agree too, and so must the bundled Mooncake trace in full (slow). Then hand-computed checks of the block
pool (free-queue LRU order, eviction, the null block, reference counts) and of the seed's
checkpoint scenario on the model alone.
"""

from __future__ import annotations

import math
import random
import subprocess
import sys
from collections import Counter
from functools import lru_cache
from pathlib import Path

import msgspec
import pytest

from kvtrace.engine_config import SchedulerSettings
from kvtrace.errors import KvtraceError
from kvtrace.events import (
    BlockAllocated,
    BlockFreed,
    BlockRemoved,
    BlockStored,
    BlockTouched,
    CheckpointSuppressed,
    EngineConfig,
    KVCacheGroup,
    RemoveReason,
    SlotsAllocated,
    StaleKeyLeft,
    StoreKind,
)
from kvtrace.replay.arrivals import Arrival
from kvtrace.replay.backend import open_backend, open_counting_backend
from kvtrace.replay.lockstep import replay_lockstep
from kvtrace.replay.model import ModelBackend, NativeModelBackend, native, open_model_backend
from kvtrace.replay.model.pool import BlockPool
from kvtrace.replay.model.reports import Records
from kvtrace.replay.scheduler import Scheduler
from kvtrace.replay.summary import ReplaySummary
from kvtrace.replay.variants import (
    MODELLED_VARIANTS, VARIANTS, CheckpointAction, CheckpointFacts)
from kvtrace.workloads.synth import synthesize
from vllm_support import (  # noqa: F401 (vllm_backend_class is a fixture)
    SEED_HASH_IDS, prefill_chunks, run_mixed_workload, seed_config, seed_hash_id,
    vllm_backend_class)

NUM_CASES = 208
# Every seeded schedule runs under both of vLLM's schedulers: "async" is the AsyncScheduler.
SCHEDULINGS = ("sync", "async")
# The model's twins: the reference in Python, and the C core where it is built.
TWINS = {"python": ModelBackend, **({"native": NativeModelBackend} if native.built else {})}
# (hash unit, full-attention block sizes, Mamba block size or None): the old test geometries,
# equal attention and Mamba blocks with the hash unit at the block or finer, a Mamba block at
# the hash unit (no fine-grained hits), a scheduler block above the Mamba block, two
# full-attention specs (the hit search's fixed point over three spec groups), one-group engines.
GEOMETRIES = [(16, (16,), 32), (32, (32,), 128), (64, (64,), 64), (32, (128,), 128),
              (16, (32,), 32), (32, (32,), 32), (32, (64,), 32), (16, (16, 32), 32),
              (16, (16,), None), (32, (), 32)]
PRESET_OVERRIDES = {
    "shared-prompt": {"system_prompts": 3, "system_prompt_len": 160, "prompt_len": 48,
                      "output_len": 24},
    "chat": {"system_prompts": 2, "system_prompt_len": 96, "prompt_len": 40, "output_len": 40,
             "turns": 3.0},
    "agent": {"system_prompts": 2, "system_prompt_len": 192, "prompt_len": 48, "output_len": 32,
              "tool_call_len": 16, "tool_output_len": 64, "turns": 4.0},
}


def schedule_case(seed: int, scheduling: str = "sync") -> tuple[EngineConfig, str, list[Arrival]]:
    """A small seeded schedule: preset, engine and variant all drawn from ``seed``; the engine
    schedules as ``scheduling`` says (``SCHEDULINGS``)."""
    rng = random.Random(seed)
    preset = list(PRESET_OVERRIDES)[seed % 3]
    variant = MODELLED_VARIANTS[seed // 3 % len(MODELLED_VARIANTS)]
    unit, attention, mamba = GEOMETRIES[seed % len(GEOMETRIES)]
    num_mamba = 0 if mamba is None else rng.choice([1, 1, 1, 2, 3])
    alignment = rng.choice([16, unit, None])
    checkpoint_blocks = 0 if alignment is None else rng.choice([1, 1, 1, 0])
    groups = [KVCacheGroup(kind="full_attention", block_size=size) for size in attention]
    groups += [KVCacheGroup(kind="mamba", block_size=mamba or 0, mamba_cache_mode="align",
                            num_prefill_checkpoint_blocks=checkpoint_blocks,
                            prefill_checkpoint_alignment=alignment)] * num_mamba
    scheduler_block = math.lcm(*(group.block_size for group in groups))
    retention = rng.choice([0, 0, None, scheduler_block, 2 * scheduler_block,
                            4 * scheduler_block]) if num_mamba else rng.choice([0, None])
    workload = synthesize(preset, rng.randint(5, 10), seed, unit, PRESET_OVERRIDES[preset])
    longest = max(request.num_tokens for request in workload.requests)
    one_request = 1 + sum(-(-longest // size) for size in attention) \
        + num_mamba * (2 + checkpoint_blocks)
    distinct = sum(len(r.hash_ids) + r.max_tokens // unit for r in workload.requests) * unit \
        // min(size for size in [*attention, mamba or 0] if size)
    num_gpu_blocks = max(one_request + rng.choice([0, 2, 8]),
                         int(rng.choice([0.05, 0.15, 0.3, 1.0]) * distinct * len(groups)))
    config = EngineConfig(
        kv_cache_groups=groups, hash_block_size=unit if attention else mamba,
        num_gpu_blocks=num_gpu_blocks, retention_interval=retention,
        enable_caching=rng.random() > 0.05,
        max_model_len=-(-longest // scheduler_block) * scheduler_block
        + rng.choice([0, scheduler_block]),
        max_num_batched_tokens=rng.choice([64, 128, 256, 512]),
        max_num_seqs=rng.choice([2, 4, 8]), long_prefill_token_threshold=rng.choice([0, 0, 96]),
        reserve_full_sequence=rng.random() < 0.5, async_scheduling=scheduling == "async")
    arrivals = [Arrival(req, r.prompt_len, r.hash_ids, r.max_tokens, r.arrival_ns,
                        r.output_hash_ids or None) for req, r in enumerate(workload.requests)]
    return config, variant, arrivals


def open_cache(backend: str, config: EngineConfig, variant: str, sink):
    """``backend``: "vllm", or a twin of the model ("python", "native")."""
    if backend in TWINS:
        return TWINS[backend](config, variant, sink)
    return open_backend(backend, config, variant, sink)


def reschedule(backend: str, config: EngineConfig, variant: str,
               arrivals: list[Arrival]) -> list:
    """The records of one backend under the scheduler model; an error ends the stream."""
    records: list = []
    try:
        with open_cache(backend, config, variant, records.append) as cache:
            Scheduler(cache, config, SchedulerSettings.from_config(config)).run(arrivals)
    except Exception as error:  # the same error at the same point is part of agreeing
        records.append(("error", type(error).__name__, str(error)))
    return records


def first_divergence(reference: list, replayed: list, context: int = 8) -> str | None:
    """None if the streams are equal; else where they first differ, with what came before."""
    for index, (mine, theirs) in enumerate(zip(reference, replayed)):
        if mine != theirs:
            before = "\n".join(f"    {record!r}" for record in reference[index - context:index])
            return (f"record #{index} differs\n  after:\n{before}\n  vllm:  {mine!r}\n"
                    f"  model: {theirs!r}")
    if len(reference) != len(replayed):
        shorter = "vllm" if len(reference) < len(replayed) else "model"
        return (f"the {shorter} stream ends first, at record #{min(len(reference), len(replayed))}"
                f" of {max(len(reference), len(replayed))}")
    return None


@lru_cache(maxsize=None)
def vllm_stream(seed: int, scheduling: str = "sync") -> tuple:
    config, variant, arrivals = schedule_case(seed, scheduling)
    return tuple(reschedule("vllm", config, variant, arrivals))


@pytest.mark.parametrize("scheduling", SCHEDULINGS)
@pytest.mark.parametrize("seed", range(NUM_CASES))
def test_both_backends_write_the_same_records(vllm_backend_class, seed, scheduling):
    config, variant, arrivals = schedule_case(seed, scheduling)
    reference = list(vllm_stream(seed, scheduling))
    for twin in TWINS:
        divergence = first_divergence(reference, reschedule(twin, config, variant, arrivals))
        assert divergence is None, f"{twin} twin, seed {seed}, {variant}, {config}:\n{divergence}"


@pytest.mark.parametrize("scheduling", SCHEDULINGS)
@pytest.mark.parametrize("seed", range(0, NUM_CASES, 8))
def test_lockstep_reissues_agree(vllm_backend_class, seed, scheduling):
    """Lockstep (sync_request with tokens in flight, captured admission terms, cache_blocks,
    released copy-on-write blocks) on a vLLM stream: both backends reproduce it exactly."""
    config, variant, _ = schedule_case(seed, scheduling)
    captured = [r for r in vllm_stream(seed, scheduling) if not isinstance(r, tuple)]
    for backend in ["vllm", *TWINS]:
        replayed: list = []
        with open_cache(backend, config, variant, replayed.append) as cache:
            replay_lockstep(captured, cache)
        assert first_divergence(captured, replayed) is None, backend


def seed_scenario(backend, with_junction: bool) -> None:
    """Reference §6 by direct calls: the 240-token producer in chunks of 128 and 112, after a
    prior request cached the shared 96 tokens (the junction) or not."""
    step = 0
    if with_junction:
        backend.add_request(1, 128, SEED_HASH_IDS[:6] + [900, 901], 1)
        step = prefill_chunks(backend, 1, [128]) + 1
        backend.free(1)
    backend.add_request(0, 240, SEED_HASH_IDS, 4)
    prefill_chunks(backend, 0, [128, 112], first_step=step)
    backend.free(0)


DIRECT_CASES = [(variant, retention, scenario) for variant in MODELLED_VARIANTS
                for retention in (None, 0) for scenario in ("seed", "junction", "mixed")]


@lru_cache(maxsize=None)
def direct_stream(backend: str, variant: str, retention: int | None, scenario: str) -> tuple:
    """The records of calls made directly on a backend (no scheduler model)."""
    records: list = []
    config = seed_config(retention, num_gpu_blocks=48 if scenario == "mixed" else 64)
    with open_cache(backend, config, variant, records.append) as cache:
        if scenario == "mixed":
            run_mixed_workload(cache)
        else:
            seed_scenario(cache, scenario == "junction")
    return tuple(records)


@pytest.mark.parametrize("variant,retention,scenario", DIRECT_CASES)
def test_direct_calls_write_the_same_records(vllm_backend_class, variant, retention, scenario):
    """Hand-made schedules: the seed scenarios, and a mixed one with a preemption, an abort and
    decode that completes hash units."""
    reference = list(direct_stream("vllm", variant, retention, scenario))
    for twin in TWINS:
        divergence = first_divergence(reference,
                                      list(direct_stream(twin, variant, retention, scenario)))
        assert divergence is None, f"{twin} twin: {divergence}"


def summaries_both_ways(twin: str, config: EngineConfig, variant: str, drive) -> tuple:
    """(ReplaySummary over the twin's records, the twin's own counts, no record made) of
    ``drive(cache)``, as figures; an error (the same at the same point is part of agreeing) as
    its text."""
    results = []
    for counting in (False, True):
        summary = ReplaySummary(config)
        try:
            with (TWINS[twin](config, variant, summary=summary) if counting
                  else TWINS[twin](config, variant, summary)) as cache:
                drive(cache)
        except Exception as error:
            results.append(("error", type(error).__name__, str(error)))
        else:
            results.append(summary.to_dict())
    return tuple(results)


@lru_cache(maxsize=None)
def counted_figures(case: int | tuple, scheduling: str = "sync") -> dict:
    """Per twin, ``summaries_both_ways`` of a seeded schedule (under ``scheduling``) or a
    direct case."""
    if isinstance(case, int):
        config, variant, arrivals = schedule_case(case, scheduling)

        def drive(cache):
            Scheduler(cache, config, SchedulerSettings.from_config(config)).run(arrivals)
    else:
        variant, retention, scenario = case
        config = seed_config(retention, num_gpu_blocks=48 if scenario == "mixed" else 64)

        def drive(cache):
            if scenario == "mixed":
                run_mixed_workload(cache)
            else:
                seed_scenario(cache, scenario == "junction")
    return {twin: summaries_both_ways(twin, config, variant, drive) for twin in TWINS}


COUNTING_CASES = [*((seed, scheduling) for scheduling in SCHEDULINGS for seed in range(NUM_CASES)),
                  *((case, "sync") for case in DIRECT_CASES)]


@pytest.mark.parametrize("case,scheduling", COUNTING_CASES)
def test_counting_twins_sum_up_as_their_records_do(case, scheduling):
    """Summary-only replays: each twin, making no record, counts what ``ReplaySummary`` counts
    over its full record stream."""
    for twin, (from_records, counted) in counted_figures(case, scheduling).items():
        assert counted == from_records, f"{twin} twin, case {case}, {scheduling}"


def test_the_counted_figures_are_not_trivial():
    """Guards the comparison above: over the cases, every figure counted is nonzero somewhere
    (resumed hits, each removal reason and store kind, hits in every kind of group...)."""
    seen: Counter = Counter()
    for case in COUNTING_CASES:
        figures = counted_figures(*case)["python"][0]
        if isinstance(figures, tuple):
            continue
        for name in ("hit_tokens", "resumed_hit_tokens", "checkpoints_published",
                     "checkpoints_suppressed", "stale_key_hazards", "preemptions"):
            seen[name] += figures[name] > 0
        seen.update(f"evictions.{reason}" for reason in figures["evictions"])
        for group in figures["groups"].values():
            seen[f"{group['kind']}.hit_blocks"] += group["hit_blocks"] > 0
            seen[f"{group['kind']}.evicted"] += group["evicted"] > 0
            seen.update(f"{group['kind']}.stored.{kind}" for kind in group["stored"])
    for name in ("hit_tokens", "resumed_hit_tokens", "checkpoints_published",
                 "checkpoints_suppressed", "stale_key_hazards", "preemptions",
                 "evictions.lru_reuse", "evictions.rekey", "evictions.stale_checkpoint",
                 "full_attention.hit_blocks", "mamba.hit_blocks", "full_attention.evicted",
                 "mamba.evicted", "full_attention.stored.full", "mamba.stored.partial",
                 "mamba.stored.checkpoint"):
        assert seen[name] > 0, (name, seen)


def record_name(record) -> str:
    """A record's kind, with the reason / store kind where those matter, and whether an
    allocation's request had tokens in flight."""
    if isinstance(record, tuple):
        return "error"
    if isinstance(record, SlotsAllocated) and record.num_in_flight_tokens:
        return "SlotsAllocated.IN_FLIGHT"
    if isinstance(record, BlockRemoved):
        return f"BlockRemoved.{RemoveReason(record.reason).name}"
    if isinstance(record, BlockStored):
        return f"BlockStored.{StoreKind(record.kind).name}"
    return type(record).__name__


def test_the_cases_exercise_what_the_caches_must_agree_on(vllm_backend_class):
    """Guards the generator: the schedules reach every behaviour the comparison is about."""
    seen: Counter = Counter()
    variants, retentions, group_counts = set(), set(), set()
    for seed in range(NUM_CASES):
        config, variant, _ = schedule_case(seed)
        variants.add(variant)
        retentions.add("dense" if config.retention_interval is None
                       else "0" if config.retention_interval == 0 else "N")
        group_counts.add(len(config.kv_cache_groups))
        for scheduling in SCHEDULINGS:
            seen.update(map(record_name, vllm_stream(seed, scheduling)))
    assert variants == set(MODELLED_VARIANTS) and retentions == {"dense", "0", "N"}
    assert {1, 2, 3, 4} <= group_counts
    # a pool too small to admit a request is rare
    assert seen["error"] < len(SCHEDULINGS) * NUM_CASES // 20
    for case in DIRECT_CASES:
        seen.update(map(record_name, direct_stream("vllm", *case)))
    for name in ("RequestPreempted", "BlocksReleased", "BlockTouched", "BoundaryStateOffloaded",
                 "CheckpointRecorded", "CheckpointSuppressed", "StaleKeyLeft",
                 "BlockRemoved.LRU_REUSE", "BlockRemoved.REKEY", "BlockRemoved.STALE_CHECKPOINT",
                 "BlockStored.FULL", "BlockStored.PARTIAL", "BlockStored.CHECKPOINT",
                 "BlocksCached", "SlotsAllocated.IN_FLIGHT"):
        assert seen[name] > 0, (name, seen)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["unfixed", "fixed"])
def test_the_mooncake_trace_in_full(vllm_backend_class, tmp_path, variant):
    """The bundled Mooncake FAST'25 trace, every request, as `kvtrace import mooncake` makes it:
    over a million records, equal one for one."""
    from third_party_data import MOONCAKE_SYNTHETIC
    from kvtrace.engine_config import derive
    from kvtrace.replay.arrivals import arrivals_of
    from kvtrace.traceio import read_records
    from kvtrace.workloads.mooncake import import_mooncake
    from kvtrace.workloads.workload import EngineShape, write_workload

    path = tmp_path / "mooncake.kvtrace"
    shape = EngineShape()
    write_workload(path, import_mooncake(MOONCAKE_SYNTHETIC, shape.hash_block_size), shape)
    reader, records = read_records(path)
    config, _ = derive(reader.header.config, str(path))
    arrivals = arrivals_of(records)
    reference = reschedule("vllm", config, variant, arrivals)
    assert len(reference) > 1_000_000
    for twin in TWINS:
        assert first_divergence(reference, reschedule(twin, config, variant, arrivals)) is None


# --- the model alone: the variants' table and hand-computed pool behaviour ---------------------


def facts(**changes) -> CheckpointFacts:
    base = dict(retention_interval=0, num_tokens=128, num_prompt_tokens=240, position=112,
                shared_prefix_boundary=0, is_prompt_checkpoint=False, is_retained=False)
    return CheckpointFacts(**{**base, **changes})


@pytest.mark.parametrize("case,expected", [
    # (facts, {variant: action}) - reference §5's table, and vLLM 0.33's gate
    (facts(), {"unfixed": "publish", "fixed": "strip", "naive": "keep_local",
               "upstream": "strip"}),
    (facts(retention_interval=None), {"unfixed": "publish", "fixed": "publish",
                                      "naive": "publish", "upstream": "strip"}),
    (facts(retention_interval=None, is_retained=True), {"upstream": "publish"}),
    (facts(shared_prefix_boundary=112), {"fixed": "publish", "naive": "publish",
                                         "upstream": "publish"}),
    (facts(num_tokens=240, is_prompt_checkpoint=True), {"fixed": "publish",
                                                        "upstream": "publish"}),
    (facts(retention_interval=256), {"fixed": "publish", "upstream": "strip"}),
])
def test_the_variants_decision_table(case, expected):
    for name, action in expected.items():
        assert VARIANTS[name].checkpoint_action(case) is CheckpointAction(action), name


def pool_of(num_blocks: int) -> tuple[BlockPool, list]:
    records = Records()
    return BlockPool(num_blocks, 2, 16, True, {}, records), records


def test_the_free_queue_starts_in_id_order_without_the_null_block():
    pool, _ = pool_of(6)
    assert pool.free_queue() == [1, 2, 3, 4, 5] and pool.num_free == 5
    assert pool.get_new_blocks(2, 7) == [1, 2]
    assert pool.free_queue() == [3, 4, 5] and pool.ref[1:3] == [1, 1]


def test_freed_blocks_go_to_the_head_unless_keyed_then_to_the_tail():
    pool, records = pool_of(8)
    a, b, c, d = pool.get_new_blocks(4, 0)  # 1, 2, 3, 4; queue [5, 6, 7]
    pool.insert_key(500, 0, b, 32, StoreKind.FULL, 0)
    pool.insert_key(501, 0, c, 48, StoreKind.FULL, 0)
    records.clear()
    pool.free_blocks([d, c, b, a])  # a request's blocks, tail first
    # Unkeyed ones in the given order at the head (reused first), keyed ones at the tail (LRU).
    assert pool.free_queue() == [4, 1, 5, 6, 7, 3, 2]
    assert records == [BlockFreed(4, 0, False), BlockFreed(3, 0, True), BlockFreed(2, 0, True),
                       BlockFreed(1, 0, False)]


def test_reusing_a_cached_block_evicts_its_keys_and_a_hit_does_not_move_it():
    pool, records = pool_of(5)
    blocks = pool.get_new_blocks(4, 0)  # 1..4, queue empty
    for block, hash_id in zip(blocks, (10, 11, 12, 13)):
        pool.insert_key(hash_id, 1, block, 16 * hash_id, StoreKind.FULL, 0)
    pool.free_blocks(blocks)  # all keyed: tail in order, queue [1, 2, 3, 4]
    pool.touch([2], 9)  # a prefix hit on 2: out of the queue, the rest keep their order
    assert pool.free_queue() == [1, 3, 4] and pool.ref[2] == 1
    pool.free_blocks([2])  # freed again: to the tail, now the most recently used
    assert pool.free_queue() == [1, 3, 4, 2]
    records.clear()
    assert pool.get_new_blocks(2, 5) == [1, 3]
    assert records == [BlockRemoved(1, 10, 1, 0, RemoveReason.LRU_REUSE),
                       BlockRemoved(3, 12, 1, 0, RemoveReason.LRU_REUSE),
                       BlockAllocated(1, 5), BlockAllocated(3, 5)]
    assert pool.cached_block(10, 1) is None and pool.cached_block(11, 1) == 2


def test_reference_counts_keep_a_shared_block_out_of_the_queue():
    pool, records = pool_of(4)
    (block,) = pool.get_new_blocks(1, 0)
    pool.touch([block, 0], 1)  # the null block is skipped
    assert pool.ref[block] == 2 and pool.ref[0] == 0
    pool.free_blocks([block, 0])
    assert pool.ref[block] == 1 and block not in pool.free_queue()
    pool.free_blocks([block])
    assert pool.free_queue()[0] == block
    assert [type(r) for r in records] == [BlockAllocated, BlockTouched, BlockFreed, BlockFreed]


def test_the_null_block_is_never_pooled_keyed_or_reported():
    pool, records = pool_of(3)
    assert pool.cache_partial_block([7, 8], 2, 0, 32, 0, False, StoreKind.PARTIAL, 0) is None
    pool.free_blocks([0], released=True)
    assert pool.free_queue() == [1, 2] and pool.keys_on(0) == []
    assert len(records) == 1 and records[0].block_ids == []


def test_duplicate_keys_hit_the_oldest_block_and_strip_removes_every_key():
    pool, records = pool_of(4)
    first, second = pool.get_new_blocks(2, 0)
    pool.insert_key(70, 0, first, 32, StoreKind.FULL, 0)
    pool.insert_key(70, 0, second, 32, StoreKind.FULL, 0)  # no dedup: block tables append only
    pool.insert_key(71, 0, second, 16, StoreKind.PARTIAL, 0)  # a secondary key
    assert pool.cached_block(70, 0) == first
    assert pool.strip_keys(first, RemoveReason.REKEY) == [(70, 0)]
    assert pool.cached_block(70, 0) == second
    assert pool.strip_keys(second, RemoveReason.REKEY) == [(70, 0), (71, 0)]
    assert pool.cached_block(70, 0) is None and pool.cached_block(71, 0) is None


@pytest.mark.parametrize("variant,published,stripped,stale", [
    ("unfixed", True, 0, 0), ("fixed", False, 1, 0), ("naive", False, 0, 1)])
def test_the_seed_junction_scenario_on_the_model(variant, published, stripped, stale):
    """Reference §6.2 on the model alone: a prior request caches the shared 96 tokens, so the
    producer's first chunk (128 tokens, checkpoint at 112) first keys its slot at the junction
    96, then the variant decides."""
    records: list = []
    backend = ModelBackend(seed_config(0), variant, records.append)
    backend.add_request(1, 128, SEED_HASH_IDS[:6] + [900, 901], 1)
    prefill_chunks(backend, 1, [128])
    backend.free(1)
    backend.add_request(0, 240, SEED_HASH_IDS, 4)
    records.clear()
    step = prefill_chunks(backend, 0, [128], first_step=2)
    stored = [r for r in records if isinstance(r, BlockStored) and r.group == 1]
    assert [r.num_tokens for r in stored if r.kind == StoreKind.FULL] == [96]
    assert any(r.num_tokens == 112 and r.kind == StoreKind.CHECKPOINT
               for r in stored) is published
    removed = [r for r in records if isinstance(r, BlockRemoved) and r.group == 1]
    assert sum(r.reason == RemoveReason.STALE_CHECKPOINT for r in removed) == stripped
    assert len([r for r in records if isinstance(r, StaleKeyLeft)]) == stale
    suppressed = [r for r in records if isinstance(r, CheckpointSuppressed)]
    assert (suppressed == []) is published
    key_96 = backend.cached_block_id(seed_hash_id(96), 1)
    assert (key_96 is not None) is (variant == "naive")  # only naive leaves the wrong key
    assert step == 2


@pytest.mark.parametrize("backend", ["vllm", *TWINS])
def test_inconsistent_calls_are_refused_alike(vllm_backend_class, backend):
    """A hit the last lookup did not find, a release of blocks not held, a duplicate or
    ill-hashed request, a sync to fewer tokens than held: the same KvtraceError on every
    backend, and nothing recorded."""
    records: list = []
    with open_cache(backend, seed_config(0), "fixed", records.append) as cache:
        cache.add_request(0, 240, SEED_HASH_IDS, 4)
        with pytest.raises(KvtraceError, match="last lookup found 0"):
            cache.allocate_slots(0, 128, 64)
        with pytest.raises(KvtraceError, match=r"releases block\(s\) \[3\]"):
            cache.release_blocks([3])
        with pytest.raises(KvtraceError, match="added twice"):
            cache.add_request(0, 240, SEED_HASH_IDS, 4)
        with pytest.raises(KvtraceError, match="15 hash ids for a 256-token prompt"):
            cache.add_request(1, 256, SEED_HASH_IDS, 4)
        with pytest.raises(KvtraceError, match="holds 240 tokens, the trace says 239"):
            cache.sync_request(0, 0, 239)
    assert records == []


def test_the_registered_model_backend_is_the_c_twin_where_built(monkeypatch):
    """For an async engine too, counting and writing alike."""
    config = seed_config(0)
    expected = NativeModelBackend if native.built else ModelBackend
    assert type(open_backend("model", config, "fixed", print)) is expected
    async_config = msgspec.structs.replace(config, async_scheduling=True)
    assert type(open_backend("model", async_config, "fixed", print)) is expected
    assert type(open_counting_backend("model", async_config, "fixed",
                                      ReplaySummary(async_config))) is expected
    monkeypatch.setattr(native, "core", None)  # KVTRACE_NATIVE=0
    assert type(open_model_backend(config, "fixed", print)) is ModelBackend


def test_the_model_imports_no_vllm():
    code = ("import sys; from kvtrace.replay.model import ModelBackend; "
            "sys.exit(any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent.parent,
                          check=False).returncode == 0


@pytest.mark.slow
def test_a_written_batch_of_requests_without_hash_ids_reads_back(tmp_path):
    """The C core's trace writer gives an empty binary column (a batch whose arriving requests
    are all shorter than one hash unit: no hash ids) the msgpack bin form, not a fixint that no
    reader decodes: the trace reads back, the same records as the vllm backend's."""
    from click.testing import CliRunner

    from kvtrace.cli import cli
    from kvtrace.events import RequestArrived
    from kvtrace.traceio import read_records

    workload = tmp_path / "short.kvtrace"
    runner = CliRunner()
    result = runner.invoke(cli, ["synth", "--preset", "chat", "--requests", "80",
                                 "--pool-fraction", "1", "--prompt-len", "16", "--output-len",
                                 "2048", "-o", str(workload)])
    assert result.exit_code == 0, result.output
    records = {}
    for backend in ("model", "vllm"):
        result = runner.invoke(cli, ["replay", str(workload), "--backend", backend, "--variant",
                                     "upstream", "-o", str(tmp_path / backend)])
        assert result.exit_code == 0, result.output
        records[backend] = read_records(str(tmp_path / backend / "short.upstream.kvtrace"))[1]
    assert any(isinstance(r, RequestArrived) and not r.hash_ids for r in records["model"])
    assert records["model"] == records["vllm"]
