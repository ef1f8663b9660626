"""A capture disarms between two scheduler steps, never inside a cache call.

A stop (``kvtrace capture`` ending, its lease lost) arrives on the control thread while vLLM's
scheduler thread may be inside a cache call. Disarmed there, the trace ended with "cut" calls:
some effect records of a call without the rest, or without its input record, and lockstep
replay of the capture failed. Now the scheduler thread disarms when its next step starts (the
stop waits for it, bounded), and a stop that cannot wait drops the unfinished step, marked.
"""

from __future__ import annotations

import threading

import pytest
from test_capture_hook import capture, patched_functions, run_engine  # noqa: F401
from vllm_support import seed_config, vllm_backend_class  # noqa: F401

from kvtrace.capture import hook
from kvtrace.events import EventsDropped
from kvtrace.replay.lockstep import verify
from kvtrace.replay.options import ReplayOptions
from kvtrace.replay.run import replay
from kvtrace.traceio import read_records


class BlockedCall:
    """Holds the scheduler thread inside the Nth ``KVCacheManager.allocate_slots``, after its
    blocks were allocated (their effects recorded) and before they are cached."""

    def __init__(self, monkeypatch, nth: int):
        from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator

        self.inside, self.release = threading.Event(), threading.Event()
        self.calls = 0
        real = KVCacheCoordinator.cache_blocks

        def cache_blocks(coordinator, *args, **kwargs):
            self.calls += 1
            if self.calls == nth:
                self.inside.set()
                self.release.wait(10)
            return real(coordinator, *args, **kwargs)

        monkeypatch.setattr(KVCacheCoordinator, "cache_blocks", cache_blocks)


def engine_in_a_thread(vllm_backend_class, capture):
    thread = threading.Thread(target=run_engine, args=(vllm_backend_class,),
                              kwargs={"start_capture": capture}, daemon=True)
    thread.start()
    return thread


def lockstep(tmp_path):
    return replay(ReplayOptions(source=str(tmp_path / "cap.kvtrace"),
                                outdir=str(tmp_path / "runs"), lockstep=True, verify=True))


def test_a_stop_inside_a_cache_call_disarms_at_the_next_step(vllm_backend_class, capture,
                                                             monkeypatch, tmp_path):
    """Asked while a call is in progress, the disarm waits for the scheduler to finish it and
    start its next step: every captured call is whole, and lockstep replay matches them all."""
    blocked = BlockedCall(monkeypatch, nth=12)
    before = patched_functions()
    engine = engine_in_a_thread(vllm_backend_class, capture)
    assert blocked.inside.wait(30)
    stopped = []
    stopper = threading.Thread(target=lambda: stopped.append(hook.disarm()))
    stopper.start()
    stopper.join(0.2)
    waited = stopper.is_alive()  # for the step boundary: the scheduler was not held
    blocked.release.set()
    stopper.join(10)
    engine.join(30)
    final = stopped[0]
    fidelity = lockstep(tmp_path).summary_json()["fidelity"]
    assert fidelity["matched"] == fidelity["total"] > 20 and fidelity["cut"] == 0, fidelity
    assert final.error is None and final.dropped == 0 and waited
    assert patched_functions() == before


def test_a_stop_that_cannot_wait_drops_the_unfinished_step(vllm_backend_class, capture,
                                                           monkeypatch, tmp_path):
    """The scheduler stays in its call for longer than a stop waits: the step it is in is
    dropped and marked, never cut, and the disarm comes within the wait."""
    monkeypatch.setattr(hook, "DISARM_WAIT_S", 0.2, raising=False)
    blocked = BlockedCall(monkeypatch, nth=12)
    engine = engine_in_a_thread(vllm_backend_class, capture)
    assert blocked.inside.wait(30)
    try:
        final = hook.disarm()
    finally:
        blocked.release.set()
    engine.join(30)
    _, records = read_records(tmp_path / "cap.kvtrace")
    # What is kept replays whole: the captured effects (before the marker, which `--verify`
    # refuses) against a lockstep replay's.
    result = replay(ReplayOptions(source=str(tmp_path / "cap.kvtrace"),
                                  outdir=str(tmp_path / "runs"), lockstep=True,
                                  variants=("fixed",)))
    _, replayed = read_records(result.variants[0].output)
    fidelity = verify([record for record in records if type(record) is not EventsDropped],
                      replayed)
    assert fidelity.matched == fidelity.total > 0 and fidelity.cut == 0, fidelity
    assert final.error is None and final.dropped > 0
    assert isinstance(records[-1], EventsDropped) and records[-1].count == final.dropped


def test_an_idle_engine_disarms_at_once_and_keeps_its_last_step(vllm_backend_class, capture,
                                                                tmp_path):
    run_engine(vllm_backend_class, start_capture=capture)
    final = hook.disarm()  # no step will come: the wait ends, nothing is in a call
    assert final.error is None and final.dropped == 0
    fidelity = lockstep(tmp_path).summary_json()["fidelity"]
    assert fidelity["matched"] == fidelity["total"] > 100 and fidelity["cut"] == 0, fidelity


@pytest.fixture(autouse=True)
def _no_capture_left():
    yield
    hook.disarm()
