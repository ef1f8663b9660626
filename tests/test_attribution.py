"""Miss attribution (kvtrace/analysis/attributor.py and its C core, `kvtrace why`, the
miss_attribution table).

- A property test over seeded schedules replayed on the real vLLM cache: for every admitted
  lookup the causes partition what was missed, the ideal matches an independent SQL
  formulation, and kvtrace's model of vLLM's hit search explains every hit (no `other`).
- Hand-built scenarios on the real cache, one per cause: `kvtrace why` names exactly that cause.
- The pushout split against the checkpoint_pushouts query on a pressured replay.
"""

from __future__ import annotations

import dataclasses

import os
import re
import shutil
import threading
from pathlib import Path

import duckdb
import msgspec
import pytest
from click.testing import CliRunner

from kvtrace.analysis.attribution import attribute_trace
from kvtrace.analysis.attributor import AttributionError
from kvtrace.analysis.causes import BEYOND_IDEAL_CAUSES, CAUSES, SHORTFALL_CAUSES
from kvtrace.analysis.miss_summary import CauseTotals
from kvtrace.analysis.miss_table import NONE, iter_rows
from kvtrace.analysis.database import open_database
from kvtrace.analysis import stream
from kvtrace.analysis.load import load_traces
from kvtrace.analysis.queries import QueryError, run_query
from kvtrace.analysis.report import report_database
from kvtrace.cli import cli
from kvtrace.engine_config import FIRST_MADE_UP_HASH_ID, SchedulerSettings
from kvtrace.errors import TraceFormatError
from kvtrace.events import (BlockRemoved, ComputedBlocksFound, RemoveReason, ReplayInfo,
                            TraceHeader)
from kvtrace.replay.arrivals import Arrival
from kvtrace.replay.options import ReplayOptions
from kvtrace.replay.run import replay
from kvtrace.replay.scheduler import Scheduler
from kvtrace.replay.vllm_backend import VllmBackend
from kvtrace.traceio import TraceWriter, read_records, write_trace
from kvtrace.workloads.mooncake import import_mooncake
from kvtrace.workloads.synth import synthesize
from kvtrace.workloads.workload import EngineShape, Workload, WorkloadRequest, write_workload

SECOND = 10**9
# Hash unit 16, full attention 16, Mamba 32 (fine-grained hits), checkpoints on 16-token
# chunks, retention 0, a pool that never evicts: the geometry of reference §6, scaled down so
# that every figure below can be worked out by hand: one attention and one Mamba group (a toy
# vLLM would not build: the Mamba block differs from the attention block).
SMALL = dict(hash_unit=16, attention_block_size=16, mamba_block_size=32, checkpoint_alignment=16,
             mamba_groups=1, retention_interval=0, num_gpu_blocks=200,
             allow_unreal_geometry=True)

MOONCAKE_SYNTHETIC = (Path(__file__).resolve().parents[1] / "data" / "mooncake"
                      / "synthetic_trace.jsonl")


def request(arrival_s: float, prompt_len: int, hash_ids: list[int], max_tokens: int = 1):
    return WorkloadRequest(int(arrival_s * SECOND), prompt_len, hash_ids, max_tokens, [], "")


def units(first: int, last: int) -> list[int]:
    return list(range(first, last + 1))


def replay_requests(directory: Path, shape: EngineShape, requests: list[WorkloadRequest],
                    variants: tuple[str, ...] = ("upstream",)) -> dict[str, str]:
    """The requests as a workload, replayed on the real vLLM cache: variant -> output trace."""
    directory.mkdir(parents=True, exist_ok=True)
    source = directory / "workload.kvtrace"
    write_workload(source, Workload("synth", requests, shape.hash_block_size), shape)
    result = replay(ReplayOptions(source=str(source), outdir=str(directory / "runs"),
                                  variants=variants))
    return {v.variant: v.output for v in result.variants}


def why(*args) -> str:
    result = CliRunner().invoke(cli, ["why", *map(str, args)])
    assert result.exit_code == 0, result.output
    return result.output


_SEGMENT = re.compile(r"^    tokens [\d,]+-[\d,]+ \([^)]*\): (\w+) - ")


def named_causes(output: str) -> tuple[set[str], set[str]]:
    """The causes `kvtrace why` names for a request's lookups: (of the shortfall, beyond the
    ideal), each as a set."""
    shortfall, beyond, section = set(), set(), None
    for line in output.splitlines():
        if line.startswith("  missed "):
            section = shortfall
        elif line.startswith("  beyond the ideal:"):
            section = beyond
        elif match := _SEGMENT.match(line):
            section.add(match.group(1))
    return shortfall, beyond


# --- the property test --------------------------------------------------------------------------

# Seeded schedules with pressure (small pools) and preemptions (chat: long decodes), on the
# old toy engine (one attention and one Mamba group, 32/128-token blocks, a 1,024-token budget:
# many chunks and preemptions in a few requests), and one on the default model's real geometry.
# The last one's engine drops EAGLE's unit (use_eagle: its header's config edited).
TOY = EngineShape(hash_unit=32, attention_block_size=32, mamba_block_size=128,
                  max_num_batched_tokens=1024, max_num_seqs=32, mamba_groups=1,
                  allow_unreal_geometry=True)
SCHEDULES = [("shared-prompt", 1, TOY), ("agent", 2, TOY),
             ("chat", 3, dataclasses.replace(TOY, pool_fraction=0.1)),
             ("agent", 4, dataclasses.replace(TOY, attention_block_size=64)),
             ("documents", 5, EngineShape())]
EAGLE_SCHEDULES = [("agent", 6, TOY)]
VARIANTS = ("unfixed", "fixed", "upstream")


def with_eagle(source: Path) -> None:
    """The workload at ``source`` rewritten for an engine that drops EAGLE's unit."""
    reader, records = read_records(source)
    config = msgspec.structs.replace(reader.header.config, use_eagle=True)
    write_trace(source, msgspec.structs.replace(reader.header, config=config), records)


@pytest.fixture(scope="module")
def seeded_replays(tmp_path_factory):
    """(preset, seed) -> (replay result, DuckDB connection over its variants, its path)."""
    replays = {}
    for preset, seed, shape in SCHEDULES + EAGLE_SCHEDULES:
        directory = tmp_path_factory.mktemp(f"{preset}{seed}")
        source = directory / "w.kvtrace"
        write_workload(source, synthesize(preset, 40, seed, shape.hash_block_size), shape)
        if (preset, seed, shape) in EAGLE_SCHEDULES:
            with_eagle(source)
        result = replay(ReplayOptions(source=str(source), outdir=str(directory / "runs"),
                                      variants=VARIANTS))
        db = directory / "w.duckdb"
        load_traces([directory / "runs"], db)
        replays[(preset, seed)] = (result, open_database(db), db)
    yield replays
    for _, connection, _ in replays.values():
        connection.close()


def sql_ideals(connection) -> dict[tuple[int, int], int]:
    """(run, lookup seq) -> ideal, from the database alone: the longest prefix of the request's
    hash units (known at the lookup, within its num_tokens) each of which a successful
    allocate_slots had covered, after its hash was reported, before the lookup; at least the
    hit. Written in SQL, independently of the streaming pass."""
    rows = connection.execute("""
        WITH units AS (
            SELECT a.run, a.req, c.pos AS unit, c.hash_id, a.seq AS known_seq
            FROM request_arrived a
            JOIN request_arrived_hash_ids c ON c.run = a.run AND c.seq = a.seq
            UNION ALL
            SELECT e.run, e.req, coalesce(a.num_hash_ids, 0)
                       + row_number() OVER (PARTITION BY e.run, e.req ORDER BY e.seq, e.pos) - 1,
                   e.hash_id, e.seq
            FROM hashes_extended_hash_ids e
            LEFT JOIN request_arrived a ON a.run = e.run AND a.req = e.req),
        covers AS (
            SELECT u.run, u.hash_id, min(s.seq) AS covered_seq
            FROM units u
            JOIN runs r ON r.run = u.run
            JOIN slots_allocated s
                ON s.run = u.run AND s.req = u.req AND s.success AND s.seq > u.known_seq
                   AND least(s.num_computed_tokens + s.num_new_computed_tokens
                             + s.num_external_computed_tokens + s.num_new_tokens, s.num_tokens)
                       >= (u.unit + 1) * r.hash_block_size
            GROUP BY ALL),
        admitted AS (SELECT * FROM lookups WHERE admitted),
        known AS (
            SELECT l.run, l.seq, u.unit, c.hash_id IS NOT NULL AS covered
            FROM admitted l
            JOIN runs r ON r.run = l.run
            JOIN units u ON u.run = l.run AND u.req = l.req AND u.known_seq < l.seq
                            AND (u.unit + 1) * r.hash_block_size <= l.num_query_tokens
            LEFT JOIN covers c ON c.run = u.run AND c.hash_id = u.hash_id AND c.covered_seq < l.seq)
        SELECT l.run, l.seq,
               greatest(l.num_hit_tokens, r.hash_block_size * coalesce(
                   min(k.unit) FILTER (WHERE NOT k.covered), count(k.unit)))
        FROM admitted l
        JOIN runs r ON r.run = l.run
        LEFT JOIN known k ON k.run = l.run AND k.seq = l.seq
        GROUP BY l.run, l.seq, l.num_hit_tokens, r.hash_block_size""").fetchall()
    return {(run, seq): ideal for run, seq, ideal in rows}


def test_causes_partition_every_lookup_of_seeded_schedules(seeded_replays):
    seen_causes, resumptions, lookups_checked = set(), 0, 0
    eagle = {(preset, seed) for preset, seed, _ in EAGLE_SCHEDULES}
    for (preset, seed), (result, connection, _) in seeded_replays.items():
        ideals = sql_ideals(connection)
        runs = dict(connection.execute("SELECT path, run FROM runs").fetchall())
        for variant in result.variants:
            traced = attribute_trace(variant.output)
            run = runs[os.path.abspath(variant.output)]
            first = [lookup for lookup in traced.lookups if lookup.lookup == 1]
            # The first admissions are the lookups the replay's hit rate counts.
            assert sum(lookup.hit_tokens for lookup in first) == variant.summary["hit_tokens"]
            assert len(first) == variant.summary["requests"]
            for lookup in traced.lookups:
                context = f"{preset} seed {seed} {variant.variant}: {lookup}"
                assert 0 <= lookup.hit_tokens <= lookup.ideal_tokens <= lookup.query_tokens, context
                assert all(s.tokens > 0 for s in lookup.segments), context
                shortfall = sum(s.tokens for s in lookup.segments if s.cause in SHORTFALL_CAUSES)
                assert shortfall == lookup.ideal_tokens - lookup.hit_tokens, context
                assert lookup.hit_tokens + sum(s.tokens for s in lookup.segments) \
                    == lookup.query_tokens, context
                # The segments tile the query from the hit to its end, without overlap.
                spans = sorted((s.start, s.end) for s in lookup.segments)
                assert [spans[0][0]] + [end for _, end in spans] \
                    == [lookup.hit_tokens] + [start for start, _ in spans[1:]] \
                    + [lookup.query_tokens], context
                # kvtrace's model of vLLM's hit search explains every real hit exactly.
                assert "other" not in {s.cause for s in lookup.segments}, context
                assert ideals[(run, lookup.seq)] == lookup.ideal_tokens, context
                # Only an engine that drops EAGLE's unit loses tokens to it.
                assert ((preset, seed) in eagle
                        or "eagle_dropped_unit" not in {s.cause for s in lookup.segments}), context
                seen_causes.update(s.cause for s in lookup.segments)
                resumptions += lookup.lookup > 1
                lookups_checked += 1
    # The schedules exercise what the property is about: pressure, preemption, many causes.
    assert resumptions > 0 and lookups_checked > 400
    assert {"checkpoint_pushout", "evicted", "mamba_evicted", "mamba_suppressed", "cold",
            "partial_unit", "eagle_dropped_unit"} <= seen_causes


def test_the_table_holds_the_streaming_pass_and_the_summary_adds_up(seeded_replays):
    result, connection, _ = seeded_replays[("agent", 2)]
    run_of = dict(connection.execute("SELECT variant, run FROM runs").fetchall())
    for variant in result.variants:
        run = run_of[variant.variant]
        expected = sorted(iter_rows(run, variant.variant, "vllm",
                                    attribute_trace(variant.output).lookups), key=repr)
        stored = connection.execute("SELECT * FROM miss_attribution WHERE run = ?", [run])
        assert sorted(stored.fetchall(), key=repr) == expected
    summary = run_query(connection, "miss_attribution_summary")
    rows = [dict(zip(summary.columns, r)) for r in summary.rows]
    for variant in result.variants:
        first = [r for r in rows if r["variant"] == variant.variant and r["lookups"] == "first"]
        assert first[0]["hit_tokens"] == variant.summary["hit_tokens"]
        assert first[0]["hit_tokens"] + sum(r["tokens"] for r in first) \
            == first[0]["query_tokens"] == variant.summary["prompt_tokens"]
        assert sum(r["tokens"] for r in first if r["in_shortfall"]) \
            == first[0]["ideal_tokens"] - first[0]["hit_tokens"]


def test_the_c_core_and_its_twins_load_the_same_tables(seeded_replays, tmp_path,
                                                      monkeypatch):
    """The streaming pass's C core (attribution, cache entries, record tables) and its twins
    (the Python attribution, the entries' SQL, the Python table sink) load the same rows into
    every table; a damaged trace still fails as itself, leaving no database and no thread."""
    if stream.core is None:
        pytest.skip("kvtrace's C core is not built here (no C compiler at install), so there is "
                    "no second implementation to compare")
    _, connection, db = seeded_replays[("agent", 2)]
    runs = [row[0] for row in connection.execute("SELECT path FROM runs ORDER BY run").fetchall()]
    monkeypatch.setattr(stream, "core", None)
    load_traces(runs, tmp_path / "twins.duckdb")
    monkeypatch.undo()
    with duckdb.connect(str(tmp_path / "twins.duckdb"), read_only=True) as twins:
        tables = [name for (name,) in twins.execute(
            "SELECT table_name FROM duckdb_tables() WHERE table_name NOT IN ('runs', "
            "'kvtrace_meta')").fetchall()]
        for table in tables:
            assert sorted(twins.execute(f"SELECT * FROM {table}").fetchall(), key=repr) \
                == sorted(connection.execute(f"SELECT * FROM {table}").fetchall(), key=repr), table
        assert twins.execute("SELECT count(*) FROM miss_attribution").fetchone()[0] > 0
        assert twins.execute("SELECT count(*) FROM cache_entry_figures").fetchone()[0] > 0
    damaged = tmp_path / "damaged.kvtrace"
    data = bytearray(Path(runs[0]).read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    threads = threading.active_count()
    with pytest.raises(TraceFormatError):
        load_traces([damaged], tmp_path / "damaged.duckdb")
    assert threading.active_count() == threads  # the inserting thread is not left running
    assert not (tmp_path / "damaged.duckdb").exists()


def test_every_record_kind_loads_the_same_on_both_twins(tmp_path, monkeypatch):
    """One record of every kind (strings, bytes, maps, lists, every int width) loads into the
    same rows whether the C core makes its table or the Python sink does; the cache entries
    too, which the SQL twin makes for a trace without an engine config either way (the C core
    follows no pool it was not told)."""
    from trace_samples import one_of_each_kind, sample_header

    if stream.core is None:
        pytest.skip("kvtrace's C core is not built here (no C compiler at install)")
    assert {"RequestArrived", "HashInterned", "RequestState"} <= {
        record_type.__name__ for record_type in stream.SHAPED_TYPES}
    trace = tmp_path / "every.kvtrace"
    write_trace(trace, sample_header(config=None), one_of_each_kind())
    tables = []
    for native in (True, False):
        if not native:
            monkeypatch.setattr(stream, "core", None)
        load_traces([trace], tmp_path / f"{native}.duckdb")
        with duckdb.connect(str(tmp_path / f"{native}.duckdb"), read_only=True) as db:
            names = [name for (name,) in db.execute(
                "SELECT table_name FROM duckdb_tables() WHERE table_name NOT IN "
                "('runs', 'kvtrace_meta') ORDER BY table_name").fetchall()]
            tables.append({name: db.execute(f"SELECT * FROM {name} ORDER BY ALL").fetchall()
                           for name in names})
            if native:  # the string and bytes columns, by name
                loaded = db.execute(
                    "SELECT (SELECT list(request_id) FROM request_arrived), "
                    "(SELECT list(hash_bytes) FROM hash_interned), "
                    "(SELECT list(request_id) FROM request_state)").fetchone()
    assert tables[0] == tables[1]
    assert loaded == (["cmpl-abc-0"], [bytes(range(32))], ["cmpl-def-4"])
    assert tables[0]["cache_entry_figures"]
    assert sum(map(len, tables[0].values())) > len(one_of_each_kind())


def test_a_trace_without_an_engine_config_loads_unattributed(tmp_path):
    """Its records load; `why` refuses it with the attribution's own error and hint."""
    headerless = tmp_path / "headerless.kvtrace"
    write_trace(headerless, TraceHeader(kvtrace_version="test", created_ns=0, source="synth"),
                [ComputedBlocksFound(0, 0, 0)])
    load_traces([headerless], tmp_path / "h.duckdb")
    with duckdb.connect(str(tmp_path / "h.duckdb"), read_only=True) as db:
        assert db.execute("SELECT count(*) FROM computed_blocks_found").fetchone()[0] == 1
        assert db.execute("SELECT count(*) FROM miss_attribution").fetchone()[0] == 0
    with pytest.raises(AttributionError, match="no engine config") as raised:
        attribute_trace(headerless)
    assert raised.value.hint == AttributionError.default_hint


def test_pushout_tokens_against_checkpoint_pushouts(seeded_replays):
    """The unfixed run of a pressured replay. Token totals differ by definition
    (docs/miss-attribution.md): checkpoint_pushouts sums depth - hit over every hot prefix
    (each block of a chain) a lookup missed, for any reason; the attribution charges each
    lookup once, for the tokens pushouts took that earlier causes had not. What must agree is
    the eviction-time fact both rest on: how many transient checkpoints sat cached behind."""
    _, connection, _ = seeded_replays[("agent", 2)]
    ours = connection.execute(
        "SELECT sum(tokens), count(DISTINCT seq) FROM miss_attribution WHERE variant = 'unfixed' "
        "AND cause = 'checkpoint_pushout'").fetchone()
    regret = sum(r[-1] for r in run_query(connection, "checkpoint_pushouts").rows
                 if r[1] == "unfixed")
    assert 0 < ours[0] < regret
    # Every eviction the attribution names carries the count block_states gives at that
    # moment (less the evicted block itself, when it is a transient checkpoint: the entries
    # *behind* it).
    mismatches = connection.execute("""
        WITH flags AS (
            SELECT run, seq, block_id, (NOT in_use AND transient)::INTEGER AS flag
            FROM block_states),
        deltas AS (
            SELECT run, seq, block_id, flag - coalesce(lag(flag) OVER (
                PARTITION BY run, block_id ORDER BY seq), 0) AS delta
            FROM flags),
        series AS (
            SELECT run, seq, sum(delta) OVER (PARTITION BY run ORDER BY seq
                                              ROWS UNBOUNDED PRECEDING) AS cached
            FROM deltas WHERE delta <> 0),
        own AS (
            SELECT run, seq, block_id, flag FROM flags),
        named AS (
            SELECT DISTINCT run, removed_seq, removed_block_id, transient_behind
            FROM miss_attribution
            WHERE cause IN ('checkpoint_pushout', 'evicted', 'mamba_evicted'))
        SELECT n.*, coalesce(s.cached, 0) - coalesce(o.flag, 0) AS expected
        FROM named n
        ASOF LEFT JOIN series s ON s.run = n.run AND s.seq < n.removed_seq
        ASOF LEFT JOIN own o
            ON o.run = n.run AND o.block_id = n.removed_block_id AND o.seq < n.removed_seq
        WHERE n.transient_behind <> coalesce(s.cached, 0) - coalesce(o.flag, 0)""").fetchall()
    named = connection.execute(
        "SELECT count(DISTINCT removed_seq) FROM miss_attribution WHERE variant = 'unfixed' "
        "AND cause = 'checkpoint_pushout'").fetchone()[0]
    assert named > 5 and mismatches == []


# --- one scenario per cause ---------------------------------------------------------------------


def scenario_workloads() -> dict[str, tuple[dict, list, str, int]]:
    """cause -> (shape, requests, variant, the request to ask about). Each comment says why."""
    reuse = units(1, 6)
    return {
        # One request: nothing before it.
        "cold": (SMALL, [request(0, 64, units(1, 4))], "upstream", 0),
        # #40696: hash unit = block = 64 (vLLM's default geometry), a 40-token prompt twice:
        # no hash covers it, so it never hits.
        "short_prompt": (dict(SMALL, hash_unit=64, attention_block_size=64, mamba_block_size=64),
                         [request(0, 40, []), request(1, 40, [])], "upstream", 1),
        # A 100-token prompt twice: the second hits 96 (the checkpoint at the last hash
        # boundary before the last token); its last 4 tokens are no hash unit.
        "partial_unit": (SMALL, [request(0, 100, reuse), request(1, 100, reuse)], "upstream", 1),
        # A 96-token prompt twice: ideal 96, but the last token is recomputed and the hit stops
        # at 80.
        "hit_cap": (SMALL, [request(0, 96, reuse), request(1, 96, reuse)], "upstream", 1),
        # 64-token blocks; the second prompt shares 48 tokens: full attention keeps a key for
        # the whole block 0 (the first prompt's) and for its own tail at 80, none at 48.
        "block_quantisation": (
            dict(SMALL, attention_block_size=64, mamba_block_size=64),
            [request(0, 80, [1, 2, 3, 4, 5]), request(1, 80, [1, 2, 3, 14, 15])], "upstream", 1),
        # Shares 64 tokens; the first prompt ran in one chunk: Mamba states exist only at its
        # checkpoint (96) and end, never at 64.
        "mamba_not_reserved": (SMALL, [request(0, 100, reuse),
                                       request(1, 100, [1, 2, 3, 4, 15, 16])], "upstream", 1),
        # 64-token chunks: states at 64 and 128 are computed, but retention 0 keeps only the
        # prompt-end one (192); the second prompt shares 128 tokens.
        "mamba_not_retained": (
            dict(SMALL, mamba_block_size=64, max_num_batched_tokens=64),
            [request(0, 200, units(1, 12)), request(1, 200, units(1, 8) + units(30, 33))],
            "upstream", 1),
        # 96-token chunks: the first chunk's transient checkpoint at 80 is kept request-local by
        # `fixed` (#56794); the second prompt shares exactly 80 tokens.
        "mamba_suppressed": (
            dict(SMALL, max_num_batched_tokens=96),
            [request(0, 200, units(1, 12)), request(1, 200, units(1, 5) + units(30, 36))],
            "fixed", 1),
        # 64-token Mamba blocks: the first prompt's checkpoint slot (block 0) is keyed at its
        # block boundary 64 by the retention mask, then re-keyed to the checkpoint at 96.
        "rekeyed": (dict(SMALL, mamba_block_size=64),
                    [request(0, 100, reuse), request(1, 100, [1, 2, 3, 4, 15, 16])], "upstream", 1),
        # A 40-block pool: prefix S (48 tokens) is cached, a 256-token prompt publishes
        # transient checkpoints behind it (unfixed), a 240-token prompt evicts S; the last
        # request needs S.
        "checkpoint_pushout": (
            dict(SMALL, max_num_batched_tokens=64, num_gpu_blocks=40),
            [request(0, 64, units(1, 4)), request(1, 256, units(10, 25)),
             request(2, 240, units(100, 114)), request(3, 80, [1, 2, 3, 60, 61])], "unfixed", 3),
        # The same with `fixed` (no transient checkpoint cached) and a prompt big enough to
        # evict S anyway.
        "evicted": (
            dict(SMALL, max_num_batched_tokens=64, num_gpu_blocks=40),
            [request(0, 64, units(1, 4)), request(1, 256, units(10, 25)),
             request(2, 320, units(100, 119)), request(3, 80, [1, 2, 3, 60, 61])], "fixed", 3),
        # Dense retention, no checkpoints, 64-token chunks: a 256-token prompt retires its
        # states at 64, 128 and 192 to the free queue while its attention blocks are still
        # held; a 240-token prompt then evicts the oldest cached blocks: those states.
        "mamba_evicted": (
            dict(SMALL, checkpoint_alignment=None, retention_interval=None,
                 max_num_batched_tokens=64, num_gpu_blocks=40),
            [request(0, 256, units(1, 16)), request(1, 240, units(100, 114)),
             request(2, 160, units(1, 8) + [50, 51])], "upstream", 2),
    }


@pytest.mark.parametrize("cause", sorted(scenario_workloads()))
def test_why_names_exactly_the_scenarios_cause(tmp_path, cause):
    shape, requests, variant, req = scenario_workloads()[cause]
    outputs = replay_requests(tmp_path, EngineShape(**shape), requests, (variant,))
    shortfall, beyond = named_causes(why(outputs[variant], "--request", req))
    if cause in BEYOND_IDEAL_CAUSES:
        assert (shortfall, beyond) == (set(), {cause})
    else:
        assert shortfall == {cause}


def test_the_fix_turns_the_pushout_back_into_a_hit(tmp_path):
    """The checkpoint_pushout scenario under `fixed`: the unhashed checkpoint slots are reused
    first, S survives and the last request hits it (48 tokens, its whole ideal)."""
    shape, requests, _, req = scenario_workloads()["checkpoint_pushout"]
    outputs = replay_requests(tmp_path, EngineShape(**shape), requests, ("unfixed", "fixed"))
    hits = {}
    for variant, output in outputs.items():
        (lookup,) = attribute_trace(output, request=req).lookups
        hits[variant] = (lookup.ideal_tokens, lookup.hit_tokens,
                         {s.cause: s.tokens for s in lookup.segments})
    assert hits == {"unfixed": (48, 0, {"checkpoint_pushout": 48, "cold": 32}),
                    "fixed": (48, 48, {"cold": 32})}


def test_why_tells_when_and_by_what_a_pushout_was_evicted(tmp_path):
    shape, requests, variant, req = scenario_workloads()["checkpoint_pushout"]
    output = why(replay_requests(tmp_path, EngineShape(**shape), requests, (variant,))[variant],
                 "--request", req)
    evictions = [line for line in output.splitlines() if "evicted from block" in line]
    assert evictions, output
    # Request 2 (240 tokens) evicted S while the transient checkpoints of the 256-token prompt
    # and its own earlier chunks sat cached behind it.
    assert all(re.search(r"to make room for request 2, while \d+ transient checkpoints sat cached "
                         r"in the free queue behind it, e\.g\. request [12]'s at [\d,]+ tokens",
                         line) for line in evictions), output


def test_mamba_eviction_scenario_holds_what_it_claims(tmp_path):
    """Checked on the records themselves: at the last lookup the attention keys of the 128
    shared tokens are all cached, and the Mamba state at 128 was evicted by LRU reuse."""
    shape, requests, variant, req = scenario_workloads()["mamba_evicted"]
    output = replay_requests(tmp_path, EngineShape(**shape), requests, (variant,))[variant]
    _, records = read_records(output)
    lookup_at = max(i for i, r in enumerate(records)
                    if isinstance(r, ComputedBlocksFound) and r.req == req)
    cached: dict[tuple[int, int], int] = {}
    last_removal = {}
    for record in records[:lookup_at]:
        kind = type(record).__name__
        if kind == "BlockStored":
            key = (record.hash_id, record.group)
            cached[key] = cached.get(key, 0) + 1
        elif kind == "BlockRemoved":
            cached[(record.hash_id, record.group)] -= 1
            last_removal[(record.hash_id, record.group)] = record.reason
    assert all(cached.get((h, 0)) for h in units(1, 8))
    assert not cached.get((8, 1)) and last_removal[(8, 1)] == RemoveReason.LRU_REUSE


def test_invalidated_by_a_prefix_cache_reset(tmp_path):
    """A reset between two identical prompts (vLLM's reset_prefix_cache, driven directly)."""
    shape = EngineShape(**SMALL)
    config = shape.engine_config(shape.num_gpu_blocks)
    path = tmp_path / "reset.kvtrace"
    header = TraceHeader(kvtrace_version="test", created_ns=0, source="replay", config=config,
                         replay=ReplayInfo(variant="upstream", backend="vllm", mode="reschedule"))
    with open(path, "wb") as file:
        writer = TraceWriter(file, header)
        with VllmBackend(config, "upstream", writer.write) as backend:
            settings = SchedulerSettings.from_config(config)
            Scheduler(backend, config, settings).run([Arrival(0, 100, units(1, 6), 1)])
            assert backend.manager.block_pool.reset_prefix_cache()
            Scheduler(backend, config, settings).run([Arrival(1, 100, units(1, 6), 1)])
        writer.close()
    assert named_causes(why(path, "--request", 1)) == ({"invalidated"}, {"partial_unit"})


def test_other_is_what_the_cache_held_but_the_hit_did_not_use(tmp_path):
    """The partial_unit scenario with the second lookup's hit edited down to 80 (as a
    connector's hit cap would): the cache held 96, so 16 tokens are `other`."""
    shape, requests, variant, req = scenario_workloads()["partial_unit"]
    output = replay_requests(tmp_path, EngineShape(**shape), requests, (variant,))[variant]
    reader, records = read_records(output)
    edited = [msgspec.structs.replace(r, num_hit_tokens=80)
              if isinstance(r, ComputedBlocksFound) and r.req == req else r for r in records]
    write_trace(tmp_path / "edited.kvtrace", reader.header, edited)
    (lookup,) = attribute_trace(tmp_path / "edited.kvtrace", request=req).lookups
    assert [(s.cause, s.start, s.end) for s in lookup.segments] == [
        ("other", 80, 96), ("partial_unit", 96, 100)]
    assert named_causes(why(tmp_path / "edited.kvtrace", "--request", req))[0] == {"other"}


def test_every_cause_has_a_scenario():
    # eagle_dropped_unit: tests/test_eagle_attribution.py (an engine config the shapes lack).
    covered = set(scenario_workloads()) | {"invalidated", "other", "eagle_dropped_unit"}
    assert covered == set(CAUSES)


# --- silent zeros, the report, the database -----------------------------------------------------


def short_prompt_workload(directory: Path) -> Path:
    """#40696: hash unit = block = 64, every prompt shorter than it (repeated prompts)."""
    shape = EngineShape(**dict(SMALL, hash_unit=64, attention_block_size=64,
                               mamba_block_size=64))
    requests = [request(i, 40 + i % 3, [], 4) for i in range(12)]
    source = directory / "short.kvtrace"
    write_workload(source, Workload("synth", requests, 64), shape)
    return source


def test_replay_and_report_warn_of_a_silent_zero(tmp_path):
    source = short_prompt_workload(tmp_path)
    result = CliRunner().invoke(cli, ["replay", str(source), "--variant", "upstream", "-o",
                                      str(tmp_path / "runs"), "--db", str(tmp_path / "s.duckdb")])
    assert result.exit_code == 0, result.output
    warnings = [l for l in result.output.splitlines() if l.startswith("kvtrace: warning:")]
    assert len(warnings) == 1, result.output
    assert ("variant upstream: prefix-cache hit rate 0.0%" in warnings[0]
            and "prompts shorter than the 64-token hash unit" in warnings[0]
            and "100% of the missed tokens" in warnings[0]), warnings
    report = report_database(str(tmp_path / "s.duckdb"), str(tmp_path / "r.html"))
    assert report.startswith("WARNING: run 0 (upstream): prefix-cache hit rate 0.0%")
    assert "== Where the hits went ==" in report
    html = (tmp_path / "r.html").read_text()
    assert 'class="warning"' in html and "Where the hits went" in html


def test_a_cold_workload_is_not_a_silent_zero(tmp_path):
    """Unique prompts longer than a unit: nothing to hit, nothing to warn about."""
    requests = [request(i, 200, units(100 * i + 1, 100 * i + 12), 4) for i in range(6)]
    outputs = replay_requests(tmp_path, EngineShape(**SMALL), requests)
    result = CliRunner().invoke(cli, ["replay", str(tmp_path / "workload.kvtrace"), "--variant",
                                      "upstream", "-o", str(tmp_path / "again")])
    assert result.exit_code == 0 and "warning" not in result.output, result.output
    totals = CauseTotals.of(attribute_trace(outputs["upstream"]).lookups)
    assert totals.hit_tokens == 0 and totals.tokens["cold"] == 6 * 192


def test_report_shows_where_the_hits_went_per_run(seeded_replays):
    result, _, db = seeded_replays[("shared-prompt", 1)]
    section = report_database(str(db)).split("== Where the hits went ==")[1].split("==")[0]
    rows = {line.split()[1]: line.split() for line in section.splitlines()
            if re.match(r"\s*\d", line)}
    assert set(rows) == set(VARIANTS)
    for variant in result.variants:
        assert float(rows[variant.variant][3]) == round(100 * variant.summary["hit_rate"], 1)


def test_an_older_database_says_to_reload(tmp_path):
    """A database of schema v1 has no miss_attribution table: queries say to reload, the
    report says so in its section, and nothing else breaks."""
    source = short_prompt_workload(tmp_path)
    outputs = replay(ReplayOptions(source=str(source), outdir=str(tmp_path / "runs"),
                                   variants=("upstream",)))
    db = tmp_path / "old.duckdb"
    load_traces([outputs.variants[0].output], db)
    connection = duckdb.connect(str(db))
    connection.execute("DROP VIEW miss_attribution")  # v4 stores it in kvtrace_rows
    connection.execute("DROP TABLE kvtrace_rows.miss_attribution")
    connection.execute("UPDATE kvtrace_meta SET value = '1' WHERE key = 'db_schema_version'")
    connection.close()
    old = open_database(db)
    try:
        with pytest.raises(QueryError, match="older kvtrace .* reload its traces"):
            run_query(old, "miss_attribution_summary")
    finally:
        old.close()
    report = report_database(str(db))
    assert "loaded by an older kvtrace and has no miss attribution: reload" in report
    assert "WARNING" not in report
    result = CliRunner().invoke(cli, ["sql", str(db), "--query", "miss_attribution"])
    assert result.exit_code == 1 and "kvtrace load" in result.output


# --- the C core against the Python reference ----------------------------------------------------


def pass_output(path, native: bool, **options):
    """The streaming pass over ``path`` on the C core or the Python reference: its attribution
    rows (sorted) and, explaining, its lookups."""
    return pass_result(finished_pass(path, native, **options), **options)


def finished_pass(path, native: bool, **options):
    from kvtrace.traceio import TraceReader

    reader = TraceReader(str(path))
    attribution = stream.new_pass(reader.header, str(path), native=native, **options)
    for batch in reader.batches():
        attribution.feed(batch)
    attribution.finish()
    return attribution


def pass_result(attribution, **options):
    if options.get("keep_lookups"):
        return attribution.lookups
    (columns,) = [columns for table, columns in attribution.take_tables()
                  if table == "miss_attribution"]
    return sorted(zip(*(columns[name].tolist() for name in stream.ATTRIBUTION_COLUMNS)))


needs_the_core = pytest.mark.skipif(
    stream.core is None, reason="kvtrace's C core is not built here (no C compiler at install), "
    "so there is no second implementation to compare")


@needs_the_core
def test_the_c_core_attributes_row_for_row_as_the_python_reference(seeded_replays):
    """Every lookup of every seeded schedule (18 replays: pressure, preemptions, three
    variants, toy and real geometries, an engine that drops EAGLE's unit): the same rows, and,
    explaining (`why`), the same lookups with every key and every transient checkpoint named
    behind an eviction."""
    rows, eagle_rows = 0, 0
    eagle = CAUSES.index("eagle_dropped_unit")
    cause = stream.ATTRIBUTION_COLUMNS.index("cause")
    for result, _, _ in seeded_replays.values():
        for variant in result.variants:
            reference = pass_output(variant.output, native=False)
            assert pass_output(variant.output, native=True) == reference, variant.output
            rows += len(reference)
            eagle_rows += sum(row[cause] == eagle for row in reference)
            explained = dict(keep_lookups=True, make_rows=False, explain=True)
            assert pass_output(variant.output, native=True, **explained) \
                == pass_output(variant.output, native=False, **explained)
    assert rows > 1500 and eagle_rows > 20
    one = seeded_replays[("agent", 2)][0].variants[0].output
    for request in (7, "7"):  # by number, and by the engine's request id (the replay's: str(req))
        options = dict(keep_lookups=True, make_rows=False, explain=True, request=request)
        lookups = pass_output(one, native=True, **options)
        assert lookups and lookups == pass_output(one, native=False, **options)
        assert {lookup.req for lookup in lookups} == {7}


@needs_the_core
def test_a_pass_that_spills_its_state_attributes_as_one_in_memory(seeded_replays, tmp_path,
                                                                  monkeypatch):
    """The C core's state that grows with the trace in a spill file, its pages handed back to
    the kernel after every batch (no resident allowance): the same rows, and the same explained
    lookups, as a pass that keeps it all in memory; with hash ids from 0 and a replay's made-up
    ones from 2^62 alike."""
    monkeypatch.setattr(stream, "SPILL_RESIDENT", 0)
    mooncake = mooncake_replay(tmp_path / "mooncake", 150)
    spill_dir = tmp_path / "spill"
    spill_dir.mkdir()
    outputs = [result.variants[0].output for result, _, _ in seeded_replays.values()]
    for output in [*outputs, mooncake]:
        for options in ({}, dict(keep_lookups=True, make_rows=False, explain=True)):
            spilled = finished_pass(output, native=True, spill_dir=str(spill_dir), **options)
            spilled_bytes, trims = spilled.core.spill
            assert spilled_bytes > 0 and trims > 0
            assert pass_result(spilled, **options) == pass_output(output, native=True, **options)
    made_up = [record for record in read_records(mooncake)[1]  # decode units past the log's
               if isinstance(record, BlockRemoved) and record.hash_id >= FIRST_MADE_UP_HASH_ID]
    assert len(made_up) > 10
    assert not list(spill_dir.iterdir())  # the spill file never had a name


@needs_the_core
def test_sparse_hash_ids_attribute_as_dense_ones(seeded_replays, tmp_path, monkeypatch):
    """Hash ids that are not dense from 0 (negative, or far beyond the ones seen: what the C core
    keeps in hash maps, not in its chunked arrays) attribute as the Python reference does, and
    as the same trace with its dense ids, spilling or not."""
    import msgspec.structs

    monkeypatch.setattr(stream, "SPILL_RESIDENT", 0)
    result = seeded_replays[("agent", 2)][0]
    dense = result.variants[0].output
    reader, records = read_records(dense)

    def sparse(hash_id: int) -> int:  # one to one; odd ids negative, all far from 0
        return -(hash_id + 1) * 7919 if hash_id % 2 else hash_id * 1_000_003 + (1 << 40)

    def remapped(record):
        changes = {name: (list(map(sparse, value)) if isinstance(value, list) else sparse(value))
                   for name in ("hash_id", "hash_ids") if hasattr(record, name)
                   for value in [getattr(record, name)]}
        return msgspec.structs.replace(record, **changes) if changes else record

    moved = tmp_path / "sparse.kvtrace"
    write_trace(moved, reader.header, [remapped(record) for record in records])
    index = stream.ATTRIBUTION_COLUMNS.index("key_hash_id")
    unmoved = [tuple(sparse(v) if i == index and v != NONE else v
                     for i, v in enumerate(row)) for row in pass_output(dense, native=True)]
    reference = pass_output(moved, native=False)
    assert sorted(unmoved) == reference and len(reference) > 100
    assert pass_output(moved, native=True) == reference
    assert pass_output(moved, native=True, spill_dir=str(tmp_path)) == reference


@needs_the_core
def test_a_spill_file_that_cannot_grow_fails_the_load_and_loses_nothing(seeded_replays,
                                                                        tmp_path):
    """`kvtrace load` whose spill file the file system refuses to grow (here: a 2 MiB limit on
    the size of any file, RLIMIT_FSIZE, past which posix_fallocate says EFBIG): one line that
    says what failed and where, one that says what to do; the database there is untouched."""
    import resource
    import subprocess
    import sys

    trace = seeded_replays[("agent", 2)][0].variants[0].output
    database = tmp_path / "kept.duckdb"
    database.write_bytes(b"an earlier database")

    def limit_file_size() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (2 << 20, 2 << 20))

    result = subprocess.run([sys.executable, "-m", "kvtrace", "load", str(trace), "-o",
                             str(database)], capture_output=True, text=True, timeout=120,
                            preexec_fn=limit_file_size)
    assert result.returncode == 1, result.stderr
    failed, hint = result.stderr.strip().splitlines()[-2:]
    assert "cannot spill the analysis' state to a file in" in failed, result.stderr
    assert str(tmp_path) in failed and "File too large" in failed
    assert "free space there" in hint
    assert database.read_bytes() == b"an earlier database"
    assert [path.name for path in tmp_path.iterdir()] == ["kept.duckdb"]


def mooncake_replay(directory: Path, num_requests: int | None = None) -> Path:
    """The bundled Mooncake trace (its first ``num_requests``) replayed under `unfixed` on the
    model backend: its trace."""
    directory.mkdir(exist_ok=True)
    source = directory / "m.kvtrace"
    shape = EngineShape()
    workload = import_mooncake(MOONCAKE_SYNTHETIC, shape.hash_block_size)
    workload = dataclasses.replace(workload, requests=workload.requests[:num_requests])
    write_workload(source, workload, shape)
    result = replay(ReplayOptions(source=str(source), outdir=str(directory / "runs"),
                                  variants=("unfixed",), backend="model"))
    return result.variants[0].output


@needs_the_core
@pytest.mark.slow
def test_the_c_core_attributes_the_mooncake_replay_as_the_python_reference(tmp_path):
    """The bundled Mooncake trace (3,993 requests) replayed under `unfixed` on the model backend
    (equal to the vLLM backend record for record: tests/test_model_backend.py): 1.5 million
    records, the same rows."""
    output = mooncake_replay(tmp_path)
    reference = pass_output(output, native=False)
    assert len(reference) > 7000
    assert pass_output(output, native=True) == reference


# The direct formulation of checkpoint_pushout_lookups (every pushout joined to every request
# sharing its unit, then to their lookups, then cut to the window): the definition the faster
# macro in kvtrace/analysis/database.py must agree with, row for row.
DIRECT_PUSHOUT_LOOKUPS = """
    WITH hot_evictions AS (
        SELECT e.*, h.hits AS entry_hits
        FROM cache_entries e
        JOIN entry_hits h ON h.run = e.run AND h.stored_seq = e.stored_seq
                             AND h.block_id = e.block_id
        WHERE e.removed_reason = 'LRU_REUSE' AND h.hits >= min_hits),
    transient_flags AS (
        SELECT run, seq, block_id, (NOT in_use AND transient)::INTEGER AS evictable_transient
        FROM block_states),
    transient_deltas AS (
        SELECT run, seq, evictable_transient - coalesce(lag(evictable_transient)
                   OVER (PARTITION BY run, block_id ORDER BY seq), 0) AS delta
        FROM transient_flags),
    transient_series AS (
        SELECT run, seq, sum(delta) OVER (PARTITION BY run ORDER BY seq
                                          ROWS UNBOUNDED PRECEDING) AS cached_transient
        FROM transient_deltas
        WHERE delta <> 0),
    pushouts AS (
        SELECT * FROM (
            SELECT v.*, coalesce(s.cached_transient, 0) AS cached_transient,
                   coalesce(n.seq, 9223372036854775807) AS restored_seq
            FROM hot_evictions v
            ASOF LEFT JOIN transient_series s ON v.run = s.run AND s.seq < v.removed_seq
            ASOF LEFT JOIN block_stored n
                ON v.run = n.run AND v.hash_id = n.hash_id AND v.group_id = n.group_id
                   AND n.seq > v.removed_seq)
        WHERE cached_transient >= min_transient),
    missed AS (
        SELECT p.run, p.removed_seq, l.seq AS lookup_seq, l.req AS lookup_req, l.num_hit_tokens
        FROM pushouts p
        JOIN runs r ON r.run = p.run
        JOIN request_hashes owner
            ON owner.run = p.run AND owner.req = p.req
               AND owner.unit = p.num_tokens // r.hash_block_size - 1
        JOIN request_hashes other
            ON other.run = p.run AND other.unit = owner.unit AND other.hash_id = owner.hash_id
        JOIN lookups l
            ON l.run = p.run AND l.req = other.req AND l.admitted
               AND l.seq > p.removed_seq AND l.seq < p.restored_seq
        WHERE l.num_hit_tokens < p.num_tokens)
    SELECT p.*, m.lookup_seq, m.lookup_req, m.num_hit_tokens
    FROM pushouts p
    LEFT JOIN missed m ON m.run = p.run AND m.removed_seq = p.removed_seq"""


def test_the_pushout_queries_agree_with_their_direct_formulation(seeded_replays):
    """checkpoint_pushouts and pushed_out_prefixes read the eviction-time figures the load made
    (hits, transient checkpoints cached) and match later lookups by key: the same rows as the
    direct formulation, which recomputes them from every block event and joins every request
    sharing a unit (what took 67 s on two million records)."""
    from kvtrace.analysis.queries import get_query

    compared = 0
    for _, connection, _ in seeded_replays.values():
        connection.execute(f"CREATE OR REPLACE TEMP MACRO direct_lookups(min_hits, min_transient) "
                           f"AS TABLE {DIRECT_PUSHOUT_LOOKUPS}")
        for params in ({}, {"min_hits": "1"}, {"min_hits": "0", "min_transient": "0"}):
            for name in ("checkpoint_pushouts", "pushed_out_prefixes"):
                query = get_query(name)
                fast = connection.execute(query.sql, query.bind(params)).fetchall()
                direct = connection.execute(
                    query.sql.replace("checkpoint_pushout_lookups(", "direct_lookups("),
                    query.bind(params)).fetchall()
                assert sorted(fast, key=repr) == sorted(direct, key=repr), (name, params)
                compared += len(fast)
    assert compared > 1000


def as_v3_layout(connection) -> None:
    """Turn a database into what kvtrace wrote before v4: every table in the main schema (the
    record kinds' and the attribution's, which v4 stores in kvtrace_rows and reads through
    views of the same columns)."""
    for (name,) in connection.execute(
            "SELECT table_name FROM duckdb_tables() WHERE schema_name = 'kvtrace_rows'").fetchall():
        connection.execute(f"CREATE TABLE main.{name}_v3 AS SELECT * FROM main.{name}")
        connection.execute(f"DROP VIEW main.{name}")
        connection.execute(f"DROP TABLE kvtrace_rows.{name}")
        connection.execute(f"ALTER TABLE main.{name}_v3 RENAME TO {name}")
    connection.execute("DROP SCHEMA kvtrace_rows")


def older_copy(db: Path, path: Path, version: int, *statements: str) -> Path:
    """A copy of ``db`` at ``path`` in the v3 layout, changed by ``statements``, that says it
    is of schema ``version``."""
    shutil.copy(db, path)
    with duckdb.connect(str(path)) as old:
        as_v3_layout(old)
        for statement in statements:
            old.execute(statement)
        old.execute("UPDATE kvtrace_meta SET value = ? WHERE key = 'db_schema_version'",
                    [str(version)])
    return path


def assert_every_query_answers_as(path: Path, connection) -> None:
    """Every shipped query on the database at ``path`` answers as on ``connection``."""
    from kvtrace.analysis.queries import shipped_queries

    reopened = open_database(path)
    try:
        for name in shipped_queries():
            assert sorted(run_query(reopened, name).rows, key=repr) \
                == sorted(run_query(connection, name).rows, key=repr), name
    finally:
        reopened.close()


def test_a_database_of_schema_v3_answers_every_query_as_it_did(seeded_replays, tmp_path):
    """A database loaded before v4 (every table in main): every shipped query answers as on
    v4."""
    _, connection, db = seeded_replays[("chat", 3)]
    old = older_copy(db, tmp_path / "v3.duckdb", 3)
    with duckdb.connect(str(old), read_only=True) as v3:
        assert v3.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name = "
                          "'block_stored' AND schema_name = 'main'").fetchone() == (1,)
    assert_every_query_answers_as(old, connection)


def test_a_database_of_schema_v2_answers_every_query_as_it_did(seeded_replays, tmp_path):
    """A database loaded before v3 (no cache_entry_figures, no in_flight, no snapshot tables,
    its views as they were): the queries recompute the entries' figures by their SQL twin and
    answer as a v3 database does."""
    _, connection, db = seeded_replays[("chat", 3)]
    old = older_copy(
        db, tmp_path / "v2.duckdb", 2, "DROP VIEW cache_entries",
        "CREATE TABLE cache_entries AS SELECT 1 AS stale",  # what v2 derived
        "DROP TABLE cache_entry_figures", "ALTER TABLE miss_attribution DROP COLUMN in_flight",
        *(f"DROP TABLE {table}" for table in ("request_state_hash_ids", "request_state",
                                              "key_cached_block_ids", "key_cached",
                                              "block_state")))
    assert_every_query_answers_as(old, connection)


@needs_the_core
def test_a_trace_without_block_ids_loads_the_same_on_both_twins(tmp_path, monkeypatch):
    """vLLM's own KV events name no block (block -1, request -1: `kvtrace capture --zmq`): every
    key lives on the unknown block, and each removal closes its own key's entry."""
    from kvtrace.events import BlockRemoved, BlockStored, StepStarted, StoreKind

    config = EngineShape(**SMALL).engine_config(200)
    header = TraceHeader(kvtrace_version="test", created_ns=0, source="zmq", config=config)
    records = [StepStarted(0, 0)]
    for hash_id in range(1, 40):
        records.append(BlockStored(-1, hash_id, hash_id % 2, 16 * hash_id, StoreKind.FULL, -1))
        if hash_id % 3 == 0:
            records.append(BlockRemoved(-1, hash_id - 2, (hash_id - 2) % 2, 16, RemoveReason.UNKNOWN))
    path = tmp_path / "zmq.kvtrace"
    write_trace(path, header, records)
    load_traces([path], tmp_path / "c.duckdb")
    monkeypatch.setattr(stream, "core", None)
    load_traces([path], tmp_path / "twins.duckdb")
    entries = []
    for name in ("c", "twins"):
        connection = open_database(tmp_path / f"{name}.duckdb")
        entries.append(sorted(connection.execute(
            "SELECT block_id, hash_id, group_id, stored_seq, removed_seq FROM cache_entries"
            ).fetchall()))
        connection.close()
    assert entries[0] == entries[1] and len(entries[0]) == 39
    assert sum(removed is not None for *_, removed in entries[0]) == 13


def test_a_batch_the_c_core_cannot_follow_ends_its_pass(tmp_path):
    """A batch that fails midway (a block outside the pool) is refused as the trace's fault, and
    the pass hands over nothing after it: the rows it began may be ragged."""
    from kvtrace.events import BlockAllocated, StepStarted
    from kvtrace.traceio import TraceReader

    if stream.core is None:
        pytest.skip("kvtrace's C core is not built here (no C compiler at install)")
    header = TraceHeader(kvtrace_version="test", created_ns=0, source="synth",
                         config=EngineShape(**SMALL).engine_config(200))
    path = tmp_path / "outside.kvtrace"
    write_trace(path, header, [StepStarted(0, 0), BlockAllocated(3, 0), BlockAllocated(999, 0)])
    analysis = stream.new_pass(header, str(path))
    (batch,) = TraceReader(str(path)).batches()
    with pytest.raises(TraceFormatError, match="names block 999, outside the header's pool"):
        analysis.feed(batch)
    with pytest.raises(RuntimeError, match="a batch failed; the pass is over"):
        analysis.take_tables(0)


@pytest.mark.parametrize("native", [True, False], ids=["C core", "twins"])
def test_a_value_past_32_bits_in_a_narrow_column_is_refused(tmp_path, monkeypatch, native):
    """Steps, requests, blocks, groups, token counts and codes are stored in 32 bits and read as
    BIGINT: the largest 32-bit value reads back whole, one past it refuses the load (one line,
    nothing written)."""
    from kvtrace.events import BlockAllocated, BlockFreed, StepStarted

    if native and stream.core is None:
        pytest.skip("kvtrace's C core is not built here (no C compiler at install)")
    if not native:
        monkeypatch.setattr(stream, "core", None)
    header = TraceHeader(kvtrace_version="test", created_ns=0, source="synth",
                         config=EngineShape(**SMALL).engine_config(200))
    largest = 2**31 - 1
    for ref_cnt, refused in ((largest, False), (largest + 1, True)):
        path, db = tmp_path / f"{ref_cnt}.kvtrace", tmp_path / f"{ref_cnt}.duckdb"
        write_trace(path, header, [StepStarted(0, 0), BlockAllocated(3, 0),
                                  BlockFreed(3, ref_cnt, False)])
        if refused:
            with pytest.raises(TraceFormatError, match=f"block_freed record holds ref_cnt "
                                                       f"{ref_cnt}, past the 32 bits"):
                load_traces([path], db)
            assert not db.exists()
            continue
        load_traces([path], db)
        connection = open_database(db)
        assert connection.execute("SELECT ref_cnt, typeof(ref_cnt), typeof(step) FROM block_freed"
                                   ).fetchall() == [(largest, "BIGINT", "BIGINT")]
        connection.close()
