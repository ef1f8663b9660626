"""What a replay does with its source (kvtrace/replay/run.py, lockstep.py): a truncated one is
replayed with a warning, a source is streamed into compact arrivals, and captured calls that
cannot be re-issued are one error."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import pytest
from bad_traces import header
from cli_runs import assert_error, replayed, run, vllm_imported, workload  # noqa: F401

from kvtrace.traceio import TraceWriter, read_records


def cut(path: Path, to: Path) -> Path:
    """``path`` without its closing frame: a writer that was killed."""
    data = path.read_bytes()
    to.write_bytes(data[:len(data) - 40])
    reader, _ = read_records(to)
    assert reader.truncated
    return to


# Hardening finding W2.
@pytest.mark.parametrize("lockstep", [False, True])
def test_a_truncated_source_is_replayed_with_a_warning(tmp_path, replayed, lockstep):
    source = cut(replayed, tmp_path / "cut.kvtrace")
    result = run("replay", source, *(["--lockstep"] if lockstep else []), "--variant", "fixed",
                 "-o", tmp_path / "again")
    assert result.exit_code == 0
    assert "kvtrace: warning:" in result.stderr and "is truncated" in result.stderr
    assert ("only the calls" if lockstep else "only the requests") in result.stderr


# Hardening finding H4.
def test_the_source_is_streamed_into_compact_arrivals(tmp_path):
    from kvtrace.events import RequestArrived
    from kvtrace.replay.source import read_source

    num_requests, units = 2000, 100
    path = tmp_path / "wide.kvtrace"
    with TraceWriter(path, header()) as writer:
        writer.write_many(RequestArrived(req=r, prompt_len=units * 16, max_tokens=1,
                                         hash_ids=list(range(r * units + 1000, (r + 1) * units + 1000)))
                          for r in range(num_requests))
    tracemalloc.start()
    try:
        source = read_source(str(path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(source.arrivals) == num_requests
    # Records with int lists cost 36+ bytes an id, twice over with the arrivals' copies.
    assert peak / (num_requests * units) < 30


def test_impossible_captured_calls_are_one_error_in_lockstep(tmp_path, replayed):
    from kvtrace.events import RequestFinished

    reader, records = read_records(replayed)
    records.insert(5, RequestFinished(req=12345, status=0))  # a request never added
    path = tmp_path / "impossible.kvtrace"
    with TraceWriter(path, reader.header) as writer:
        writer.write_many(records)
    assert_error(run("replay", path, "--lockstep", "--variant", "fixed", "-o", tmp_path / "x"),
                 "cannot be re-issued")
