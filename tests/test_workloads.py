"""Workloads: `kvtrace synth` presets share prefixes the way they claim, deterministically per
seed, and `kvtrace import mooncake` maps 512-token block ids onto the hash unit by hand-checked
rules, refusing malformed logs with one error line and no output file."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvtrace.cli import cli
from kvtrace.events import HashesExtended, RequestArrived
from kvtrace.traceio import read_records
from kvtrace.workloads import synth
from kvtrace.workloads.mooncake import import_mooncake
from kvtrace.workloads.synth import UnitHasher, synthesize
from kvtrace.workloads.workload import (
    EngineShape,
    Workload,
    WorkloadRequest,
    distinct_attention_blocks,
    pool_size,
    workload_records,
)
from third_party_data import MOONCAKE_SYNTHETIC

H = 32


def run(*args: str):
    return CliRunner().invoke(cli, [str(a) for a in args])


def by_request_id(workload: Workload) -> dict[str, WorkloadRequest]:
    return {r.request_id: r for r in workload.requests}


def previous_turn(request_id: str) -> str | None:
    """``chat-5-2`` -> ``chat-5-1`` (None for a session's first turn)."""
    preset, session, turn = request_id.rsplit("-", 2)
    return f"{preset}-{session}-{int(turn) - 1}" if int(turn) else None


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# --- the unit hasher -------------------------------------------------------------------------------


def test_unit_ids_chain_pieces_of_segments_by_hand():
    hasher = UnitHasher(hash_unit=4)
    # 6 tokens of content 0 then 5 of content 1: units [0,4) [4,8); 3 tokens left over.
    assert hasher.unit_ids([(0, 6), (1, 5)]) == [0, 1]
    # Same first unit; the second now holds content 2, so it and all later units are new.
    assert hasher.unit_ids([(0, 6), (2, 7)]) == [0, 2, 3]
    assert hasher.unit_ids([(0, 4)]) == [0]
    # Content 1 at another place in the stream is another prefix: new ids.
    assert hasher.unit_ids([(1, 8)]) == [4, 5]
    assert len(hasher) == 6


# --- synth: structure, determinism, sharing ---------------------------------------------------------


@pytest.mark.parametrize("preset", list(synth.PRESETS))
def test_same_seed_same_workload_other_seed_another(preset):
    first = synthesize(preset, 300, seed=7, hash_unit=H)
    again = synthesize(preset, 300, seed=7, hash_unit=H)
    other = synthesize(preset, 300, seed=8, hash_unit=H)
    assert first.requests == again.requests and first.params == again.params
    assert [r.hash_ids for r in first.requests] != [r.hash_ids for r in other.requests]


@pytest.mark.parametrize("preset", list(synth.PRESETS))
def test_every_request_has_one_id_per_full_unit_dense_and_in_order(preset):
    workload = synthesize(preset, 400, seed=1, hash_unit=H)
    assert len(workload.requests) == 400
    arrivals = [r.arrival_ns for r in workload.requests]
    assert arrivals == sorted(arrivals)
    next_new_id = 0
    for r in workload.requests:
        assert len(r.hash_ids) == r.prompt_len // H
        assert len(r.output_hash_ids) == (r.prompt_len + r.max_tokens) // H - r.prompt_len // H
        for unit_id in r.hash_ids + r.output_hash_ids:  # dense, numbered by first appearance
            assert unit_id <= next_new_id
            next_new_id += unit_id == next_new_id


def test_chat_turn_extends_previous_prompt_and_declared_output():
    workload = synthesize("chat", 500, seed=3, hash_unit=H)
    requests = by_request_id(workload)
    index = {r.request_id: i for i, r in enumerate(workload.requests)}
    seen_ids: set[int] = set()
    followups = 0
    for r in workload.requests:
        before = previous_turn(r.request_id)
        if before is not None:
            prev = requests[before]
            assert index[before] < index[r.request_id]
            history = prev.hash_ids + prev.output_hash_ids
            assert r.hash_ids[: len(history)] == history
            assert r.prompt_len > prev.prompt_len + prev.max_tokens
            # The unit holding the end of that output and the new message is new content.
            assert not seen_ids.intersection(r.hash_ids[len(history):])
            followups += 1
        seen_ids.update(r.hash_ids + r.output_hash_ids)
    assert followups > 250


def test_agent_step_extends_previous_prompt_with_its_tool_call():
    workload = synthesize("agent", 300, seed=2, hash_unit=H)
    requests = by_request_id(workload)
    steps = 0
    for r in workload.requests:
        before = previous_turn(r.request_id)
        if before is not None:
            prev = requests[before]
            history = prev.hash_ids + prev.output_hash_ids
            assert r.hash_ids[: len(history)] == history
            steps += 1
    assert steps > 200


def test_shared_prompt_requests_share_exactly_their_system_prompt():
    params = synth.preset_params("shared-prompt")
    workload = synthesize("shared-prompt", 400, seed=5, hash_unit=H)
    groups: dict[int, list[WorkloadRequest]] = {}
    for r in workload.requests:
        groups.setdefault(r.hash_ids[0], []).append(r)
    assert 2 <= len(groups) <= params.system_prompts
    owner: dict[int, int] = {}  # unit id -> the one request holding it beyond its system prompt
    for group in groups.values():
        shared = min(common_prefix(group[0].hash_ids, r.hash_ids) for r in group[1:])
        assert shared >= 1
        for i, r in enumerate(group):
            assert r.hash_ids[:shared] == group[0].hash_ids[:shared]
            for unit_id in r.hash_ids[shared + 1:] + r.output_hash_ids:
                assert owner.setdefault(unit_id, i) == i
    # The most popular system prompt (Zipf) serves the most requests.
    sizes = sorted((len(g) for g in groups.values()), reverse=True)
    assert sizes[0] > len(workload.requests) / params.system_prompts


def test_arrivals_are_poisson_at_the_rate_and_lengths_lognormal_at_the_median():
    workload = synthesize("shared-prompt", 2000, seed=11, hash_unit=H,
                          overrides={"rate": 10.0, "output_len": 200})
    gaps = [(b.arrival_ns - a.arrival_ns) / 1e9 for a, b in zip(workload.requests, workload.requests[1:])]
    mean_gap = statistics.mean(gaps)
    assert mean_gap == pytest.approx(0.1, rel=0.08)
    assert statistics.pstdev(gaps) / mean_gap == pytest.approx(1.0, abs=0.1)  # exponential: CV 1
    outputs = [r.max_tokens for r in workload.requests]
    assert statistics.median(outputs) == pytest.approx(200, rel=0.1)
    assert max(outputs) > 3 * 200  # a lognormal tail, not a constant


def test_parameter_flags_reach_the_generator():
    short = synthesize("agent", 200, seed=0, hash_unit=H, overrides={"turns": 1.0})
    assert all(r.request_id.endswith("-0") for r in short.requests)  # one step per task
    assert short.params["turns"] == "1.0" and short.params["preset"] == "agent"


def test_docstring_table_is_the_generated_one_and_every_parameter_is_documented():
    assert synth.parameter_table() in synth.__doc__
    for preset in synth.PRESETS.values():
        for name in preset.params_type.__dataclass_fields__:
            assert name in synth.PARAM_HELP


# --- pool sizing ---------------------------------------------------------------------------------------


def test_distinct_attention_blocks_by_hand():
    shape = EngineShape(hash_unit=16, attention_block_size=32)  # kimi-k3: 3 Mamba groups
    workload = Workload("synth", [
        # 100 prompt + 30 output tokens = 4 full blocks of 32: units 1, 3 (prompt), 5, 7 (declared).
        WorkloadRequest(0, 100, [0, 1, 2, 3, 4, 5], 30, [6, 7], "a"),
        # Shares blocks 1 and 3; 70 + 30 = 100 tokens = 3 blocks, the third undeclared.
        WorkloadRequest(1, 70, [0, 1, 2, 3], 30, [], "b"),
    ], hash_unit=16)
    assert distinct_attention_blocks(workload, 32) == 4 + 1
    assert pool_size(workload, EngineShape(hash_unit=16, attention_block_size=32,
                                           num_gpu_blocks=50)) == (50, "given")
    # 0.25 x 5 is tiny: the floor is twice the largest request (130 tokens = 5 attention
    # blocks, + 4 Mamba pages in each of the 3 Mamba groups).
    assert pool_size(workload, shape) == (34, "2 x the largest request (17 blocks)")


# --- synth through the CLI --------------------------------------------------------------------------------


def test_synth_cli_writes_a_workload_trace(tmp_path):
    out = tmp_path / "chat.kvtrace"
    result = run("synth", "--preset", "chat", "--requests", 120, "--seed", 4, "--turns", 3,
                 "--hash-unit", 16, "-o", out)
    assert result.exit_code == 0, result.output
    assert "120 requests" in result.output
    reader, records = read_records(out)
    header = reader.header
    assert header.source == "synth" and not header.includes_hash_bytes
    assert header.params["preset"] == "chat" and header.params["seed"] == "4"
    assert header.params["turns"] == "3.0"
    # The default model's geometry (kimi-k3 at TP 16): 3 KDA groups and the MLA group, all
    # 384-token blocks, FlashKDA checkpoints (1 block, 16-token alignment).
    assert header.params["model"] == "kimi-k3" and header.params["tensor_parallel_size"] == "16"
    config = header.config
    assert [(g.kind, g.block_size) for g in config.kv_cache_groups] == [
        ("mamba", 384)] * 3 + [("full_attention", 384)]
    mamba = config.kv_cache_groups[0]
    assert mamba.mamba_cache_mode == "align"
    assert (mamba.num_prefill_checkpoint_blocks, mamba.prefill_checkpoint_alignment) == (1, 16)
    assert config.hash_block_size == 16 and config.retention_interval == 0
    assert config.max_num_batched_tokens == 8192 and config.max_model_len % 384 == 0
    # Records: each RequestArrived, in request order, then its HashesExtended (if any).
    expected = synthesize("chat", 120, seed=4, hash_unit=16, overrides={"turns": 3.0})
    assert records == list(workload_records(expected))
    assert isinstance(records[0], RequestArrived) and records[0].req == 0
    for record, after in zip(records, records[1:]):
        if isinstance(after, HashesExtended):
            assert isinstance(record, RequestArrived) and record.req == after.req


def test_unreal_geometry_needs_its_flag_and_is_marked(tmp_path):
    """Toy sizes vLLM would never build (Mamba block != attention block) stay possible as an
    explicit what-if, and the workload says so."""
    out = tmp_path / "toy.kvtrace"
    toy = ["--hash-unit", 16, "--attention-block-size", 16, "--mamba-block-size", 64]
    refused = run("synth", "--preset", "chat", "--requests", 20, *toy, "-o", out)
    assert refused.exit_code == 1 and "--allow-unreal-geometry" in refused.stderr
    assert not out.exists()
    result = run("synth", "--preset", "chat", "--requests", 20, *toy, "--allow-unreal-geometry",
                 "-o", out)
    assert result.exit_code == 0, result.output
    header = read_records(out)[0].header
    assert header.params["unreal_geometry"] == "allowed"
    assert {(g.kind, g.block_size) for g in header.config.kv_cache_groups} == {
        ("mamba", 64), ("full_attention", 16)}


def test_synth_cli_same_seed_same_records(tmp_path):
    a, b = tmp_path / "a.kvtrace", tmp_path / "b.kvtrace"
    for path in (a, b):
        assert run("synth", "--preset", "agent", "--requests", 50, "--seed", 9, "-o", path).exit_code == 0
    (reader_a, records_a), (reader_b, records_b) = read_records(a), read_records(b)
    assert records_a == records_b and reader_a.header.params == reader_b.header.params
    assert reader_a.header.config == reader_b.header.config


def test_retention_dense_and_explicit_pool(tmp_path):
    out = tmp_path / "w.kvtrace"
    result = run("synth", "--preset", "shared-prompt", "--requests", 20, "--retention-interval",
                 "dense", "--num-gpu-blocks", 5000, "-o", out)
    assert result.exit_code == 0, result.output
    config = read_records(out)[0].header.config
    assert config.retention_interval is None and config.num_gpu_blocks == 5000


@pytest.mark.parametrize("args, message", [
    (["--preset", "chat", "--tool-call-len", 5], "--tool-call-len does not apply to preset chat"),
    (["--preset", "chat", "--attention-block-size", 48], "not a multiple of the hash unit 384"),
    (["--preset", "chat", "--mamba-block-size", 768], "attention block 384 and Mamba block 768 differ"),
    (["--preset", "agent", "--num-gpu-blocks", 10], "a pool of 10 blocks cannot hold request"),
    (["--preset", "chat", "--rate", 0], "--rate must be positive"),
    (["--preset", "agent", "--turns", 0.5], "--turns must be at least 1, not 0.5"),
])
def test_synth_cli_bad_settings_fail_cleanly(tmp_path, args, message):
    out = tmp_path / "w.kvtrace"
    result = run("synth", *args, "--requests", 30, "-o", out)
    assert result.exit_code == 1
    assert result.stderr.count("kvtrace: error:") == 1 and message in result.stderr
    assert "kvtrace: hint:" in result.stderr and "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_synth_cli_missing_output_directory(tmp_path):
    result = run("synth", "--preset", "chat", "--requests", 5, "-o", tmp_path / "no" / "w.kvtrace")
    assert result.exit_code == 1 and "cannot write" in result.stderr


# --- Mooncake import ---------------------------------------------------------------------------------------


TINY_LOG = [
    {"timestamp": 0, "input_length": 1100, "output_length": 10, "hash_ids": [7, 8, 9]},
    {"timestamp": 5, "input_length": 700, "output_length": 3, "hash_ids": [7, 11]},
    {"timestamp": 2, "input_length": 512, "output_length": 0, "hash_ids": [7]},
]


def write_log(path: Path, rows: list, raw_lines: dict[int, str] = {}) -> Path:
    lines = [json.dumps(row) for row in rows]
    for number, text in raw_lines.items():
        lines[number - 1] = text
    path.write_text("\n".join(lines) + "\n")
    return path


def test_mooncake_mapping_by_hand(tmp_path):
    log = write_log(tmp_path / "tiny.jsonl", TINY_LOG)
    workload = import_mooncake(log, hash_unit=128)
    # Stable timestamp order: line 1 (t=0), line 3 (t=2), line 2 (t=5).
    first, third, second = workload.requests
    assert [r.request_id for r in workload.requests] == ["line-1", "line-3", "line-2"]
    # 1100 tokens = 8 full units of 128: block 7 -> units 0-3, block 8 -> 4-7; block 9's
    # 76 tokens fill no unit.
    assert first.hash_ids == [0, 1, 2, 3, 4, 5, 6, 7]
    assert third.hash_ids == [0, 1, 2, 3]  # the same block 7
    assert second.hash_ids == [0, 1, 2, 3, 8]  # block 11 is another prefix: a new id
    assert [r.arrival_ns for r in workload.requests] == [0, 2_000_000, 5_000_000]
    assert [r.max_tokens for r in workload.requests] == [10, 1, 3]  # 0 is clamped to 1
    assert all(r.output_hash_ids == [] for r in workload.requests)
    assert workload.params["output_length_zero_clamped"] == "1"
    # A hash unit coarser than the source block: a unit is named by its last block.
    coarse = import_mooncake(log, hash_unit=1024)
    assert [r.hash_ids for r in coarse.requests] == [[0], [], []]


def test_mooncake_cli_writes_import_trace(tmp_path):
    log = write_log(tmp_path / "tiny.jsonl", TINY_LOG)
    out = tmp_path / "tiny.kvtrace"
    result = run("import", "mooncake", log, "--hash-unit", 128, "--attention-block-size", 512,
                 "-o", out)
    assert result.exit_code == 0, result.output
    reader, records = read_records(out)
    assert reader.header.source == "import" and reader.header.config.hash_block_size == 128
    assert reader.header.params["source_file"] == "tiny.jsonl"
    assert [(r.req, r.prompt_len, r.hash_ids) for r in records] == [
        (0, 1100, [0, 1, 2, 3, 4, 5, 6, 7]), (1, 512, [0, 1, 2, 3]), (2, 700, [0, 1, 2, 3, 8])]


@pytest.mark.parametrize("raw_lines, message", [
    ({2: '{"timestamp": 5, "input_length": 700,'}, "line 2: not JSON (Input data was truncated)"),
    ({3: '{"timestamp": 2, "input_length": 512, "output_length": 0}'},
     "line 3: Object missing required field `hash_ids`"),
    ({1: '{"timestamp": "0", "input_length": 1100, "output_length": 1, "hash_ids": [7, 8, 9]}'},
     "line 1: Expected `int`, got `str`"),
    ({2: '{"timestamp": 5, "input_length": 1700, "output_length": 3, "hash_ids": [7, 11]}'},
     "line 2: 2 hash_ids for input_length 1700; expected ceil(1700/512) = 4"),
    ({2: '{"timestamp": 5, "input_length": 700, "output_length": 3, "hash_ids": [11, 8]}'},
     "line 2: block id 8 follows id 11 here but id 7 on line 1"),
    ({3: '{"timestamp": 2, "input_length": 0, "output_length": 1, "hash_ids": []}'},
     "line 3: input_length 0 is not positive"),
])
def test_mooncake_malformed_lines_fail_with_line_number_and_no_output(tmp_path, raw_lines, message):
    log = write_log(tmp_path / "bad.jsonl", TINY_LOG, raw_lines)
    out = tmp_path / "out" / "bad.kvtrace"
    out.parent.mkdir()
    result = run("import", "mooncake", log, "-o", out)
    assert result.exit_code == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("kvtrace: error:")]
    assert len(errors) == 1 and message in errors[0], result.stderr
    assert "Traceback" not in result.stderr
    assert list(out.parent.iterdir()) == []


def test_mooncake_empty_log_is_refused(tmp_path):
    log = tmp_path / "empty.jsonl"
    log.write_text("\n")
    result = run("import", "mooncake", log, "-o", tmp_path / "e.kvtrace")
    assert result.exit_code == 1 and "holds no requests" in result.stderr


def test_real_mooncake_synthetic_trace_imports_faithfully(tmp_path):
    out = tmp_path / "synthetic.kvtrace"
    result = run("import", "mooncake", MOONCAKE_SYNTHETIC, "--hash-unit", 64, "-o", out)
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in MOONCAKE_SYNTHETIC.read_text().splitlines()]
    reader, records = read_records(out)
    assert len(records) == len(rows) == 3993  # the file's request count (README)
    for row, record in zip(rows, records):  # the file is already in timestamp order
        assert record.prompt_len == row["input_length"]
        assert record.arrival_ns == row["timestamp"] * 1_000_000
        assert record.max_tokens == row["output_length"]
        assert len(record.hash_ids) == row["input_length"] // 64
    # Units shared by two requests = blocks they share x 8, within both prompts' full units.
    for i in range(0, len(rows) - 1, 7):
        for j in (i + 1, (i * 31) % len(rows)):
            a, b = rows[i], rows[j]
            blocks = common_prefix(a["hash_ids"], b["hash_ids"])
            expected = min(blocks * 8, a["input_length"] // 64, b["input_length"] // 64)
            assert common_prefix(records[i].hash_ids, records[j].hash_ids) == expected
