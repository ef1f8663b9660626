"""A fleet of traces (issue #32): loaded in worker processes, on Ray and as Parquet partitions
into the database a serial load makes, table for table; and the report's fleet section (one
row per engine, the engines that lose most, what a fix is worth summed over them) against
figures computed by hand on small hand-built traces."""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import resource
import shutil
import sys
from pathlib import Path

import duckdb
import msgspec
import pytest
from click.testing import CliRunner
from test_analysis_scenario import CONFIG, scenario

import kvtrace.analysis.load as load
import kvtrace.analysis.load_parts as load_parts
from kvtrace.analysis.database import open_database
from kvtrace.analysis.load import load_partitions, load_traces
from kvtrace.analysis.load_parts import LocalWorkers, run_part
from kvtrace.analysis.part_files import PARTS_MANIFEST
from kvtrace.analysis.queries import run_query
from kvtrace.analysis.fleet_verdict import fleet_lines
from kvtrace.analysis.pricing import pricing_for
from kvtrace.analysis.report_collect import collect
from kvtrace.analysis.report_text import render_markdown, render_text
from kvtrace.cli import cli
from kvtrace.errors import KvtraceError
from kvtrace.events import (
    BlockAllocated,
    BlockFreed,
    BlockRemoved,
    BlockStored,
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
from kvtrace.files import file_digest
from kvtrace.traceio import write_trace

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
from forensics import generate  # noqa: E402  (the forensics benchmark's trace generator)

# --- loading a fleet ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fleet_dir(tmp_path_factory) -> Path:
    """Four generated traces with evictions, hits and pushouts, a copy of one (skipped as a
    duplicate), a trace cut short (loaded up to the cut) and one whose header names no pool
    (its cache entries come from their SQL twin), in run order."""
    directory = tmp_path_factory.mktemp("fleet")
    for seed in range(4):
        generate(str(directory / f"e{seed}.kvtrace"), 30_000 + 7_000 * seed, seed=seed)
    shutil.copy(directory / "e1.kvtrace", directory / "e1copy.kvtrace")
    data = (directory / "e2.kvtrace").read_bytes()
    (directory / "e2cut.kvtrace").write_bytes(data[:len(data) * 2 // 3])
    write_trace(directory / "nopool.kvtrace", TraceHeader(kvtrace_version="test", created_ns=0,
                                                          source="test"), scenario(True))
    return directory


def tables_of(db: Path) -> dict[str, list[tuple]]:
    """Every table's rows, ordered, but the load's own metadata (its time and version)."""
    with duckdb.connect(str(db), read_only=True) as connection:
        names = connection.execute(
            "SELECT schema_name, table_name FROM duckdb_tables() ORDER BY ALL").fetchall()
        return {f"{schema}.{name}": connection.execute(
                    f"SELECT * FROM {schema}.{name} ORDER BY ALL").fetchall()
                for schema, name in names if name != "kvtrace_meta"}


@pytest.fixture(scope="module")
def serial(fleet_dir, tmp_path_factory):
    db = tmp_path_factory.mktemp("serial") / "serial.duckdb"
    return load_traces([fleet_dir], db), tables_of(db)


def same_load(summary, expected, duplicates: bool = True) -> None:
    want, _ = expected
    assert [(r.run, r.path, r.num_records, r.truncated, r.digest) for r in summary.runs] == [
        (r.run, r.path, r.num_records, r.truncated, r.digest) for r in want.runs]
    assert summary.duplicates == (want.duplicates if duplicates else [])


def test_the_fleet_holds_what_the_tests_need(serial, fleet_dir):
    summary, tables = serial
    assert [Path(r.path).name for r in summary.runs] == [
        "e0.kvtrace", "e1.kvtrace", "e2.kvtrace", "e2cut.kvtrace", "e3.kvtrace", "nopool.kvtrace"]
    assert [r.run for r in summary.runs] == [0, 1, 3, 4, 5, 6]  # run 2: the copy, unused
    assert summary.duplicates == [(str(fleet_dir / "e1copy.kvtrace"),
                                   str(fleet_dir / "e1.kvtrace"))]
    assert summary.runs[3].truncated
    assert len(tables["kvtrace_rows.block_removed"]) > 1000
    assert {row[0] for row in tables["main.cache_entry_figures"]} == {0, 1, 3, 4, 5, 6}


def test_two_workers_make_the_serial_database(serial, fleet_dir, tmp_path):
    summary = load_traces([fleet_dir], tmp_path / "w.duckdb", workers=2)
    assert summary.workers == "2 local processes"
    same_load(summary, serial)
    assert tables_of(tmp_path / "w.duckdb") == serial[1]


def test_partitions_load_back_into_the_serial_database(serial, fleet_dir, tmp_path):
    parts = tmp_path / "parts"
    same_load(load_partitions([fleet_dir], parts, workers=2), serial)
    manifest = msgspec.json.decode((parts / PARTS_MANIFEST).read_bytes())
    assert [row["run"] for row in manifest["runs"]] == [0, 1, 3, 4, 5, 6]
    assert not (parts / "block_stored" / "run=2").exists()  # the copy's part was dropped
    same_load(load_traces([parts], tmp_path / "back.duckdb"), serial, duplicates=False)
    assert tables_of(tmp_path / "back.duckdb") == serial[1]
    # as they are, to DuckDB: the run from the path, the rows the database's
    with duckdb.connect() as connection:
        counts = connection.execute(
            f"SELECT run, count(*) FROM read_parquet('{parts}/block_removed/*/*.parquet', "
            "hive_partitioning = true) GROUP BY run ORDER BY run").fetchall()
    stored = {}
    for row in serial[1]["kvtrace_rows.block_removed"]:
        stored[row[0]] = stored.get(row[0], 0) + 1
    assert counts == sorted(stored.items())


def test_partitions_of_many_hosts_number_their_runs_anew(serial, fleet_dir, tmp_path):
    """Two directories (two hosts) each number their runs from 0: one database of both
    numbers them in the order given, and a trace both hosts loaded counts once."""
    one, two = tmp_path / "one", tmp_path / "two"
    load_partitions([fleet_dir / "e0.kvtrace", fleet_dir / "e1.kvtrace"], one)
    load_partitions([fleet_dir / "e1copy.kvtrace", fleet_dir / "e3.kvtrace"], two)
    summary = load_traces([one, two], tmp_path / "both.duckdb")
    assert [(r.run, Path(r.path).name) for r in summary.runs] == [
        (0, "e0.kvtrace"), (1, "e1.kvtrace"), (3, "e3.kvtrace")]
    assert summary.duplicates == [(str(fleet_dir / "e1copy.kvtrace"), str(fleet_dir / "e1.kvtrace"))]
    both = tables_of(tmp_path / "both.duckdb")
    want = {run: 0 for run in (0, 1, 5)}  # e0, e1 and e3 in the serial load
    for row in serial[1]["kvtrace_rows.block_stored"]:
        if row[0] in want:
            want[row[0]] += 1
    got = {}
    for row in both["kvtrace_rows.block_stored"]:
        got[row[0]] = got.get(row[0], 0) + 1
    assert got == {0: want[0], 1: want[1], 3: want[5]}


@pytest.fixture
def damaged_fleet(fleet_dir, tmp_path) -> Path:
    """Two good traces around a damaged one: a flipped byte in its middle."""
    directory = tmp_path / "damaged"
    directory.mkdir()
    shutil.copy(fleet_dir / "e0.kvtrace", directory / "a.kvtrace")
    data = bytearray((fleet_dir / "e3.kvtrace").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (directory / "b.kvtrace").write_bytes(bytes(data))
    shutil.copy(fleet_dir / "e2.kvtrace", directory / "c.kvtrace")
    return directory


@pytest.mark.parametrize("workers", [1, 2])
def test_a_damaged_trace_in_the_middle_fails_as_the_serial_load_does(damaged_fleet, tmp_path,
                                                                     workers):
    out = tmp_path / "out"
    out.mkdir()
    (out / "prod.duckdb").write_bytes(b"the database before")
    with pytest.raises(KvtraceError) as serial_error:
        load_traces([damaged_fleet], out / "serial.duckdb")
    with pytest.raises(KvtraceError) as error:
        load_traces([damaged_fleet], out / "prod.duckdb", workers=workers)
    assert (type(error.value), str(error.value), error.value.hint) == (
        type(serial_error.value), str(serial_error.value), serial_error.value.hint)
    assert str(damaged_fleet / "b.kvtrace") in str(error.value)
    with pytest.raises(KvtraceError) as partitions_error:
        load_partitions([damaged_fleet], out / "parts", workers=workers)
    assert str(partitions_error.value) == str(serial_error.value)
    assert sorted(os.listdir(out)) == ["prod.duckdb"]  # no scratch, no partial output
    assert (out / "prod.duckdb").read_bytes() == b"the database before"


def _dies_on_e2(task):
    """``run_part``, but the worker dies on e2, as the kernel's out-of-memory killer kills."""
    if task.path.endswith("e2.kvtrace"):
        os._exit(9)
    return run_part(task)


def test_a_worker_that_dies_fails_the_load_naming_the_trace(fleet_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(load_parts, "run_part", _dies_on_e2)  # the workers fork with it
    paths = [fleet_dir / name for name in ("e0.kvtrace", "e2.kvtrace", "e3.kvtrace")]
    with pytest.raises(KvtraceError, match="a worker process died") as error:
        load_traces(paths, tmp_path / "x.duckdb", workers=2)
    assert "e2.kvtrace" in str(error.value) or "e0.kvtrace" in str(error.value)
    assert os.listdir(tmp_path) == []


def test_the_command_loads_with_workers_and_to_parquet(fleet_dir, tmp_path, serial):
    runner = CliRunner()
    result = runner.invoke(cli, ["load", str(fleet_dir), "-o", str(tmp_path / "c.duckdb"),
                                 "-j", "2"])
    assert result.exit_code == 0, result.output
    assert "(2 local processes)" in result.stdout
    assert "skipped" in result.stderr and "e1copy.kvtrace" in result.stderr
    assert tables_of(tmp_path / "c.duckdb") == serial[1]
    result = runner.invoke(cli, ["load", str(fleet_dir / "e0.kvtrace"),
                                 "--parquet", str(tmp_path / "p")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "p" / PARTS_MANIFEST).is_file()
    for argv in (["load", str(fleet_dir)], ["load", str(fleet_dir), "-o", "x.duckdb",
                                             "--parquet", "p2"]):
        result = runner.invoke(cli, argv)
        assert result.exit_code == 1 and "give either -o DB or --parquet DIR" in result.stderr
    result = runner.invoke(cli, ["load", str(fleet_dir / "e0.kvtrace"),
                                 "--parquet", str(tmp_path / "p")])
    assert result.exit_code == 1 and "is not an empty directory" in result.stderr


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                    reason="Ray is not installed (pip install 'kvtrace[ray]')")
@pytest.mark.skipif(resource.getrlimit(resource.RLIMIT_AS)[0] != resource.RLIM_INFINITY,
                    reason="an address-space limit (ulimit -v, prlimit --as): Ray's object "
                           "store cannot be mapped, and ray.init waits forever")
def test_ray_tasks_make_the_serial_database(fleet_dir, tmp_path, serial):
    result = CliRunner().invoke(cli, ["load", str(fleet_dir), "-o", str(tmp_path / "r.duckdb"),
                                      "--ray", "local", "-j", "2"])
    if result.exit_code != 0 and "cannot connect to Ray" in result.output:
        pytest.skip(f"Ray cannot start here: {result.output.strip()}")
    assert result.exit_code == 0, result.output
    assert "(a local Ray instance)" in result.stdout
    assert tables_of(tmp_path / "r.duckdb") == serial[1]


def test_local_workers_are_forked_before_the_database_opens(fleet_dir, tmp_path, monkeypatch):
    """Every worker runs before the database is opened, and no other is forked later, once
    DuckDB's threads run in this process."""
    workers, seen = LocalWorkers(2), []
    real = load._new_database

    def spy(*args, **kwargs):
        seen.append(sorted(child.pid for child in multiprocessing.active_children()))
        real(*args, **kwargs)
        seen.append(sorted(child.pid for child in multiprocessing.active_children()))

    monkeypatch.setattr(load, "_new_database", spy)
    summary = load_traces([fleet_dir / "e0.kvtrace", fleet_dir / "e3.kvtrace"],
                          tmp_path / "x.duckdb", runner=workers)
    assert len(summary.runs) == 2
    assert len(seen[0]) == 2 and seen[1] == seen[0]
    assert workers.executor is None  # stopped with the load


# --- the report's fleet section ------------------------------------------------------------

HOUR = 3_600 * 10**9
UNIT = 16
PROMPT = 4 * UNIT + 1  # four hash units and a last token, which never hits
EVICTING = EngineConfig(kv_cache_groups=[KVCacheGroup(kind="full_attention", block_size=UNIT)],
                        hash_block_size=UNIT, num_gpu_blocks=6, retention_interval=0)


def engine_header(pid: int, rank: int, config: EngineConfig = CONFIG) -> TraceHeader:
    """A capture of data-parallel rank ``rank``'s engine core on host gpu1."""
    return TraceHeader(kvtrace_version="test", created_ns=0, source="capture", config=config,
                       pid=pid, host="gpu1", process_title=f"VLLM::EngineCore_DP{rank}")


def seconds_apart(records: list, seconds: int) -> list:
    """``records`` with step k at k * ``seconds`` (the scenario's steps are 1 ns apart)."""
    return [StepStarted(r.step, r.ts_ns * seconds * 10**9) if isinstance(r, StepStarted) else r
            for r in records]


def thrashing() -> list:
    """Six requests, two prompts in turn (S, E, S, ...), each filling the whole pool (five
    blocks: four hashed units and the last token's): each takes the blocks the other cached,
    so after the first two every lookup loses its four units (64 tokens) to eviction."""
    records, keys = [], {}  # block -> (hash, num_tokens) cached on it
    for req in range(6):
        units = [10 * (req % 2 + 1) + unit for unit in range(4)]
        records += [StepStarted(req, req * 600 * 10**9),
                    RequestArrived(req, PROMPT, units, 1),
                    ComputedBlocksFound(req, 0, 0),
                    SlotsAllocated(req, PROMPT, 0, 0, 0, 0, PROMPT, True)]
        for block in (5, 4, 3, 2, 1):  # the free queue's order after every request
            if block in keys:
                hash_id, tokens = keys.pop(block)
                records.append(BlockRemoved(block, hash_id, 0, tokens, RemoveReason.LRU_REUSE))
            records.append(BlockAllocated(block, req))
        for index, block in enumerate((5, 4, 3, 2)):
            keys[block] = (units[index], (index + 1) * UNIT)
            records.append(BlockStored(block, units[index], 0, (index + 1) * UNIT,
                                       StoreKind.FULL, req))
        records.append(RequestFinished(req, 0))
        records += [BlockFreed(block, 0, block != 1) for block in (1, 2, 3, 4, 5)]
    return records


@pytest.fixture(scope="module")
def fleet_db(tmp_path_factory) -> Path:
    """Three engine cores of one host (data-parallel ranks 0-2). Ranks 0 and 2 ran the
    hand-built scenario (a hot prefix pushed out by a transient checkpoint), and each capture
    was replayed under unfixed and fixed; rank 1 thrashed its pool, with no replay."""
    directory = tmp_path_factory.mktemp("engines")
    paths = []
    for pid, rank in ((11, 0), (13, 2)):
        capture = directory / f"dp{rank}.kvtrace"
        write_trace(capture, engine_header(pid, rank), seconds_apart(scenario(True), 600))
        paths.append(capture)
        for variant in ("unfixed", "fixed"):
            replay = directory / f"dp{rank}.{variant}.kvtrace"
            write_trace(replay, TraceHeader(
                kvtrace_version="test", created_ns=0, source="replay", config=CONFIG,
                replay=ReplayInfo(variant=variant, backend="model", mode="reschedule",
                                  source_path=str(capture), source_digest=file_digest(capture))),
                seconds_apart(scenario(variant == "unfixed"), 600))
            paths.append(replay)
    thrashed = directory / "dp1.kvtrace"
    write_trace(thrashed, engine_header(12, 1, EVICTING), thrashing())
    paths.append(thrashed)
    db = directory / "fleet.duckdb"
    load_traces(paths, db)
    return db


@pytest.fixture(scope="module")
def report(fleet_db):
    connection = open_database(fleet_db)
    try:
        yield collect(connection, str(fleet_db), pricing=pricing_for())
    finally:
        connection.close()


# The scenario, by hand (its comments): admitted lookups of requests 0-5 query 32, 32, 48, 80,
# 32 and 32 tokens; unfixed hits 0, 16, 16, 0, 0 and 16 (request 4 lost the pushed-out
# prefix), fixed hits 16 on request 4 too. Its last step is step 7, 7 x 10 minutes after the
# first arrival. The thrashing pool: six prompts of 65 tokens, none hit; 50 minutes.
SCENARIO_HOURS = 7 * 600 / 3600
SCENARIO_MISSED = {"unfixed": 256 - 48, "fixed": 256 - 64}
THRASHED_MISSED = 6 * PROMPT
THRASHED_HOURS = 5 * 600 / 3600


def test_one_row_per_engine_by_hand(report):
    rows = {row["engine"]: row for row in report.fleet.engines}
    assert list(rows) == ["gpu1:12 dp1", "gpu1:11 dp0", "gpu1:13 dp2"]  # losing most first
    thrashed, rank0, rank2 = rows.values()
    assert (thrashed["host"], thrashed["pid"], thrashed["rank"]) == ("gpu1", 12, 1)
    assert (thrashed["runs"], thrashed["replays"]) == ([6], [])
    assert (rank0["runs"], rank0["replays"]) == ([0], [1, 2])
    assert (rank2["runs"], rank2["replays"]) == ([3], [4, 5])
    assert thrashed["lookups"] == 6 and thrashed["hit_rate"] == 0
    assert thrashed["missed_tokens"] == THRASHED_MISSED
    assert thrashed["traffic_hours"] == pytest.approx(THRASHED_HOURS)
    assert thrashed["missed_tokens_per_hour"] == pytest.approx(THRASHED_MISSED / THRASHED_HOURS)
    for row in (rank0, rank2):  # each capture as the unfixed replay of it
        assert (row["lookups"], row["hit_rate"], row["missed_tokens"]) == (
            6, 48 / 256, SCENARIO_MISSED["unfixed"])
        assert row["missed_tokens_per_hour"] == pytest.approx(208 / SCENARIO_HOURS)
        assert row["share_of_fleet_missed"] == pytest.approx(208 / (2 * 208 + THRASHED_MISSED))
        assert row["gpu_seconds"] is None and row["cost_model"] is None  # no model named
    assert sum(row["share_of_fleet_missed"] for row in rows.values()) == pytest.approx(1)


def test_each_engines_top_finding(report):
    rows = {row["engine"]: row for row in report.fleet.engines}
    # four lookups lost four units each to eviction: 256 of the 390 tokens missed
    assert rows["gpu1:12 dp1"]["top_finding"] == f"pool-pressure ({256 / THRASHED_MISSED:.1%})"
    # the scenario: 192 tokens no earlier request had computed, and request 4's 16 pushed out
    for engine in ("gpu1:11 dp0", "gpu1:13 dp2"):
        assert rows[engine]["top_finding"] == f"unique-prompts ({192 / 208:.1%})"
    # over the fleet: the scenario's cold tokens twice and the thrashing pool's first two
    # prompts (four units each) outweigh the 256 tokens it lost to eviction
    assert report.fleet.finding == ("unique-prompts", 2 * 192 + 2 * 64,
                                    ["gpu1:11 dp0", "gpu1:13 dp2"])


def test_the_fleet_verdict_sums_the_fix_over_the_engines_it_was_replayed_on(report):
    (fix,) = report.fleet.fixes
    assert fix.engines == ["gpu1:11 dp0", "gpu1:13 dp2"]
    saved = (SCENARIO_MISSED["unfixed"] - SCENARIO_MISSED["fixed"]) / SCENARIO_HOURS
    assert fix.row["prefill_tokens_saved_per_hour"] == pytest.approx(2 * saved)
    assert fix.row["from_prefill_tokens"] == 2 * SCENARIO_MISSED["unfixed"]
    assert fix.row["gpu_seconds_saved_per_hour"] is None
    assert fix.advice.startswith("Upgrade to a release with the #56794 gate")
    assert f"{2 * saved:,.0f} fewer prefill tokens per hour" in fix.advice
    per_engine = {row["engine"]: row["fixes"] for row in report.fleet.engines}
    assert per_engine["gpu1:12 dp1"] == {}
    for engine in fix.engines:
        (row,) = per_engine[engine].values()
        assert row["prefill_tokens_saved_per_hour"] == pytest.approx(saved)


def test_a_fix_is_priced_per_engine_with_a_model(fleet_db):
    connection = open_database(fleet_db)
    try:
        data = collect(connection, str(fleet_db),
                       pricing=pricing_for("h200", "nemotron-h-8b"))
    finally:
        connection.close()
    (fix,) = data.fleet.fixes
    verdicts = [v.row["gpu_seconds_saved_per_hour"] for v in data.verdicts]
    assert fix.row["gpu_seconds_saved_per_hour"] == pytest.approx(sum(verdicts))
    assert "GPU-seconds per hour of nemotron-h-8b" in fix.advice
    top = data.fleet.engines[0]
    assert top["gpu_seconds_per_hour"] == pytest.approx(
        top["gpu_seconds"] / top["traffic_hours"])


def test_the_fleet_in_text_markdown_and_html(report, fleet_db, tmp_path):
    from kvtrace.analysis.report_html import render_html

    text = render_text(report)
    assert "== Fleet: 3 engines ==" in text
    assert text.index("== Verdict ==") < text.index("== Fleet") < text.index("== Hit rate")
    assert fleet_lines(report)[0].startswith("The engines that lose most, of 3: gpu1:12 dp1 (")
    assert f"kvtrace sql {fleet_db} --query fleet" in text
    markdown = render_markdown(report)
    assert "### Fleet: 3 engines" in markdown and "| gpu1:12 dp1 |" in markdown
    page = render_html(report)
    assert '<section id="fleet"><h2>Fleet: 3 engines</h2>' in page
    assert page.index('id="verdict"') < page.index('id="fleet"') < page.index('id="plots"')


def test_the_fleet_query_reproduces_the_rows(report, fleet_db):
    connection = open_database(fleet_db)
    try:
        result = run_query(connection, "fleet")
    finally:
        connection.close()
    assert [row[0] for row in result.rows] == [row["engine"] for row in report.fleet.engines]


def test_one_engine_has_no_fleet_section(tmp_path):
    path = tmp_path / "one.kvtrace"
    write_trace(path, engine_header(11, 0), seconds_apart(scenario(True), 600))
    load_traces([path], tmp_path / "one.duckdb")
    connection = open_database(tmp_path / "one.duckdb")
    try:
        data = collect(connection, str(tmp_path / "one.duckdb"))
    finally:
        connection.close()
    assert data.fleet is None and "== Fleet" not in render_text(data)
