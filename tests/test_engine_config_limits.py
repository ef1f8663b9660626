"""The engine config's rules (kvtrace/engine_config.py) bound sizes before work: a pool or a state
pool that cannot fit this machine is refused with the figure; a retention, config or request
that cannot exist is one error wherever it is used."""

from __future__ import annotations

import tracemalloc

import pytest
from bad_traces import SMALL_CONFIG, header, impossible_configs, requests, trace
from cli_runs import (  # noqa: F401 (fixtures)
    COMMANDS_ON_A_TRACE,
    assert_error,
    run,
    vllm_imported,
    workload,
)


# Hardening finding H3.
def test_a_pool_this_machine_cannot_hold_is_refused_with_the_figure(tmp_path, workload):
    result = run("replay", workload, "--num-gpu-blocks", 10**12, "-o", tmp_path / "runs")
    assert_error(result, "a pool of 1,000,000,000,000 blocks needs about 232.8 TiB")
    assert "this machine has available" in result.stderr


# Hardening finding H3.
def test_the_memory_rule_covers_the_real_vllm_pool():
    """REPLAY_BYTES_PER_BLOCK against vLLM's own pool: building it costs less than the
    figure (which leaves room for a keyed block's prefix-cache entry), and not far less."""
    import msgspec

    from kvtrace.engine_config import REPLAY_BYTES_PER_BLOCK
    from kvtrace.replay.backend import open_backend

    num_blocks = 200_000
    config = msgspec.structs.replace(SMALL_CONFIG, num_gpu_blocks=num_blocks)
    tracemalloc.start()
    try:
        with open_backend("vllm", config, "fixed", lambda record: None):
            per_block = tracemalloc.get_traced_memory()[0] / num_blocks
    finally:
        tracemalloc.stop()
    assert REPLAY_BYTES_PER_BLOCK / 3 < per_block < REPLAY_BYTES_PER_BLOCK - 64, per_block


# Hardening finding H3.
def test_an_execute_state_pool_this_machine_cannot_hold_is_refused(tmp_path, workload):
    """The state pool was allocated as asked: 10**5 blocks at full scale failed inside torch."""
    result = run("replay", workload, "--execute", "--model", "kimi-linear-48b-a3b", "--device",
                 "cpu", "--state-scale", "1", "--num-gpu-blocks", 10**5, "-o", tmp_path / "runs")
    assert_error(result, "--execute's state pool of 100,000 blocks at state scale 1 needs about")
    assert "this machine has available" in result.stderr
    assert not list((tmp_path / "runs").iterdir())


# Hardening finding H4.
def test_the_engine_is_checked_before_the_records_are_read(tmp_path, workload):
    damaged = tmp_path / "damaged.kvtrace"
    data = bytearray(workload.read_bytes())
    data[-60] ^= 0xFF  # a byte of the records frame: its checksum fails when read
    damaged.write_bytes(bytes(data))
    assert_error(run("replay", damaged, "--num-gpu-blocks", 1, "-o", tmp_path / "runs"),
                 "num_gpu_blocks is 1")


# Hardening finding C5.
@pytest.mark.parametrize("retention", ["99999999999999999999999", str(64 * 10**21)])
def test_a_retention_beyond_64_bits_is_one_error(tmp_path, workload, retention):
    assert_error(run("replay", workload, "--retention", retention, "-o", tmp_path / "runs"),
                 "retention")
    assert not (tmp_path / "runs").exists()


# Hardening finding M3.
def test_synth_and_replay_share_the_retention_rule(tmp_path, workload):
    synth = run("synth", "--preset", "chat", "--requests", 5, "--retention-interval", 7,
                "-o", tmp_path / "s.kvtrace")
    replay = run("replay", workload, "--retention", 7, "-o", tmp_path / "runs")
    assert synth.exit_code == replay.exit_code == 1
    assert "retention interval 7 is not 0 or a multiple" in synth.stderr
    assert "retention interval 7 is not 0 or a multiple" in replay.stderr


@pytest.mark.parametrize("command", COMMANDS_ON_A_TRACE)
def test_impossible_configs_are_one_error_where_the_config_is_used(tmp_path, command):
    for name, config in impossible_configs().items():
        path = trace(tmp_path / f"{name.replace(' ', '_')}.kvtrace", requests(), header(config))
        result = run(*COMMANDS_ON_A_TRACE[command](path, tmp_path))
        if command in ("info", "cat"):  # they show the header as it is
            assert result.exit_code == 0, (name, result.output)
            if command == "info":
                assert "its engine config cannot be replayed" in result.stdout, name
        elif command.split()[0] in ("replay", "sweep", "engine") or name not in ("unknown group kind",
                                                                      "huge pool"):
            assert result.exit_code == 1 and result.stderr.count("kvtrace: error:") == 1, (
                name, result.output)
        assert "Traceback" not in result.output


def test_impossible_requests_are_one_error(tmp_path):
    from kvtrace.events import RequestArrived

    for arrival in (RequestArrived(req=0, prompt_len=0, hash_ids=[], max_tokens=3),
                    RequestArrived(req=0, prompt_len=16, hash_ids=[1], max_tokens=-4),
                    RequestArrived(req=0, prompt_len=2**40, hash_ids=[], max_tokens=1),
                    RequestArrived(req=0, prompt_len=160, hash_ids=[1, 2], max_tokens=1)):
        path = trace(tmp_path / "r.kvtrace", [arrival])
        for command in ("replay", "replay --backend model", "sweep", "engine"):
            result = run(*COMMANDS_ON_A_TRACE[command](path, tmp_path))
            assert_error(result, "request 0")
