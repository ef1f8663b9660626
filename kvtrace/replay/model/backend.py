"""The ``model`` replay backend: kvtrace's own implementation of vLLM 0.33's hybrid prefix cache.

It implements what replay drives of vLLM's ``KVCacheManager`` and ``HybridKVCacheCoordinator``
(the prefix lookup, ``allocate_slots``, caching, freeing, preemption, copy-on-write releases)
over the pool and managers of this package, and reports every call as the ``vllm`` backend's
probes do: the same records, in the same order, for the same calls (held to it by
``tests/test_model_backend.py``). The checkpoint variants' two decisions come from
``kvtrace.replay.variants``, the table the ``vllm`` backend uses too. No vLLM import. A replay
that only wants its summary gets a counting backend: no record is made, the figures are counted
as the reports are made (``reports.Tally``).

Scope: the engines ``kvtrace.engine_config.validate`` accepts (full-attention and Mamba
"align" groups, no EAGLE or MTP, no KV connector, no speculative or lookahead blocks in Mamba).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from kvtrace.engine_config import check_added_request, validate
from kvtrace.errors import ConfigError, KvtraceError
from kvtrace.events import (
    BlocksCached,
    ComputedBlocksFound,
    EngineConfig,
    FinishStatus,
    HashesExtended,
    RequestArrived,
    RequestFinished,
    RequestPreempted,
    SlotsAllocated,
    StepStarted,
)
from kvtrace.replay.backend import RecordSink, take_pending_hit, tokens_to_sync
from kvtrace.replay.model.managers import FullAttentionManager, MambaManager, Request
from kvtrace.replay.model.pool import NULL_BLOCK, BlockPool
from kvtrace.replay.model.reports import Records, Tally
from kvtrace.replay.variants import get_variant
from kvtrace.replay.vllm_backend import UNLIMITED_MODEL_LEN, MadeUpHashIds

if TYPE_CHECKING:
    from kvtrace.replay.summary import ReplaySummary
    from kvtrace.replay.snapshot import StartSnapshot

Hits = tuple[list[int], ...]  # per KV-cache group: the hit blocks (null blocks included)
SpecGroups = list[tuple[tuple[bool, int], list[int]]]  # ((is Mamba, block size), group ids)


@dataclass(frozen=True)
class CachePlan:
    """What vLLM's coordinator derives from an engine (both twins build from it): hybrid
    (several groups), unitary, or no prefix cache; fine-grained partial hits (a Mamba "align"
    block coarser than the hash unit); the hit alignment; the hit search's spec groups (groups
    of one kind and block size look up together, full attention first)."""

    hybrid: bool
    partial_hits: bool
    alignment: int
    spec_groups: SpecGroups
    simple_hybrid: bool  # one full-attention spec and one other: one pass of the fixed point

    @classmethod
    def of(cls, config: EngineConfig) -> CachePlan:
        groups = config.kv_cache_groups
        hybrid = config.enable_caching and len(groups) > 1
        partial_hits = hybrid and any(
            g.kind == "mamba" and g.block_size > config.hash_block_size for g in groups)
        specs: dict[tuple[bool, int], list[int]] = {}
        for index, group in enumerate(groups):
            specs.setdefault((group.kind == "mamba", group.block_size), []).append(index)
        spec_groups = sorted(specs.items(), key=lambda item: item[0][0])
        return cls(hybrid, partial_hits,
                   config.hash_block_size if partial_hits else config.scheduler_block_size,
                   spec_groups, len(spec_groups) == 2 and not spec_groups[0][0][0])


def check_release(block_ids: list[int], num_blocks: int, ref_count) -> None:
    """Refuse to release blocks the cache does not hold (``ref_count(block)`` > 0)."""
    held = [block for block in block_ids if 0 <= block < num_blocks and ref_count(block) > 0]
    if held != block_ids:
        unheld = sorted(set(block_ids) - set(held))
        raise KvtraceError(
            f"the trace releases block(s) {unheld[:5]} that the replayed cache does not hold",
            "The trace's inputs are inconsistent with its engine config; was it edited, or "
            "captured from a different engine?")


class ModelBackend:
    """``CacheBackend`` on kvtrace's model of vLLM 0.33's prefix cache (see module docstring):
    the pure-Python twin, the reference for ``NativeModelBackend``."""

    backend_name = "model"

    def __init__(self, config: EngineConfig, variant: str, sink: RecordSink | None = None,
                 summary: ReplaySummary | None = None) -> None:
        """Records go to ``sink``; given ``summary`` instead, no record is made: the backend
        counts the summary's figures itself (``reports.Tally``) and sets them on close."""
        if (sink is None) == (summary is None):
            raise TypeError("a model backend reports to a sink or counts into a summary")
        validate(config)
        check_vllm_accepts(config)
        self.config = config
        self.variant = get_variant(variant)
        self.sink = sink
        self.summary = summary
        self.num_gpu_blocks = config.num_gpu_blocks
        self.max_model_len = config.max_model_len or UNLIMITED_MODEL_LEN
        self.retention_interval = config.retention_interval
        self.hash_block_size = unit = config.hash_block_size
        self.scheduler_block_size = config.scheduler_block_size
        groups = config.kv_cache_groups
        caching = config.enable_caching
        self.records = (Records() if summary is None
                        else Tally(config.num_gpu_blocks, len(groups)))
        self.depth: dict[int, int] = {}  # hash id -> the prefix length it was reported at
        self.pool = BlockPool(config.num_gpu_blocks, len(groups), unit, caching, self.depth,
                              self.records)
        plan = CachePlan.of(config)
        self.hybrid, self.partial_hits = plan.hybrid, plan.partial_hits
        self.spec_groups, self.simple_hybrid = plan.spec_groups, plan.simple_hybrid
        alignment = plan.alignment
        self.managers: list[FullAttentionManager] = []
        for index, group in enumerate(groups):
            if group.kind == "mamba":
                manager = MambaManager(index, group.block_size, self.pool, caching, alignment,
                                       self.variant, group.num_prefill_checkpoint_blocks,
                                       group.prefill_checkpoint_alignment, self.records)
            else:
                manager = FullAttentionManager(index, group.block_size, self.pool, caching,
                                               alignment)
            self.managers.append(manager)
        self.mamba_managers = [m for m in self.managers if m.is_mamba]
        self.no_hits: Hits = tuple([] for _ in self.managers)
        self.requests: dict[int, Request] = {}
        self.pending_hits: dict[int, tuple[Hits | None, int]] = {}
        self.made_up_hash_id = MadeUpHashIds()

    # --- CacheBackend ---------------------------------------------------------------------------

    def new_step(self, step: int, ts_ns: int) -> None:
        self.records.report(StepStarted, step, ts_ns)
        for manager in self.mamba_managers:
            manager.new_step()
        self.flush()

    def add_request(self, req: int, prompt_len: int, hash_ids: list[int], max_tokens: int,
                    output_hash_ids: list[int] | None = None) -> None:
        check_added_request(self.config, req, prompt_len, hash_ids, max_tokens,
                            req in self.requests)
        known_ids = [*hash_ids, *(output_hash_ids or ())]
        if known_ids:
            self.made_up_hash_id.skip_past(max(known_ids))
        self.requests[req] = Request(req, prompt_len, max(1, max_tokens), known_ids,
                                     self.hash_block_size)

    def get_computed_blocks(self, req: int) -> tuple[int, int]:
        request = self.requests[req]
        self.report_request(request)
        if self.pool.enable_caching:
            hits, num_hit, num_uncached = self.find_longest_cache_hit(
                request, request.num_tokens - 1)
            junction = num_hit + num_uncached if num_uncached else 0
        else:
            hits, num_hit, junction = None, 0, 0
        # As vLLM's scheduler does on admission: the junction steers the Mamba retention mask.
        request.shared_prefix_boundary = junction
        self.pending_hits[req] = (hits, num_hit)
        self.records.report(ComputedBlocksFound, req, num_hit, junction)
        self.flush()
        return num_hit, junction

    def allocate_slots(self, req: int, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       num_lookahead_tokens: int = 0, *, full_sequence_must_fit: bool = False,
                       reserved_blocks: int = 0, has_scheduled_reqs: bool = False) -> bool:
        request = self.requests[req]
        hits = take_pending_hit(self.pending_hits, req, num_new_computed_tokens)
        records = self.records
        if request.num_reported is None or request.num_hashes != request.num_reported:
            self.report_request(request)
        first_effect = records.mark()
        num_computed_tokens, num_tokens = request.num_computed_tokens, request.num_tokens
        success = False
        try:
            if num_new_tokens == 0 and num_new_computed_tokens == 0:
                raise ValueError("num_new_tokens must be greater than 0 when there are no "
                                 "computed tokens to adopt")
            success = self.allocate(request, num_new_tokens, num_new_computed_tokens, hits,
                                    num_lookahead_tokens, full_sequence_must_fit,
                                    reserved_blocks)
        finally:
            records.report_at(first_effect, SlotsAllocated, req, num_new_tokens,
                              num_computed_tokens, num_new_computed_tokens,
                              num_lookahead_tokens, 0, num_tokens, success,
                              full_sequence_must_fit, reserved_blocks, has_scheduled_reqs,
                              request.num_in_flight_tokens)
            self.flush()
        if success:
            self.pending_hits.pop(req, None)
            request.num_computed_tokens += num_new_computed_tokens
        return success

    def end_schedule(self) -> None:
        """As ``Scheduler.schedule()`` after its allocations: the step's copy-on-write copies
        run, so their retained blocks are released."""
        retained = []
        for manager in self.managers:
            for source, copy in manager.cow_copies:
                retained += (source, copy)
            manager.cow_copies = []
        if retained:
            self.pool.free_blocks(retained, released=True)
            self.flush()

    def advance(self, req: int, num_tokens: int) -> None:
        request = self.requests[req]
        request.num_computed_tokens += num_tokens
        if request.num_computed_tokens >= request.num_tokens:
            self.append_tokens(request, 1)  # the step sampled a token

    def cache_blocks(self, req: int, num_tokens_to_cache: int) -> None:
        request = self.requests[req]
        if request.num_reported is None or request.num_hashes != request.num_reported:
            self.report_request(request)
        self.records.report(BlocksCached, req, num_tokens_to_cache, request.num_computed_tokens,
                            request.num_tokens)
        self.cache_coordinator_blocks(request, num_tokens_to_cache)
        self.flush()

    def free(self, req: int, status: FinishStatus = FinishStatus.FINISHED) -> None:
        request = self.requests.pop(req)
        self.pending_hits.pop(req, None)
        if request.num_reported is not None:
            self.records.report(RequestFinished, req, FinishStatus.ABORTED
                                if status == FinishStatus.ABORTED else FinishStatus.FINISHED)
        for manager in self.managers:
            manager.release(req)
        self.flush()

    def preempt(self, req: int) -> None:
        request = self.requests[req]
        self.pending_hits.pop(req, None)
        if request.num_reported is not None:
            self.records.report(RequestPreempted, req)
        for manager in self.managers:
            manager.release(req)
        request.num_computed_tokens = 0
        self.flush()

    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def sync_request(self, req: int, num_computed_tokens: int, num_tokens: int,
                     num_in_flight_tokens: int = 0) -> None:
        request = self.requests[req]
        request.num_computed_tokens = num_computed_tokens
        request.num_in_flight_tokens = num_in_flight_tokens
        missing = tokens_to_sync(req, request.num_tokens, num_tokens)
        if missing:
            self.append_tokens(request, missing)

    def release_blocks(self, block_ids: list[int]) -> None:
        check_release(block_ids, self.num_gpu_blocks, self.pool.ref.__getitem__)
        self.pool.free_blocks(block_ids, released=True)
        self.flush()

    def restore(self, snapshot: StartSnapshot) -> None:
        """Start from a capture's start snapshot: its pool, and its requests in flight with
        their blocks and per-request state in every group (their decode completes the output
        units the snapshot names, then made-up ones)."""
        unit = self.hash_block_size
        depth = self.depth
        for state in snapshot.requests:
            known_ids = snapshot.known_hash_ids(state)
            if known_ids:
                self.made_up_hash_id.skip_past(max(known_ids))
            request = Request(state.req, state.prompt_len, max(1, state.max_tokens), known_ids,
                              unit)
            request.num_tokens = state.num_tokens
            request.num_hashes = request.num_reported = len(state.hash_ids)
            request.num_computed_tokens = state.num_computed_tokens
            request.shared_prefix_boundary = state.shared_prefix_boundary
            request.num_in_flight_tokens = state.num_in_flight_tokens
            self.requests[state.req] = request
            depth.update(zip(state.hash_ids, range(unit, (len(state.hash_ids) + 1) * unit, unit)))
        for key in snapshot.keys:
            if key.num_tokens > 0:
                depth.setdefault(key.hash_id, key.num_tokens)
        self.pool.restore(snapshot)
        for state in snapshot.request_blocks:
            self.managers[state.group].restore_request(state.req, state.block_ids, state.fields)
        if self.summary is not None:  # counting: the summary's figures start from it too
            for record in snapshot.records():
                self.records.report(type(record), *msgspec.structs.astuple(record))

    def close(self) -> None:
        self.flush()
        if self.summary is not None:
            self.records.fill(self.summary)

    def __enter__(self) -> ModelBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- inspection -----------------------------------------------------------------------------

    def cached_block_id(self, hash_id: int, group: int) -> int | None:
        """The block a lookup of ``hash_id`` in KV-cache group ``group`` would hit, or None."""
        return self.pool.cached_block(hash_id, group)

    def request(self, req: int) -> Request:
        """A request's counters (``num_tokens``, ``num_computed_tokens``...), as the ``vllm``
        backend hands out its live vLLM ``Request``."""
        return self.requests[req]

    # --- requests and records -------------------------------------------------------------------

    def flush(self) -> None:
        """Hand the records made so far to the sink, in order (they are dropped either way);
        a counting backend makes none."""
        records = self.records
        if self.summary is None and records:
            sink = self.sink
            try:
                for record in records:
                    sink(record)
            finally:
                records.clear()

    def report_request(self, request: Request) -> None:
        """As the probes on a request's first lookup: its arrival; later, hash units decode
        completed since the last report."""
        unit = self.hash_block_size
        depth = self.depth
        if request.num_reported is None:
            num_units = min(request.prompt_len // unit, request.num_hashes)
            hash_ids = request.hash_ids[:num_units]
            self.records.report(RequestArrived, request.req, request.prompt_len, hash_ids,
                                request.max_tokens, 0, 0, str(request.req))
            depth.update(zip(hash_ids, range(unit, (num_units + 1) * unit, unit)))
            request.num_reported = num_units
        start, stop = request.num_reported, request.num_hashes
        if stop > start:
            hash_ids = request.hash_ids[start:stop]
            self.records.report(HashesExtended, request.req, hash_ids)
            depth.update(zip(hash_ids, range((start + 1) * unit, (stop + 1) * unit, unit)))
            request.num_reported = stop

    def append_tokens(self, request: Request, count: int) -> None:
        """Output tokens join the sequence; each completed hash unit gets its id (a declared
        output id, else a made-up one)."""
        request.num_tokens += count
        stop = request.num_tokens // self.hash_block_size
        hash_ids = request.hash_ids
        while len(hash_ids) < stop:
            hash_ids.append(self.made_up_hash_id())
        if stop > request.num_hashes:
            request.num_hashes = stop

    # --- the coordinator ------------------------------------------------------------------------

    def allocate(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int,
                 hits: Hits | None, num_lookahead_tokens: int, full_sequence_must_fit: bool,
                 reserved_blocks: int) -> bool:
        """``KVCacheManager.allocate_slots`` (True: allocated)."""
        managers = self.managers
        pool = self.pool
        max_model_len = self.max_model_len
        num_local = request.num_computed_tokens + num_new_computed_tokens
        total = num_local if num_local < max_model_len else max_model_len
        prefill_end = 0
        if self.retention_interval == 0:
            prefill_end = request.num_tokens - 1
            if prefill_end < request.prompt_len:
                prefill_end = request.prompt_len
        group_hits = hits if hits is not None else self.no_hits
        if full_sequence_must_fit:
            full = min(request.num_tokens, max_model_len)
            need = 0
            for manager, hit in zip(managers, group_hits):
                need += manager.blocks_to_allocate(request, full, hit, total, num_local, full,
                                                   True, prefill_end)
            if need > pool.num_free:
                return False
        num_tokens_main = total + num_new_tokens
        num_tokens = num_tokens_main + num_lookahead_tokens
        if num_tokens > max_model_len:
            num_tokens = max_model_len
        # Full attention keeps every block; a step in flight has not processed its tokens.
        num_processed = total - request.num_in_flight_tokens
        for manager in self.mamba_managers:
            manager.retire(request, num_processed if num_processed > 0 else 0)
        need = 0
        for manager, hit in zip(managers, group_hits):
            need += manager.blocks_to_allocate(request, num_tokens, hit, total, num_local,
                                               num_tokens_main, False, prefill_end)
        if need > pool.num_free - reserved_blocks:
            return False
        if hits is not None:
            req = request.req
            if any(req in manager.num_cached for manager in managers):
                if any(hits):
                    raise AssertionError(f"running request {req} got prefix hits")
            else:
                for manager, hit in zip(managers, hits):
                    manager.add_hit(request, hit, num_local, total)
        for manager in managers:
            manager.allocate(request, num_tokens, num_tokens_main)
        num_cacheable = total + num_new_tokens
        if num_cacheable > request.num_tokens:
            num_cacheable = request.num_tokens
        self.cache_coordinator_blocks(request, num_cacheable)
        return True

    def cache_coordinator_blocks(self, request: Request, num_tokens: int) -> None:
        """``KVCacheCoordinator.cache_blocks``: without partial hits a hybrid engine caches only
        up to the scheduler block a later hit could match."""
        if not self.pool.enable_caching:
            return
        if self.hybrid and not self.partial_hits:
            num_tokens -= num_tokens % self.scheduler_block_size
        boundaries = (request.prompt_len - 1,)
        retention = self.retention_interval
        for manager in self.managers:
            manager.cache(request, num_tokens, retention, boundaries)

    def find_longest_cache_hit(self, request: Request,
                               max_length: int) -> tuple[Hits, int, int]:
        """(hit blocks per group, joint hit length, longest single-group hit beyond it).

        Hybrid: an iterative fixed point over the spec groups, full attention first (looked up
        once, then only trimmed); a simple hybrid (one full-attention spec and one other) stops
        after one pass."""
        if not self.hybrid:
            manager = self.managers[0]
            blocks, num_hit = self.group_hit(manager, [manager.group], request, max_length,
                                             manager.block_size)
            return (blocks[0],), num_hit, 0
        num_groups = len(self.managers)
        hit_length = max_length
        longest = 0
        group_blocks: list[list[int] | None] = [None] * num_groups
        group_lengths = [0] * num_groups
        alignment = self.managers[0].alignment
        while True:
            current = hit_length
            for (is_mamba, _), group_ids in self.spec_groups:
                first = group_ids[0]
                if not is_mamba and group_blocks[first] is not None:
                    current = min(current, group_lengths[first])
                    continue
                blocks, current = self.group_hit(self.managers[first], group_ids, request,
                                                 current, alignment)
                for group, hit in zip(group_ids, blocks):
                    group_blocks[group] = hit
                    group_lengths[group] = current
                longest = max(longest, current)
            if current >= hit_length:
                break
            hit_length = current
            if self.simple_hybrid:
                break
        for (is_mamba, block_size), group_ids in self.spec_groups:
            if is_mamba:
                continue
            num_blocks = -(-hit_length // block_size)
            for group in group_ids:
                hit = group_blocks[group]
                if hit is not None:
                    del hit[num_blocks:]
                    group_lengths[group] = hit_length
        hits = tuple(hit if hit is not None else [] for hit in group_blocks)
        return hits, hit_length, longest - hit_length

    def group_hit(self, manager: FullAttentionManager, group_ids: list[int], request: Request,
                  max_length: int, alignment: int) -> tuple[list[list[int]], int]:
        """One spec group's ``find_longest_cache_hit``: the blocks every group in ``group_ids``
        holds for the longest prefix it can resume at, up to ``max_length``."""
        pool = self.pool
        hash_ids, num_hashes = request.hash_ids, request.num_hashes
        unit = pool.hash_block_size
        block_size = manager.block_size
        fine = alignment < block_size and block_size % alignment == 0
        tables = [pool.cached[group] for group in group_ids]

        def lookup(hash_id: int) -> list[int] | None:
            found = []
            for table in tables:
                holder = table.get(hash_id)
                if holder is None:
                    return None
                found.append(holder if type(holder) is int else holder[0])
            return found

        scale = block_size // unit
        hits: list[list[int]] = [[] for _ in group_ids]
        if manager.is_mamba:
            # Right to left: the state at one boundary is all a hit needs.
            if fine:
                per_block = block_size // alignment
                for index in range(min(max_length // alignment, num_hashes) - 1, -1, -1):
                    found = lookup(hash_ids[index])
                    if found is not None:
                        nulls = [NULL_BLOCK] * (index // per_block)
                        return [nulls + [block] for block in found], (index + 1) * alignment
                return hits, 0
            for index in range(max_length // block_size - 1, -1, -1):
                found = lookup(hash_ids[(index + 1) * scale - 1])
                if found is not None:
                    if block_size != alignment and (index + 1) * block_size % alignment:
                        continue
                    nulls = [NULL_BLOCK] * index
                    return [nulls + [block] for block in found], (index + 1) * block_size
            return hits, 0
        # Full attention: left to right while blocks hit (hashes chain), then, fine-grained,
        # the first missed block's interior boundaries from the right.
        for index in range(min(max_length // block_size, num_hashes // scale)):
            found = lookup(hash_ids[(index + 1) * scale - 1])
            if found is None:
                break
            for hit, block in zip(hits, found):
                hit.append(block)
        num_full = len(hits[0])
        hit_length = num_full * block_size
        if fine:
            per_block = block_size // alignment
            first = num_full * per_block
            stop = min(first + per_block - 1, max_length // alignment, num_hashes)
            for index in range(stop - 1, first - 1, -1):
                found = lookup(hash_ids[index])
                if found is not None:
                    for hit, block in zip(hits, found):
                        hit.append(block)
                    hit_length = (index + 1) * alignment
                    break
        hit_length -= hit_length % alignment
        num_blocks = -(-hit_length // block_size)
        for hit in hits:
            del hit[num_blocks:]
        return hits, hit_length


def check_vllm_accepts(config: EngineConfig) -> None:
    """What vLLM 0.33's ``KVCacheManager`` refuses beyond ``validate``, refused alike; and a
    drafting engine's speculative Mamba state blocks, which the model does not keep."""
    groups = config.kv_cache_groups
    if (config.enable_caching and len(groups) == 1
            and groups[0].block_size != config.hash_block_size):
        raise ConfigError(
            "vLLM rejected the engine config: a single KV-cache group hashes at its block size "
            f"({groups[0].block_size}), not {config.hash_block_size}",
            "Give a one-group engine a hash unit equal to its block size.")
    if config.num_speculative_tokens and any(g.kind == "mamba" for g in groups):
        raise ConfigError(
            f"the engine drafts {config.num_speculative_tokens} tokens a step, and the model "
            "backend keeps no speculative Mamba state blocks",
            "Replay it on the vllm backend (--backend vllm, the default).")
    if (config.use_eagle or config.num_lookahead_tokens or config.num_hash_lookahead_tokens
            or config.num_prefill_lookahead_tokens):
        raise ConfigError(
            "the engine drafts with EAGLE or MTP (lookahead slots, lookahead block hashes or "
            "the dropped last block), which the model backend does not reproduce",
            "Replay it on the vllm backend (--backend vllm, the default).")
    retention = config.retention_interval
    if retention and not any(g.kind == "mamba" for g in groups):
        raise ConfigError(
            f"vLLM rejected the engine config: retention interval {retention} has no effect "
            "without a Mamba group", "Use retention 0 or none for a full-attention engine.")
