"""Every shipped query: a well-formed header, and on a small trace exactly its declared columns."""

from __future__ import annotations

import re
import sys
from importlib import resources
from pathlib import Path

from msgspec.structs import replace

import pytest

from kvtrace.analysis.database import open_database
from kvtrace.analysis.load import load_sweep, load_traces
from kvtrace.analysis.queries import shipped_queries, run_query
from kvtrace.traceio import read_records

from test_analysis_scenario import header

sys.path.insert(0, str(Path(__file__).parent / "data"))
from make_golden import forensics_records  # noqa: E402

EXPECTED = {"prefix_hotness", "checkpoint_pushouts", "lost_hits_by_prefix", "hit_rate_timeline",
            "eviction_causes", "checkpoint_publications", "stale_key_hazards", "cache_occupancy",
            "pushed_out_prefixes", "miss_attribution", "miss_attribution_summary",
            "recompute_gpu_seconds", "variant_verdict", "pushout_lookups", "request_causes",
            "sweep_break_even", "diagnosis", "counter_reconciliation",
            "vllm_counter_reconciliation", "fleet"}


GOLDEN = [Path(__file__).parent / "data" / f"forensics-v1-{v}.kvtrace" for v in ("unfixed", "fixed")]


def test_golden_forensics_traces_hold_the_scenario():
    """The golden files (tests/data/make_golden.py) are the hand-built scenario, decoded."""
    for path, variant in zip(GOLDEN, ("unfixed", "fixed")):
        reader, records = read_records(path)
        assert reader.header == replace(header(variant), format_minor=0)  # written by 1.0
        assert records == forensics_records(variant)


@pytest.fixture(scope="module")
def connection(tmp_path_factory):
    # The golden v1 replays of the scenario (the unfixed one with a stale-key hazard on block 4),
    # so every query has rows to shape, and old traces keep loading.
    directory = tmp_path_factory.mktemp("q")
    load_traces(GOLDEN, directory / "q.duckdb")
    load_sweep(hand_sweep(), directory / "q.duckdb")
    connection = open_database(directory / "q.duckdb")
    yield connection
    connection.close()


# Hit rates of a hand-made sweep: (unfixed, fixed) per pool size. fixed hits less at 64 and
# 96 blocks, as much or more from 112 on: the fix pays from 112 blocks (80 is a false start).
SWEPT = {64: (0.30, 0.20), 80: (0.32, 0.33), 96: (0.40, 0.39), 112: (0.45, 0.45),
         128: (0.46, 0.50)}


def hand_sweep() -> dict:
    rows = [{"variant": variant, "retention_interval": 0, "num_gpu_blocks": blocks,
             "pool_fraction": blocks / 160, "requests": 10, "prompt_tokens": 1000,
             "hit_tokens": int(rates[i] * 1000), "hit_rate": rates[i], "evictions": 0,
             "checkpoints_published": 0, "checkpoints_suppressed": 0, "stale_key_hazards": 0,
             "preemptions": 0, "steps": 1, "wall_s": 0.1}
            for blocks, rates in SWEPT.items() for i, variant in enumerate(("unfixed", "fixed"))]
    return {"source": "w.kvtrace", "source_digest": "sha256:00", "backend": "model",
            "rows": rows}


def test_sweep_break_even_is_where_the_fix_stops_losing(connection):
    (row,) = [dict(zip(r.columns, values)) for r in [run_query(connection, "sweep_break_even")]
              for values in r.rows]
    assert (row["pool_sizes"], row["break_even_blocks"], row["break_even_fraction"]) == (
        5, 112, 112 / 160)
    assert row["hit_rate_change"] == 0
    assert (row["largest_gain"], row["largest_gain_blocks"]) == (pytest.approx(0.04), 128)
    swapped = run_query(connection, "sweep_break_even",
                        {"from_variant": "fixed", "to_variant": "unfixed"})
    assert swapped.rows[0][swapped.columns.index("break_even_blocks")] is None  # 128 loses


def test_the_shipped_queries_are_package_data():
    names = {e.name for e in resources.files("kvtrace.sql").iterdir() if e.name.endswith(".sql")}
    assert names == {f"{n}.sql" for n in EXPECTED}
    assert set(shipped_queries()) == EXPECTED


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_query_returns_the_columns_its_header_declares(connection, name):
    query = shipped_queries()[name]
    assert query.summary and query.columns
    assert all(p.description for p in query.params)
    result = run_query(connection, name)
    assert result.columns == query.columns
    assert result.rows, f"{name} returned no rows on the scenario"


def test_stale_key_hazard_counts_the_hit_that_read_the_wrong_state(connection):
    # Key 103 stays on block 4 from the hazard (seq 30) until the trace ends; block 4 is never
    # touched afterwards in the unfixed scenario, so no wrong-state hit.
    rows = run_query(connection, "stale_key_hazards").rows
    assert [(r[1], r[7], r[8], r[9], r[10], r[11]) for r in rows] == [
        ("unfixed", 103, 32, 48, None, 0)]


def test_every_param_in_sql_is_declared():
    for query in shipped_queries().values():
        assert set(re.findall(r"\$(\w+)", query.sql)) == {p.name for p in query.params}


def test_variant_verdict_by_hand(connection):
    """The scenario's two replays: request 4 hits S (16 tokens) in fixed and misses it in
    unfixed; priced at 1,000 FLOPs a token and 10 per position attended, on 1 MFLOP/s."""
    result = run_query(connection, "variant_verdict", {
        "flops_per_token": "1000", "flops_per_position": "10", "gpu_flops_per_s": "1e6"})
    (row,) = [dict(zip(result.columns, values)) for values in result.rows]
    # Every request's one admission, (query, hit): the scenario's lookups.
    unfixed = [(32, 0), (32, 16), (48, 16), (80, 0), (32, 0), (32, 16)]
    fixed = unfixed[:4] + [(32, 16), (32, 16)]

    def price(lookups):
        return sum(1000 * (q - h) + 10 * (q * (q + 1) - h * (h + 1)) / 2
                   for q, h in lookups) / 1e6

    hours = 7 / 3.6e12  # every arrival at 0 ns, the last step at 7 ns
    assert (row["from_variant"], row["to_variant"], row["lookups"]) == ("unfixed", "fixed", 6)
    assert (row["from_hit_rate"], row["to_hit_rate"]) == (48 / 256, 64 / 256)
    assert (row["from_prefill_tokens"], row["to_prefill_tokens"]) == (208, 192)
    assert row["traffic_hours"] == pytest.approx(hours)
    assert row["prefill_tokens_saved_per_hour"] == pytest.approx(16 / hours)
    assert (row["from_gpu_seconds"], row["to_gpu_seconds"]) == (
        pytest.approx(price(unfixed)), pytest.approx(price(fixed)))
    assert row["gpu_seconds_saved_per_hour"] == pytest.approx(
        (price(unfixed) - price(fixed)) / hours)
    assert row["cost_model"] == "(parameters)"
    unpriced = run_query(connection, "variant_verdict")  # no figures in these old headers
    assert unpriced.rows[0][unpriced.columns.index("from_gpu_seconds")] is None
