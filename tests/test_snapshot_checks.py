"""A start snapshot no engine could have had is refused before any backend rebuilds it, in
lockstep and in a rescheduled replay alike: one ``kvtrace: error:`` line naming the record, the
field and the value, exit 1, no traceback, no output, the trace unchanged. Each snapshot here is
a real mid-flight capture's (``test_snapshot``) with one thing changed; unchanged, it replays
to 100%.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from cli_runs import assert_error, run
from test_snapshot import crafted, mid_flight_trace, workload  # noqa: F401 (fixtures)

from kvtrace.events import (
    BlockState,
    KeyCached,
    RequestBlocksState,
    RequestQueue,
    RequestState,
    SnapshotStarted,
)
from kvtrace.replay.snapshot import snapshot_of
from kvtrace.traceio import TraceReader, TraceWriter

replace = msgspec.structs.replace
MODES = {"lockstep": ("--lockstep", "--verify"), "rescheduled": ("--variant", "fixed")}


@pytest.fixture(scope="module")
def snapshot(mid_flight_trace):
    return snapshot_of(TraceReader(str(mid_flight_trace)))


def edit_nth(kind, n, edit):
    """A ``crafted`` change: the ``n``-th record of ``kind`` (from 0) becomes ``edit(it)``."""
    seen = [0]

    def change(record):
        if type(record) is not kind:
            return record
        seen[0] += 1
        return edit(record) if seen[0] == n + 1 else record
    return change


def edit_where(kind, matches, edit):
    """A ``crafted`` change: every record of ``kind`` that ``matches`` becomes ``edit(it)``."""
    return lambda record: edit(record) if type(record) is kind and matches(record) else record


def rearranged(trace: Path, directory: Path, arrange) -> str:
    """``trace`` with its records in the order ``arrange(snapshot, others)`` gives (its state
    records, then all others, each in file order)."""
    records = list(TraceReader(str(trace)))
    path = directory / "rearranged.kvtrace"
    with TraceWriter(path, TraceReader(str(trace)).header) as writer:
        writer.write_many(arrange([r for r in records if r.family == "state"],
                                  [r for r in records if r.family != "state"]))
    return str(path)


def assert_refused(path: str, directory: Path, mode: str, message: str) -> None:
    """Replaying ``path`` in ``mode`` fails with one error line holding ``message``; the trace
    is unchanged and no output is left."""
    before = Path(path).read_bytes()
    outdir = directory / f"runs-{mode}"
    assert_error(run("replay", path, *MODES[mode], "-o", outdir), message)
    assert Path(path).read_bytes() == before
    assert not outdir.exists() or not any(outdir.iterdir())


def first_table(snapshot) -> RequestBlocksState:
    return snapshot.request_blocks[0]


def running(snapshot) -> RequestState:
    return snapshot.running()[0]


# (name, change of the snapshot's records given the snapshot, message)
CRAFTED = [
    # Refused deep inside vLLM's cache before (an assertion, an overflow): now by name.
    ("one block in two block_state records",
     lambda s: edit_nth(BlockState, 1, lambda r: s.blocks[0]),
     lambda s: f"has two block_state records of block {s.blocks[0].block_id}"),
    ("a negative hash id",
     lambda s: edit_nth(RequestState, 0, lambda r: replace(r, hash_ids=[-5, *r.hash_ids[1:]])),
     lambda s: f"request_state of request {s.requests[0].req} has hash id -5"),
    ("a hash id among the replay's made-up ones",
     lambda s: edit_nth(RequestState, 0,
                        lambda r: replace(r, hash_ids=[2**62, *r.hash_ids[1:]])),
     lambda s: f"request_state of request {s.requests[0].req} has hash id {2**62}"),
    ("a last state index past the request's blocks",
     lambda s: edit_nth(RequestBlocksState, 0, lambda r: replace(
         r, fields={**r.fields, "last_state_block_idx": [10**9]})),
     lambda s: "last_state_block_idx [1000000000], not an index of its"),
    ("a negative count of cached blocks",
     lambda s: edit_nth(RequestBlocksState, 0, lambda r: replace(
         r, fields={**r.fields, "num_cached_block": [-3]})),
     lambda s: "num_cached_block [-3], not a count of its"),
    ("a preempted request that holds blocks",
     lambda s: edit_where(RequestState, lambda r: r.req == running(s).req, lambda r: replace(
         r, queue=RequestQueue.WAITING, status="PREEMPTED", num_computed_tokens=0)),
     lambda s: f"gives request {running(s).req} (PREEMPTED) blocks"),
    ("a preempted request with computed tokens",
     lambda s: edit_where(RequestState, lambda r: r.queue == RequestQueue.WAITING,
                          lambda r: replace(r, status="PREEMPTED", num_computed_tokens=16)),
     lambda s: f"request_state of request {s.waiting()[0].req} has num_computed_tokens 16"),
    # Memory followed a number of the snapshot.
    ("a prompt of 2^61 tokens",
     lambda s: edit_nth(RequestState, 0, lambda r: replace(r, prompt_len=2**61,
                                                           num_tokens=2**61 + 1)),
     lambda s: f"request_state of request {s.requests[0].req} has "
               f"{2**61 + s.requests[0].max_tokens:,} tokens"),
    ("a prompt of 3 * 10^8 tokens, its hash ids there",
     lambda s: edit_nth(RequestState, 0, lambda r: replace(
         r, prompt_len=3 * 10**8, num_tokens=3 * 10**8,
         hash_ids=list(range(3 * 10**8 // 1040)))),
     lambda s: f"request_state of request {s.requests[0].req} has "
               f"{3 * 10**8 + s.requests[0].max_tokens:,} tokens"),
    # Passed silently: figures from a cache no engine could have held.
    ("a block held in four groups, one reference",
     lambda s: edit_where(RequestBlocksState,
                          lambda r: r.req == first_table(s).req and 1 <= r.group <= 3,
                          lambda r: replace(r, block_ids=[*r.block_ids,
                                                          first_table(s).block_ids[-1]])),
     lambda s: f"block {first_table(s).block_ids[-1]} has ref_cnt 1, but request tables "
               "hold it 4 times"),
    ("a huge reference count",
     lambda s: edit_where(BlockState, lambda r: r.block_id == first_table(s).block_ids[-1],
                          lambda r: replace(r, ref_cnt=2**40)),
     lambda s: f"block {first_table(s).block_ids[-1]} has ref_cnt {2**40}, but request "
               "tables hold it 1 time"),
    ("one key in two key_cached records",
     lambda s: edit_nth(KeyCached, 1, lambda r: s.keys[0]),
     lambda s: f"has two key_cached records of hash {s.keys[0].hash_id} in group "
               f"{s.keys[0].group}"),
    ("a key its block does not agree with",
     lambda s: edit_nth(KeyCached, 0, lambda r: replace(r, hash_id=10**6)),
     lambda s: f"block_state of block {min(s.keys[0].block_ids)} is keyed with hash "
               f"{s.keys[0].hash_id} in group {s.keys[0].group}, which no key_cached"),
    ("one request's table in two request_blocks_state records",
     lambda s: edit_nth(RequestBlocksState, 1, lambda r: first_table(s)),
     lambda s: f"has two request_blocks_state records of request {first_table(s).req} in "
               f"group {first_table(s).group}"),
    ("a running request missing a group",
     lambda s: edit_where(RequestBlocksState, lambda r: (r.req, r.group) == (running(s).req, 3),
                          lambda r: None),
     lambda s: f"request {running(s).req} has request_blocks_state in 6 of the 7 KV-cache "
               "groups, none in group 3"),
    ("a negative request number",
     lambda s: edit_nth(RequestState, 0, lambda r: replace(r, req=-7)),
     lambda s: "request_state of request -7"),
    ("a checkpoint past the request's blocks",
     lambda s: edit_nth(RequestBlocksState, 0, lambda r: replace(
         r, fields={**r.fields, "_checkpoints": [1040, 10**6]})),
     lambda s: "_checkpoints [1040, 1000000]"),
    ("a Mamba field in an attention group",
     lambda s: edit_where(RequestBlocksState, lambda r: r.group == 6, lambda r: replace(
         r, fields={**r.fields, "last_state_block_idx": [0]})),
     lambda s: "last_state_block_idx in group 6 (full_attention)"),
    ("a count of requests the snapshot does not hold",
     lambda s: edit_nth(SnapshotStarted, 0, lambda r: replace(r, num_requests=5)),
     lambda s: f"snapshot_started has num_requests 5, but {len(s.requests)} request_state"),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name, change, message", CRAFTED, ids=[c[0] for c in CRAFTED])
def test_an_impossible_snapshot_is_one_error(mid_flight_trace, snapshot, tmp_path, mode, name,
                                             change, message):
    path = crafted(mid_flight_trace, tmp_path, change(snapshot))
    assert_refused(path, tmp_path, mode, message(snapshot))


@pytest.mark.parametrize("mode", MODES)
def test_a_second_snapshot_is_refused(mid_flight_trace, tmp_path, mode):
    path = rearranged(mid_flight_trace, tmp_path,
                      lambda state, others: [*state, *state, *others])
    assert_refused(path, tmp_path, mode, "a second start snapshot")


@pytest.mark.parametrize("mode", MODES)
def test_a_snapshot_after_the_first_calls_is_refused(mid_flight_trace, tmp_path, mode):
    calls = []

    def late(state, others):
        calls.extend(r for r in others[:2000] if r.family in ("input", "effect"))
        return [*others[:2000], *state, *others[2000:]]
    path = rearranged(mid_flight_trace, tmp_path, late)
    assert_refused(path, tmp_path, mode, "(snapshot_started) comes after the trace's calls")
    assert calls, "the snapshot was moved behind calls"


def test_a_sound_snapshot_still_replays_in_lockstep_to_identical(mid_flight_trace, tmp_path):
    result = run("replay", mid_flight_trace, "--lockstep", "--verify", "-o", tmp_path / "runs")
    assert result.exit_code == 0, result.output
    assert "identical" in result.output and "kvtrace: error" not in result.output
    result = run("replay", mid_flight_trace, "--variant", "fixed", "-o", tmp_path / "fixed")
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("hash_id", [-5, 1 << 62], ids=["negative", "2^62"])
@pytest.mark.parametrize("backend", ["vllm", "model"])
def test_an_arrival_with_a_hash_id_out_of_range_is_one_error(tmp_path, hash_id, backend):
    """The same rule for an arriving request as for one in the snapshot: a negative id was an
    OverflowError traceback in the vllm backend's hash bytes."""
    from kvtrace.events import RequestArrived

    workload = tmp_path / "chat.kvtrace"
    assert run("synth", "--preset", "chat", "--requests", 5, "-o", workload).exit_code == 0
    change = edit_nth(RequestArrived, 0, lambda r: replace(r, hash_ids=[hash_id,
                                                                        *r.hash_ids[1:]]))
    path = tmp_path / "arrival.kvtrace"
    with TraceWriter(path, TraceReader(str(workload)).header) as writer:
        writer.write_many(change(record) for record in TraceReader(str(workload)))
    outdir = tmp_path / "runs"
    assert_error(run("replay", path, "--variant", "fixed", "--backend", backend, "-o", outdir),
                 f"has hash id {hash_id}; hash ids run from 0 to below 2^62")


@pytest.mark.parametrize("hash_id", [-5, 1 << 62], ids=["negative", "2^62"])
def test_an_output_unit_with_a_hash_id_out_of_range_is_one_error(mid_flight_trace, tmp_path,
                                                                 hash_id):
    """The output units a later turn names (``hashes_extended``), for a request in flight at
    the snapshot: the same rule, before a backend turns them into hash bytes."""
    from kvtrace.events import HashesExtended

    change = edit_nth(HashesExtended, 0, lambda r: replace(r, hash_ids=[hash_id]))
    path = tmp_path / "extended.kvtrace"
    with TraceWriter(path, TraceReader(str(mid_flight_trace)).header) as writer:
        writer.write_many(change(record) for record in TraceReader(str(mid_flight_trace)))
    for mode in MODES:
        assert_refused(str(path), tmp_path, mode, f"has hash id {hash_id}; hash ids run from 0")
