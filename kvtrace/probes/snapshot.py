"""The start snapshot: a live vLLM cache's state as ``state`` records, and the same state rebuilt.

A capture arms on an engine that is already serving, so its first records must say what the
cache held at that moment (``events.SnapshotStarted`` and what follows it). ``take`` reads it off
vLLM's own objects on the scheduler thread, at the start of a step, through the capture's probe
set: the hashes are interned as the records that follow will name them, and the probe set learns
the requests in flight, so that none of them is reported as arriving. ``restore`` writes the same
state into a freshly built vLLM ``KVCacheManager`` (the ``vllm`` replay backend), so that
lockstep replay re-issues the captured calls against the cache the engine had.

Both directions share one table of the per-request state a KV-cache group's manager keeps beside
its blocks (``REQUEST_FIELDS``, by vLLM 0.33's attribute names), so what is taken is exactly what
is rebuilt. Imports: stdlib and kvtrace.events; vLLM only inside ``restore``.
"""

from __future__ import annotations

import gc
import time
from array import array
from dataclasses import dataclass
from itertools import islice
from operator import attrgetter
from typing import Any, Callable

from kvtrace import native
from kvtrace.events import (
    BlockState,
    FreeQueueState,
    HashInterned,
    KeyCached,
    Record,
    RequestBlocksState,
    RequestQueue,
    RequestState,
    SnapshotEnded,
    SnapshotStarted,
)

# How a per-request value is written as ints: an int; membership of a set (no values); a pair
# of ints; a (block index, block) pair; a (block, int) pair. Blocks are written by id.
_INT, _MEMBER, _PAIR, _INDEX_BLOCK, _BLOCK_INT = "int", "member", "pair", "index_block", "block_int"
_BLOCK_ID = attrgetter("block_id")

# A group manager's per-request state besides ``req_to_blocks`` (vLLM 0.33,
# ``single_type_kv_cache_manager.py``): attribute name -> encoding. A manager has the ones its
# kind keeps (a Mamba "align" manager all of them); the step-local ones (``_checkpoints`` of the
# allocation in progress aside) are empty at the start of a step and not taken.
REQUEST_FIELDS: dict[str, str] = {
    "num_cached_block": _INT,
    "_partial_hit_reqs": _INDEX_BLOCK,
    "last_state_block_idx": _INT,
    "_num_retired_blocks": _INT,
    "_allocated_block_reqs": _MEMBER,
    "_checkpoints": _PAIR,
    "_producer_partial_tail_reqs": _BLOCK_INT,
}

# A vLLM ``Request``'s async-scheduling state (``RequestState``'s last fields, in order): what
# the step in flight at the snapshot will still do to it.
IN_FLIGHT_FIELDS = ("num_output_placeholders", "num_in_flight_tokens", "num_stale_output_tokens")


def field_size(name: str) -> int | None:
    """How many ints a per-request value of ``name`` is written as (None: not one we take)."""
    encoding = REQUEST_FIELDS.get(name)
    if encoding is None:
        return None
    return {_INT: 1, _MEMBER: 0}.get(encoding, 2)


def _encode_field(encoding: str, value: Any) -> list[int]:
    if encoding == _INT:
        return [int(value)]
    if encoding == _MEMBER:
        return []
    if encoding == _PAIR:
        return [int(value[0]), int(value[1])]
    if encoding == _INDEX_BLOCK:
        return [int(value[0]), value[1].block_id]
    return [value[0].block_id, int(value[1])]  # _BLOCK_INT


def _group_fields(containers: dict[str, Any], requests: dict[str, int]
                  ) -> dict[str, dict[str, list[int]]]:
    """The per-request state in a manager's ``containers`` (``REQUEST_FIELDS`` by name) for the
    ``requests`` (by request id), as ints: request id -> {attribute: values}. Each container is
    read once, not once a request."""
    fields: dict[str, dict[str, list[int]]] = {}
    for name, container in containers.items():
        encoding = REQUEST_FIELDS[name]
        for request_id in container:
            if request_id in requests:
                fields.setdefault(request_id, {})[name] = _encode_field(
                    encoding, None if encoding == _MEMBER else container[request_id])
    return fields


def _status_queue(status_name: str) -> RequestQueue:
    return RequestQueue.RUNNING if status_name == "RUNNING" else RequestQueue.WAITING


def take(manager: Any, scheduler: Any, probes: Any, requests: list | None = None) -> Taken:
    """The state of ``manager`` (and of the requests ``scheduler`` holds), read through the
    capture's probe set ``probes``, which learns every hash and request on the way. Call it on
    the scheduler thread, between steps: it reads vLLM's objects without locks, and holds the
    engine meanwhile, so it only reads and interns; ``Taken.records()`` makes the records
    later, on another thread. The cyclic garbage collector waits meanwhile: a pass over the
    engine's heap, set off by the snapshot's new objects, would stretch the pause many times
    over. ``requests``: the requests in flight (``_requests_in_flight``), when the caller
    has them already."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        started = time.perf_counter_ns()
        return _take(manager, scheduler, probes, started, requests if requests is not None
                     else _requests_in_flight(manager, scheduler))
    finally:
        if collecting:
            gc.enable()


def take_keyframe(manager: Any, scheduler: Any, probes: Any) -> Taken:
    """A snapshot taken while ``probes`` record (a ring's keyframe, at the start of a step):
    the probes first report each request in flight as far as the step that ended leaves it,
    and hand that step's records over, so that the keyframe comes after all of them."""
    unit = manager.block_pool.hash_block_size
    requests = _requests_in_flight(manager, scheduler)
    for request, _ in requests:
        probes.report_request(request, unit)
    probes._flush()
    return take(manager, scheduler, probes, requests)


@dataclass(frozen=True)
class Taken:
    """A start snapshot as read off the engine: the records that need the live objects (the
    requests'), the pool as packed int64 rows (``_read_pool``), and the hashes it interned
    first; ``records()`` is the snapshot as records, in the order a trace holds them."""

    started: SnapshotStarted
    new_hashes: list[bytes]  # interned first by the snapshot, from id ``first_hash_id`` on
    first_hash_id: int
    free_queue: list[int]
    pool: tuple[bytes, bytes, bytes]  # block rows, key rows, holders
    requests: list[RequestState]
    # Per KV-cache group: its id, each request's blocks (copied: the blocks' ids never change),
    # and copies of the manager's per-request containers.
    groups: list[tuple[int, dict[str, list], dict[str, Any]]]
    ended: SnapshotEnded

    def __len__(self) -> int:
        """How many records ``records()`` makes, counted without making them."""
        request_ids = [state.request_id for state in self.requests]
        num_request_blocks = sum(
            request_id in tables or any(request_id in c for c in containers.values())
            for _, tables, containers in self.groups for request_id in request_ids)
        return (3 + len(self.new_hashes) + len(self.pool[0]) // 40 + len(self.pool[1]) // 32
                + len(self.requests) + num_request_blocks)

    def request_blocks(self) -> list[RequestBlocksState]:
        reqs = {state.request_id: state.req for state in self.requests}
        records = []
        for group, tables, containers in self.groups:
            fields = _group_fields(containers, reqs)
            records.extend([
                RequestBlocksState(req, group, list(map(_BLOCK_ID, tables.get(request_id, ()))),
                                   fields.get(request_id, {}))
                for request_id, req in reqs.items() if request_id in tables or request_id in fields])
        return records

    def records(self) -> list[Record]:
        block_rows, key_rows, holders = (array("q", rows) for rows in self.pool)
        holder_ids = iter(holders)
        return [
            self.started,
            *(HashInterned(hash_id, hash_bytes)
              for hash_id, hash_bytes in enumerate(self.new_hashes, self.first_hash_id)),
            FreeQueueState(self.free_queue),
            *(BlockState(*block_rows[i:i + 5]) for i in range(0, len(block_rows), 5)),
            *(KeyCached(key_rows[i], key_rows[i + 1], key_rows[i + 2],
                        list(islice(holder_ids, key_rows[i + 3])))
              for i in range(0, len(key_rows), 4)),
            *self.requests, *self.request_blocks(), self.ended]


def _take(manager: Any, scheduler: Any, probes: Any, started: int, requests: list) -> Taken:
    pool = manager.block_pool
    unit = pool.hash_block_size
    ids = probes._interned_ids
    emit, probes.emit_hash_bytes = probes.emit_hash_bytes, False  # Taken makes HashInterned
    first_hash_id = len(ids) if ids is not None else 0
    try:
        free_queue = [block.block_id for block in pool.free_block_queue.get_all_free_blocks()]
        # Requests first: their hash units fix the prefix lengths the keys cover.
        request_records = []
        for request, queue in requests:
            req, hash_ids = probes.adopt_request(request, unit)
            request_records.append(RequestState(
                req, queue, request.status.name, request.num_prompt_tokens, hash_ids,
                request.max_tokens, request.num_tokens,
                request.num_computed_tokens, request.num_preemptions,
                request.shared_prefix_boundary,
                max(0, int(request.arrival_time * 1e9) - probes.created_ns),
                probes._salt_id(request), request.request_id,
                *(getattr(request, name, 0) for name in IN_FLIGHT_FIELDS)))
        packed = _read_pool(probes, pool)
    finally:
        probes.emit_hash_bytes = emit
    request_ids = [request.request_id for request, _ in requests]
    groups = []
    for group_manager in manager.coordinator.single_type_managers:
        tables = group_manager.req_to_blocks
        containers = {name: getattr(group_manager, name, None) for name in REQUEST_FIELDS}
        groups.append((group_manager.kv_cache_group_id,
                       {request_id: list(tables[request_id]) for request_id in request_ids
                        if tables.get(request_id)},
                       {name: container.copy() for name, container in containers.items()
                        if container}))
    new_hashes = (list(islice(ids, first_hash_id, None)) if emit and ids is not None else [])
    head = SnapshotStarted(time.time_ns() - probes.created_ns, len(pool.blocks), len(requests),
                           len(packed[1]) // 32, _counters(manager, scheduler))
    return Taken(head, new_hashes, first_hash_id, free_queue, packed, request_records, groups,
                 SnapshotEnded(time.perf_counter_ns() - started))


def _read_pool(probes: Any, pool: Any) -> tuple[bytes, bytes, bytes]:
    """The pool's state as packed native int64 rows: (block_id, ref_cnt, hash_id, group,
    num_tokens) per held or keyed block (-1, 0, -1 for no key), (hash_id, group, num_tokens,
    number of holders) per key in the map's order, and every key's holders in lookup order.
    Interns the keys' hashes and teaches the probe set each primary key's prefix length. The
    native core does it in C (``csrc/snapshot.c``) where the probe set has a plain
    ``HashInterner``; this is its twin, in bulk (comprehensions and dict operations, not a
    Python call per key)."""
    cache = pool.cached_block_hash_to_block._cache
    if native.core is not None and probes._interned_ids is not None:
        return native.core.snapshot_pool(probes, pool.blocks, cache)
    pairs = probes.intern_keys(list(cache))
    key_ids = dict(zip(cache, pairs))
    key_ids[None] = (-1, 0)  # an unkeyed block
    rows = [(block.block_id, block.ref_cnt, *key_ids[block._block_hash],
             block._block_hash_num_tokens)
            for block in pool.blocks[1:]  # block 0 is the null block
            if block.ref_cnt or block._block_hash is not None]
    depth = probes._depth
    # The first block with a key gives its length, unless one is known (reversed: it wins).
    depth.update({hash_id: num_tokens or 0 for _, _, hash_id, _, num_tokens in reversed(rows)
                  if hash_id >= 0 and hash_id not in depth})
    holders = [[holder.block_id] if type(holder) is not dict
               else [block.block_id for block in holder.values()] for holder in cache.values()]
    return (array("q", [value for *row, num_tokens in rows
                        for value in (*row, -1 if num_tokens is None else num_tokens)]).tobytes(),
            array("q", [value for (hash_id, group), held in zip(pairs, holders)
                        for value in (hash_id, group, depth.get(hash_id, 0), len(held))]).tobytes(),
            array("q", [block_id for held in holders for block_id in held]).tobytes())


def _requests_in_flight(manager: Any, scheduler: Any) -> list[tuple[Any, RequestQueue]]:
    """Every request the scheduler holds, running ones first, each queue in its order; then any
    other request still holding blocks in the cache (none in vLLM's usual flow)."""
    if scheduler is None:
        return []
    requests = [(request, RequestQueue.RUNNING) for request in scheduler.running]
    requests += [(request, RequestQueue.WAITING) for request in scheduler.waiting]
    seen = {request.request_id for request, _ in requests}
    holding = {request_id for group in manager.coordinator.single_type_managers
               for request_id, blocks in group.req_to_blocks.items() if blocks}
    for request_id in sorted(holding - seen):
        request = scheduler.requests.get(request_id)
        if request is not None:
            requests.append((request, _status_queue(request.status.name)))
    return requests


def _counters(manager: Any, scheduler: Any) -> dict[str, int]:
    """The scheduler's and cache's own counters at the snapshot (vLLM's names)."""
    counters = {"num_free_blocks": manager.block_pool.get_num_free_blocks()}
    stats = getattr(manager, "prefix_cache_stats", None)
    for name in ("requests", "queries", "hits"):
        value = getattr(stats, name, None)
        if isinstance(value, int):
            counters[f"prefix_cache_{name}"] = value
    if scheduler is not None:
        counters["current_step"] = int(getattr(scheduler, "current_step", 0) or 0)
        counters["num_running"] = len(scheduler.running)
        counters["num_waiting"] = len(scheduler.waiting)
    return counters


# --- rebuilding -------------------------------------------------------------------------------


def restore(manager: Any, snapshot: Any, key_bytes: Callable[[int, int], bytes],
            request_of: Callable[[int], Any]) -> None:
    """Write ``snapshot`` (a ``replay.snapshot.StartSnapshot``) into ``manager``, a vLLM
    ``KVCacheManager`` freshly built for the same engine: every block's reference count and
    keys, the keys' holders in lookup order, the free queue's order, and each request's blocks
    and per-request state in every group. ``key_bytes(hash_id, group)`` is the key the backend
    gives a hash; ``request_of(req)`` the backend's vLLM ``Request`` for a snapshot request."""
    from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue

    pool = manager.block_pool
    blocks = pool.blocks
    for state in snapshot.blocks:
        block = blocks[state.block_id]
        block.ref_cnt = state.ref_cnt
        if state.hash_id >= 0:
            block.set_block_hash(key_bytes(state.hash_id, state.group),
                                 None if state.num_tokens < 0 else state.num_tokens)
    for key_state in snapshot.keys:
        key = key_bytes(key_state.hash_id, key_state.group)
        for block_id in key_state.block_ids:
            block = blocks[block_id]
            if block.block_hash != key:
                pool.cached_block_hashes_by_block.setdefault(block_id, set()).add(key)
            pool.cached_block_hash_to_block.insert(key, block)
    for block in blocks:
        block.prev_free_block = block.next_free_block = None
    pool.free_block_queue = FreeKVCacheBlockQueue([blocks[i] for i in snapshot.free_queue])
    managers = manager.coordinator.single_type_managers
    for state in snapshot.request_blocks:
        group_manager = managers[state.group]
        request_id = request_of(state.req).request_id
        group_manager.req_to_blocks[request_id] = [
            pool.null_block if block_id == 0 else blocks[block_id]
            for block_id in state.block_ids]
        for name, values in state.fields.items():
            _set_field(group_manager, name, request_id, values, blocks)


def _set_field(manager: Any, name: str, request_id: str, values: list[int],
               blocks: list[Any]) -> None:
    encoding = REQUEST_FIELDS[name]
    container = getattr(manager, name)
    if encoding == _MEMBER:
        container.add(request_id)
    elif encoding == _INT:
        container[request_id] = values[0]
    elif encoding == _PAIR:
        container[request_id] = (values[0], values[1])
    elif encoding == _INDEX_BLOCK:
        container[request_id] = (values[0], blocks[values[1]])
    else:
        container[request_id] = (blocks[values[0]], values[1])
