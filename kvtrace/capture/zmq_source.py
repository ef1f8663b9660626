"""Capture from vLLM's own KV-cache events over ZMQ, for deployments where nothing may be injected.

vLLM publishes, per scheduler step that changed the prefix cache, a 3-frame multipart message
``[topic, 8-byte big-endian sequence number, msgpack KVEventBatch]`` (``--kv-events-config``,
``vllm/distributed/kv_events.py``). We subscribe, decode each batch generically (array- or
map-encoded events, bytes or 64-bit-int hashes, optional fields missing; older and newer vLLMs
differ in all three) and write a kvtrace trace of *effect* records.

The events say much less than the probes: no request ids, no block ids, no removal reasons,
no allocations, touches or frees, hence no LRU order. The trace header's ``params`` says so,
so nobody mistakes such a trace for a probe capture. What the events do give, and we keep:
which hash was stored or removed, in which KV-cache group, at which prefix depth, per step.
"""

from __future__ import annotations

import re
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from kvtrace import __version__
from kvtrace.errors import KvtraceError
from kvtrace.events import (
    BlockRemoved,
    BlockStored,
    EventsDropped,
    HashInterned,
    HashInterner,
    Record,
    RemoveReason,
    StepStarted,
    StoreKind,
    TraceHeader,
)
from kvtrace.traceio import TraceWriter

# Field order of vLLM's event Structs, for publishers that encode events as arrays
# (``["BlockStored", block_hashes, parent_block_hash, ...]``); newer ones send maps with "type".
_ARRAY_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                    "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}
# Offload tiers (CPU, storage) publish on the same socket; the trace models the GPU cache.
_GPU_MEDIA = (None, "GPU")
_UNKNOWN_DEPTH = -1
_INT_HASH_BYTES = 8  # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES (the default): the hash's low 64 bits
_POLL_MS = 100
_DRAIN_LIMIT = 1000  # messages per poll, so a flood cannot starve the stop and duration checks
_MISSING = object()

TRACE_PARAMS = {
    "details": "vLLM KV events: no request ids (req -1), no block ids (block_id -1), no removal "
               "reasons (UNKNOWN; RESET for AllBlocksCleared), no allocations/touches/frees, "
               "no LRU order",
    "step": "StepStarted.step is the publisher's batch sequence number; ts_ns its batch ts",
    "events_dropped": "EventsDropped.count counts missing batches (sequence gaps), not records",
    "store_kind": "FULL when the event's block_size is the group's block size, else PARTIAL; "
                  "a Mamba checkpoint cannot be told from a partial block here",
    "num_tokens": "prefix depth from parent chains and block_size; -1 where the chain is unknown",
}


@dataclass
class ZmqCaptureStats:
    """What a ZMQ capture saw; ``dropped_batches`` counts sequence gaps and undecodable batches."""

    batches: int = 0
    records: int = 0
    stores: int = 0
    removals: int = 0
    clears: int = 0
    dropped_batches: int = 0
    malformed_batches: int = 0
    duplicate_batches: int = 0
    publisher_restarts: int = 0
    skipped_events: int = 0  # unknown kinds, other media, empty stores
    unknown_depths: int = 0
    first_seq: int | None = None
    last_seq: int | None = None
    elapsed_s: float = 0.0


class KVEventTranslator:
    """Turns decoded KV-event batches into kvtrace records, keeping what the stream implies.

    A hash's bytes fingerprint a prefix of a fixed length (vLLM chains every hash over its
    whole prefix, in every group), so a depth learnt once holds everywhere; new depths follow
    from the parent's depth and ``block_size``. Stores are counted per (group, hash) because
    vLLM can key the same hash on two blocks and an ``AllBlocksCleared`` removes them all.
    """

    def __init__(self, created_ns: int, stats: ZmqCaptureStats, *, hash_bytes: bool = True,
                 block_sizes: Mapping[int, int] | None = None) -> None:
        self.created_ns = created_ns
        self.stats = stats
        self.hash_bytes = hash_bytes
        self._fixed_block_sizes = dict(block_sizes or {})
        self._learnt_block_sizes: dict[int, int] = {}
        self._interner = HashInterner()
        self._depths: dict[int, int] = {}
        self._stored: Counter[tuple[int, int]] = Counter()

    def translate(self, seq: int, payload: bytes) -> list[Record]:
        """Records for one message; a gap before it becomes an ``EventsDropped`` marker."""
        stats = self.stats
        records: list[Record] = []
        if stats.last_seq is not None and seq <= stats.last_seq:
            if seq != 0:  # a re-sent batch (at-least-once delivery)
                stats.duplicate_batches += 1
                return records
            stats.publisher_restarts += 1
        elif stats.last_seq is not None and seq > stats.last_seq + 1:
            self._mark_dropped(seq - stats.last_seq - 1, records)
        if stats.first_seq is None:
            stats.first_seq = seq
        stats.last_seq = seq
        decoded = decode_batch(payload)
        if decoded is None:
            stats.malformed_batches += 1
            self._mark_dropped(1, records)
            return records
        ts, events = decoded
        stats.batches += 1
        ts_ns = time.time_ns() if ts is None else round(ts * 1e9)
        records.append(StepStarted(step=seq, ts_ns=ts_ns - self.created_ns))
        for kind, fields in events:
            if kind == "AllBlocksCleared":
                self._clear_all(records)
            elif (kind not in ("BlockStored", "BlockRemoved")
                  or fields.get("medium") not in _GPU_MEDIA):
                stats.skipped_events += 1
            elif kind == "BlockStored":
                self._store(fields, records)
            else:
                self._remove(fields, records)
        return records

    def _mark_dropped(self, num_batches: int, records: list[Record]) -> None:
        self.stats.dropped_batches += num_batches
        records.append(EventsDropped(count=num_batches, ts_ns=time.time_ns() - self.created_ns))

    def _hash_id(self, raw_hash: Any, records: list[Record]) -> int:
        hash_bytes = _hash_bytes(raw_hash)
        hash_id, is_new = self._interner.intern(hash_bytes)
        if is_new and self.hash_bytes:
            records.append(HashInterned(hash_id=hash_id, hash_bytes=hash_bytes))
        return hash_id

    def _store(self, fields: dict, records: list[Record]) -> None:
        raw_hashes = _hash_list(fields.get("block_hashes"))
        block_size = _int_or_none(fields.get("block_size"))
        if not raw_hashes or block_size is None or block_size <= 0:
            self.stats.skipped_events += 1  # vLLM emits empty stores for null-only ranges
            return
        group = _int_or_none(fields.get("group_idx")) or 0
        group_block_size = self._group_block_size(group, block_size)
        kind = StoreKind.FULL if block_size == group_block_size else StoreKind.PARTIAL
        hash_ids = [self._hash_id(h, records) for h in raw_hashes]
        depths = self._depths_of(hash_ids, fields, block_size, records)
        for hash_id, depth in zip(hash_ids, depths):
            if depth == _UNKNOWN_DEPTH:
                self.stats.unknown_depths += 1
            else:
                self._depths[hash_id] = depth
            self._stored[group, hash_id] += 1
            records.append(BlockStored(block_id=-1, hash_id=hash_id, group=group,
                                       num_tokens=depth, kind=kind, req=-1))
        self.stats.stores += len(hash_ids)

    def _group_block_size(self, group: int, block_size: int) -> int:
        """The configured size, else the largest seen: partial entries are one hash unit."""
        if group in self._fixed_block_sizes:
            return self._fixed_block_sizes[group]
        learnt = max(self._learnt_block_sizes.get(group, 0), block_size)
        self._learnt_block_sizes[group] = learnt
        return learnt

    def _depths_of(self, hash_ids: list[int], fields: dict, block_size: int,
                   records: list[Record]) -> list[int]:
        """Prefix depth of each stored hash.

        A store starts where its parent hash ends (0 without a parent) and its ``token_ids``
        span the whole range; when null or masked blocks (Mamba align mode, sliding windows)
        were skipped there are fewer hashes than blocks, and the kept ones are the range's last
        blocks. Depths already learnt win: a hash always covers the same prefix."""
        parent = fields.get("parent_block_hash", _MISSING)
        if parent is _MISSING:
            start = None
        elif parent is None:
            start = 0
        else:
            start = self._depths.get(self._hash_id(parent, records))
        token_ids = fields.get("token_ids")
        span = len(token_ids) if isinstance(token_ids, (list, tuple)) else None
        count = len(hash_ids)
        if start is None:
            computed = [_UNKNOWN_DEPTH] * count
        elif span is None or span <= count * block_size:
            computed = [start + (i + 1) * block_size for i in range(count)]
        else:
            end = start + span
            computed = [end - (count - 1 - i) * block_size for i in range(count)]
        return [self._depths.get(h, d) for h, d in zip(hash_ids, computed)]

    def _remove(self, fields: dict, records: list[Record]) -> None:
        group = _int_or_none(fields.get("group_idx")) or 0
        for raw_hash in _hash_list(fields.get("block_hashes")):
            hash_id = self._hash_id(raw_hash, records)
            key = (group, hash_id)
            if self._stored[key] > 1:
                self._stored[key] -= 1
            else:
                self._stored.pop(key, None)
            records.append(BlockRemoved(block_id=-1, hash_id=hash_id, group=group,
                                        num_tokens=self._depths.get(hash_id, _UNKNOWN_DEPTH),
                                        reason=RemoveReason.UNKNOWN))
            self.stats.removals += 1

    def _clear_all(self, records: list[Record]) -> None:
        """``reset_prefix_cache``: every hash stored so far, once per store, goes."""
        for (group, hash_id), count in self._stored.items():
            removal = BlockRemoved(block_id=-1, hash_id=hash_id, group=group,
                                   num_tokens=self._depths.get(hash_id, _UNKNOWN_DEPTH),
                                   reason=RemoveReason.RESET)
            records.extend([removal] * count)
            self.stats.removals += count
        self._stored.clear()
        self.stats.clears += 1


def decode_batch(payload: bytes) -> tuple[float | None, list[tuple[str, dict]]] | None:
    """``(ts, [(event kind, fields)])`` of a msgpack ``KVEventBatch``; None if it is not one.

    Generic on purpose: the batch is an array ``[ts, events, dp_rank?]`` (or a map), each
    event a map with ``type`` or an array led by its kind; unknown kinds pass through with
    their name so the caller can count them."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError:
        return None
    if isinstance(raw, dict):
        ts, raw_events = raw.get("ts"), raw.get("events")
    elif isinstance(raw, list) and len(raw) >= 2:
        ts, raw_events = raw[0], raw[1]
    else:
        return None
    if not isinstance(raw_events, list):
        return None
    events: list[tuple[str, dict]] = []
    for raw_event in raw_events:
        if isinstance(raw_event, dict):
            events.append((str(raw_event.get("type", "")), raw_event))
        elif isinstance(raw_event, list) and raw_event and isinstance(raw_event[0], str):
            names = _ARRAY_FIELDS.get(raw_event[0], ())
            events.append((raw_event[0], dict(zip(names, raw_event[1:]))))
        else:
            events.append(("", {}))
    is_number = isinstance(ts, (int, float)) and not isinstance(ts, bool)
    return (float(ts) if is_number else None), events


def _hash_bytes(raw_hash: Any) -> bytes:
    if isinstance(raw_hash, int):
        return (raw_hash & ((1 << 64) - 1)).to_bytes(_INT_HASH_BYTES, "big")
    if isinstance(raw_hash, (bytes, bytearray, memoryview)):
        return bytes(raw_hash)
    return repr(raw_hash).encode()  # an unexpected encoding still keys consistently


def _hash_list(value: Any) -> list:
    return list(value) if isinstance(value, (list, tuple)) else []


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# --- the subscriber ------------------------------------------------------------------------------

_ENDPOINT = re.compile(r"^(?P<scheme>tcp|ipc)://(?P<address>.+)$")
_TCP_ADDRESS = re.compile(r"^(?P<host>\[[^\]]+\]|[^:\[\]]+):(?P<port>\d+)$")


def check_endpoint(endpoint: str, *, bind: bool = False) -> None:
    """Refuse an endpoint we cannot subscribe on, before anything is created."""
    hint = ("Pass the publisher's address as tcp://HOST:PORT (the engine's --kv-events-config "
            "endpoint, with its host instead of *) or ipc://PATH; if the engine's endpoint has "
            "no *, the engine connects out and kvtrace must bind that address.")
    match = _ENDPOINT.match(endpoint)
    if match is None:
        raise KvtraceError(f"not a ZMQ endpoint kvtrace can subscribe to: {endpoint!r}", hint)
    if match["scheme"] == "ipc":
        return
    address = _TCP_ADDRESS.match(match["address"])
    if address is None or not 0 < int(address["port"]) < 65536:
        raise KvtraceError(f"ZMQ endpoint {endpoint!r} needs HOST:PORT with a port 1-65535", hint)
    host = address["host"].strip("[]")
    if host == "*":
        if bind:
            return
        raise KvtraceError(f"{endpoint!r} is a bind address; a subscriber connects to a host",
                           hint)
    try:
        socket.getaddrinfo(host, None)
    except socket.gaierror as error:
        raise KvtraceError(f"cannot resolve the host of {endpoint!r}: {error.strerror}",
                           hint) from None


class ZmqCapture:
    """Subscribes to a vLLM KV-events publisher and writes a trace until stopped.

    By default we connect to the engine's PUB socket (its endpoint has ``*``: it binds). With
    ``bind`` we bind ``endpoint`` instead, for engines configured to connect out to a collector.
    ``stop()`` (or setting ``stop_event``) from any thread ends ``run()`` within ~0.1 s with
    a complete, closed trace; so do ``duration_s`` and Ctrl-C. ``stats`` is live.
    """

    def __init__(self, endpoint: str, path: str, *, duration_s: float | None = None,
                 topic: str = "", stop_event: threading.Event | None = None,
                 on_progress: Callable[[ZmqCaptureStats], None] | None = None,
                 progress_interval_s: float = 1.0, hash_bytes: bool = True,
                 block_sizes: Mapping[int, int] | None = None, bind: bool = False) -> None:
        check_endpoint(endpoint, bind=bind)
        if duration_s is not None and duration_s <= 0:
            raise KvtraceError(f"capture duration must be positive, not {duration_s}",
                               "Pass --duration like 30s or 10m, or omit it and stop with Ctrl-C.")
        self.endpoint, self.path, self.topic = endpoint, path, topic
        self.duration_s = duration_s
        self.stop_event = stop_event or threading.Event()
        self.on_progress = on_progress
        self.progress_interval_s = progress_interval_s
        self.hash_bytes = hash_bytes
        self.block_sizes = block_sizes
        self.bind = bind
        self.stats = ZmqCaptureStats()

    def stop(self) -> None:
        self.stop_event.set()

    def run(self) -> ZmqCaptureStats:
        try:
            import zmq
        except ImportError:
            raise KvtraceError("pyzmq is not installed", "pip install pyzmq") from None
        subscriber = zmq.Context.instance().socket(zmq.SUB)
        try:
            subscriber.setsockopt(zmq.RCVHWM, 1_000_000)  # batches queue here, not get dropped
            subscriber.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
            try:
                (subscriber.bind if self.bind else subscriber.connect)(self.endpoint)
            except zmq.ZMQError as error:
                verb = "bind" if self.bind else "subscribe to"
                raise KvtraceError(f"cannot {verb} {self.endpoint}: {error.strerror}",
                                   "Check the endpoint against the engine's --kv-events-config."
                                   ) from None
            self._record(subscriber, zmq)
        finally:
            subscriber.close(linger=0)
        return self.stats

    def _record(self, subscriber: Any, zmq: Any) -> None:
        created_ns = time.time_ns()
        params = {"endpoint": self.endpoint, "topic": self.topic,
                  "socket": "bind" if self.bind else "connect", **TRACE_PARAMS}
        if self.block_sizes:
            sizes = sorted(self.block_sizes.items())
            params["block_sizes"] = ",".join(f"{group}:{size}" for group, size in sizes)
        header = TraceHeader(kvtrace_version=__version__, created_ns=created_ns, source="zmq",
                             includes_hash_bytes=self.hash_bytes, params=params)
        try:
            writer = TraceWriter(self.path, header, atomic=True)
        except OSError as error:
            raise KvtraceError(f"cannot write {self.path}: {error.strerror}",
                               "Check that the output directory exists and is writable.") from None
        translator = KVEventTranslator(created_ns, self.stats, hash_bytes=self.hash_bytes,
                                       block_sizes=self.block_sizes)
        started = time.monotonic()
        deadline = None if self.duration_s is None else started + self.duration_s
        next_progress = started + self.progress_interval_s
        try:
            while not self.stop_event.is_set():
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    break
                wait_ms = _POLL_MS if deadline is None else min(_POLL_MS, (deadline - now) * 1000)
                if subscriber.poll(max(1, int(wait_ms)), zmq.POLLIN):
                    self._drain(subscriber, zmq, translator, writer)
                self.stats.elapsed_s = time.monotonic() - started
                if self.on_progress is not None and time.monotonic() >= next_progress:
                    next_progress += self.progress_interval_s
                    self.on_progress(self.stats)
        except KeyboardInterrupt:
            pass  # Ctrl-C ends an open-ended capture like --duration does
        except BaseException:
            writer.abandon()
            raise
        self.stats.elapsed_s = time.monotonic() - started
        writer.close(num_dropped=self.stats.dropped_batches)

    def _drain(self, subscriber: Any, zmq: Any, translator: KVEventTranslator,
               writer: TraceWriter) -> None:
        """Translate the messages already queued (up to a limit), without blocking."""
        for _ in range(_DRAIN_LIMIT):
            try:
                frames = subscriber.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[1]) != 8:
                self.stats.malformed_batches += 1  # its sequence gap shows at the next batch
                continue
            records = translator.translate(int.from_bytes(frames[1], "big"), frames[2])
            writer.write_many(records)
            self.stats.records += len(records)


def capture_zmq(endpoint: str, path: str, *, duration_s: float | None = None, topic: str = "",
                stop_event: threading.Event | None = None,
                on_progress: Callable[[ZmqCaptureStats], None] | None = None,
                hash_bytes: bool = True, block_sizes: Mapping[int, int] | None = None,
                bind: bool = False) -> ZmqCaptureStats:
    """Record vLLM's KV events from ``endpoint`` into the trace ``path`` until ``duration_s``
    passes, ``stop_event`` is set or Ctrl-C; the trace is written atomically and closed."""
    return ZmqCapture(endpoint, path, duration_s=duration_s, topic=topic, stop_event=stop_event,
                      on_progress=on_progress, hash_bytes=hash_bytes,
                      block_sizes=block_sizes, bind=bind).run()
