"""The start snapshot, in-process on vLLM 0.33's own ``Scheduler`` and ``KVCacheManager``
(``kvtrace engine``'s) serving a real-geometry workload:

* taken mid-flight and rebuilt into a fresh cache, it reads back the same, record for record;
* a capture armed mid-flight and stopped mid-flight replays in lockstep to 100% from it, on the
  real vLLM cache and on the model backend;
* a snapshot no engine could hold is refused with one message, whatever is wrong with it.
"""

from __future__ import annotations

import types

import msgspec
import pytest

from kvtrace.capture import hook
from kvtrace.engine.core import EngineOptions, VllmScheduler, load_workload
from kvtrace.errors import KvtraceError
from kvtrace.events import (
    BlockState,
    FreeQueueState,
    HashInterner,
    KeyCached,
    RequestBlocksState,
    RequestQueue,
    RequestState,
    SnapshotEnded,
    SnapshotStarted,
)
from kvtrace.probes import CacheProbes
from kvtrace.probes import snapshot as live_snapshot
from kvtrace.replay.backend import open_backend
from kvtrace.replay.options import ReplayOptions
from kvtrace.replay.run import replay
from kvtrace.replay.snapshot import SnapshotError, snapshot_of
from kvtrace.replay.snapshot_checks import check_snapshot
from kvtrace.traceio import TraceReader, TraceWriter
from kvtrace.workloads.synth import synthesize
from kvtrace.workloads.workload import EngineShape, write_workload

MODEL = "nemotron-h-8b"  # six Mamba2 groups and an attention group, 1,040-token blocks


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    shape = EngineShape(model=MODEL)
    path = tmp_path_factory.mktemp("snapshot") / "w.kvtrace"
    write_workload(path, synthesize("documents", 60, 0, shape.hash_block_size), shape)
    return load_workload(EngineOptions(str(path), variant="unfixed"))


def serving(workload, steps: int, variant: str = "unfixed") -> VllmScheduler:
    """vLLM's scheduler on the workload under ``variant``, every request arrived, ``steps``
    steps in."""
    engine = VllmScheduler(workload.config, workload.settings, variant)
    for arrival in workload.arrivals:
        engine.add_request(arrival)
    for _ in range(steps):
        engine.step()
    return engine


def capture_steps(engine: VllmScheduler, trace, steps: int):
    """A capture of ``engine`` armed now (its start snapshot taken at the next step) and
    disarmed ``steps`` steps later, the engine still busy then; ``trace``."""
    hook.arm(hook.CaptureOptions(path=str(trace), gpu_interval_ms=0))
    try:
        for _ in range(steps):
            engine.step()
        assert engine.has_requests()
    finally:
        final = hook.disarm()
    assert final.error is None and final.dropped == 0 and final.snapshot_pause_ns > 0
    return trace


def state_records(records) -> list:
    """A snapshot's records without what differs between two takes of one state: the times,
    the counters, the engine's own request ids and arrival times, and the hash bytes."""
    kept = []
    for record in records:
        if type(record) in (SnapshotStarted, SnapshotEnded) or record.family == "meta":
            continue
        if type(record) is RequestState:
            record = msgspec.structs.replace(record, arrival_ns=0, request_id="")
        kept.append(record)
    return kept


def test_a_snapshot_rebuilt_into_a_fresh_cache_reads_back_the_same(workload):
    engine = serving(workload, steps=40)
    scheduler = engine.scheduler
    assert scheduler.running and scheduler.waiting, "mid-flight: requests run and wait"
    taken = live_snapshot.take(scheduler.kv_cache_manager, scheduler,
                               CacheProbes(lambda record: None, HashInterner())).records()
    kinds = {type(record) for record in taken}
    assert {FreeQueueState, BlockState, KeyCached, RequestState, RequestBlocksState} <= kinds
    snapshot = snapshot_of(taken)
    check_snapshot(snapshot, workload.config, "test")
    with open_backend("vllm", workload.config, "unfixed", lambda record: None,
                      snapshot) as backend:
        requests = [backend.request(r.req) for r in snapshot.requests]
        restored = types.SimpleNamespace(
            running=[r for r, s in zip(requests, snapshot.requests)
                     if s.queue == RequestQueue.RUNNING],
            waiting=[r for r, s in zip(requests, snapshot.requests)
                     if s.queue == RequestQueue.WAITING],
            requests={r.request_id: r for r in requests})
        again = live_snapshot.take(backend.manager, restored, backend.probes).records()
    assert state_records(again) == state_records(taken)


@pytest.fixture(scope="module")
def mid_flight_trace(workload, tmp_path_factory):
    """A capture armed 300 steps into the workload and disarmed 600 steps later, the engine
    busy throughout."""
    return capture_steps(serving(workload, steps=300),
                         tmp_path_factory.mktemp("mid-flight") / "cap.kvtrace", 600)


@pytest.mark.parametrize("backend", ["vllm", "model"])
def test_a_capture_armed_mid_flight_replays_in_lockstep(mid_flight_trace, tmp_path, backend):
    snapshot = snapshot_of(TraceReader(str(mid_flight_trace)))
    assert snapshot is not None and snapshot.running() and snapshot.keys
    result = replay(ReplayOptions(source=str(mid_flight_trace), outdir=str(tmp_path / "runs"),
                                  backend=backend, lockstep=True, verify=True))
    fidelity = result.fidelity
    assert fidelity.matched == fidelity.total > 1000, str(fidelity)
    replayed = snapshot_of(TraceReader(result.variants[0].output))
    assert replayed.records() == snapshot.records()  # a replay trace starts where its source did


def crafted(trace, tmp_path, change) -> str:
    """``trace`` with its snapshot's records passed through ``change`` (record -> record, or
    None to leave it out)."""
    reader = TraceReader(str(trace))
    path = tmp_path / "crafted.kvtrace"
    with TraceWriter(path, reader.header) as writer:
        for record in TraceReader(str(trace)):
            changed = change(record) if record.family == "state" else record
            if changed is not None:
                writer.write(changed)
    return str(path)


def _first_held(record):
    return type(record) is BlockState and record.ref_cnt > 0


@pytest.mark.parametrize("change, message", [
    (lambda r: msgspec.structs.replace(r, block_ids=[*r.block_ids, r.block_ids[0]])
     if type(r) is FreeQueueState else r, "lists a block twice in the free queue"),
    (lambda r: msgspec.structs.replace(r, block_id=10**6) if type(r) is BlockState else r,
     "names block 1000000, outside the pool"),
    (lambda r: msgspec.structs.replace(r, group=-1) if type(r) is KeyCached else r,
     "names KV-cache group -1"),
    (lambda r: msgspec.structs.replace(r, fields={**r.fields, "_bogus": [1]})
     if type(r) is RequestBlocksState else r, "unknown per-request state '_bogus'"),
    (lambda r: msgspec.structs.replace(r, fields={**r.fields, "num_cached_block": [1, 2]})
     if type(r) is RequestBlocksState else r, "num_cached_block = \\[1, 2\\]"),
    (lambda r: msgspec.structs.replace(r, status="FINISHED_STOPPED")
     if type(r) is RequestState else r, "'FINISHED_STOPPED'"),
    (lambda r: msgspec.structs.replace(r, ref_cnt=0) if _first_held(r) else r,
     "references outside the free queue"),
    (lambda r: r if type(r) is not SnapshotEnded else None, "is incomplete"),
])
def test_an_impossible_snapshot_is_refused(mid_flight_trace, tmp_path, change, message):
    path = crafted(mid_flight_trace, tmp_path, change)
    with pytest.raises(SnapshotError, match=message):
        replay(ReplayOptions(source=path, outdir=str(tmp_path / "runs"), lockstep=True))
    with pytest.raises(KvtraceError, match=message):
        replay(ReplayOptions(source=path, outdir=str(tmp_path / "runs")))
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
