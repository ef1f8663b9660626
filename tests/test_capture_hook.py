"""The in-engine capture hook, in-process on the real vLLM 0.33 cache: what it records replays
to 100%, it restores what it patched, and it never harms the engine (stalled or failing writer)."""

from __future__ import annotations

import os
import threading
import time

import msgspec
import pytest
from vllm_support import prefill_chunks, run_mixed_workload, seed_config, vllm_backend_class  # noqa: F401

from kvtrace.capture import hook
from kvtrace.capture.messages import ControlMessageError
from kvtrace.events import EventsDropped, SlotsAllocated
from kvtrace.replay.options import ReplayOptions
from kvtrace.replay.run import replay
from kvtrace.traceio import TraceReader, TraceWriter, read_records


class RecordingCalls:
    """Wraps a backend and remembers what its cache answered (the engine's results)."""

    ANSWERS = ("get_computed_blocks", "allocate_slots", "num_free_blocks")

    def __init__(self, backend):
        self.backend, self.results = backend, []

    def __getattr__(self, name):
        method = getattr(self.backend, name)
        if name not in self.ANSWERS:
            return method

        def call(*args, **kwargs):
            result = method(*args, **kwargs)
            self.results.append((name, args, result))
            return result

        return call


def run_engine(vllm_backend_class, variant="fixed", num_gpu_blocks=40, start_capture=None):
    """The mixed workload on an engine-like backend (no replay probes); its results.

    ``start_capture`` arms a capture once the engine's cache exists, as in a live engine."""
    with vllm_backend_class(seed_config(0, num_gpu_blocks), variant, None) as backend:
        if start_capture is not None:
            start_capture()
        calls = RecordingCalls(backend)
        run_mixed_workload(calls)
        return calls.results


@pytest.fixture
def capture(tmp_path):
    sessions = []

    def start(**options):
        status = hook.arm(hook.CaptureOptions(path=str(tmp_path / "cap.kvtrace"), gpu_interval_ms=0,
                                              **options))
        sessions.append(status)
        return status

    yield start
    hook.disarm()


def patched_functions():
    from kvtrace.probes import probe_targets

    return {(owner, name): owner.__dict__[name] for owner, name, _ in probe_targets()}


def test_capture_replays_in_lockstep_to_100_percent(vllm_backend_class, capture, tmp_path):
    run_engine(vllm_backend_class, "fixed", start_capture=capture)
    final = hook.disarm()
    assert final.dropped == 0 and final.error is None and final.written > 100
    reader, records = read_records(tmp_path / "cap.kvtrace")
    assert reader.header.source == "capture" and reader.header.params["variant"] == "fixed"
    # Read off the live manager (the backend builds max_model_len 0 as 2**24, vLLM needs one).
    assert msgspec.structs.replace(reader.header.config, max_model_len=0) == seed_config(0, 40)
    result = replay(ReplayOptions(source=str(tmp_path / "cap.kvtrace"), outdir=str(tmp_path / "runs"),
                                  lockstep=True, verify=True))
    fidelity = result.summary_json()["fidelity"]
    assert fidelity["matched"] == fidelity["total"] > 100, fidelity


def test_disarm_restores_every_original_function(vllm_backend_class, capture):
    """Armed, the capture waits for the engine's next step (only ``new_step_starts`` is
    replaced, by the trigger); that step patches everything; disarming restores each
    original function object."""
    before = patched_functions()
    capture()
    waiting = patched_functions()
    assert [name for (_, name), function in waiting.items()
            if function is not before[(_, name)]] == ["new_step_starts"]
    with vllm_backend_class(seed_config(0, 40), "fixed", None) as backend:
        backend.new_step(0, 0)
    during = patched_functions()
    assert all(during[key] is not before[key] for key in before)
    hook.disarm()
    after = patched_functions()
    assert all(after[key] is before[key] for key in before)


def test_a_failing_snapshot_stops_the_capture_not_the_engine(vllm_backend_class, capture,
                                                              monkeypatch):
    """The start snapshot raises (a vLLM that changed underneath, say): the engine's step goes
    on and its results are unchanged, the capture stops with the error, nothing stays
    patched."""
    from kvtrace.probes import snapshot

    uncaptured = run_engine(vllm_backend_class)
    before = patched_functions()

    def broken(*args):
        raise RuntimeError("vLLM moved its blocks")

    monkeypatch.setattr(snapshot, "take", broken)
    results = run_engine(vllm_backend_class, start_capture=capture)
    assert results == uncaptured
    status = hook.status()
    assert not status.armed and "the start snapshot failed" in status.error
    assert "vLLM moved its blocks" in status.error
    assert patched_functions() == before


@pytest.mark.parametrize("stop", [SystemExit, KeyboardInterrupt])
def test_the_engines_own_stop_during_the_snapshot_reaches_it(vllm_backend_class, capture,
                                                              monkeypatch, stop):
    """vLLM's signal handler raises (SystemExit for SIGTERM) while the start snapshot runs on
    its scheduler thread: the capture stops, nothing stays patched, and the stop goes on to
    the engine, which would otherwise not stop when told."""
    from kvtrace.probes import snapshot

    before = patched_functions()

    def stopped(*args):
        raise stop(15)

    monkeypatch.setattr(snapshot, "take", stopped)
    with pytest.raises(stop):
        run_engine(vllm_backend_class, start_capture=capture)
    status = hook.status()
    assert not status.armed and "the engine was stopped during the start snapshot" in status.error
    assert patched_functions() == before


def test_disarm_before_any_step_restores_the_trigger(capture):
    before = patched_functions()
    capture()
    status = hook.disarm()
    assert status.snapshot_pause_ns == -1  # no step came: no snapshot was taken
    assert patched_functions() == before


def test_a_second_capture_is_refused(vllm_backend_class, capture, tmp_path):
    capture()
    with pytest.raises(hook.AlreadyCapturingError, match="already capturing"):
        hook.arm(hook.CaptureOptions(path=str(tmp_path / "second.kvtrace")))


def test_stalled_writer_drops_and_counts_never_blocks(vllm_backend_class, capture, monkeypatch,
                                                      tmp_path):
    uncaptured = run_engine(vllm_backend_class)
    started = time.perf_counter()
    run_engine(vllm_backend_class)
    baseline_s = time.perf_counter() - started

    original = TraceWriter.write_encoded_rows

    def stalled(self, chunks):
        time.sleep(0.5)
        return original(self, chunks)

    monkeypatch.setattr(TraceWriter, "write_encoded_rows", stalled)
    started = time.perf_counter()
    results = run_engine(vllm_backend_class, start_capture=lambda: capture(buffer_capacity=64))
    captured_s = time.perf_counter() - started
    final = hook.disarm()
    assert results == uncaptured
    assert final.dropped > 0
    # A stalled writer costs the engine nothing it would notice: far below one 0.5 s stall.
    assert captured_s < baseline_s + 0.4, (captured_s, baseline_s)
    reader, records = read_records(tmp_path / "cap.kvtrace")
    markers = [r.count for r in records if isinstance(r, EventsDropped)]
    # Every drop is marked where it happened, and the closing frame counts them all.
    assert markers and sum(markers) == final.dropped == reader.closing.num_dropped
    assert len(records) == final.written


def test_failing_writer_leaves_engine_results_identical(vllm_backend_class, capture, monkeypatch):
    uncaptured = run_engine(vllm_backend_class)

    def broken(self, chunks):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(TraceWriter, "write_encoded_rows", broken)
    results = run_engine(vllm_backend_class, start_capture=capture)
    deadline = time.monotonic() + 5
    while hook.active_session().status().armed and time.monotonic() < deadline:
        time.sleep(0.01)
    status = hook.active_session().status()
    assert results == uncaptured
    assert "No space left on device" in status.error and not status.armed
    from kvtrace.probes.cache_probes import _Patches

    assert not _Patches.originals, "a failed writer must disarm the probes"


def test_signature_mismatch_refuses_before_patching(vllm_backend_class, capture, monkeypatch, tmp_path):
    from kvtrace.probes import ProbeSignatureError
    from vllm.v1.core.block_pool import BlockPool

    def touch(self, blocks, extra):  # a "newer vLLM" with another parameter
        pass

    monkeypatch.setattr(BlockPool, "touch", touch)
    untouched = {(BlockPool, name): function for name, function in vars(BlockPool).items()}
    with pytest.raises(ProbeSignatureError, match="BlockPool.touch"):
        capture()
    assert {(BlockPool, name): function for name, function in vars(BlockPool).items()} == untouched
    assert not (tmp_path / "cap.kvtrace").exists()


def test_records_are_written_while_capturing(vllm_backend_class, capture, tmp_path):
    """The trace grows during a capture (readable as truncated), not only at the end."""
    run_engine(vllm_backend_class, start_capture=capture)
    deadline = time.monotonic() + 5
    while hook.active_session().status().written == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    reader = TraceReader(str(tmp_path / "cap.kvtrace"))
    partial = list(reader)
    assert reader.truncated and any(isinstance(r, SlotsAllocated) for r in partial)


def test_each_captured_request_gets_its_own_number(vllm_backend_class, capture, tmp_path):
    """Requests finish and new ones arrive: numbers are never reused (a live engine's ids are
    opaque strings, so the capture numbers them itself)."""
    from kvtrace.events import RequestArrived

    with vllm_backend_class(seed_config(0, 40), "fixed", None) as backend:
        capture()
        for req in range(3):  # one after the other: each finishes before the next arrives
            backend.add_request(req, 64, list(range(100 * req, 100 * req + 4)), max_tokens=1)
            prefill_chunks(backend, req, [64], first_step=req)
            backend.free(req)
    hook.disarm()
    _, records = read_records(tmp_path / "cap.kvtrace")
    assert [r.req for r in records if isinstance(r, RequestArrived)] == [0, 1, 2]


def test_ill_typed_options_are_refused_before_anything_happens(vllm_backend_class, tmp_path):
    """Issue "Hardening" E1 in process: ``gpu_interval_ms="abc"`` once left the probes patched
    and a writer running with no session, so that every later arm failed."""
    before = patched_functions()
    with pytest.raises(ControlMessageError, match=r"got `str` - at `\$.gpu_interval_ms`"):
        hook.arm(hook.CaptureOptions(path=str(tmp_path / "cap.kvtrace"), gpu_interval_ms="abc"))
    assert patched_functions() == before and hook.active_session() is None
    assert not (tmp_path / "cap.kvtrace").exists()


def test_a_start_that_fails_part_way_is_undone(vllm_backend_class, capture, monkeypatch,
                                               tmp_path):
    """A failure after the probes are patched and the writer runs (here: the GPU sampler's
    start) leaves nothing patched, no writer thread, no trace file; the next arm captures."""
    from kvtrace.probes.cache_probes import _Patches

    before = patched_functions()

    def broken(session):
        raise RuntimeError("telemetry broke")

    monkeypatch.setattr(hook, "_start_telemetry", broken)
    with pytest.raises(RuntimeError, match="telemetry broke"):
        capture()
    assert patched_functions() == before and not _Patches.originals and not _Patches.armed
    assert [t for t in threading.enumerate() if t.name == "kvtrace-writer"] == []
    assert os.listdir(tmp_path) == [] and hook.active_session() is None  # no file, no draft
    monkeypatch.undo()
    run_engine(vllm_backend_class, start_capture=capture)
    final = hook.disarm()
    assert final.error is None and final.written > 100
    assert patched_functions() == before


@pytest.mark.parametrize("failure, said", [
    (RuntimeError("vLLM moved its requests"), "a keyframe failed"),
    (SystemExit(15), "the engine was stopped during a keyframe")])
def test_a_failing_keyframe_stops_the_ring_not_the_engine(vllm_backend_class, tmp_path,
                                                          monkeypatch, failure, said):
    """A ring's keyframe raises on the scheduler thread: the capture stops with the error and
    nothing stays patched; an engine's own stop goes on to it."""
    from kvtrace.probes import snapshot

    before = patched_functions()
    with vllm_backend_class(seed_config(0, 40), "fixed", None) as backend:
        hook.arm(hook.CaptureOptions(path=str(tmp_path / "ring"), hash_bytes=False,
                                     gpu_interval_ms=0, ring_s=60, keyframe_s=30))
        run_mixed_workload(RecordingCalls(backend))  # armed: the probes record

        def broken(*args):
            raise failure

        monkeypatch.setattr(snapshot, "take_keyframe", broken)
        session = hook.active_session()
        session._take_keyframe = snapshot.take_keyframe
        if isinstance(failure, Exception):
            session._keyframe(backend.manager, None)
        else:
            with pytest.raises(SystemExit):
                session._keyframe(backend.manager, None)
    status = hook.disarm()
    assert said in status.error and patched_functions() == before


def test_an_idle_engines_ring_still_ages_its_old_segments_out(vllm_backend_class, tmp_path):
    """A ring opens a segment at each keyframe, and a keyframe waits for a step: an engine that
    stops stepping still has the segments behind the one being written removed once they are
    older than the ring, not kept until its next step."""
    from kvtrace.ring import list_segments

    ring = tmp_path / "ring"
    with vllm_backend_class(seed_config(0, 40), "fixed", None) as backend:
        hook.arm(hook.CaptureOptions(path=str(ring), hash_bytes=False, gpu_interval_ms=0,
                                     ring_s=1.0, keyframe_s=0.05))
        step, deadline = 0, time.monotonic() + 30
        while len(list_segments(ring)) < 4 and time.monotonic() < deadline:
            step += 1
            backend.new_step(step, step * 1_000_000)  # each step may take the keyframe due
            time.sleep(0.01)
        stepped = list_segments(ring)
        assert len(stepped) >= 4, stepped
        while len(list_segments(ring)) > 1 and time.monotonic() < deadline:
            time.sleep(0.05)  # idle: no step comes
        kept = list_segments(ring)
        status = hook.disarm()
    assert kept == stepped[-1:], (stepped, kept)  # only the one being written
    assert status.error is None and status.armed is False
