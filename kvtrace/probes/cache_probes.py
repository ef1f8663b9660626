"""Wrap vLLM 0.33's prefix-cache methods and report every call as kvtrace records.

``CacheProbes(sink, interner).arm(block_pool)`` patches the real classes (by qualified name, after
checking every method's signature against 0.33.0, refusing before anything is patched) and routes
calls on *that* pool's cache to ``sink(record)``; ``arm()`` with no pool observes every cache in
the process (live capture). Several probes can be armed at once (one per replay backend); the
class patches stay while any is armed and ``disarm`` of the last restores the original function
objects exactly.

Why wrap private helpers (``_insert_block_hash``, ``_remove_cached_block_hashes``): every hash put
on or taken off a block passes through them, so one cheap wrapper each sees all stores and removals
with the block; the public callers (``get_new_blocks``, ``cache_full_blocks``,
``cache_partial_block``, ``MambaManager.cache_blocks``...) only set *why* (a reason / store kind)
for the duration of their call. Checkpoint decisions are read from the slot after
``MambaManager.cache_blocks``, so they are observed whichever policy made them (vLLM's own, or a
replay variant installed on the manager).

Wrappers never raise into vLLM: a failure of ours or of the sink is swallowed and counted in
``num_failures``; the real method's result (or exception) is returned (raised) unchanged.
"""

from __future__ import annotations

import importlib
import inspect
import time
from typing import Any, Callable, Protocol

from kvtrace.errors import KvtraceError
from kvtrace.events import (
    BlockAllocated,
    BlockFreed,
    BlockRemoved,
    BlockStored,
    BlockTouched,
    BoundaryStateOffloaded,
    CheckpointClass,
    CheckpointRecorded,
    CheckpointSuppressed,
    ComputedBlocksFound,
    FinishStatus,
    HashesExtended,
    HashInterned,
    Record,
    RemoveReason,
    RequestArrived,
    RequestFinished,
    RequestPreempted,
    SlotsAllocated,
    StaleKeyLeft,
    StepStarted,
    StoreKind,
)

SUPPORTED_VLLM_VERSION = "0.33.0"

_BLOCK_POOL = "vllm.v1.core.block_pool.BlockPool"
_MANAGER = "vllm.v1.core.kv_cache_manager.KVCacheManager"
_MAMBA = "vllm.v1.core.single_type_kv_cache_manager.MambaManager"

# Qualified name -> parameter names in vLLM 0.33.0 ("*x" marks a keyword-only parameter).
EXPECTED_SIGNATURES: dict[str, tuple[str, ...]] = {
    f"{_BLOCK_POOL}.get_new_blocks": ("self", "num_blocks"),
    f"{_BLOCK_POOL}.touch": ("self", "blocks"),
    f"{_BLOCK_POOL}.free_blocks": ("self", "ordered_blocks"),
    f"{_BLOCK_POOL}.cache_full_blocks": (
        "self", "request", "blocks", "num_cached_blocks", "num_full_blocks", "block_size",
        "kv_cache_group_id", "block_mask"),
    f"{_BLOCK_POOL}.cache_partial_block": (
        "self", "request", "block", "num_tokens", "kv_cache_group_id", "block_size",
        "replace_existing_hashes"),
    f"{_BLOCK_POOL}.move_block_hashes": ("self", "src_block", "dst_block"),
    f"{_BLOCK_POOL}.evict_blocks": ("self", "block_ids"),
    f"{_BLOCK_POOL}.reset_prefix_cache": ("self",),
    f"{_BLOCK_POOL}._remove_cached_block_hashes": ("self", "block"),
    f"{_BLOCK_POOL}._insert_block_hash": ("self", "block_hash_with_group_id", "block",
                                          "num_tokens"),
    f"{_MANAGER}.new_step_starts": ("self",),
    f"{_MANAGER}.get_computed_blocks": ("self", "request", "max_cache_hit_length"),
    f"{_MANAGER}.allocate_slots": (
        "self", "request", "num_new_tokens", "num_new_computed_tokens", "new_computed_blocks",
        "num_lookahead_tokens", "num_external_computed_tokens", "delay_cache_blocks",
        "num_encoder_tokens", "full_sequence_must_fit", "reserved_blocks", "has_scheduled_reqs",
        "skip_zeroing_group_ids"),
    f"{_MANAGER}.free": ("self", "request"),
    f"{_MANAGER}.pop_blocks_for_free": ("self", "request"),
    f"{_MAMBA}.get_num_blocks_to_allocate": (
        "self", "request_id", "num_tokens", "new_computed_blocks", "total_computed_tokens",
        "num_local_computed_tokens", "num_tokens_main_model", "apply_admission_cap",
        "prefill_end"),
    f"{_MAMBA}.allocate_new_blocks": ("self", "request_id", "num_tokens",
                                      "num_tokens_main_model"),
    f"{_MAMBA}.cache_blocks": ("self", "request", "num_tokens", "retention_interval",
                               "*replay_boundaries"),
}

_PROBE_ATTR = "_kvtrace_probes"  # set on a BlockPool instance armed for one probe set


class ProbeSignatureError(KvtraceError):
    """A wrapped vLLM method does not have the signature the probes were written against."""

    default_hint = (f"kvtrace's probes support vLLM {SUPPORTED_VLLM_VERSION}; install that "
                    "version or a kvtrace release that supports yours.")


class HashIdInterner(Protocol):
    def intern(self, hash_bytes: bytes) -> tuple[int, bool]: ...


def _parameter_names(function: Callable) -> tuple[str, ...]:
    return tuple(
        ("*" if p.kind is inspect.Parameter.KEYWORD_ONLY else "") + p.name
        for p in inspect.signature(function).parameters.values()
    )


def probe_targets() -> list[tuple[type, str, Callable]]:
    """Resolve every wrapped method and check its signature; raise before anything is patched."""
    targets = []
    for qualname, expected in EXPECTED_SIGNATURES.items():
        module_name, class_name, method_name = qualname.rsplit(".", 2)
        try:
            owner = getattr(importlib.import_module(module_name), class_name)
            function = owner.__dict__[method_name]
        except (ImportError, AttributeError, KeyError):
            raise ProbeSignatureError(
                f"vLLM has no {qualname} (kvtrace probes support vLLM {SUPPORTED_VLLM_VERSION})"
            ) from None
        found = _parameter_names(function)
        if found != expected:
            raise ProbeSignatureError(
                f"{qualname} has parameters ({', '.join(found)}); vLLM {SUPPORTED_VLLM_VERSION} "
                f"has ({', '.join(expected)})"
            )
        targets.append((owner, method_name, function))
    return targets


class _Patches:
    """The process-wide class patches, shared by every armed probe set."""

    originals: dict[tuple[type, str], Callable] = {}
    armed: list["CacheProbes"] = []
    catch_all: "CacheProbes | None" = None


_POOL_METHODS = frozenset({
    "get_new_blocks", "touch", "free_blocks", "cache_full_blocks", "cache_partial_block",
    "move_block_hashes", "evict_blocks", "reset_prefix_cache", "_remove_cached_block_hashes",
    "_insert_block_hash"})


def _make_wrapper(method_name: str, original: Callable) -> Callable:
    """A wrapper that finds the probe set of the call's pool and hands it the call.

    Kept to a dict lookup and one call: it runs on every cache operation of the engine."""
    handler = getattr(CacheProbes, f"_on{method_name}" if method_name.startswith("_")
                      else f"_on_{method_name}")
    if method_name in _POOL_METHODS:
        def wrapper(pool, *args, **kwargs):
            probe = pool.__dict__.get(_PROBE_ATTR) or _Patches.catch_all
            if probe is None:
                return original(pool, *args, **kwargs)
            return handler(probe, original, pool, *args, **kwargs)
    else:
        def wrapper(manager, *args, **kwargs):
            probe = manager.block_pool.__dict__.get(_PROBE_ATTR) or _Patches.catch_all
            if probe is None:
                return original(manager, *args, **kwargs)
            return handler(probe, original, manager, *args, **kwargs)

    wrapper.__name__ = method_name
    wrapper.__qualname__ = f"kvtrace_probe.{method_name}"
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    return wrapper


class CacheProbes:
    """Turns calls on one vLLM prefix cache (or all of them) into trace records.

    ``interner`` maps hash bytes to dense ids (``events.HashInterner`` for capture; replay passes
    one that decodes the ids it encoded). ``req_number`` maps a vLLM request id to the trace's
    ``req`` (default: dense ints in arrival order). ``created_ns`` is the trace's wall-clock
    origin for ``StepStarted.ts_ns``. With ``emit_hash_bytes`` a ``HashInterned`` record precedes
    the first use of each new id.
    """

    def __init__(self, sink: Callable[[Record], None], interner: HashIdInterner, *,
                 req_number: Callable[[str], int] | None = None, created_ns: int | None = None,
                 emit_hash_bytes: bool = False) -> None:
        self.sink = sink
        self.interner = interner
        self.emit_hash_bytes = emit_hash_bytes
        self.created_ns = time.time_ns() if created_ns is None else created_ns
        self.num_failures = 0
        self._req_number = req_number
        self._reqs: dict[str, int] = {}
        self._num_requests = 0
        self._num_reported_hashes: dict[str, int] = {}
        self._salt_ids: dict[str, int] = {}
        self._depth: dict[int, int] = {}  # hash id -> prefix length in tokens it covers
        self._step = -1
        self._announced_step: tuple[int, int] | None = None
        self._pool: Any = None
        self._armed = False
        # Context set by the outer method being called.
        self._req = -1
        self._request: Any = None
        self._remove_reason = RemoveReason.UNKNOWN
        self._store_kind = StoreKind.FULL
        self._in_checkpoint = False
        self._num_stripped = 0
        self._deferred: list[Record] | None = None

    # --- arming -------------------------------------------------------------------------------

    def arm(self, block_pool: Any = None) -> "CacheProbes":
        """Patch vLLM (if no probe set has yet) and observe ``block_pool`` (None: every pool)."""
        if self._armed:
            return self
        targets = probe_targets()
        if block_pool is None and _Patches.catch_all is not None:
            raise KvtraceError("another probe set already observes every cache in this process",
                               "Disarm it first; only one process-wide capture can run.")
        if not _Patches.originals:
            for owner, name, function in targets:
                _Patches.originals[(owner, name)] = function
                setattr(owner, name, _make_wrapper(name, function))
        if block_pool is None:
            _Patches.catch_all = self
        else:
            block_pool.__dict__[_PROBE_ATTR] = self
        self._pool = block_pool
        _Patches.armed.append(self)
        self._armed = True
        return self

    def disarm(self) -> None:
        """Stop observing; the last armed probe set restores the original functions exactly."""
        if not self._armed:
            return
        if self._pool is None:
            _Patches.catch_all = None
        else:
            self._pool.__dict__.pop(_PROBE_ATTR, None)
        _Patches.armed.remove(self)
        self._armed = False
        if not _Patches.armed:
            for (owner, name), function in _Patches.originals.items():
                setattr(owner, name, function)
            _Patches.originals.clear()

    def announce_step(self, step: int, ts_ns: int) -> None:
        """Give the next ``new_step_starts`` its step number and time (replay drives both)."""
        self._announced_step = (step, ts_ns)

    # --- emitting -----------------------------------------------------------------------------

    def _emit(self, record: Record) -> None:
        if self._deferred is not None:
            self._deferred.append(record)
            return
        try:
            self.sink(record)
        except Exception:
            self.num_failures += 1

    def _failed(self) -> None:
        self.num_failures += 1

    def _hash_id(self, hash_bytes: bytes) -> int:
        hash_id, is_new = self.interner.intern(hash_bytes)
        if is_new and self.emit_hash_bytes:
            self._emit(HashInterned(hash_id, bytes(hash_bytes)))
        return hash_id

    def _key(self, key: bytes) -> tuple[int, int]:
        """(hash id, group) of a ``BlockHashWithGroupId``: hash bytes + 4-byte big-endian group."""
        return self._hash_id(key[:-4]), int.from_bytes(key[-4:], "big")

    def _keys_on(self, pool: Any, block: Any) -> list[bytes]:
        keys = [] if block.block_hash is None else [block.block_hash]
        keys.extend(pool.cached_block_hashes_by_block.get(block.block_id, ()))
        return keys

    # --- requests -----------------------------------------------------------------------------

    def _enter(self, request: Any, hash_block_size: int) -> None:
        """Make ``request`` the current one; report its arrival or newly completed hash units."""
        request_id = request.request_id
        req = self._reqs.get(request_id)
        hashes = request.block_hashes
        if req is None:
            # A counter, not len(self._reqs): finished requests are forgotten, and a reused
            # number would merge two requests in the trace.
            req = self._reqs[request_id] = (self._req_number(request_id) if self._req_number
                                            else self._num_requests)
            self._num_requests += 1
            num_prompt_units = min(request.num_prompt_tokens // hash_block_size, len(hashes))
            self._emit(RequestArrived(
                req, request.num_prompt_tokens,
                self._hash_ids(hashes, 0, num_prompt_units, hash_block_size),
                request.max_tokens,
                max(0, int(request.arrival_time * 1e9) - self.created_ns),
                self._salt_id(request), request_id))
            self._num_reported_hashes[request_id] = num_prompt_units
        reported = self._num_reported_hashes[request_id]
        if len(hashes) > reported:
            self._emit(HashesExtended(
                req, self._hash_ids(hashes, reported, len(hashes), hash_block_size)))
            self._num_reported_hashes[request_id] = len(hashes)
        self._req = req
        self._request = request

    def _hash_ids(self, hashes: list, start: int, stop: int, hash_block_size: int) -> list[int]:
        ids = []
        for index in range(start, stop):
            hash_id = self._hash_id(hashes[index])
            self._depth[hash_id] = (index + 1) * hash_block_size
            ids.append(hash_id)
        return ids

    def _salt_id(self, request: Any) -> int:
        lora = request.lora_request
        salt = request.cache_salt or (lora.name if lora is not None else None)
        if not salt:
            return 0
        return self._salt_ids.setdefault(salt, len(self._salt_ids) + 1)

    def _leave(self) -> None:
        self._req = -1
        self._request = None

    # --- KVCacheManager: inputs ---------------------------------------------------------------

    def _on_new_step_starts(self, original, manager):
        try:
            if self._announced_step is not None:
                step, ts_ns = self._announced_step
                self._announced_step = None
            else:
                step, ts_ns = self._step + 1, time.time_ns() - self.created_ns
            self._step = step
            self._emit(StepStarted(step, ts_ns))
        except Exception:
            self._failed()
        return original(manager)

    def _on_get_computed_blocks(self, original, manager, request, max_cache_hit_length=None):
        try:
            self._enter(request, manager.block_pool.hash_block_size)
        except Exception:
            self._failed()
        try:
            result = original(manager, request, max_cache_hit_length)
        finally:
            req = self._req
            self._leave()
        try:
            self._emit(ComputedBlocksFound(req, result[1], result[2]))
        except Exception:
            self._failed()
        return result

    def _on_allocate_slots(self, original, manager, request, num_new_tokens,
                           num_new_computed_tokens=0, new_computed_blocks=None,
                           num_lookahead_tokens=0, num_external_computed_tokens=0,
                           *args, **kwargs):
        try:
            self._enter(request, manager.block_pool.hash_block_size)
            num_computed_tokens, num_tokens = request.num_computed_tokens, request.num_tokens
        except Exception:
            self._failed()
            num_computed_tokens = num_tokens = -1
        # The call's effects follow its input record, which needs the result: hold them.
        effects = self._deferred = []
        result = None
        try:
            result = original(manager, request, num_new_tokens, num_new_computed_tokens,
                              new_computed_blocks, num_lookahead_tokens,
                              num_external_computed_tokens, *args, **kwargs)
        finally:
            self._deferred = None
            req = self._req
            self._leave()
            try:
                self._emit(SlotsAllocated(
                    req, num_new_tokens, num_computed_tokens, num_new_computed_tokens,
                    num_lookahead_tokens, num_external_computed_tokens, num_tokens,
                    result is not None))
                for record in effects:
                    self._emit(record)
            except Exception:
                self._failed()
        return result

    def _on_free(self, original, manager, request):
        self._report_release(request)
        try:
            return original(manager, request)
        finally:
            self._forget_if_finished(request)

    def _on_pop_blocks_for_free(self, original, manager, request):
        self._report_release(request)
        try:
            return original(manager, request)
        finally:
            self._forget_if_finished(request)

    def _report_release(self, request: Any) -> None:
        """A free of a finished request is its end; of a running one, a preemption (vLLM's
        ``_preempt_request`` frees first and marks the request PREEMPTED after)."""
        try:
            req = self._reqs.get(request.request_id)
            if req is None:
                return
            if request.is_finished():
                aborted = request.status.name == "FINISHED_ABORTED"
                self._emit(RequestFinished(
                    req, FinishStatus.ABORTED if aborted else FinishStatus.FINISHED))
            else:
                self._emit(RequestPreempted(req))
            self._req = req
        except Exception:
            self._failed()

    def _forget_if_finished(self, request: Any) -> None:
        try:
            if request.is_finished() and self._reqs.pop(request.request_id, None) is not None:
                self._num_reported_hashes.pop(request.request_id, None)
            self._leave()
        except Exception:
            self._failed()

    # --- BlockPool: effects -------------------------------------------------------------------

    def _with_context(self, original, args, remove_reason, store_kind=None):
        saved = self._remove_reason, self._store_kind
        self._remove_reason = remove_reason
        if store_kind is not None:
            self._store_kind = store_kind
        try:
            return original(*args)
        finally:
            self._remove_reason, self._store_kind = saved

    def _on_get_new_blocks(self, original, pool, num_blocks):
        blocks = self._with_context(original, (pool, num_blocks), RemoveReason.LRU_REUSE)
        try:
            req = self._req
            for block in blocks:
                self._emit(BlockAllocated(block.block_id, req))
        except Exception:
            self._failed()
        return blocks

    def _on_touch(self, original, pool, blocks):
        original(pool, blocks)
        try:
            req = self._req
            for block in blocks:
                if not block.is_null:
                    self._emit(BlockTouched(block.block_id, req))
        except Exception:
            self._failed()

    def _on_free_blocks(self, original, pool, ordered_blocks):
        ordered_blocks = list(ordered_blocks)
        original(pool, ordered_blocks)
        try:
            for block in ordered_blocks:
                if not block.is_null:
                    self._emit(BlockFreed(block.block_id, block.ref_cnt,
                                          block.block_hash is not None))
        except Exception:
            self._failed()

    def _on_cache_full_blocks(self, original, pool, *args, **kwargs):
        return self._with_context(lambda: original(pool, *args, **kwargs), (),
                                  RemoveReason.REKEY, StoreKind.FULL)

    def _on_cache_partial_block(self, original, pool, *args, **kwargs):
        kind = StoreKind.CHECKPOINT if self._in_checkpoint else StoreKind.PARTIAL
        return self._with_context(lambda: original(pool, *args, **kwargs), (),
                                  RemoveReason.REKEY, kind)

    def _on_move_block_hashes(self, original, pool, src_block, dst_block):
        return self._with_context(original, (pool, src_block, dst_block),
                                  RemoveReason.REKEY, StoreKind.PARTIAL)

    def _on_evict_blocks(self, original, pool, block_ids):
        return self._with_context(original, (pool, block_ids), RemoveReason.CONNECTOR)

    def _on_reset_prefix_cache(self, original, pool):
        try:
            held = [(block.block_id, key) for block in pool.blocks
                    for key in self._keys_on(pool, block)]
        except Exception:
            self._failed()
            held = []
        reset = original(pool)
        try:
            if reset:
                for block_id, key in held:
                    hash_id, group = self._key(key)
                    self._emit(BlockRemoved(block_id, hash_id, group, self._depth.get(hash_id, 0),
                                            RemoveReason.RESET))
        except Exception:
            self._failed()
        return reset

    def _on_remove_cached_block_hashes(self, original, pool, block):
        removed = original(pool, block)
        if removed:
            try:
                reason = self._remove_reason
                for key in removed:
                    hash_id, group = self._key(key)
                    self._emit(BlockRemoved(block.block_id, hash_id, group,
                                            self._depth.get(hash_id, 0), reason))
                if reason is RemoveReason.STALE_CHECKPOINT:
                    self._num_stripped += len(removed)
            except Exception:
                self._failed()
        return removed

    def _on_insert_block_hash(self, original, pool, block_hash_with_group_id, block, num_tokens):
        try:
            is_new = not (block.block_hash == block_hash_with_group_id
                          or pool.cached_block_hash_to_block.contain(block_hash_with_group_id,
                                                                     block.block_id))
        except Exception:
            self._failed()
            is_new = False
        original(pool, block_hash_with_group_id, block, num_tokens)
        if is_new:
            try:
                hash_id, group = self._key(block_hash_with_group_id)
                self._emit(BlockStored(block.block_id, hash_id, group,
                                       self._depth.get(hash_id, num_tokens or 0),
                                       self._store_kind, self._req))
            except Exception:
                self._failed()

    # --- MambaManager: checkpoints and offload reports ----------------------------------------

    def _on_get_num_blocks_to_allocate(self, original, manager, request_id, num_tokens,
                                       new_computed_blocks, total_computed_tokens,
                                       num_local_computed_tokens, num_tokens_main_model,
                                       apply_admission_cap=False, prefill_end=0):
        checkpoints = getattr(manager, "_checkpoints", None)
        before = checkpoints.get(request_id) if checkpoints is not None else None
        result = original(manager, request_id, num_tokens, new_computed_blocks,
                          total_computed_tokens, num_local_computed_tokens,
                          num_tokens_main_model, apply_admission_cap, prefill_end)
        if checkpoints is not None and not apply_admission_cap:
            try:
                after = checkpoints.get(request_id)
                if after is not None and after is not before:
                    self._report_checkpoint(manager, after, num_tokens_main_model)
            except Exception:
                self._failed()
        return result

    def _report_checkpoint(self, manager, checkpoint, chunk_end: int) -> None:
        position, block_idx = checkpoint
        request = self._request
        if request is not None and position == request.shared_prefix_boundary:
            position_class = CheckpointClass.JUNCTION
        elif request is not None and chunk_end < request.num_prompt_tokens:
            position_class = CheckpointClass.TRANSIENT
        else:
            position_class = CheckpointClass.PROMPT_END
        self._emit(CheckpointRecorded(self._req, manager.kv_cache_group_id, position, block_idx,
                                      position_class))

    def _on_allocate_new_blocks(self, original, manager, request_id, num_tokens,
                                num_tokens_main_model):
        num_offloads = len(manager._pending_boundary_state_offloads)
        blocks = original(manager, request_id, num_tokens, num_tokens_main_model)
        self._report_offloads(manager, num_offloads)
        return blocks

    def _report_offloads(self, manager, num_before: int) -> None:
        try:
            for _, group, block, num_tokens in manager._pending_boundary_state_offloads[
                    num_before:]:
                self._emit(BoundaryStateOffloaded(self._req, group, block.block_id, num_tokens))
        except Exception:
            self._failed()

    def _on_cache_blocks(self, original, manager, request, num_tokens, retention_interval=None,
                         *, replay_boundaries):
        checkpoints = getattr(manager, "_checkpoints", None)
        checkpoint = checkpoints.get(request.request_id) if checkpoints is not None else None
        num_offloads = len(manager._pending_boundary_state_offloads)
        saved = self._remove_reason, self._in_checkpoint, self._num_stripped
        self._remove_reason = RemoveReason.STALE_CHECKPOINT
        self._in_checkpoint = checkpoint is not None
        self._num_stripped = 0
        try:
            original(manager, request, num_tokens, retention_interval,
                     replay_boundaries=replay_boundaries)
            if checkpoint is not None:
                try:
                    self._report_checkpoint_decision(manager, request, checkpoint)
                except Exception:
                    self._failed()
        finally:
            self._remove_reason, self._in_checkpoint, self._num_stripped = saved
        self._report_offloads(manager, num_offloads)

    def _report_checkpoint_decision(self, manager, request, checkpoint) -> None:
        """After publication: a slot not keyed at the checkpoint kept it request-local; any key
        of another length left on it names a state the slot will not hold."""
        position, block_idx = checkpoint
        slot = manager.req_to_blocks[request.request_id][block_idx]
        if slot.is_null:
            return
        pool = manager.block_pool
        keys = [(self._key(key), key) for key in self._keys_on(pool, slot)]
        group = manager.kv_cache_group_id
        if not any(self._depth.get(hash_id) == position for (hash_id, _), _ in keys):
            self._emit(CheckpointSuppressed(self._req, group, position, slot.block_id,
                                            self._num_stripped))
        for (hash_id, _), _ in keys:
            key_num_tokens = self._depth.get(hash_id, 0)
            if key_num_tokens != position:
                self._emit(StaleKeyLeft(self._req, group, slot.block_id, hash_id,
                                        key_num_tokens, position))
