"""A hand-built scenario: a 6-block pool, six requests, two variants of one source.

The expectations below are computed by hand from the records (queue states in the comments);
the tests check that the shipped queries return exactly those rows.
"""

from __future__ import annotations

import pytest

from kvtrace.analysis.database import open_database
from kvtrace.analysis.load import load_traces
from kvtrace.analysis.queries import run_query
from kvtrace.events import (
    BlockAllocated,
    BlockFreed,
    BlockRemoved,
    BlockStored,
    BlockTouched,
    CheckpointClass,
    CheckpointRecorded,
    CheckpointSuppressed,
    ComputedBlocksFound,
    EngineConfig,
    KVCacheGroup,
    RemoveReason,
    ReplayInfo,
    RequestArrived,
    RequestFinished,
    SlotsAllocated,
    StepStarted,
    StoreKind,
    TraceHeader,
)
from kvtrace.traceio import write_trace

FULL, CKPT = StoreKind.FULL, StoreKind.CHECKPOINT
LRU = RemoveReason.LRU_REUSE
TRANSIENT = CheckpointClass.TRANSIENT
S = 100  # the shared system-prompt unit: prefix (100, group 0), 16 tokens

CONFIG = EngineConfig(
    kv_cache_groups=[KVCacheGroup(kind="full_attention", block_size=16),
                     KVCacheGroup(kind="mamba", block_size=16, mamba_cache_mode="align")],
    hash_block_size=16, num_gpu_blocks=7, retention_interval=0)


def header(variant: str) -> TraceHeader:
    return TraceHeader(kvtrace_version="0.1.0", created_ns=0, source="replay", config=CONFIG,
                       replay=ReplayInfo(variant=variant, backend="model", mode="reschedule",
                                         source_path="scenario.kvtrace"))


def allocated(req: int, n_tokens: int, hit: int = 0, ok: bool = True) -> SlotsAllocated:
    return SlotsAllocated(req, n_tokens - hit, 0, hit, 0, 0, n_tokens, ok)


def scenario(unfixed: bool) -> list:
    """Seq numbers (record positions) are noted for the unfixed run, whose effects matter."""
    def checkpoint(req, block, position, hash_id):
        # unfixed publishes the transient checkpoint; fixed (#56794) keeps it request-local.
        if unfixed:
            return BlockStored(block, hash_id, 1, position, CKPT, req)
        return CheckpointSuppressed(req, 1, position, block, 0)

    records = [
        StepStarted(0, 0),                                         # seq 0, step 1
        RequestArrived(0, 32, [S, 101], 1),
        ComputedBlocksFound(0, 0, 0),
        allocated(0, 32),
        BlockAllocated(1, 0),                                      # queue 2 3 4 5 6
        BlockAllocated(2, 0),                                      # queue 3 4 5 6
        CheckpointRecorded(0, 1, 16, 1, TRANSIENT),
        BlockStored(1, S, 0, 16, FULL, 0),                         # seq 7: S stored
        checkpoint(0, 2, 16, S),                                   # seq 8: T1 on block 2
        StepStarted(1, 1),                                         # step 2
        RequestFinished(0, 0),
        BlockFreed(2, 0, unfixed),                                 # unfixed: 3 4 5 6 2
        BlockFreed(1, 0, True),                                    # unfixed: 3 4 5 6 2 1
        RequestArrived(1, 32, [S, 102], 1),
        ComputedBlocksFound(1, 16, 0),
        BlockTouched(1, 1),                                        # seq 15: hit 1 on S
        allocated(1, 32, hit=16),
        BlockAllocated(3, 1),                                      # 4 5 6 2
        StepStarted(2, 2),                                         # step 3
        RequestFinished(1, 0),
        BlockFreed(3, 0, False),                                   # 3 4 5 6 2
        BlockFreed(1, 0, True),                                    # 3 4 5 6 2 1
        RequestArrived(2, 48, [S, 103, 104], 1),
        ComputedBlocksFound(2, 16, 0),
        BlockTouched(1, 2),                                        # seq 24: hit 2 on S: hot
        allocated(2, 48, hit=16),
        BlockAllocated(3, 2),                                      # 4 5 6 2
        BlockAllocated(4, 2),                                      # 5 6 2
        CheckpointRecorded(2, 1, 32, 1, TRANSIENT),
        checkpoint(2, 4, 32, 103),                                 # seq 29: T2 on block 4
        StepStarted(3, 3),                                         # step 4
        RequestFinished(2, 0),
        BlockFreed(1, 0, True),                                    # 5 6 2 1
        BlockFreed(3, 0, False),                                   # 3 5 6 2 1
        BlockFreed(4, 0, unfixed),                                 # 3 5 6 2 1 4: T2 behind S
        StepStarted(4, 4),                                         # seq 35, step 5
        RequestArrived(3, 80, [200, 201, 202, 203, 204], 1),
        ComputedBlocksFound(3, 0, 0),
        allocated(3, 80),
        BlockAllocated(3, 3),                                      # 5 6 2 1 4
        BlockAllocated(5, 3),                                      # 6 2 1 4
        BlockAllocated(6, 3),                                      # 2 1 4
    ]
    if unfixed:
        records += [
            BlockRemoved(2, S, 1, 16, LRU),                        # seq 42: T1 evicted, 0 hits
            BlockAllocated(2, 3),                                  # 1 4
            BlockRemoved(1, S, 0, 16, LRU),                        # seq 44: S evicted, T2 behind
            BlockAllocated(1, 3),                                  # 4
        ]
    else:  # the unhashed checkpoint slots went to the head and are reused; S survives
        records += [BlockAllocated(2, 3), BlockAllocated(4, 3)]
    records += [
        StepStarted(5, 5),                                         # step 6
        RequestFinished(3, 0),
        *(BlockFreed(block, 0, False) for block in (3, 5, 6, 2, 1 if unfixed else 4)),
        RequestArrived(4, 32, [S, 106], 1),
        ComputedBlocksFound(4, 0 if unfixed else 16, 0),           # needs S; unfixed misses it
        allocated(4, 32, hit=0 if unfixed else 16, ok=False),      # not admitted: looked up again
        StepStarted(6, 6),                                         # step 7
        ComputedBlocksFound(4, 0 if unfixed else 16, 0),           # the admitted lookup
        allocated(4, 32, hit=0 if unfixed else 16),
        *([BlockAllocated(3, 4), BlockStored(3, S, 0, 16, FULL, 4)] if unfixed  # S re-stored
          else [BlockTouched(1, 4)]),
        StepStarted(7, 7),                                         # step 8
        RequestArrived(5, 32, [S, 107], 1),
        ComputedBlocksFound(5, 16, 0),                             # after the re-store: a hit
        allocated(5, 32, hit=16),
    ]
    return records


@pytest.fixture(scope="module")
def scenario_db(tmp_path_factory):
    directory = tmp_path_factory.mktemp("runs")
    write_trace(directory / "fixed.kvtrace", header("fixed"), scenario(unfixed=False))
    write_trace(directory / "unfixed.kvtrace", header("unfixed"), scenario(unfixed=True))
    db_path = directory / "scenario.duckdb"
    load_traces([directory], db_path)
    connection = open_database(db_path)
    yield connection
    connection.close()


def rows_as_dicts(result):
    return [dict(zip(result.columns, row)) for row in result.rows]


def test_scenario_seq_numbers_match_the_comments():
    records = scenario(unfixed=True)
    assert records[7] == BlockStored(1, S, 0, 16, FULL, 0)
    assert isinstance(records[35], StepStarted)
    assert records[44] == BlockRemoved(1, S, 0, 16, LRU)


def test_checkpoint_pushouts_finds_exactly_the_hot_prefix_pushed_out(scenario_db):
    # Run 0 is fixed (directory order): nothing evicted there. In the unfixed run (run 1):
    # - T1 (block 2) is evicted at seq 42: a transient checkpoint, never hit -> not hot.
    # - S (block 1) is evicted at seq 44 (step 5) after 2 hits (seq 15, 24). T1 is gone, but
    #   T2 (block 4, freed at seq 34 behind S) is cached in the free queue: 1 transient.
    # - Later lookups needing unit 0 = S: req 4 twice (seq 54 not admitted, seq 57 admitted,
    #   hit 0 < 16) -> 1 missed lookup, regret 16 - 0 = 16. S is re-stored at seq 60; req 5
    #   (seq 63) hits it.
    result = run_query(scenario_db, "checkpoint_pushouts")
    assert rows_as_dicts(result) == [{
        "run": 1, "variant": "unfixed", "hash_id": S, "group_id": 0, "depth_tokens": 16,
        "block_id": 1, "evicted_seq": 44, "evicted_step": 5, "hits_before_eviction": 2,
        "transient_checkpoints_cached": 1, "later_missed_lookups": 1, "regret_tokens": 16,
    }]
    assert run_query(scenario_db, "checkpoint_pushouts", {"min_hits": "3"}).rows == []
    assert run_query(scenario_db, "checkpoint_pushouts", {"min_transient": "2"}).rows == []


def test_lost_hits_by_prefix_counts_the_lookup_unfixed_lost(scenario_db):
    # Admitted lookups paired by (req, admission): hits (fixed, unfixed) per request:
    # req0 (0, 0), req1 (16, 16), req2 (16, 16), req3 (0, 0), req4 (16, 0), req5 (16, 16).
    # Every hit ends at S (unit 0, depth 16): fixed 4, unfixed 3; req4 is the one lost,
    # 16 - 0 = 16 tokens; nothing gained.
    result = run_query(scenario_db, "lost_hits_by_prefix")
    assert rows_as_dicts(result) == [{
        "source": "scenario.kvtrace", "backend": "model", "fixed_run": 0, "unfixed_run": 1,
        "prefix_hash_id": S, "depth_tokens": 16, "fixed_hits": 4, "unfixed_hits": 3, "lost_lookups": 1,
        "tokens_lost": 16, "gained_lookups": 0, "tokens_gained": 0, "net_tokens_lost": 16,
    }]
    # Swapping the roles turns the loss into a gain.
    swapped = rows_as_dicts(run_query(scenario_db, "lost_hits_by_prefix",
                                      {"fixed": "unfixed", "unfixed": "fixed"}))
    assert [(r["tokens_lost"], r["tokens_gained"], r["net_tokens_lost"]) for r in swapped] == [
        (0, 16, -16)]


def test_checkpoint_publications_split_by_variant(scenario_db):
    # Two TRANSIENT checkpoints recorded per run: unfixed publishes both (T1 evicted by LRU,
    # none hit), fixed suppresses both.
    result = run_query(scenario_db, "checkpoint_publications")
    assert [row[:10] for row in result.rows] == [
        (0, "fixed", 1, "TRANSIENT", 2, 0, 2, 0, 0, 0),
        (1, "unfixed", 1, "TRANSIENT", 2, 2, 0, 0, 0, 1),
    ]


def test_eviction_causes_and_occupancy(scenario_db):
    causes = run_query(scenario_db, "eviction_causes")
    assert sorted((r[0], r[2], r[3], r[4], r[5], r[6]) for r in causes.rows) == [
        (1, "LRU_REUSE", 0, "FULL", None, 1),
        (1, "LRU_REUSE", 1, "CHECKPOINT", "TRANSIENT", 1),
    ]
    occupancy = rows_as_dicts(run_query(scenario_db, "cache_occupancy"))
    unfixed_step4 = next(r for r in occupancy if r["run"] == 1 and r["step_start"] == 4)
    # End of step 4 (unfixed): queue 3 5 6 2 1 4 -> S hot (2 hits), T1 and T2 transient,
    # nothing running, 3 unhashed free blocks (3 5 6).
    assert unfixed_step4 == {"run": 1, "variant": "unfixed", "step_start": 4, "pool_blocks": 6,
                             "running": 0, "hot_prefix": 1, "transient_checkpoint": 2,
                             "other_cached": 0, "free": 3}


def duplicate_copies() -> list:
    """One prefix S on two blocks (two requests computed it in the same step), both copies
    pushed out while a transient checkpoint sat cached, then one lookup that missed S."""
    return [
        StepStarted(0, 0),                                         # seq 0
        RequestArrived(0, 16, [S], 1),
        ComputedBlocksFound(0, 0, 0),
        allocated(0, 16),
        BlockAllocated(1, 0),
        BlockAllocated(2, 0),
        CheckpointRecorded(0, 1, 16, 1, TRANSIENT),
        BlockStored(1, S, 0, 16, FULL, 0),                         # seq 7: copy 1
        BlockStored(2, 900, 1, 16, CKPT, 0),                       # seq 8: transient T
        RequestArrived(1, 16, [S], 1),
        ComputedBlocksFound(1, 0, 0),
        allocated(1, 16),
        BlockAllocated(3, 1),
        BlockStored(3, S, 0, 16, FULL, 1),                         # seq 13: copy 2
        StepStarted(1, 1),
        RequestFinished(0, 0),
        BlockFreed(2, 0, True),                                    # T cached, free
        BlockFreed(1, 0, True),
        RequestFinished(1, 0),
        BlockFreed(3, 0, True),
        RequestArrived(2, 16, [S], 1),
        ComputedBlocksFound(2, 16, 0),
        BlockTouched(1, 2),                                        # seq 22: copy 1 hit
        allocated(2, 16, hit=16),
        RequestArrived(3, 16, [S], 1),
        ComputedBlocksFound(3, 16, 0),
        BlockTouched(3, 3),                                        # seq 26: copy 2 hit
        allocated(3, 16, hit=16),
        StepStarted(2, 2),
        RequestFinished(2, 0),
        BlockFreed(1, 0, True),
        RequestFinished(3, 0),
        BlockFreed(3, 0, True),
        StepStarted(3, 3),                                         # seq 33, step 4
        RequestArrived(4, 64, [500, 501, 502, 503], 1),
        ComputedBlocksFound(4, 0, 0),
        allocated(4, 64),
        BlockRemoved(1, S, 0, 16, LRU),                            # seq 37: copy 1 pushed out
        BlockAllocated(1, 4),
        BlockRemoved(3, S, 0, 16, LRU),                            # seq 39: copy 2 pushed out
        BlockAllocated(3, 4),
        StepStarted(4, 4),                                         # step 5
        RequestArrived(5, 16, [S], 1),
        ComputedBlocksFound(5, 0, 0),                              # seq 43: needs S, misses
        allocated(5, 16),
        BlockAllocated(4, 5),
        BlockStored(4, S, 0, 16, FULL, 5),                         # seq 46: S again
    ]


def test_a_prefix_pushed_out_twice_is_ranked_once(tmp_path):
    """checkpoint_pushouts has a row per eviction (the one missed lookup falls in both
    windows); pushed_out_prefixes counts the prefix once and that lookup once."""
    write_trace(tmp_path / "dup.kvtrace", header("unfixed"), duplicate_copies())
    load_traces([tmp_path / "dup.kvtrace"], tmp_path / "dup.duckdb")
    connection = open_database(tmp_path / "dup.duckdb")
    try:
        per_eviction = rows_as_dicts(run_query(connection, "checkpoint_pushouts",
                                               {"min_hits": "1"}))
        per_prefix = rows_as_dicts(run_query(connection, "pushed_out_prefixes",
                                             {"min_hits": "1"}))
        assert not run_query(connection, "pushed_out_prefixes", {"min_hits": "2"}).rows
    finally:
        connection.close()
    assert [(r["block_id"], r["evicted_seq"], r["hits_before_eviction"],
             r["transient_checkpoints_cached"], r["later_missed_lookups"], r["regret_tokens"])
            for r in sorted(per_eviction, key=lambda r: r["evicted_seq"])] == [
        (1, 37, 1, 1, 1, 16), (3, 39, 1, 1, 1, 16)]
    assert per_prefix == [{
        "run": 0, "variant": "unfixed", "hash_id": S, "depth_tokens": 16, "group_ids": [0],
        "evictions": 2, "first_evicted_step": 4, "hits_before_evictions": 2,
        "later_missed_lookups": 1, "regret_tokens": 16,
    }]


def test_pushed_out_prefixes_agrees_with_checkpoint_pushouts(scenario_db):
    per_prefix = rows_as_dicts(run_query(scenario_db, "pushed_out_prefixes"))
    assert per_prefix == [{
        "run": 1, "variant": "unfixed", "hash_id": S, "depth_tokens": 16, "group_ids": [0],
        "evictions": 1, "first_evicted_step": 5, "hits_before_evictions": 2,
        "later_missed_lookups": 1, "regret_tokens": 16,
    }]
