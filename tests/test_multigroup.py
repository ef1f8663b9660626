"""Several Mamba/KDA groups, as vLLM builds real hybrid models (e.g. Kimi-Linear: one MLA group
and three KDA groups): every variant's two decisions apply in every group, replays verify in
lockstep, and a capture of vLLM's own scheduler over such a cache replays to 100%."""

from __future__ import annotations

import dataclasses
from collections import Counter

import msgspec
import pytest

from kvtrace.capture import hook
from kvtrace.engine_config import SchedulerSettings
from kvtrace.events import CheckpointRecorded, CheckpointSuppressed, BlockStored, StoreKind
from kvtrace.replay.arrivals import arrivals_of
from kvtrace.replay.options import ReplayOptions
from kvtrace.replay.run import replay
from kvtrace.replay.variants import MODELLED_VARIANTS
from kvtrace.traceio import read_records, write_trace
from kvtrace.workloads.synth import synthesize
from kvtrace.workloads.workload import EngineShape, write_workload

# Long shared prompts prefilled in several chunks at retention 0: transient checkpoints. The
# default model's checkpoint settings; blocks of 128 tokens hashed at 32 keep it small.
SHAPE = EngineShape(hash_unit=32, attention_block_size=128, max_num_batched_tokens=512,
                    max_num_seqs=8)
OVERRIDES = {"system_prompts": 3, "system_prompt_len": 768, "prompt_len": 640, "output_len": 8}


def workload_with_groups(directory, num_groups: int, num_gpu_blocks: int | None = None,
                         requests: int = 24) -> str:
    """A shared-prompt workload whose engine has one attention group and ``num_groups - 1``
    identical Mamba groups."""
    base = directory / "base.kvtrace"
    shape = dataclasses.replace(SHAPE, num_gpu_blocks=num_gpu_blocks)
    write_workload(base, synthesize("shared-prompt", requests, 3, SHAPE.hash_unit, OVERRIDES),
                   shape)
    reader, records = read_records(base)
    groups = reader.header.config.kv_cache_groups
    attention = next(g for g in groups if g.kind == "full_attention")
    mamba = next(g for g in groups if g.kind == "mamba")
    config = msgspec.structs.replace(reader.header.config,
                                     kv_cache_groups=[attention] + [mamba] * (num_groups - 1))
    path = directory / f"groups{num_groups}.kvtrace"
    write_trace(path, msgspec.structs.replace(reader.header, config=config), records)
    return str(path)


def per_group(records, kind, key=lambda r: r.group) -> Counter:
    return Counter(key(r) for r in records if isinstance(r, kind))


@pytest.mark.parametrize("num_groups", [2, 4, 7])
def test_every_variant_applies_in_every_mamba_group(tmp_path, num_groups):
    source = workload_with_groups(tmp_path, num_groups, num_gpu_blocks=4000)
    result = replay(ReplayOptions(source=source, outdir=str(tmp_path / "runs"),
                                  variants=MODELLED_VARIANTS))
    mamba_groups = set(range(1, num_groups))
    summaries = {v.variant: v.summary for v in result.variants}
    for variant in result.variants:
        _, records = read_records(variant.output)
        recorded = per_group(records, CheckpointRecorded)
        assert set(recorded) == mamba_groups and len(set(recorded.values())) == 1, recorded
        checkpoints = per_group([r for r in records if isinstance(r, BlockStored)
                                 and r.kind == StoreKind.CHECKPOINT], BlockStored)
        suppressed = per_group(records, CheckpointSuppressed)
        if variant.variant == "unfixed":  # publishes its checkpoints alike in every group
            assert set(checkpoints) == mamba_groups and len(set(checkpoints.values())) == 1
            assert not suppressed
        if variant.variant == "fixed":  # strips the transient ones, in every group
            transient = per_group(records, CheckpointRecorded,
                                  key=lambda r: (r.group, r.position_class))
            assert suppressed and set(suppressed) == mamba_groups
            assert all(suppressed[g] == transient[(g, 0)] for g in mamba_groups)
        # The replay is a capture-like trace: lockstep under its own variant reproduces it.
        check = replay(ReplayOptions(source=variant.output, outdir=str(tmp_path / variant.variant),
                                     lockstep=True, verify=True))
        assert check.fidelity.matched == check.fidelity.total > 1000
    # A pool that never evicts: what hits does not depend on how many groups hold the state.
    assert not any(s["evictions"].get("lru_reuse") for s in summaries.values())
    assert summaries["unfixed"]["hit_tokens"] > 0


def test_hits_do_not_depend_on_the_number_of_groups_without_pressure(tmp_path):
    hits = {}
    for num_groups in (2, 4):
        (tmp_path / str(num_groups)).mkdir()
        source = workload_with_groups(tmp_path / str(num_groups), num_groups, 4000)
        result = replay(ReplayOptions(source=source, outdir=str(tmp_path / f"r{num_groups}"),
                                      variants=("unfixed", "fixed")))
        hits[num_groups] = {v.variant: v.summary["hit_tokens"] for v in result.variants}
    assert hits[2] == hits[4]


def test_capture_of_vllms_scheduler_over_four_groups_replays_to_100_percent(tmp_path):
    """vLLM 0.33's own Scheduler over a 1 + 3 group cache (as for Kimi-Linear), captured by the
    in-engine hook, re-issued in lockstep: every effect must match."""
    from kvtrace.engine.core import VllmScheduler

    source = workload_with_groups(tmp_path, 4, num_gpu_blocks=160)
    reader, records = read_records(source)
    config = reader.header.config
    engine = VllmScheduler(config, SchedulerSettings.from_config(config), "unfixed")
    capture = tmp_path / "capture.kvtrace"
    hook.arm(hook.CaptureOptions(path=str(capture), gpu_interval_ms=0))
    try:
        engine.run(arrivals_of(records))
    finally:
        final = hook.disarm()
    assert final["dropped"] == 0 and final["error"] is None
    captured_reader, captured = read_records(capture)
    assert [g.kind for g in captured_reader.header.config.kv_cache_groups] == [
        "full_attention", "mamba", "mamba", "mamba"]
    assert set(per_group(captured, CheckpointRecorded)) == {1, 2, 3}
    result = replay(ReplayOptions(source=str(capture), outdir=str(tmp_path / "verify"),
                                  lockstep=True, verify=True))
    assert result.fidelity_variant == "unfixed"
    assert result.fidelity.matched == result.fidelity.total > 1000, str(result.fidelity)
