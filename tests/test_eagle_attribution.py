"""EAGLE's dropped unit in the miss attribution: an engine built with ``use_eagle`` (vLLM's
KVCacheManager flag: EAGLE/MTP drafting without lookahead block hashes) drops the last matched
unit of every hit, and the attribution files those tokens under ``eagle_dropped_unit``.

The traces are replays on the vllm backend (vLLM 0.33's real KVCacheManager, built with the
header's ``use_eagle``) of tiny workloads whose hits are worked out by hand below."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from kvtrace.analysis.attribution import attribute_trace
from kvtrace.analysis.causes import SHORTFALL_CAUSES
from kvtrace.analysis.database import open_database
from kvtrace.analysis.load import load_traces
from kvtrace.analysis.queries import run_query
from kvtrace.events import KVCacheGroup
from kvtrace.replay.options import ReplayOptions
from kvtrace.replay.run import replay
from kvtrace.traceio import read_records, write_trace
from kvtrace.workloads.workload import EngineShape, Workload, WorkloadRequest, write_workload

from test_attribution import SMALL, named_causes, needs_the_core, pass_output, units, why

SECOND = 10**9


def request(arrival_s: float, prompt_len: int, hash_ids: list[int]) -> WorkloadRequest:
    return WorkloadRequest(int(arrival_s * SECOND), prompt_len, hash_ids, 1, [], "")


def replayed(directory: Path, shape: dict, requests: list[WorkloadRequest], **config) -> str:
    """The requests replayed on the vllm backend (upstream) under the shape's engine config with
    ``config``'s fields replaced (use_eagle, the groups): the output trace."""
    directory.mkdir(parents=True, exist_ok=True)
    source = directory / "w.kvtrace"
    write_workload(source, Workload("synth", requests, shape["hash_unit"]), EngineShape(**shape))
    reader, records = read_records(source)
    header = msgspec.structs.replace(
        reader.header, config=msgspec.structs.replace(reader.header.config, **config))
    write_trace(source, header, records)
    result = replay(ReplayOptions(source=str(source), outdir=str(directory / "runs"),
                                  variants=("upstream",)))
    return result.variants[0].output


def second_lookup(output: str):
    """Request 1's lookup, checked to partition its query."""
    (lookup,) = attribute_trace(output, request=1).lookups
    assert lookup.hit_tokens + sum(s.tokens for s in lookup.segments) == lookup.query_tokens
    assert sum(s.tokens for s in lookup.segments if s.cause in SHORTFALL_CAUSES) \
        == lookup.ideal_tokens - lookup.hit_tokens
    return lookup


def segments(lookup) -> list[tuple[str, int, int]]:
    return sorted((s.cause, s.start, s.end) for s in lookup.segments)


# The small hybrid engine (one full-attention group of 16-token blocks, one Mamba group of
# 32-token blocks, a 16-token hash unit: fine-grained hits, so EAGLE drops one hash unit).
ONLY_ATTENTION = [KVCacheGroup(kind="full_attention", block_size=16)]
COARSE = dict(SMALL, hash_unit=32, attention_block_size=32, mamba_block_size=32,
              checkpoint_alignment=32)

# name -> (shape, requests, config fields, request 1's segments with use_eagle, without it).
SCENARIOS = {
    # A 100-token prompt twice. Without EAGLE the second hits 96 (6 units; 4 tokens no hash
    # covers). With it, full attention looks one unit past the cap (99 + 16, at most the 6
    # units: 96), finds 96 and drops a unit: 80; the Mamba state at 80 is there (vLLM keeps
    # Mamba states on EAGLE's replay boundary), so the hit is 80: 16 tokens to the drop.
    "resend": (SMALL, [request(0, 100, units(1, 6)), request(1, 100, units(1, 6))], {},
               [("eagle_dropped_unit", 80, 96), ("partial_unit", 96, 100)],
               [("partial_unit", 96, 100)]),
    # A block-aligned 96-token prompt twice: the cap (95) already keeps the hit at 80, and the
    # hybrid coordinator's margin (one unit past the cap) makes the drop land there too: EAGLE
    # costs nothing more.
    "aligned_resend": (SMALL, [request(0, 96, units(1, 6)), request(1, 96, units(1, 6))], {},
                       [("hit_cap", 80, 96)], [("hit_cap", 80, 96)]),
    # The same with one full-attention group (UnitaryKVCacheCoordinator): no margin, so the
    # search stops at the cap (5 blocks, 80) and drops a block: 64.
    "aligned_resend_one_group": (
        SMALL, [request(0, 96, units(1, 6)), request(1, 96, units(1, 6))],
        dict(kv_cache_groups=ONLY_ATTENTION, retention_interval=None),
        [("eagle_dropped_unit", 64, 80), ("hit_cap", 80, 96)], [("hit_cap", 80, 96)]),
    # 32-token units and blocks (no fine-grained hits): the drop is a whole block. A 200-token
    # prompt twice: 192 without EAGLE, 192 - 32 = 160 with it.
    "coarse_resend": (COARSE, [request(0, 200, units(1, 6)), request(1, 200, units(1, 6))], {},
                      [("eagle_dropped_unit", 160, 192), ("partial_unit", 192, 200)],
                      [("partial_unit", 192, 200)]),
}


@pytest.mark.parametrize("name", SCENARIOS)
def test_the_dropped_unit_is_filed_under_its_own_cause(tmp_path, name):
    shape, requests, config, with_eagle, without = SCENARIOS[name]
    eagle = second_lookup(replayed(tmp_path / "eagle", shape, requests, use_eagle=True, **config))
    assert segments(eagle) == with_eagle
    plain = second_lookup(replayed(tmp_path / "plain", shape, requests, **config))
    assert segments(plain) == without
    # What EAGLE costs is exactly the hit the plain engine had above it.
    lost = sum(s.tokens for s in eagle.segments if s.cause == "eagle_dropped_unit")
    assert plain.hit_tokens - eagle.hit_tokens == lost


def test_the_cause_follows_the_engine_config_not_the_hit(tmp_path):
    """The EAGLE replay's trace read as if its engine did not drop: the same 16 tokens are no
    longer EAGLE's (vLLM keeps no Mamba state at 96 under EAGLE, so the model without the drop
    finds none there), and `kvtrace why` names the cause only for the real engine."""
    shape, requests, _, _, _ = SCENARIOS["resend"]
    output = replayed(tmp_path, shape, requests, use_eagle=True)
    assert named_causes(why(output, "--request", 1)) \
        == ({"eagle_dropped_unit"}, {"partial_unit"})
    reader, records = read_records(output)
    config = msgspec.structs.replace(reader.header.config, use_eagle=False)
    edited = tmp_path / "no-eagle.kvtrace"
    write_trace(edited, msgspec.structs.replace(reader.header, config=config), records)
    lookup = second_lookup(str(edited))
    assert lookup.hit_tokens == 80
    assert "eagle_dropped_unit" not in {s.cause for s in lookup.segments}
    assert segments(lookup) == [("mamba_not_reserved", 80, 96), ("partial_unit", 96, 100)]


def test_the_table_and_the_summary_carry_the_cause(tmp_path):
    shape, requests, _, _, _ = SCENARIOS["resend"]
    output = replayed(tmp_path, shape, requests, use_eagle=True)
    db = tmp_path / "e.duckdb"
    load_traces([output], db)
    connection = open_database(db)
    try:
        rows = connection.execute(
            "SELECT req, cause::VARCHAR, in_shortfall, from_tokens, to_tokens "
            "FROM miss_attribution WHERE cause = 'eagle_dropped_unit'").fetchall()
        assert rows == [(1, "eagle_dropped_unit", True, 80, 96)]
        summary = run_query(connection, "miss_attribution_summary")
        by_cause = {row["cause"]: row for row in map(lambda r: dict(zip(summary.columns, r)),
                                                     summary.rows)}
        assert by_cause["eagle_dropped_unit"]["tokens"] == 16
    finally:
        connection.close()


@needs_the_core
@pytest.mark.parametrize("name", SCENARIOS)
def test_the_c_core_attributes_the_drop_as_the_python_reference(tmp_path, name):
    shape, requests, config, _, _ = SCENARIOS[name]
    output = replayed(tmp_path, shape, requests, use_eagle=True, **config)
    reference = pass_output(output, native=False)
    assert pass_output(output, native=True) == reference
    explained = dict(keep_lookups=True, make_rows=False, explain=True)
    assert pass_output(output, native=True, **explained) \
        == pass_output(output, native=False, **explained)
