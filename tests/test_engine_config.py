"""The engine-config rules (kvtrace.engine_config): one message per rule, the same in every
command that meets the rule."""

from __future__ import annotations

import msgspec
import pytest
from click.testing import CliRunner

from kvtrace.cli import cli
from kvtrace.engine_config import (
    KEEP,
    Overrides,
    SchedulerSettings,
    blocks_needed,
    check_pool_fits,
    derive,
    validate,
)
from kvtrace.errors import ConfigError
from kvtrace.events import EngineConfig, KVCacheGroup
from vllm_support import seed_config

GOOD = seed_config(0)  # full attention 16, Mamba align 32 (1 checkpoint block), hash unit 16


def with_groups(*groups: KVCacheGroup, **changes) -> EngineConfig:
    return msgspec.structs.replace(GOOD, kv_cache_groups=list(groups), **changes)


ATTENTION, MAMBA = GOOD.kv_cache_groups
BROKEN = {
    "no groups": (with_groups(), "no KV-cache groups"),
    "hash unit": (msgspec.structs.replace(GOOD, hash_block_size=0), "must be positive, not 0"),
    "group kind": (with_groups(ATTENTION, KVCacheGroup(kind="sliding_window", block_size=16)),
                   "is 'sliding_window'"),
    "block vs unit": (with_groups(msgspec.structs.replace(ATTENTION, block_size=24), MAMBA),
                      "block size 24, not a multiple of the hash unit 16"),
    "mamba mode": (with_groups(ATTENTION, msgspec.structs.replace(MAMBA, mamba_cache_mode="all")),
                   "prefix caching needs 'align'"),
    "mamba groups differ": (
        with_groups(ATTENTION, MAMBA, msgspec.structs.replace(MAMBA, block_size=64)),
        "the 2 Mamba groups differ in block size or checkpoint settings"),
    "pool": (msgspec.structs.replace(GOOD, num_gpu_blocks=1), "leaves no usable block"),
    "retention": (msgspec.structs.replace(GOOD, retention_interval=48),
                  "retention interval 48 is not 0 or a multiple of the scheduler block size 32"),
}


@pytest.mark.parametrize("rule", BROKEN)
def test_each_rule_refuses_with_its_own_message(rule):
    config, message = BROKEN[rule]
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as error:
        validate(config)
    assert error.value.hint  # and says what to do
    others = [m for r, (_, m) in BROKEN.items() if r != rule]
    assert not any(other in str(error.value) for other in others)


def test_good_config_passes_and_derive_applies_overrides():
    validate(GOOD)
    validate(with_groups(ATTENTION, MAMBA, MAMBA, MAMBA))  # several Mamba groups, as vLLM builds
    config, settings = derive(GOOD, "w.kvtrace", Overrides(
        num_gpu_blocks=500, retention_interval=None, max_num_seqs=7))
    assert (config.num_gpu_blocks, config.retention_interval) == (500, None)
    assert settings.max_num_seqs == 7 and settings.max_num_batched_tokens == 8192
    kept, _ = derive(GOOD, "w.kvtrace", Overrides(retention_interval=KEEP))
    assert kept == GOOD
    with pytest.raises(ConfigError, match="leaves no usable block"):
        derive(GOOD, "w.kvtrace", Overrides(num_gpu_blocks=1))  # overrides are checked too
    with pytest.raises(ConfigError, match="no engine config"):
        derive(None, "w.kvtrace")


def test_scheduler_limits_are_checked():
    with pytest.raises(ConfigError, match="must be positive"):
        SchedulerSettings.from_config(GOOD, max_num_seqs=0)
    with pytest.raises(ConfigError, match="long_prefill_token_threshold -1 is negative"):
        SchedulerSettings.from_config(GOOD, long_prefill_token_threshold=-1)


def test_pool_need_by_hand():
    # 100 tokens: ceil(100 / 16) = 7 attention blocks, 2 + 1 checkpoint Mamba blocks, + null.
    assert blocks_needed(GOOD, 100) == 7 + 3 + 1
    check_pool_fits(msgspec.structs.replace(GOOD, num_gpu_blocks=11), 0, 100)
    with pytest.raises(ConfigError, match="cannot hold request 3 .100 tokens need 11 blocks"):
        check_pool_fits(msgspec.structs.replace(GOOD, num_gpu_blocks=10), 3, 100)


def test_commands_agree_on_a_retention_vllm_refuses(tmp_path):
    """synth used to accept an interval that replay refused: both refuse it now, alike."""
    runner = CliRunner()
    workload = tmp_path / "w.kvtrace"
    result = runner.invoke(cli, ["synth", "--preset", "chat", "--requests", "5",
                                 "--retention-interval", "7", "-o", str(workload)])
    assert result.exit_code == 1 and "retention interval 7 is not 0 or a multiple" in result.output
    assert not workload.exists()
    assert runner.invoke(cli, ["synth", "--preset", "chat", "--requests", "5",
                               "-o", str(workload)]).exit_code == 0
    for command in (["replay", str(workload), "-o", str(tmp_path / "runs")],
                    ["engine", str(workload)]):
        result = runner.invoke(cli, [*command, "--retention", "7"])
        assert result.exit_code == 1, result.output
        assert "retention interval 7 is not 0 or a multiple" in result.output
