"""Checkpoint variants on the real vLLM 0.33.0 MambaManager: the seed's regression scenarios
(reference §6) and the decision table of §5, through kvtrace's backend API."""

from __future__ import annotations

import pytest

from kvtrace.errors import ConfigError
from kvtrace.events import (
    BlockRemoved,
    BlockStored,
    CheckpointClass,
    CheckpointRecorded,
    CheckpointSuppressed,
    EngineConfig,
    KVCacheGroup,
    RemoveReason,
    StaleKeyLeft,
    StoreKind,
)
from kvtrace.replay.variants import MODELLED_VARIANTS, VARIANTS, get_variant
from kvtrace.vllm_release_table import PROJECT_RELEASE
from vllm_support import (  # noqa: F401 (vllm_backend_class is a fixture)
    SEED_HASH_IDS, prefill_chunks, seed_config, seed_hash_id, vllm_backend_class)

MAMBA = 1


def of(records, kind):
    return [r for r in records if type(r) is kind]


def run_seed(backend_class, variant, retention, *, junction_96=False):
    """The seed producer: 240 tokens in chunks of 128 then 112. With ``junction_96`` a prior
    request first caches the shared 96 tokens (full attention only), so the producer's lookup
    finds the junction at 96 the way vLLM's scheduler does (not by setting it by hand)."""
    records = []
    backend = backend_class(seed_config(retention), variant, records.append)
    step = 0
    if junction_96:
        # 128 tokens: the first 96 shared with the producer, then its own; one chunk, finished.
        backend.add_request(1, 128, SEED_HASH_IDS[:6] + [900, 901], 1)
        step = prefill_chunks(backend, 1, [128]) + 1
        backend.free(1)
    backend.add_request(0, 240, SEED_HASH_IDS, 4)
    backend.new_step(step, step)
    lookup = backend.get_computed_blocks(0)
    assert backend.allocate_slots(0, 128, lookup[0])
    backend.advance(0, 128)
    after_first = {n: backend.cached_block_id(seed_hash_id(n), MAMBA) for n in (96, 112)}
    first_chunk_records = list(records)
    backend.new_step(step + 1, step + 1)
    assert backend.allocate_slots(0, 112)
    after_second = backend.cached_block_id(seed_hash_id(224), MAMBA)
    backend.close()
    return lookup, after_first, after_second, first_chunk_records, records


@pytest.mark.parametrize("retention,transient_published", [(None, True), (0, False)])
def test_fixed_publishes_transient_checkpoint_only_under_dense_retention(
        vllm_backend_class, retention, transient_published):
    _, after_first, prompt_end, first, records = run_seed(vllm_backend_class, "fixed", retention)
    assert (after_first[112] is not None) == transient_published
    assert prompt_end is not None  # the prompt-end checkpoint at 224 is published either way
    recorded = of(records, CheckpointRecorded)
    assert [(r.position, r.block_idx, r.position_class) for r in recorded] == [
        (112, 2, CheckpointClass.TRANSIENT), (224, 6, CheckpointClass.PROMPT_END)]
    suppressed = of(first, CheckpointSuppressed)
    assert [s.position for s in suppressed] == ([] if transient_published else [112])


def test_fixed_strips_the_junction_key_from_the_transient_slot(vllm_backend_class):
    lookup, after_first, _, first, _ = run_seed(vllm_backend_class, "fixed", 0, junction_96=True)
    assert lookup == (0, 96)  # full attention hit 96, Mamba 0: the junction
    assert after_first == {96: None, 112: None}
    slot = of(first, CheckpointRecorded)[-1]
    assert (slot.position, slot.block_idx) == (112, 2)
    suppressed = of(first, CheckpointSuppressed)[-1]
    assert (suppressed.position, suppressed.num_stripped) == (112, 1)
    stripped = [r for r in of(first, BlockRemoved) if r.reason == RemoveReason.STALE_CHECKPOINT]
    assert [(r.hash_id, r.group, r.num_tokens, r.block_id) for r in stripped] == [
        (seed_hash_id(96), MAMBA, 96, suppressed.block_id)]
    assert not of(first, StaleKeyLeft)


def test_unfixed_publishes_the_transient_checkpoint_under_latest_only(vllm_backend_class):
    _, after_first, prompt_end, first, _ = run_seed(vllm_backend_class, "unfixed", 0)
    assert after_first[112] is not None and prompt_end is not None
    stored = [r for r in of(first, BlockStored) if r.kind == StoreKind.CHECKPOINT]
    assert [(r.hash_id, r.group, r.num_tokens, r.block_id) for r in stored] == [
        (seed_hash_id(112), MAMBA, 112, after_first[112])]
    assert not of(first, CheckpointSuppressed)


def test_naive_leaves_the_junction_key_on_the_slot_holding_state_112(vllm_backend_class):
    lookup, after_first, _, first, _ = run_seed(vllm_backend_class, "naive", 0, junction_96=True)
    assert lookup == (0, 96)
    suppressed = of(first, CheckpointSuppressed)[-1]
    assert (suppressed.position, suppressed.num_stripped) == (112, 0)
    assert after_first[112] is None
    assert after_first[96] == suppressed.block_id  # a hit on 96 would load the state at 112
    stale = of(first, StaleKeyLeft)
    assert [(r.block_id, r.hash_id, r.key_num_tokens, r.state_num_tokens) for r in stale] == [
        (suppressed.block_id, seed_hash_id(96), 96, 112)]


def test_upstream_reserves_only_the_prompt_end_checkpoint_under_latest_only(
        vllm_backend_class):
    _, after_first, prompt_end, _, records = run_seed(vllm_backend_class, "upstream", 0)
    assert [(r.position, r.position_class) for r in of(records, CheckpointRecorded)] == [
        (224, CheckpointClass.PROMPT_END)]
    assert after_first[112] is None and prompt_end is not None


def test_upstream_strips_an_unaligned_transient_even_under_dense_retention(vllm_backend_class):
    """0.33's generalised gate: 112 is not block-aligned, so not retained; #56794 kept it."""
    _, after_first, _, first, _ = run_seed(vllm_backend_class, "upstream", None)
    assert after_first[112] is None
    suppressed = of(first, CheckpointSuppressed)[-1]
    assert (suppressed.position, suppressed.num_stripped) == (112, 1)  # the dense key at 96


def test_unknown_variant_lists_the_known_names(vllm_backend_class):
    with pytest.raises(ConfigError) as error:
        get_variant("fixd")
    assert all(name in error.value.hint for name in VARIANTS)
    with pytest.raises(ConfigError):
        vllm_backend_class(seed_config(0), "fixd", print)


@pytest.mark.parametrize("groups,message", [
    ([KVCacheGroup(kind="full_attention", block_size=24)], "not a multiple of the hash unit"),
    ([KVCacheGroup(kind="sliding_window", block_size=16)], "full_attention and mamba"),
])
def test_config_errors(vllm_backend_class, groups, message):
    config = EngineConfig(kv_cache_groups=groups, hash_block_size=16, num_gpu_blocks=32)
    with pytest.raises(ConfigError, match=message):
        vllm_backend_class(config, "fixed", print)


def test_pool_too_small_for_one_request(vllm_backend_class):
    # 240 + 4 tokens need 16 attention blocks + 3 Mamba blocks + the null block = 20.
    backend = vllm_backend_class(seed_config(0, num_gpu_blocks=19), "fixed", print)
    with pytest.raises(ConfigError, match="cannot hold request 0.*need 20 blocks"):
        backend.add_request(0, 240, SEED_HASH_IDS, 4)
    backend.close()
    backend = vllm_backend_class(seed_config(0, num_gpu_blocks=20), "fixed", lambda r: None)
    backend.add_request(0, 240, SEED_HASH_IDS, 4)
    prefill_chunks(backend, 0, [128, 112])  # and vLLM agrees it fits
    backend.close()


# --- what each variant stands for in a report's verdict -----------------------------------------


def verdict_row(old: str, new: str, saved_per_hour: float) -> dict:
    """A ``variant_verdict`` row moving from ``old`` to ``new``, unpriced."""
    return {"from_variant": old, "to_variant": new, "prefill_tokens_saved_per_hour": saved_per_hour,
            "gpu_seconds_saved_per_hour": None, "cost_model": "", "from_prefill_tokens": 1000,
            "to_prefill_tokens": 1000 - saved_per_hour}


@pytest.mark.parametrize("name", [name for name in VARIANTS if name != "naive"])
def test_the_report_says_what_each_variant_stands_for(name):
    """``Variant.role`` is the verdict's wording for a variant (none: "a variant"), and
    ``Variant.gated`` makes moving to it from unfixed the upgrade to the #56794 gate."""
    from kvtrace.analysis.pricing import pricing_for
    from kvtrace.analysis.verdict import advice

    variant, pricing = get_variant(name), pricing_for()
    upgrade = advice(verdict_row("unfixed", name, 500), pricing)
    if variant.gated:
        assert upgrade.startswith(f"Upgrade to a release with the #56794 gate ({name}: "
                                  f"{variant.role}): ")
    else:
        assert upgrade.startswith(f"Prefer {name} ({variant.role or 'a variant'}) over unfixed")
    preferred = advice(verdict_row("other", name, 500), pricing)
    assert preferred.startswith(f"Prefer {name} ({variant.role or 'a variant'}) over other: ")


def test_the_modelled_policies_have_roles_and_the_releases_none():
    assert [name for name, v in VARIANTS.items() if v.role] == list(MODELLED_VARIANTS)
    assert [name for name, v in VARIANTS.items() if v.gated] == ["fixed", "upstream"]
    assert get_variant("upstream").role == f"vLLM {PROJECT_RELEASE.version}'s own checkpoint logic"
