"""MTP and EAGLE drafting (issue #29): the engine config fields vLLM 0.33 derives from a
speculative config, the hash units a lookahead-hashing engine has, the Mamba checkpoint
position under both EAGLE/MTP rules, and what each backend, release and replay mode refuses.

vLLM's own scheduler and cache are held to the model in ``test_scheduler_vs_vllm.py``
(``DRAFTERS``, and a hand-computed scenario per drafter); captures of MTP engines mid-flight
in ``test_midflight.py``.
"""

from __future__ import annotations

import itertools

import pytest
from click.testing import CliRunner
from msgspec.structs import replace

from bad_traces import header, requests, trace
from test_releases import needs_release

from kvtrace.cli import cli
from kvtrace.engine_config import (SchedulerSettings, check_request, derive, drafter_fields,
                                   num_hashed_units, speculative_method)
from kvtrace.errors import ConfigError
from kvtrace.events import EngineConfig, KVCacheGroup
from kvtrace.replay.scheduler import Scheduler
from kvtrace.replay.scheduling_rules import mamba_checkpoint_position

FULL_ATTENTION = EngineConfig(kv_cache_groups=[KVCacheGroup(kind="full_attention",
                                                            block_size=16)],
                              hash_block_size=16, num_gpu_blocks=200, max_num_batched_tokens=256,
                              max_num_seqs=4, num_speculative_tokens=2)
DRAFTER_FIELDS = ("num_lookahead_tokens", "num_prefill_lookahead_tokens",
                  "num_hash_lookahead_tokens", "use_eagle")


def drafter(config: EngineConfig) -> tuple:
    return tuple(getattr(config, name) for name in DRAFTER_FIELDS)


@pytest.mark.parametrize("method, hashes, enable_caching, expected", [
    ("ngram", None, True, (0, 0, 0, False)),
    ("mtp", None, True, (2, 1, 1, False)),  # vLLM 0.33's default: lookahead block hashes
    ("mtp", True, True, (2, 1, 1, False)),
    ("mtp", False, True, (2, 1, 0, True)),  # disable_lookahead_block_hashes: the drop
    ("mtp", None, False, (2, 1, 0, True)),  # no prefix caching, no lookahead hashes
])
def test_the_drafter_fields_are_what_vllm_derives(method, hashes, enable_caching, expected):
    """``drafter_fields`` against vLLM's own properties (``VllmConfig.num_lookahead_tokens``,
    ``num_prefill_lookahead_tokens``, ``num_hash_lookahead_tokens``, the scheduler's drop),
    read off the scheduler ``kvtrace engine`` builds; ``check_drafter`` passing is the
    comparison, the tuple the hand-written expectation."""
    from kvtrace.engine.core import VllmScheduler

    config = replace(FULL_ATTENTION, enable_caching=enable_caching)
    config = replace(config, **drafter_fields(config, method, hashes))
    assert drafter(config) == expected
    assert speculative_method(config) == method
    scheduler = VllmScheduler(config, SchedulerSettings.from_config(config), "upstream")
    assert scheduler.scheduler.num_lookahead_tokens == expected[0]


def test_derive_applies_the_drafter_only_when_asked():
    from kvtrace.engine_config import Overrides

    mtp, _ = derive(FULL_ATTENTION, "w", Overrides(speculative_method="mtp"))
    assert drafter(mtp) == (2, 1, 1, False)
    dropping, _ = derive(mtp, "w", Overrides(lookahead_block_hashes=False))
    assert drafter(dropping) == (2, 1, 0, True)
    assert drafter(derive(dropping, "w", Overrides(num_speculative_tokens=3))[0]) == (
        3, 1, 0, True)  # the choice of the config is kept
    assert drafter(derive(mtp, "w", Overrides(num_speculative_tokens=0))[0]) == (0, 0, 0, False)
    # A captured config is kept as it is (multi-module MTP reads K prefill tokens ahead).
    captured = replace(mtp, num_prefill_lookahead_tokens=2, num_hash_lookahead_tokens=2)
    assert derive(captured, "w", Overrides(num_gpu_blocks=300))[0].num_prefill_lookahead_tokens == 2
    with pytest.raises(ConfigError, match="lookahead block hashes are MTP's") as error:
        derive(FULL_ATTENTION, "w", Overrides(lookahead_block_hashes=False))
    assert "--speculative-method mtp" in error.value.hint
    with pytest.raises(ConfigError, match="drafts nothing") as error:
        derive(FULL_ATTENTION, "w", Overrides(speculative_method="mtp", num_speculative_tokens=0))
    assert "--num-speculative-tokens" in error.value.hint


def test_a_lookahead_hashing_engine_hashes_a_unit_once_the_token_after_it_exists():
    assert [num_hashed_units(n, 16, 1) for n in (15, 16, 17, 32, 33)] == [0, 0, 1, 1, 2]
    assert [num_hashed_units(n, 16) for n in (15, 16, 17, 32, 33)] == [0, 1, 1, 2, 2]
    check_request(0, 32, 4, [1], 16, hash_lookahead=1)  # as the engine saw it at arrival
    check_request(0, 32, 4, [1, 2], 16, hash_lookahead=1)  # as a workload names it
    with pytest.raises(ConfigError, match=r"1 hash ids for a 32-token prompt \(hash unit 16 "
                                          r"needs 2\)"):
        check_request(0, 32, 4, [1], 16)
    with pytest.raises(ConfigError, match=r"0 hash ids .* needs 1 to 2\)"):
        check_request(0, 32, 4, [], 16, hash_lookahead=1)


def test_the_mamba_checkpoint_position_is_vllms_under_both_rules():
    """Every prompt length up to four units, on two units, with and without EAGLE's drop and
    lookahead hashes of 0 to 3 tokens: the model's position is vLLM's."""
    from vllm.v1.kv_cache_interface import get_mamba_prefill_checkpoint_position

    for num_tokens, unit, drop, lookahead in itertools.product(range(1, 65), (8, 16),
                                                               (False, True), range(4)):
        assert mamba_checkpoint_position(num_tokens, unit, drop, lookahead) == (
            get_mamba_prefill_checkpoint_position(num_tokens, unit, drop, lookahead)), (
            num_tokens, unit, drop, lookahead)
    assert mamba_checkpoint_position(33, 16, False, 2) == 16  # 31 floored: the hash needs 2


def mtp_trace(tmp_path, config: EngineConfig):
    return trace(tmp_path / "mtp.kvtrace", requests(), header(config))


def test_the_model_backend_refuses_an_mtp_engine_and_names_the_one_that_replays_it(tmp_path):
    config = replace(FULL_ATTENTION, **drafter_fields(FULL_ATTENTION, "mtp", None))
    result = CliRunner().invoke(cli, ["replay", str(mtp_trace(tmp_path, config)),
                                      "--backend", "model", "-o", str(tmp_path / "out")])
    assert result.exit_code != 0
    assert "drafts with EAGLE or MTP" in result.output
    assert "--backend vllm" in result.output
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_the_vllm_backend_replays_an_mtp_workload_with_its_lookahead_slots(tmp_path):
    """The default backend takes it: every allocation reserves the two lookahead slots."""
    from kvtrace.events import SlotsAllocated
    from kvtrace.traceio import TraceReader

    config = replace(FULL_ATTENTION, **drafter_fields(FULL_ATTENTION, "mtp", None))
    result = CliRunner().invoke(cli, ["replay", str(mtp_trace(tmp_path, config)),
                                      "--variant", "unfixed", "-o", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    replayed = TraceReader(str(tmp_path / "out" / "mtp.unfixed.kvtrace"))
    assert drafter(replayed.header.config) == (2, 1, 1, False)
    lookahead = [r.num_lookahead_tokens for r in replayed if isinstance(r, SlotsAllocated)]
    assert lookahead and set(lookahead) == {2}


def test_the_rescheduled_replay_refuses_multi_module_mtp(tmp_path):
    """Multi-module MTP never ends a prefill chunk within K tokens of its end; the model does
    not schedule that, so it says so and names lockstep, which replays the captured calls."""
    config = replace(FULL_ATTENTION, num_lookahead_tokens=2, num_prefill_lookahead_tokens=2,
                     num_hash_lookahead_tokens=2)
    with pytest.raises(ConfigError, match="multi-module MTP") as error:
        Scheduler(None, config, SchedulerSettings.from_config(config))
    assert "--lockstep" in error.value.hint


@pytest.mark.slow
@needs_release("0.32.0")
def test_a_release_without_lookahead_hashes_refuses_a_trace_hashed_with_them(tmp_path):
    """vLLM 0.32.0 drops the last block where 0.33 hashes the token after it: the trace's
    hashes cannot be replayed under the drop, and the worker on 0.32.0 says so."""
    config = replace(FULL_ATTENTION, **drafter_fields(FULL_ATTENTION, "mtp", None))
    result = CliRunner().invoke(cli, ["replay", str(mtp_trace(tmp_path, config)),
                                      "--variant", "vllm-0.32.0", "-o", str(tmp_path / "out")])
    assert result.exit_code != 0
    assert "lookahead block hashes" in result.output and "0.32.0" in result.output
    assert "0.33" in result.output


def test_replay_switches_an_mtp_engine_between_the_drop_and_lookahead_hashes(tmp_path):
    """`kvtrace replay --lookahead-block-hashes` on a dropping engine's trace replays it as
    vLLM 0.33 hashes by default (no dropped block: more hits), `--no-lookahead-block-hashes`
    the other way; on an engine that does not draft with MTP it is refused."""
    import json

    dropping = replace(FULL_ATTENTION, **drafter_fields(FULL_ATTENTION, "mtp", False))
    source = trace(tmp_path / "drop.kvtrace", requests(), header(dropping))
    rates = {}
    for flag in ("--lookahead-block-hashes", "--no-lookahead-block-hashes"):
        summary = tmp_path / f"{flag}.json"
        result = CliRunner().invoke(cli, ["replay", str(source), "--variant", "unfixed", flag,
                                          "-o", str(tmp_path / flag), "--summary-json",
                                          str(summary)])
        assert result.exit_code == 0, result.output
        rates[flag] = json.loads(summary.read_text())["variants"]["unfixed"]["hit_rate"]
    assert rates["--lookahead-block-hashes"] > rates["--no-lookahead-block-hashes"], rates
    ngram = trace(tmp_path / "ngram.kvtrace", requests(), header(FULL_ATTENTION))
    result = CliRunner().invoke(cli, ["replay", str(ngram), "--lookahead-block-hashes", "-o",
                                      str(tmp_path / "refused")])
    assert result.exit_code != 0 and "lookahead block hashes are MTP's" in result.output
