"""Every shipped query: a well-formed header, and on a small trace exactly its declared columns."""

from __future__ import annotations

import re
import sys
from importlib import resources
from pathlib import Path

from msgspec.structs import replace

import pytest

from kvtrace.analysis.database import open_database
from kvtrace.analysis.load import load_traces
from kvtrace.analysis.queries import shipped_queries, run_query
from kvtrace.traceio import read_records

from test_analysis_scenario import header

sys.path.insert(0, str(Path(__file__).parent / "data"))
from make_golden import forensics_records  # noqa: E402

EXPECTED = {"prefix_hotness", "checkpoint_pushouts", "lost_hits_by_prefix", "hit_rate_timeline",
            "eviction_causes", "checkpoint_publications", "stale_key_hazards", "cache_occupancy",
            "pushed_out_prefixes", "miss_attribution", "miss_attribution_summary",
            "recompute_gpu_seconds"}


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
    connection = open_database(directory / "q.duckdb")
    yield connection
    connection.close()


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
