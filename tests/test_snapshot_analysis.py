"""A capture that armed mid-flight: its start snapshot in load, the miss attribution, `why`, the
queries and the replay summary (trace format 1.2, docs/miss-attribution.md "A capture's start").

A hand-built trace on a 6-block pool (one attention and one Mamba group of 16-token blocks, a
16-token hash unit): when the capture armed, key S was cached in both groups (blocks 1 and 2),
request 0 was running, half prefilled, with one admission behind it, and request 5 was waiting,
never admitted. Then:

* request 1 arrives and hits S (16 tokens);
* request 0 is preempted and admitted again, hitting S: its second admission (a resumption);
* request 5 is admitted, hitting S: its first admission, inside the trace;
* request 2 evicts every cached block, S's included (LRU, no transient checkpoint behind);
* request 3 needs S and misses it: S was cached at the start and evicted, so the 16 tokens are
  lost to `evicted`, not `cold` (an attribution that did not know the snapshot would say cold).

A request in flight counts as ReplaySummary counts it: its first lookup inside the trace is a
first admission only if the snapshot shows it never admitted (waiting, no preemption).

Every figure below is worked out by hand from these records; each test runs on the C core and on
its Python twins.
"""

from __future__ import annotations

import msgspec
import pytest
from click.testing import CliRunner

from kvtrace.analysis import stream
from kvtrace.analysis.attribution import attribute_trace
from kvtrace.analysis.database import open_database
from kvtrace.analysis.load import load_traces
from kvtrace.analysis.queries import run_query
from kvtrace.cli import cli
from kvtrace.events import (
    BlockAllocated,
    BlockFreed,
    BlockRemoved,
    BlockState,
    BlockStored,
    BlockTouched,
    ComputedBlocksFound,
    EngineConfig,
    FreeQueueState,
    KeyCached,
    KVCacheGroup,
    RemoveReason,
    ReplayInfo,
    RequestArrived,
    RequestBlocksState,
    RequestFinished,
    RequestPreempted,
    RequestQueue,
    RequestState,
    SlotsAllocated,
    SnapshotEnded,
    SnapshotStarted,
    StepStarted,
    StoreKind,
    TraceHeader,
)
from kvtrace.replay.model.reports import Tally
from kvtrace.replay.summary import ReplaySummary
from kvtrace.traceio import write_trace

S = 100  # the key cached when the capture armed
LRU, FULL = RemoveReason.LRU_REUSE, StoreKind.FULL
CONFIG = EngineConfig(
    kv_cache_groups=[KVCacheGroup(kind="full_attention", block_size=16),
                     KVCacheGroup(kind="mamba", block_size=16, mamba_cache_mode="align")],
    hash_block_size=16, num_gpu_blocks=7, retention_interval=0)
HEADER = TraceHeader(kvtrace_version="test", created_ns=0, source="capture", config=CONFIG)


def allocated(req: int, num_tokens: int, hit: int = 0) -> SlotsAllocated:
    return SlotsAllocated(req, num_tokens - hit, 0, hit, 0, 0, num_tokens, True)


def snapshot() -> list:
    return [
        SnapshotStarted(0, 7, 1, 2, {"prefix_cache_queries": 48}),   # seq 0
        FreeQueueState([3, 4, 2, 1]),
        BlockState(1, 0, S, 0, 16),
        BlockState(2, 0, S, 1, 16),
        BlockState(5, 1, -1, 0, 0),
        BlockState(6, 1, -1, 1, 0),
        KeyCached(S, 0, 16, [1]),
        KeyCached(S, 1, 16, [2]),
        RequestState(0, RequestQueue.RUNNING, "RUNNING", 32, [S, 201], 4, 32, 16, 0, 0),
        RequestBlocksState(0, 0, [5], {"num_cached_block": [0]}),
        RequestBlocksState(0, 1, [6], {}),
        RequestState(5, RequestQueue.WAITING, "WAITING", 32, [S, 501], 1, 32, 0, 0, 0),
        SnapshotEnded(1500),                                         # seq 12
    ]


def records() -> list:
    return snapshot() + [
        StepStarted(0, 0),                                           # seq 13, step 1
        RequestArrived(1, 32, [S, 101], 1),
        ComputedBlocksFound(1, 16, 0),                               # hits S
        allocated(1, 32, hit=16),
        BlockTouched(1, 1),
        BlockTouched(2, 1),
        BlockAllocated(3, 1),
        BlockAllocated(4, 1),
        BlockStored(3, 101, 0, 32, FULL, 1),
        BlockStored(4, 101, 1, 32, FULL, 1),
        RequestFinished(1, 0),
        *(BlockFreed(block, 0, True) for block in (4, 3, 2, 1)),
        StepStarted(1, 1),                                           # seq 28, step 2
        RequestPreempted(0),
        BlockFreed(5, 0, False),
        BlockFreed(6, 0, False),
        ComputedBlocksFound(0, 16, 0),                               # seq 32: in flight, hits S
        allocated(0, 32, hit=16),
        BlockTouched(1, 0),
        BlockTouched(2, 0),
        BlockAllocated(5, 0),
        BlockAllocated(6, 0),
        RequestFinished(0, 0),
        *(BlockFreed(block, 0, block in (1, 2)) for block in (6, 5, 2, 1)),
        ComputedBlocksFound(5, 16, 0),                               # seq 43: in flight, first
        allocated(5, 32, hit=16),
        BlockTouched(1, 5),
        BlockTouched(2, 5),
        RequestFinished(5, 0),
        BlockFreed(2, 0, True),
        BlockFreed(1, 0, True),
        StepStarted(2, 2),                                           # seq 50, step 3
        RequestArrived(2, 64, [300, 301, 302, 303], 1),
        ComputedBlocksFound(2, 0, 0),
        allocated(2, 64),
        BlockRemoved(1, S, 0, 16, LRU),                              # seq 54: S evicted
        BlockAllocated(1, 2),
        BlockRemoved(2, S, 1, 16, LRU),
        BlockAllocated(2, 2),
        BlockRemoved(3, 101, 0, 32, LRU),
        BlockAllocated(3, 2),
        BlockRemoved(4, 101, 1, 32, LRU),
        BlockAllocated(4, 2),
        RequestFinished(2, 0),
        *(BlockFreed(block, 0, False) for block in (4, 3, 2, 1)),
        StepStarted(3, 3),                                           # seq 67, step 4
        RequestArrived(3, 32, [S, 400], 1),
        ComputedBlocksFound(3, 0, 0),                                # misses S
        allocated(3, 32),
    ]


@pytest.fixture(params=["C core", "Python twins"])
def twin(request, monkeypatch):
    if request.param == "C core":
        if stream.core is None:
            pytest.skip("kvtrace's C core is not built here (no C compiler at install)")
    else:
        monkeypatch.setattr(stream, "core", None)
    return request.param


@pytest.fixture
def capture(tmp_path):
    path = tmp_path / "capture.kvtrace"
    write_trace(path, HEADER, records())
    return path


def test_scenario_seq_numbers_match_the_comments():
    trace = records()
    assert isinstance(trace[12], SnapshotEnded) and trace[32] == ComputedBlocksFound(0, 16, 0)
    assert trace[43] == ComputedBlocksFound(5, 16, 0) and trace[50] == StepStarted(2, 2)
    assert trace[54] == BlockRemoved(1, S, 0, 16, LRU) and trace[69] == ComputedBlocksFound(3, 0, 0)


def test_a_key_cached_at_the_start_and_evicted_is_an_eviction_not_cold(capture, twin):
    lookups = {lookup.req: lookup for lookup in attribute_trace(capture).lookups}
    causes = {req: [(s.cause, s.start, s.end) for s in lookup.segments]
              for req, lookup in lookups.items()}
    # request 3: S was cached at the start, then evicted by request 2's allocation
    assert (lookups[3].ideal_tokens, lookups[3].hit_tokens) == (16, 0)
    assert causes[3] == [("evicted", 0, 16), ("cold", 16, 32)]
    (key,) = [s for s in lookups[3].segments if s.cause == "evicted"][0].keys
    assert (key.hash_id, key.removal.seq, key.removal.by_req) == (S, 54, 2)
    # request 1 hit S; requests 0 and 5 were in flight: 0's admission inside the trace is its
    # second, 5's its first (its first lookup falls inside the trace)
    assert causes[1] == [("cold", 16, 32)] and not lookups[1].in_flight
    assert (lookups[0].lookup, lookups[0].in_flight) == (2, True)
    assert (lookups[5].lookup, lookups[5].in_flight) == (1, True)
    assert (lookups[0].ideal_tokens, lookups[0].hit_tokens) == (16, 16) \
        == (lookups[5].ideal_tokens, lookups[5].hit_tokens)
    assert sorted(req for req, lookup in lookups.items() if lookup.lookup == 1) == [1, 2, 3, 5]


def test_load_keeps_the_snapshot_and_the_queries_read_it(capture, twin, tmp_path):
    db = tmp_path / "capture.duckdb"
    load_traces([capture], db)
    connection = open_database(db)
    try:
        # every state record is a row, its maps as JSON text
        assert connection.execute("SELECT counters FROM snapshot_started").fetchall() == [
            ('{"prefix_cache_queries":48}',)]
        assert connection.execute(
            "SELECT queue, num_computed_tokens FROM request_state ORDER BY req").fetchall() == [
            ("RUNNING", 16), ("WAITING", 0)]
        assert connection.execute("SELECT count(*) FROM free_queue_state_block_ids").fetchone() \
            == (4,)
        # the keys cached at the start are cache entries: hit three times, evicted by request 2
        entries = connection.execute(
            "SELECT group_id, block_id, stored_seq, hits, removed_seq, removed_reason, kind "
            "FROM cache_entries WHERE from_snapshot ORDER BY group_id").fetchall()
        assert entries == [(0, 1, 6, 3, 54, "LRU_REUSE", None), (1, 2, 7, 3, 56, "LRU_REUSE", None)]
        # lookups: request 0 is in flight, at its second admission; request 5 in flight, at its
        # first; the timeline counts the first admissions (requests 1, 5, 2 and 3)
        assert connection.execute(
            "SELECT req, admission, in_flight FROM lookups WHERE admitted ORDER BY seq").fetchall() \
            == [(1, 1, False), (0, 2, True), (5, 1, True), (2, 1, False), (3, 1, False)]
        timeline = run_query(connection, "hit_rate_timeline", {"bucket_steps": "100"})
        assert [(r[4], r[5], r[6]) for r in timeline.rows] == [(4, 160, 32)]
        summary = run_query(connection, "miss_attribution_summary")
        kinds = {(row[4], row[9]): row[11] for row in summary.rows}
        assert kinds[("resumed", "cold")] == 16 and kinds[("first", "evicted")] == 16
        assert {row[4]: row[6] for row in summary.rows} == {"first": 160, "resumed": 32}
        hotness = run_query(connection, "prefix_hotness")
        assert sorted((r[2], r[3], r[7], r[8]) for r in hotness.rows) == [(S, 0, 3, 1),
                                                                          (S, 1, 3, 1)]
    finally:
        connection.close()


def test_why_names_the_eviction_of_a_key_cached_at_the_start(capture, twin):
    result = CliRunner().invoke(cli, ["why", str(capture), "--request", "3"])
    assert result.exit_code == 0, result.output
    assert "evicted - the full-attention block was evicted by LRU reuse" in result.output
    assert "evicted from block 1 at step 3 (seq 54) to make room for request 2" in result.output
    result = CliRunner().invoke(cli, ["why", str(capture), "--request", "0"])
    assert result.exit_code == 0, result.output
    assert "lookup 2 (resumption 1, in flight when the capture began)" in result.output


def test_the_summary_counts_the_requests_whose_first_lookup_is_in_the_trace():
    """ReplaySummary, and the model backend's Tally that counts without records, alike: the
    arrivals and request 5 (waiting, never admitted) are first admissions; request 0 (running)
    was admitted before the capture: its hit counts as resumed."""
    summary = ReplaySummary(CONFIG)
    tally = Tally(CONFIG.num_gpu_blocks, len(CONFIG.kv_cache_groups))
    for record in records():
        summary(record)
        tally.report(type(record), *msgspec.structs.astuple(record))
    figures = summary.to_dict()
    assert (figures["requests"], figures["prompt_tokens"], figures["hit_tokens"],
            figures["resumed_hit_tokens"]) == (4, 160, 32, 16)
    counted = ReplaySummary(CONFIG)
    tally.fill(counted)
    assert counted.to_dict() == figures
