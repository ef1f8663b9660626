"""``kvtrace capture --zmq``: vLLM's own KV events, over loopback ZMQ, into a kvtrace trace.

The end-to-end test publishes the events a real vLLM 0.33 hybrid KVCacheManager emitted through
vLLM's own ZmqEventPublisher and checks the trace against the manager itself (hash by hash,
depth from the request's own hash list, the cache's contents before a reset). The rest use a
plain PUB socket (exact control of sequence numbers) or the translator directly.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter

import msgspec
import pytest

from kvtrace.capture.zmq_source import (
    KVEventTranslator,
    ZmqCapture,
    ZmqCaptureStats,
    capture_zmq,
)
from kvtrace.errors import KvtraceError
from kvtrace.events import (
    BlockRemoved,
    BlockStored,
    EventsDropped,
    HashInterned,
    RemoveReason,
    StepStarted,
    StoreKind,
)
from kvtrace.traceio import read_records

zmq = pytest.importorskip("zmq")

HASH_UNIT = 4
FULL_ATTENTION_BLOCK, MAMBA_BLOCK = 4, 8


def free_loopback_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


class RunningCapture:
    """A ZmqCapture on a background thread, stopped the way the CLI's signal handler would."""

    def __init__(self, endpoint: str, path, **options) -> None:
        self.capture = ZmqCapture(endpoint, str(path), **options)
        self.result: ZmqCaptureStats | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.result = self.capture.run()

    def stop(self) -> ZmqCaptureStats:
        self.capture.stop()
        self.thread.join(timeout=10)
        assert not self.thread.is_alive() and self.result is not None
        return self.result


def hash_table(records) -> dict[int, bytes]:
    return {r.hash_id: r.hash_bytes for r in records if isinstance(r, HashInterned)}


# --- events from the real vLLM 0.33 cache ---------------------------------------------------------


@pytest.fixture(scope="session")
def vllm_kv_events():
    """Per-step event lists from a real hybrid KVCacheManager with events on, and the truth.

    Full attention (block 4) + Mamba align (block 8, one checkpoint block), hash unit 4, a pool
    of 24 blocks: four 30-40-token requests prefilled in 14-token chunks, sharing and then
    evicting prefixes, then ``reset_prefix_cache``. Returns the steps, each hash's true depth
    (from the requests' own hash lists), each group's block size and the cache's (group, hash)
    keys just before the reset."""
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.block_pool import get_block_hash, get_group_id
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import (
        get_request_block_hasher,
        init_none_hash,
        maybe_convert_block_hash,
    )
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                            MambaSpec)
    from vllm.v1.request import Request

    init_none_hash(sha256)
    config = KVCacheConfig(
        num_blocks=24, kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["attn"], FullAttentionSpec(
                block_size=FULL_ATTENTION_BLOCK, num_kv_heads=1, head_size=1,
                dtype=torch.float32)),
            KVCacheGroupSpec(["kda"], MambaSpec(
                block_size=MAMBA_BLOCK, shapes=((1, 1),), dtypes=(torch.float32,),
                mamba_cache_mode="align", num_prefill_checkpoint_blocks=1,
                prefill_checkpoint_alignment=HASH_UNIT)),
        ],
        prefix_cache_retention_interval=None)
    manager = KVCacheManager(config, max_model_len=1024, scheduler_block_size=MAMBA_BLOCK,
                             hash_block_size=HASH_UNIT, enable_caching=True,
                             enable_kv_cache_events=True)
    hasher = get_request_block_hasher(HASH_UNIT, sha256)
    depth_of: dict[object, int] = {}
    steps: list[list] = []

    def end_step() -> None:
        """As the scheduler does each step: release copy-on-write retentions, take events."""
        manager.take_boundary_state_offloads()
        _, retained_blocks = manager.take_kv_cache_block_copies()
        manager.block_pool.free_blocks(retained_blocks)
        steps.append(manager.take_events())

    def serve(request_id: str, prompt: list[int], chunk: int = 14) -> None:
        request = Request(request_id, prompt, SamplingParams(max_tokens=1), None,
                          block_hasher=hasher)
        for i, block_hash in enumerate(request.block_hashes):
            depth_of[maybe_convert_block_hash(block_hash)] = (i + 1) * HASH_UNIT
        manager.new_step_starts()
        blocks, num_hit, boundary = manager.get_computed_blocks(request)
        request.shared_prefix_boundary = boundary
        num_new = min(chunk, len(prompt) - num_hit)
        assert manager.allocate_slots(request, num_new, num_hit, blocks) is not None
        request.num_computed_tokens += num_hit + num_new
        end_step()
        while request.num_computed_tokens < len(prompt):
            manager.new_step_starts()
            num_new = min(chunk, len(prompt) - request.num_computed_tokens)
            assert manager.allocate_slots(request, num_new) is not None
            request.num_computed_tokens += num_new
            end_step()
        manager.free(request)
        end_step()

    serve("a", list(range(100, 130)))
    serve("b", list(range(100, 120)) + list(range(500, 514)))  # shares a's first 20 tokens
    serve("c", list(range(900, 940)))  # a new prefix: evicts
    serve("d", list(range(100, 130)))  # a again
    manager.new_step_starts()
    cached_keys = Counter()
    for key, blocks in manager.block_pool.cached_block_hash_to_block._cache.items():
        cached_keys[get_group_id(key), maybe_convert_block_hash(get_block_hash(key))] += (
            len(blocks) if isinstance(blocks, dict) else 1)
    assert manager.reset_prefix_cache()
    steps.append(manager.take_events())
    return steps, depth_of, {0: FULL_ATTENTION_BLOCK, 1: MAMBA_BLOCK}, cached_keys


def external_hash_bytes(external_hash) -> bytes:
    """How the trace keys vLLM's external hash (int by default, bytes when configured)."""
    if isinstance(external_hash, int):
        return external_hash.to_bytes(8, "big")
    return external_hash


@pytest.mark.slow
@pytest.mark.parametrize("told_block_sizes", [True, False], ids=["block-sizes", "learnt"])
def test_capture_from_vllm_publisher_matches_the_real_cache(vllm_kv_events, tmp_path,
                                                            told_block_sizes):
    """Every store and removal the real manager emitted, with its depth, group and kind."""
    from vllm.distributed.kv_events import AllBlocksCleared, KVEventBatch, ZmqEventPublisher
    from vllm.distributed.kv_events import BlockRemoved as VllmBlockRemoved
    from vllm.distributed.kv_events import BlockStored as VllmBlockStored

    steps, depth_of, block_sizes, cached_keys = vllm_kv_events
    kinds_seen = Counter(type(e).__name__ for step in steps for e in step)
    assert all(kinds_seen[kind] for kind in ("BlockStored", "BlockRemoved", "AllBlocksCleared"))

    # The engine is configured to connect out (no * in its endpoint), so kvtrace binds.
    endpoint = f"tcp://127.0.0.1:{free_loopback_port()}"
    trace = tmp_path / "zmq.kvtrace"
    running = RunningCapture(endpoint, trace, bind=True, topic="kv",
                             block_sizes=block_sizes if told_block_sizes else None)
    publisher = ZmqEventPublisher(0, endpoint=endpoint, topic="kv")
    try:
        # A new subscription takes a moment to reach the publisher: warm up with empty batches.
        num_warmup = 0
        while running.capture.stats.batches == 0:
            publisher.publish(KVEventBatch(ts=time.time(), events=[]))
            num_warmup += 1
            time.sleep(0.02)
        for step in steps:
            publisher.publish(KVEventBatch(ts=time.time(), events=step))
        last_seq = num_warmup + len(steps) - 1  # the publisher numbers batches from 0
        wait_until(lambda: running.capture.stats.last_seq == last_seq)
    finally:
        publisher.shutdown()
    stats = running.stop()

    reader, records = read_records(trace)
    assert reader.header.source == "zmq" and not reader.truncated
    assert reader.closing.num_dropped == 0 and stats.dropped_batches == 0
    assert not any(isinstance(r, EventsDropped) for r in records)
    hashes = hash_table(records)

    expected_stores, expected_removals = Counter(), Counter()
    for step in steps:
        for event in step:
            if isinstance(event, VllmBlockStored):
                kind = (StoreKind.FULL if event.block_size == block_sizes[event.group_idx]
                        else StoreKind.PARTIAL)
                for h in event.block_hashes:
                    expected_stores[event.group_idx, depth_of[h], kind, external_hash_bytes(h)] += 1
            elif isinstance(event, VllmBlockRemoved):
                for h in event.block_hashes:
                    expected_removals[event.group_idx, depth_of[h], RemoveReason.UNKNOWN,
                                      external_hash_bytes(h)] += 1
            else:
                assert isinstance(event, AllBlocksCleared)
    expected_resets = Counter({(group, depth_of[h], RemoveReason.RESET, external_hash_bytes(h)): n
                               for (group, h), n in cached_keys.items()})

    stores = Counter((r.group, r.num_tokens, r.kind, hashes[r.hash_id])
                     for r in records if isinstance(r, BlockStored))
    removals = Counter((r.group, r.num_tokens, r.reason, hashes[r.hash_id])
                       for r in records if isinstance(r, BlockRemoved))
    assert stores == expected_stores
    assert removals == expected_removals + expected_resets
    assert {kind for _, _, kind, _ in stores} == {StoreKind.FULL, StoreKind.PARTIAL}
    assert all(r.block_id == -1 and r.req == -1 for r in records if isinstance(r, BlockStored))
    # One StepStarted per batch, numbered by the publisher's sequence, in order.
    assert [r.step for r in records if isinstance(r, StepStarted)] == list(
        range(stats.first_seq, last_seq + 1))


# --- sequence gaps, over a plain PUB socket ------------------------------------------------------


def encoded_batch(events: list, ts: float | None = None) -> bytes:
    return msgspec.msgpack.encode([time.time() if ts is None else ts, events, 0])


def stored(hashes: list, parent, num_tokens: int, block_size: int, group: int = 0) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": list(range(num_tokens)), "block_size": block_size, "lora_id": None,
            "medium": "GPU", "group_idx": group}


@pytest.fixture
def loopback_publisher():
    """A PUB socket bound on loopback; kvtrace connects to it (the usual engine set-up)."""
    publisher = zmq.Context.instance().socket(zmq.PUB)
    port = publisher.bind_to_random_port("tcp://127.0.0.1")
    yield publisher, f"tcp://127.0.0.1:{port}"
    publisher.close(linger=0)


def publish_until_seen(publisher, running: RunningCapture) -> int:
    """Send empty batches 0, 1, ... until the subscription is live; the next sequence number.

    Those sent before it was live are lost without a gap: a trace starts at the first batch."""
    seq = 0
    while running.capture.stats.batches == 0:
        publisher.send_multipart([b"", seq.to_bytes(8, "big"), encoded_batch([])])
        seq += 1
        time.sleep(0.02)
    return seq


def test_sequence_gap_becomes_events_dropped(loopback_publisher, tmp_path):
    publisher, endpoint = loopback_publisher
    trace = tmp_path / "gap.kvtrace"
    running = RunningCapture(endpoint, trace)
    first = publish_until_seen(publisher, running)
    sent = [first, first + 1, first + 4, first + 5]  # first + 2 and first + 3 are lost
    for seq in sent:
        publisher.send_multipart([b"", seq.to_bytes(8, "big"),
                                  encoded_batch([stored([seq], None, 4, 4)])])
    wait_until(lambda: running.capture.stats.last_seq == sent[-1])
    stats = running.stop()

    reader, records = read_records(trace)
    assert stats.dropped_batches == 2 and reader.closing.num_dropped == 2
    marks = [(type(r).__name__, getattr(r, "step", getattr(r, "count", None)))
             for r in records if isinstance(r, (StepStarted, EventsDropped))]
    assert marks[-5:] == [("StepStarted", sent[0]), ("StepStarted", sent[1]),
                          ("EventsDropped", 2), ("StepStarted", sent[2]), ("StepStarted", sent[3])]
    assert [s for kind, s in marks[:-5]] == list(range(stats.first_seq, first))
    assert sum(isinstance(r, BlockStored) for r in records) == 4


def test_duration_ends_the_capture_with_a_complete_trace(loopback_publisher, tmp_path):
    publisher, endpoint = loopback_publisher
    trace = tmp_path / "timed.kvtrace"
    progress: list[int] = []
    started = time.monotonic()
    stats = capture_zmq(endpoint, str(trace), duration_s=0.5,
                        on_progress=lambda s: progress.append(s.batches))
    elapsed = time.monotonic() - started
    assert 0.5 <= elapsed < 2.0 and stats.batches == 0
    reader, records = read_records(trace)
    assert records == [] and not reader.truncated and reader.closing is not None
    assert reader.header.params["socket"] == "connect"
    assert not (tmp_path / "timed.kvtrace.partial").exists()


def test_stop_event_from_another_thread(loopback_publisher, tmp_path):
    _, endpoint = loopback_publisher
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    stats = capture_zmq(endpoint, str(tmp_path / "stopped.kvtrace"), stop_event=stop)
    assert 0.3 <= stats.elapsed_s < 2.0
    assert read_records(tmp_path / "stopped.kvtrace")[0].closing is not None


@pytest.mark.parametrize("endpoint, message", [
    ("http://127.0.0.1:5557", "not a ZMQ endpoint"),
    ("tcp://127.0.0.1", "needs HOST:PORT"),
    ("tcp://127.0.0.1:70000", "needs HOST:PORT"),
    ("tcp://*:5557", "bind address"),
])
def test_bad_endpoint_is_a_clear_error_and_writes_nothing(endpoint, message, tmp_path):
    with pytest.raises(KvtraceError, match=message) as raised:
        capture_zmq(endpoint, str(tmp_path / "never.kvtrace"), duration_s=1)
    assert raised.value.hint and list(tmp_path.iterdir()) == []


def test_bind_on_a_port_in_use_is_a_clear_error(loopback_publisher, tmp_path):
    _, endpoint = loopback_publisher  # the publisher holds this port
    with pytest.raises(KvtraceError, match="cannot bind"):
        capture_zmq(endpoint, str(tmp_path / "never.kvtrace"), duration_s=1, bind=True)
    assert list(tmp_path.iterdir()) == []


# --- the translator: decoding variants and depths, hand-computed ---------------------------------


def translate(batches: list[tuple[int, bytes]], **options) -> tuple[list, ZmqCaptureStats]:
    stats = ZmqCaptureStats()
    translator = KVEventTranslator(0, stats, **options)
    records = [r for seq, payload in batches for r in translator.translate(seq, payload)]
    return records, stats


def effects(records) -> list[tuple]:
    hashes = hash_table(records)
    out = []
    for r in records:
        if isinstance(r, BlockStored):
            out.append(("stored", hashes.get(r.hash_id), r.group, r.num_tokens, r.kind))
        elif isinstance(r, BlockRemoved):
            out.append(("removed", hashes.get(r.hash_id), r.group, r.num_tokens, r.reason))
    return out


def test_depths_follow_parent_chains_and_skipped_null_blocks():
    """Hash unit 4, full attention 4, Mamba 8: a 12-token chunk, then a sparse Mamba range."""
    b = [bytes([i]) * 32 for i in range(8)]  # b[i] is the hash at 4·(i+1) tokens
    records, stats = translate([
        (0, encoded_batch([stored(b[0:3], None, 12, 4)])),  # depths 4, 8, 12
        # Mamba (group 1) caches 8..24 but keeps only its last block: one hash for 16 tokens.
        (1, encoded_batch([stored(b[3:6], b[2], 12, 4), stored([b[5]], b[1], 16, 8, group=1)])),
        # A checkpoint-like partial entry at 28 tokens in the Mamba group.
        (2, encoded_batch([stored([b[6]], b[5], 4, 4, group=1)])),
        (3, encoded_batch([{"type": "BlockRemoved", "block_hashes": [b[5]], "medium": "GPU",
                            "group_idx": 1}])),
    ])
    assert effects(records) == [
        ("stored", b[0], 0, 4, StoreKind.FULL), ("stored", b[1], 0, 8, StoreKind.FULL),
        ("stored", b[2], 0, 12, StoreKind.FULL),
        ("stored", b[3], 0, 16, StoreKind.FULL), ("stored", b[4], 0, 20, StoreKind.FULL),
        ("stored", b[5], 0, 24, StoreKind.FULL),
        ("stored", b[5], 1, 24, StoreKind.FULL),
        ("stored", b[6], 1, 28, StoreKind.PARTIAL),
        ("removed", b[5], 1, 24, RemoveReason.UNKNOWN),
    ]
    assert stats.stores == 8 and stats.removals == 1 and stats.unknown_depths == 0


def test_sparse_store_without_known_depths_takes_the_range_tail():
    records, _ = translate([(0, encoded_batch([stored([7], None, 24, 8, group=1)]))])
    assert effects(records) == [("stored", (7).to_bytes(8, "big"), 1, 24, StoreKind.FULL)]


def test_old_array_encoding_int_hashes_and_missing_fields():
    batch = msgspec.msgpack.encode([12.5, [
        ["BlockStored", [11, 12], None, list(range(8)), 4, None],  # no medium, no group
        ["BlockStored", [13], 12, [0, 0, 0, 0], 4],  # even lora_id missing
        ["BlockRemoved", [11], "GPU"],
    ]])  # and no data_parallel_rank
    records, stats = translate([(0, batch)])
    hash_of = lambda n: n.to_bytes(8, "big")  # noqa: E731
    assert effects(records) == [
        ("stored", hash_of(11), 0, 4, StoreKind.FULL),
        ("stored", hash_of(12), 0, 8, StoreKind.FULL),
        ("stored", hash_of(13), 0, 12, StoreKind.FULL),
        ("removed", hash_of(11), 0, 4, RemoveReason.UNKNOWN),
    ]
    assert records[0] == StepStarted(step=0, ts_ns=12_500_000_000)


def test_unknown_parent_gives_unknown_depth_not_a_guess():
    records, stats = translate([
        (0, encoded_batch([stored([5], 99, 4, 4)])),
        (1, encoded_batch([{"type": "BlockStored", "block_hashes": [6], "block_size": 4}])),
    ])
    assert [e[3] for e in effects(records)] == [-1, -1] and stats.unknown_depths == 2


def test_all_blocks_cleared_removes_every_stored_hash_once_per_store():
    records, stats = translate([
        (0, encoded_batch([stored([1, 2], None, 8, 4), stored([1], None, 4, 4),
                           stored([2], 1, 4, 4, group=1)])),
        (1, encoded_batch([{"type": "BlockRemoved", "block_hashes": [2], "group_idx": 0},
                           {"type": "AllBlocksCleared"}])),
        (2, encoded_batch([{"type": "AllBlocksCleared"}])),  # nothing left to clear
    ])
    resets = Counter((e[1], e[2], e[3]) for e in effects(records) if e[4] == RemoveReason.RESET)
    one, two = (1).to_bytes(8, "big"), (2).to_bytes(8, "big")
    assert resets == Counter({(one, 0, 4): 2, (two, 1, 8): 1})
    assert stats.clears == 2


def test_other_media_unknown_kinds_and_empty_stores_are_skipped():
    records, stats = translate([(0, encoded_batch([
        {**stored([1], None, 4, 4), "medium": "CPU"},
        {"type": "SomethingNew", "x": 1},
        stored([], None, 4, 4),
    ]))])
    assert effects(records) == [] and stats.skipped_events == 3


def test_duplicates_restarts_and_garbage():
    records, stats = translate([
        (0, encoded_batch([])), (1, encoded_batch([])),
        (1, encoded_batch([stored([1], None, 4, 4)])),  # a replayed duplicate: ignored
        (2, b"\xc1 not msgpack"),  # undecodable: counted as a dropped batch
        (0, encoded_batch([])),  # the publisher restarted
    ])
    assert [r.step for r in records if isinstance(r, StepStarted)] == [0, 1, 0]
    assert [r.count for r in records if isinstance(r, EventsDropped)] == [1]
    assert (stats.duplicate_batches, stats.malformed_batches, stats.publisher_restarts,
            stats.dropped_batches) == (1, 1, 1, 1)


def test_no_hash_bytes_keeps_ids_only():
    records, _ = translate([(0, encoded_batch([stored([b"x" * 32], None, 4, 4)]))],
                           hash_bytes=False)
    assert not any(isinstance(r, HashInterned) for r in records)
    assert [r.hash_id for r in records if isinstance(r, BlockStored)] == [0]
