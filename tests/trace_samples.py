"""Sample records and headers shared by the trace-format tests and the golden-file generator."""

from __future__ import annotations

import struct

from vllm_support import seed_config

from kvtrace.events import (
    BlockAllocated,
    BlockFreed,
    BlockRemoved,
    BlockStored,
    BlocksCached,
    BlockTouched,
    BoundaryStateOffloaded,
    CheckpointClass,
    CheckpointRecorded,
    CheckpointSuppressed,
    ComputedBlocksFound,
    BlockState,
    EventsDropped,
    FinishStatus,
    FreeQueueState,
    KeyCached,
    RequestBlocksState,
    RequestQueue,
    RequestState,
    SnapshotEnded,
    SnapshotStarted,
    GpuSampled,
    HashesExtended,
    HashInterned,
    RemoveReason,
    ReplayInfo,
    RequestArrived,
    RequestFinished,
    RequestPreempted,
    BlocksReleased,
    SlotsAllocated,
    StaleKeyLeft,
    StepStarted,
    StoreKind,
    TraceHeader,
)

SEED_CONFIG = seed_config(0)


def frame_ends(data: bytes) -> list[int]:
    """Offsets where each frame of a trace ends, found by walking the framing (12-byte preamble,
    then u32 length + u32 crc + payload) independently of the reader."""
    offset, ends = 12, []
    while offset < len(data):
        length, _ = struct.unpack_from("<II", data, offset)
        offset += 8 + length
        ends.append(offset)
    assert offset == len(data)
    return ends


def sample_header(**overrides) -> TraceHeader:
    fields = dict(
        kvtrace_version="0.1.0",
        created_ns=1_790_000_000_000_000_000,
        source="test",
        config=SEED_CONFIG,
        vllm_version="0.33.0",
        pid=4242,
        host="node-7",
        process_title="VLLM::EngineCore_DP0",
        cmdline=["vllm", "serve"],
        replay=ReplayInfo(variant="fixed", backend="vllm", mode="reschedule"),
        params={"seed": "7"},
    )
    fields.update(overrides)
    return TraceHeader(**fields)


def one_of_each_kind() -> list:
    """One record of every kind, with values that exercise every column width and sign."""
    return [
        StepStarted(step=3, ts_ns=1_234_567_890_123),
        RequestArrived(req=0, prompt_len=240, hash_ids=[0, 1, 2, 70_000], max_tokens=16,
                       arrival_ns=5, salt_id=2, request_id="cmpl-abc-0"),
        HashesExtended(req=0, hash_ids=[]),
        ComputedBlocksFound(req=0, num_hit_tokens=96, shared_prefix_boundary=112),
        SlotsAllocated(req=0, num_new_tokens=128, num_computed_tokens=0, num_new_computed_tokens=96,
                       num_lookahead_tokens=0, num_external_computed_tokens=0, num_tokens=240,
                       success=True, num_in_flight_tokens=1),
        BlocksCached(req=0, num_tokens_to_cache=240, num_computed_tokens=241, num_tokens=241),
        RequestFinished(req=0, status=FinishStatus.ABORTED),
        RequestPreempted(req=1),
        BlocksReleased(block_ids=[5, 9]),
        BlockAllocated(block_id=17, req=-1),
        BlockStored(block_id=17, hash_id=2**40, group=1, num_tokens=112, kind=StoreKind.CHECKPOINT, req=0),
        BlockRemoved(block_id=17, hash_id=5, group=1, num_tokens=96, reason=RemoveReason.STALE_CHECKPOINT),
        BlockTouched(block_id=300, req=0),
        BlockFreed(block_id=300, ref_cnt=0, hashed=True),
        BoundaryStateOffloaded(req=0, group=1, block_id=17, num_tokens=224),
        CheckpointRecorded(req=0, group=1, position=112, block_idx=2,
                           position_class=CheckpointClass.TRANSIENT),
        CheckpointSuppressed(req=0, group=1, position=112, block_id=17, num_stripped=1),
        StaleKeyLeft(req=0, group=1, block_id=17, hash_id=5, key_num_tokens=96, state_num_tokens=112),
        HashInterned(hash_id=5, hash_bytes=bytes(range(32))),
        GpuSampled(ts_ns=9, gpu_index=0, memory_used_bytes=80 * 2**30, memory_total_bytes=141 * 2**30,
                   utilization_pct=97),
        EventsDropped(count=12, ts_ns=10),
        SnapshotStarted(ts_ns=11, num_blocks=3038, num_requests=1, num_keys=1,
                        counters={"current_step": 7}),
        FreeQueueState(block_ids=[3, 2_000, 9]),
        BlockState(block_id=17, ref_cnt=2, hash_id=-1, group=0, num_tokens=-1),
        KeyCached(hash_id=2**40, group=1, num_tokens=768, block_ids=[17, 300]),
        RequestState(req=4, queue=RequestQueue.WAITING, status="PREEMPTED", prompt_len=900,
                     hash_ids=[0, 1], max_tokens=64, num_tokens=905, num_computed_tokens=0,
                     num_preemptions=1, shared_prefix_boundary=384, arrival_ns=-5,
                     salt_id=1, request_id="cmpl-def-4"),
        RequestBlocksState(req=4, group=1, block_ids=[0, 0, 17],
                           fields={"num_cached_block": [2], "_checkpoints": [768, 2],
                                   "_allocated_block_reqs": []}),
        SnapshotEnded(pause_ns=1_500_000),
    ]
