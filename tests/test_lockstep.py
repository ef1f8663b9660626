"""Lockstep replay and fidelity verification on the real vLLM 0.33.0 backend."""

from __future__ import annotations

import msgspec
import pytest

from kvtrace.errors import KvtraceError
from kvtrace.events import (
    BlocksReleased,
    BlockAllocated,
    BlockFreed,
    BlockStored,
    CheckpointSuppressed,
    EventsDropped,
    HashesExtended,
    RequestPreempted,
    RequestFinished,
    StepStarted,
    TraceHeader,
)
from kvtrace.replay.lockstep import replay_lockstep, verify
from kvtrace.traceio import TraceReader, TraceWriter
from vllm_support import (  # noqa: F401 (vllm_backend_class is a fixture)
    run_mixed_workload, seed_config, vllm_backend_class)


@pytest.fixture(scope="module")
def captured(vllm_backend_class):
    """A trace of the mixed workload under ``fixed`` with latest-only retention, tight pool."""
    records = []
    with vllm_backend_class(seed_config(0, num_gpu_blocks=48), "fixed", records.append) as b:
        run_mixed_workload(b)
    return records


def lockstep(backend_class, records, variant="fixed"):
    replayed = []
    with backend_class(seed_config(0, num_gpu_blocks=48), variant, replayed.append) as backend:
        replay_lockstep(records, backend)
    return replayed


def test_the_workload_exercises_what_lockstep_must_reissue(captured):
    kinds = {type(r) for r in captured}
    assert {RequestPreempted, RequestFinished, HashesExtended, CheckpointSuppressed} <= kinds
    assert any(type(r) is BlockStored and r.group == 1 for r in captured)


def test_lockstep_of_a_backend_trace_verifies_fully(vllm_backend_class, captured):
    fidelity = verify(captured, lockstep(vllm_backend_class, captured))
    assert fidelity.first_divergence is None
    assert fidelity.matched == fidelity.total == sum(r.family == "effect" for r in captured)
    assert fidelity.total > 200


def test_lockstep_through_a_trace_file(vllm_backend_class, captured, tmp_path):
    path = tmp_path / "captured.kvtrace"
    header = TraceHeader(kvtrace_version="test", created_ns=0, source="test",
                         config=seed_config(0, num_gpu_blocks=48))
    with TraceWriter(path, header, atomic=True) as writer:
        writer.write_many(captured)
    replayed = lockstep(vllm_backend_class, list(TraceReader(str(path))))
    fidelity = verify(TraceReader(str(path)), replayed)
    assert fidelity.ratio == 1.0 and fidelity.total > 200


def test_a_tampered_effect_is_the_first_divergence(vllm_backend_class, captured):
    replayed = lockstep(vllm_backend_class, captured)
    index = next(i for i, r in enumerate(captured) if type(r) is BlockAllocated and r.block_id > 5)
    tampered = list(captured)
    tampered[index] = msgspec.structs.replace(captured[index], block_id=9999)
    fidelity = verify(tampered, replayed)
    divergence = fidelity.first_divergence
    effect_index = sum(r.family == "effect" for r in captured[:index])
    assert divergence.index == effect_index
    assert divergence.captured.block_id == 9999
    assert divergence.replayed == captured[index]
    assert divergence.last_input == next(r for r in reversed(captured[:index])
                                         if r.family == "input")
    assert fidelity.matched == fidelity.total - 1
    assert "9999" in str(fidelity)


def test_another_variant_diverges_where_the_policies_differ(vllm_backend_class, captured):
    fidelity = verify(captured, lockstep(vllm_backend_class, captured, "unfixed"))
    divergence = fidelity.first_divergence
    assert divergence is not None
    assert type(divergence.captured) is CheckpointSuppressed  # fixed kept it request-local
    assert type(divergence.replayed) in (BlockStored, BlockFreed)


def test_a_trace_with_dropped_events_is_refused(vllm_backend_class, captured, tmp_path):
    with pytest.raises(KvtraceError, match="dropped 3 events"):
        verify([*captured[:10], EventsDropped(3, 0), *captured[10:]], captured)
    path = tmp_path / "lossy.kvtrace"
    header = TraceHeader(kvtrace_version="test", created_ns=0, source="test")
    writer = TraceWriter(path, header)
    writer.write_many(captured)
    writer.close(num_dropped=5)
    with pytest.raises(KvtraceError, match="dropped 5 events"):
        verify(TraceReader(str(path)), captured)


def test_a_release_of_blocks_the_replay_does_not_hold_is_a_clear_error(vllm_backend_class):
    with vllm_backend_class(seed_config(0, num_gpu_blocks=48), "fixed", lambda r: None) as backend:
        with pytest.raises(KvtraceError, match=r"releases block\(s\) \[3, 999\]"):
            replay_lockstep([BlocksReleased([3, 999])], backend)


def test_effects_of_a_call_the_stop_cut_are_counted_apart_and_nothing_else_is():
    """A live call's input is written in front of its effects when it returns: a capture
    stopped during a call ends with effects and no input (CI saw 52 such on a mid-flight
    capture). Those are ``cut``, not compared; effects the replay lacks before a later input
    remain divergences."""
    step = StepStarted(0, 0)
    effects = [BlockAllocated(1, 0), BlockAllocated(2, 0), BlockAllocated(3, 0)]
    whole = [step, effects[0], step, effects[1]]
    fidelity = verify([*whole, effects[2]], whole)
    assert (fidelity.matched, fidelity.total, fidelity.cut) == (2, 2, 1)
    assert fidelity.first_divergence is None and "1 more, of a call" in str(fidelity)
    # The same effect followed by an input: the replay lost it, a divergence.
    fidelity = verify([*whole, effects[2], step], whole)
    assert (fidelity.matched, fidelity.total, fidelity.cut) == (2, 3, 0)
    assert fidelity.first_divergence.captured == effects[2]
    assert fidelity.first_divergence.replayed is None
    # An effect the replay lacks in the middle still diverges, the cut tail apart.
    later = StepStarted(1, 0)
    fidelity = verify([step, effects[0], effects[1], later, effects[2]],
                      [step, effects[0], later])
    assert (fidelity.matched, fidelity.total, fidelity.cut) == (1, 2, 1)
