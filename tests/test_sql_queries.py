"""Every shipped query: a well-formed header, and on a small trace exactly its declared columns."""

from __future__ import annotations

import re
from importlib import resources

import pytest

from kvtrace.analysis.database import open_database
from kvtrace.analysis.load import load_traces
from kvtrace.analysis.queries import shipped_queries, run_query
from kvtrace.traceio import write_trace

from test_analysis_scenario import header, scenario

EXPECTED = {"prefix_hotness", "checkpoint_pushouts", "lost_hits_by_prefix", "hit_rate_timeline",
            "eviction_causes", "checkpoint_publications", "stale_key_hazards", "cache_occupancy"}


@pytest.fixture(scope="module")
def connection(tmp_path_factory):
    from kvtrace.events import StaleKeyLeft

    directory = tmp_path_factory.mktemp("q")
    # The unfixed scenario plus a stale-key hazard on block 4, so every query has rows to shape.
    records = scenario(unfixed=True)
    records.insert(30, StaleKeyLeft(2, 1, 4, 103, 32, 48))
    write_trace(directory / "unfixed.kvtrace", header("unfixed"), records)
    write_trace(directory / "fixed.kvtrace", header("fixed"), scenario(unfixed=False))
    load_traces([directory], directory / "q.duckdb")
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
