"""What `kvtrace load` stores (kvtrace/analysis/load.py, stream.py): a trace loaded twice is
loaded once, runs under different engines are never paired, many one-record frames load in
bounded memory, and a record naming a group the header lacks is refused."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest
from bad_traces import header, trace
from cli_runs import assert_error, run, vllm_imported  # noqa: F401
from test_replay_cli import hot_prefix_workload

from kvtrace.events import (
    BlockAllocated,
    BlockRemoved,
    BlockStored,
    CheckpointClass,
    CheckpointRecorded,
    RemoveReason,
    StepStarted,
    StoreKind,
)
from kvtrace.traceio import TraceWriter


def lost_hits(db: Path) -> list[tuple]:
    result = run("sql", db, "--query", "lost_hits_by_prefix", "--json")
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in result.stdout.splitlines()]


# Hardening finding W1.
def test_the_same_trace_loaded_twice_is_loaded_once(tmp_path):
    source = hot_prefix_workload(tmp_path / "hot.kvtrace", 140)
    runs = tmp_path / "runs"
    assert run("replay", source, "-o", runs).exit_code == 0
    once, twice = tmp_path / "once.duckdb", tmp_path / "twice.duckdb"
    assert run("load", runs, "-o", once).exit_code == 0
    result = run("load", runs, runs / "hot.fixed.kvtrace", runs, "-o", twice)
    assert result.exit_code == 0
    assert result.stderr.count("the same content as") == 3
    assert lost_hits(twice) == lost_hits(once) and lost_hits(once)[0]["net_tokens_lost"] > 0
    with duckdb.connect(str(twice), read_only=True) as connection:
        digests = connection.execute("SELECT digest FROM runs").fetchall()
    assert len(digests) == len(set(digests)) == 2


# Hardening finding W1.
def test_runs_under_different_engines_are_never_paired(tmp_path):
    source = hot_prefix_workload(tmp_path / "hot.kvtrace", 140)
    for blocks in (140, 1000):
        assert run("replay", source, "-o", tmp_path / f"p{blocks}", "--num-gpu-blocks",
                   blocks).exit_code == 0
    big_only, mixed = tmp_path / "big.duckdb", tmp_path / "mixed.duckdb"
    assert run("load", tmp_path / "p1000", "-o", big_only).exit_code == 0
    # fixed and unfixed at 1000 blocks, plus unfixed at 140: the 140-block run has no partner
    assert run("load", tmp_path / "p1000", tmp_path / "p140" / "hot.unfixed.kvtrace",
               "-o", mixed).exit_code == 0
    assert lost_hits(mixed) == lost_hits(big_only)
    assert sum(row["tokens_lost"] for row in lost_hits(big_only)) == 0
    both = tmp_path / "both.duckdb"
    assert run("load", tmp_path / "p1000", tmp_path / "p140", "-o", both).exit_code == 0
    pairs = {(row["fixed_run"], row["unfixed_run"]) for row in lost_hits(both)}
    assert pairs == {(0, 1), (2, 3)}  # each pool size with itself


def one_record_frames(path: Path, count: int) -> Path:
    """A trace of ``count`` frames of one record each (a writer flushing every record)."""
    with TraceWriter(path, header(), batch_size=1) as writer:
        for index in range(count):
            writer.write(BlockAllocated(1 + index % 150, index // 8))
    return path


def test_loading_many_one_record_frames_holds_bounded_memory(tmp_path):
    """#24 item 8: a million one-record frames took 3.6 GB (a numpy chunk kept per frame). Rows
    now gather in fixed-size column buffers: the load's peak memory is that of a process that
    loads a small trace, whatever the number of frames (200,000 frames would have taken about
    720 MB)."""
    peaks = {}
    for count in (2_000, 200_000):
        path = one_record_frames(tmp_path / f"one{count}.kvtrace", count)
        child = subprocess.run(
            [sys.executable, "-c", "import resource, sys; from kvtrace.cli import main; "
             "sys.argv = ['kvtrace', 'load', sys.argv[1], '-o', sys.argv[2]]\n"
             "try:\n    main()\nexcept SystemExit:\n    pass\n"
             "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)",
             str(path), str(tmp_path / f"one{count}.duckdb")],
            capture_output=True, text=True, check=True)
        assert f"loaded {count} records" in child.stdout, child.stdout + child.stderr
        peaks[count] = int(child.stdout.split()[-1]) * 1024
    assert peaks[200_000] < peaks[2_000] + 100 * 2**20, peaks


@pytest.mark.parametrize("core", ["C core", "Python twins"])
@pytest.mark.parametrize("group", [2, 7, -1])
def test_a_record_naming_a_group_the_header_lacks_is_refused(tmp_path, monkeypatch, core,
                                                             group):
    """#24 item 9: a group id past the header's groups was an IndexError traceback in load and
    why; a negative one was attributed to the wrong group (Python's negative indexing). Both
    are refused, with the record and the groups the header has."""
    from kvtrace.analysis import stream

    if core == "C core" and stream.core is None:
        pytest.skip("kvtrace's C core is not built here (no C compiler at install)")
    if core == "Python twins":
        monkeypatch.setattr(stream, "core", None)
    path = trace(tmp_path / "bad.kvtrace", [
        StepStarted(0, 0), BlockAllocated(3, 0),
        BlockStored(block_id=3, hash_id=5, group=group, num_tokens=16, kind=StoreKind.FULL,
                    req=0)])
    message = (f"record 2 (block_stored) names KV-cache group {group}, but the header has 2 "
               "groups (0 to 1)")
    assert_error(run("load", path, "-o", tmp_path / "bad.duckdb"), message)
    assert not (tmp_path / "bad.duckdb").exists()
    assert_error(run("why", path, "-r", "0"), message)


# Issue #24, item 9.
def test_a_checkpoint_or_a_removal_naming_a_group_the_header_lacks_is_refused(tmp_path):
    for record, kind in ((BlockRemoved(3, 5, 4, 16, RemoveReason.LRU_REUSE), "block_removed"),
                         (CheckpointRecorded(0, -2, 16, 0, CheckpointClass.TRANSIENT),
                          "checkpoint_recorded")):
        path = trace(tmp_path / f"{kind}.kvtrace", [StepStarted(0, 0), record])
        assert_error(run("load", path, "-o", tmp_path / "bad.duckdb"),
                     f"record 1 ({kind}) names KV-cache group")
