"""``kvtrace replay`` end to end on the real vLLM 0.33.0 cache (VllmBackend), in-process so
vLLM is imported once per test session."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner
from third_party_data import MOONCAKE_SYNTHETIC

from kvtrace.cli import cli
from kvtrace.events import (
    EngineConfig,
    EventsDropped,
    KVCacheGroup,
    RequestArrived,
    TraceHeader,
)
from kvtrace.traceio import TraceReader, TraceWriter, read_records, write_trace


# Hot-prefix workload: 6 system prompts of 256 tokens, used round-robin, each followed by
# 1024 unique tokens; one request at a time; budget 512, so every prompt prefills in 3 chunks
# and takes 2 mid-prompt (transient) checkpoints. Each prompt is used 6 times: the 1st misses,
# the 2nd finds the attention prefix but no Mamba state (it publishes the junction at 256),
# the 3rd..6th hit 256 tokens if the prefix survived 5 other requests in the LRU pool.
NUM_PROMPTS, PREFIX, SUFFIX, UNIT, BLOCK, REQUESTS = 6, 256, 1024, 16, 64, 36
EXPECTED_HITS = NUM_PROMPTS * 4 * PREFIX  # 6144 tokens if no hot prefix is evicted


def hot_prefix_workload(path: Path, num_gpu_blocks: int, block_size: int = BLOCK) -> Path:
    config = EngineConfig(
        kv_cache_groups=[
            KVCacheGroup(kind="full_attention", block_size=block_size),
            KVCacheGroup(kind="mamba", block_size=BLOCK, mamba_cache_mode="align",
                         num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=UNIT),
        ],
        hash_block_size=UNIT, num_gpu_blocks=num_gpu_blocks, retention_interval=0,
        max_num_batched_tokens=512, max_num_seqs=4)
    prefix_units, suffix_units = PREFIX // UNIT, SUFFIX // UNIT
    next_id = NUM_PROMPTS * prefix_units
    records = []
    for req in range(REQUESTS):
        prompt = req % NUM_PROMPTS
        hash_ids = list(range(prompt * prefix_units, (prompt + 1) * prefix_units))
        hash_ids += range(next_id, next_id + suffix_units)
        next_id += suffix_units
        records.append(RequestArrived(req=req, prompt_len=PREFIX + SUFFIX, hash_ids=hash_ids,
                                      max_tokens=4, arrival_ns=req * 10**9))
    write_trace(path, TraceHeader(kvtrace_version="test", created_ns=0, source="test",
                                  config=config), records)
    return path


@pytest.fixture(scope="session", autouse=True)
def vllm_imported():
    """Import vLLM (~7 s) once for the session, not inside whichever test runs first."""
    import vllm.v1.core.kv_cache_manager  # noqa: F401


def replay(*args: str):
    return CliRunner().invoke(cli, ["replay", *args], catch_exceptions=False)


def summary_of(tmp_path: Path, num_gpu_blocks: int) -> dict:
    source = hot_prefix_workload(tmp_path / "hot.kvtrace", num_gpu_blocks)
    out = tmp_path / f"runs{num_gpu_blocks}"
    summary = tmp_path / f"summary{num_gpu_blocks}.json"
    result = replay(str(source), "--variant", "unfixed", "--variant", "fixed", "-o", str(out),
                    "--summary-json", str(summary))
    assert result.exit_code == 0, result.output
    print(result.output)
    return json.loads(summary.read_text())


def test_under_pressure_unfixed_loses_hot_prefix_hits_that_fixed_keeps(tmp_path):
    summary = summary_of(tmp_path, num_gpu_blocks=140)
    unfixed, fixed = summary["variants"]["unfixed"], summary["variants"]["fixed"]
    assert fixed["hit_tokens"] == EXPECTED_HITS
    assert unfixed["hit_tokens"] < fixed["hit_tokens"]
    # The cause: unfixed publishes every transient checkpoint, fixed strips them; the keyed
    # slots queue up as cache, so the LRU evicts more (the hot prefixes among them).
    assert unfixed["checkpoints_suppressed"] == 0 < fixed["checkpoints_suppressed"]
    assert unfixed["checkpoints_published"] > fixed["checkpoints_published"]
    assert unfixed["evictions"]["lru_reuse"] > fixed["evictions"]["lru_reuse"]
    assert fixed["groups"]["1"]["kind"] == "mamba"
    assert fixed["groups"]["1"]["hit_blocks"] == NUM_PROMPTS * 4  # one state block per hit
    assert summary["fidelity"] is None


def test_with_a_pool_that_never_evicts_both_variants_hit_the_same(tmp_path):
    summary = summary_of(tmp_path, num_gpu_blocks=1000)
    unfixed, fixed = summary["variants"]["unfixed"], summary["variants"]["fixed"]
    assert unfixed["hit_tokens"] == fixed["hit_tokens"] == EXPECTED_HITS
    assert unfixed["hit_rate"] == fixed["hit_rate"] == EXPECTED_HITS / (REQUESTS * (PREFIX + SUFFIX))
    assert "lru_reuse" not in unfixed["evictions"] and "lru_reuse" not in fixed["evictions"]


def test_outputs_are_replay_traces_that_lockstep_verify_reproduces(tmp_path):
    source = hot_prefix_workload(tmp_path / "hot.kvtrace", 140)
    result = replay(str(source), "--variant", "fixed", "-o", str(tmp_path / "runs"))
    assert result.exit_code == 0, result.output
    output = tmp_path / "runs" / "hot.fixed.kvtrace"
    reader, records = read_records(output)
    assert reader.closing is not None
    info = reader.header.replay
    assert (reader.header.source, info.variant, info.backend, info.mode) == (
        "replay", "fixed", "vllm", "reschedule")
    assert info.source_digest.startswith("sha256:") and info.source_path == str(source)
    assert reader.header.config.num_gpu_blocks == 140
    # Lockstep re-issues that run's calls: with the same variant every effect must match.
    verify_json = tmp_path / "verify.json"
    result = replay(str(output), "--lockstep", "--verify", "-o", str(tmp_path / "verify"),
                    "--summary-json", str(verify_json))
    assert result.exit_code == 0, result.output
    fidelity = json.loads(verify_json.read_text())["fidelity"]
    assert fidelity["matched"] == fidelity["total"] > 1000
    assert fidelity["first_divergence"] is None and fidelity["variant"] == "fixed"
    # Under another variant the same calls give other effects: --verify would catch it.
    result = replay(str(output), "--lockstep", "--verify", "--variant", "unfixed",
                    "-o", str(tmp_path / "other"))
    assert result.exit_code == 1 and "engine ran 'fixed'" in result.output


def assert_clean_failure(result, message: str, outdir: Path) -> None:
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert lines[0].startswith("kvtrace: error: ") and message in lines[0], result.output
    assert lines[1].startswith("kvtrace: hint: ")
    assert not outdir.exists() or not any(outdir.iterdir())


def test_unknown_variant(tmp_path):
    source = hot_prefix_workload(tmp_path / "hot.kvtrace", 140)
    out = tmp_path / "runs"
    assert_clean_failure(replay(str(source), "--variant", "fixed", "--variant", "nope", "-o", str(out)),
                         "unknown variant 'nope'", out)


def test_block_size_not_a_multiple_of_the_hash_unit(tmp_path):
    source = hot_prefix_workload(tmp_path / "hot.kvtrace", 140, block_size=24)
    out = tmp_path / "runs"
    assert_clean_failure(replay(str(source), "-o", str(out)),
                         "block size 24, not a multiple of the hash unit 16", out)


def test_pool_too_small_for_one_request(tmp_path):
    source = hot_prefix_workload(tmp_path / "hot.kvtrace", 140)
    out = tmp_path / "runs"
    assert_clean_failure(replay(str(source), "--num-gpu-blocks", "12", "-o", str(out)),
                         "cannot hold request 0", out)


def test_lockstep_on_a_workload_without_captured_calls(tmp_path):
    source = hot_prefix_workload(tmp_path / "hot.kvtrace", 140)
    out = tmp_path / "runs"
    assert_clean_failure(replay(str(source), "--lockstep", "-o", str(out)),
                         "holds no captured allocate_slots calls", out)


def test_verify_on_a_trace_with_dropped_events(tmp_path):
    source = hot_prefix_workload(tmp_path / "hot.kvtrace", 140)
    assert replay(str(source), "--variant", "fixed", "-o", str(tmp_path / "runs")).exit_code == 0
    reader, records = read_records(tmp_path / "runs" / "hot.fixed.kvtrace")
    records.insert(len(records) // 2, EventsDropped(count=17, ts_ns=0))
    lossy = tmp_path / "lossy.kvtrace"
    write_trace(lossy, reader.header, records)
    out = tmp_path / "verify"
    assert_clean_failure(replay(str(lossy), "--lockstep", "--verify", "-o", str(out)),
                         "dropped 17 events", out)


def test_verify_without_lockstep_is_refused(tmp_path):
    source = hot_prefix_workload(tmp_path / "hot.kvtrace", 140)
    out = tmp_path / "runs"
    assert_clean_failure(replay(str(source), "--verify", "-o", str(out)), "--verify needs --lockstep", out)


def test_bad_retention(tmp_path):
    source = hot_prefix_workload(tmp_path / "hot.kvtrace", 140)
    out = tmp_path / "runs"
    assert_clean_failure(replay(str(source), "--retention", "sometimes", "-o", str(out)),
                         "--retention 'sometimes'", out)


@pytest.mark.slow
def test_mooncake_synthetic_trace_end_to_end(tmp_path):
    workload = tmp_path / "mooncake.kvtrace"
    result = CliRunner().invoke(cli, [
        "import", "mooncake", str(MOONCAKE_SYNTHETIC), "-o", str(workload),
        "--max-num-seqs", "64"], catch_exceptions=False)  # the default model's geometry
    assert result.exit_code == 0, result.output
    summary_path = tmp_path / "summary.json"
    result = replay(str(workload), "--variant", "unfixed", "--variant", "fixed",
                    "-o", str(tmp_path / "runs"), "--summary-json", str(summary_path))
    assert result.exit_code == 0, result.output
    print(result.output)
    variants = json.loads(summary_path.read_text())["variants"]
    for name in ("unfixed", "fixed"):
        figures = variants[name]
        assert figures["requests"] == 3993
        assert figures["prompt_tokens"] == 61_194_628
        assert 0 < figures["hit_rate"] < 0.66  # below the infinite-cache ratio of the log
        assert TraceReader(str(tmp_path / "runs" / f"mooncake.{name}.kvtrace")).header.replay.variant == name
    assert variants["fixed"]["checkpoints_suppressed"] > 0 == variants["unfixed"]["checkpoints_suppressed"]


def test_db_loads_every_variant_for_the_forensics_queries(tmp_path):
    source = hot_prefix_workload(tmp_path / "hot.kvtrace", 140)
    db = tmp_path / "hot.duckdb"
    result = replay(str(source), "--variant", "unfixed", "--variant", "fixed", "-o",
                    str(tmp_path / "runs"), "--db", str(db))
    assert result.exit_code == 0, result.output
    assert "loaded 2 trace(s)" in result.output
    import duckdb

    with duckdb.connect(str(db), read_only=True) as connection:
        variants = connection.execute("SELECT variant FROM runs ORDER BY variant").fetchall()
        removals = connection.execute("SELECT count(*) FROM block_removed").fetchone()[0]
    assert variants == [("fixed",), ("unfixed",)] and removals > 0


@pytest.mark.parametrize("params, said", [
    ({"scheduler": "AsyncScheduler", "async_scheduling": "true"},
     "with async scheduling (AsyncScheduler) by a kvtrace older than format 1.3, whose engine "
     "config does not say so"),
    ({"num_speculative_tokens": "2", "speculative_method": "mtp"},
     "drafts 2 tokens a step (mtp) by a kvtrace older than format 1.3, whose engine config "
     "does not say so; the rescheduled replay does not model speculative"),
])
def test_a_source_from_an_engine_that_scheduled_otherwise_is_said_to(tmp_path, params, said):
    """What a capture records of its engine's scheduling that the rescheduled replay does not
    model (or, from a kvtrace before format 1.3, whose config does not carry) is said in a
    warning, not passed over (a synchronous engine's capture says nothing)."""
    source = hot_prefix_workload(tmp_path / "w.kvtrace", num_gpu_blocks=64)
    reader = TraceReader(str(source))
    path = tmp_path / "scheduled.kvtrace"
    header = msgspec.structs.replace(reader.header, params={**reader.header.params, **params})
    with TraceWriter(path, header) as writer:
        writer.write_many(TraceReader(str(source)))
    for trace, warned in ((path, True), (source, False)):
        result = CliRunner().invoke(cli, ["replay", str(trace), "--variant", "fixed", "-o",
                                          str(tmp_path / f"runs-{warned}")])
        assert result.exit_code == 0, result.output
        assert (said in result.stderr) == warned, result.stderr
