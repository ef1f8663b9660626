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

Cost: the wrappers run on the engine's scheduler thread, ~10 calls per engine step, so each is
a single Python frame with the method's own parameters, and records are batched rather than
handed to the sink one at a time (``benchmarks/capture_overhead.py`` measures it). Where the
optional native core (``kvtrace/_native.c``, see ``kvtrace.native``) is on, the ten hottest
wrappers run their common case in C and hand every other case to the Python wrapper below,
which stays the reference.
"""

from __future__ import annotations

import importlib
import inspect
import struct
import time
from typing import Any, Callable, Protocol

from kvtrace import native
from kvtrace.errors import KvtraceError
from kvtrace.events import (
    BlockAllocated,
    BlockFreed,
    BlockRemoved,
    BlocksReleased,
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
    HashInterner,
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

_PROBE_ATTR = "_kvtrace_probes"  # a BlockPool's probe set: on the instance, or on the class (all)
_GROUP_OF_KEY = struct.Struct(">I").unpack_from  # (key, -4): a key ends in its 4-byte group


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


# --- wrappers -------------------------------------------------------------------------------------
# They run on every cache operation of the engine, so each is one Python frame: it has the
# wrapped method's own parameters (``_make_wrapper`` copies the original's defaults), finds its
# probe set with one attribute read, and does the common work inline; rare paths call into
# ``CacheProbes``. Records are appended to the probe set's list and handed over in batches
# (``CacheProbes._flush``): when the outermost wrapped call returns, or for ``sink_many`` (a
# live capture) once per engine step.

_WRAPPER_FACTORIES: dict[str, Callable[[Callable], Callable]] = {}

# The wrappers with a native fast path (kvtrace/_native.c), used when the classes are patched
# while ``native.core`` is on.
NATIVE_FAST_PATHS = frozenset({
    "new_step_starts", "allocate_slots", "_insert_block_hash", "_remove_cached_block_hashes",
    "get_num_blocks_to_allocate", "allocate_new_blocks", "cache_blocks", "get_new_blocks",
    "touch", "free_blocks"})

_NO_REQ, _UNSEEN_REQ = -1, -2  # ``CacheProbes._req`` outside a call; in a free of an unseen request
_LRU_REUSE, _REKEY, _CONNECTOR, _STALE_CHECKPOINT = (
    RemoveReason.LRU_REUSE, RemoveReason.REKEY, RemoveReason.CONNECTOR,
    RemoveReason.STALE_CHECKPOINT)


def _wrapper_for(*method_names: str) -> Callable:
    def register(factory: Callable[[Callable], Callable]) -> Callable[[Callable], Callable]:
        for method_name in method_names:
            _WRAPPER_FACTORIES[method_name] = factory
        return factory
    return register


def _make_wrapper(method_name: str, original: Callable) -> Callable:
    """The wrapper that replaces ``original``; same parameters and defaults unless it takes
    ``*args`` (the rarely called methods). With the native core, a hot method's wrapper is its
    C fast path, which hands other cases to the Python wrapper."""
    wrapper = _python_wrapper(method_name, original)
    if native.core is None or method_name not in NATIVE_FAST_PATHS:
        return wrapper
    code = original.__code__
    fast = native.core.FastWrapper(method_name, original, wrapper,
                                   code.co_varnames[:code.co_argcount],
                                   original.__defaults__ or ())
    fast.__name__, fast.__qualname__ = wrapper.__name__, wrapper.__qualname__
    fast.__wrapped__ = original
    return fast


def _python_wrapper(method_name: str, original: Callable) -> Callable:
    wrapper = _WRAPPER_FACTORIES[method_name](original)
    if wrapper.__code__.co_flags & inspect.CO_VARARGS == 0:
        if _parameter_names(wrapper) != _parameter_names(original):
            raise ProbeSignatureError(f"kvtrace's wrapper of {method_name} has parameters "
                                      f"{_parameter_names(wrapper)}, vLLM's "
                                      f"{_parameter_names(original)}")
        wrapper.__defaults__ = original.__defaults__
        wrapper.__kwdefaults__ = original.__kwdefaults__
    wrapper.__name__ = method_name
    wrapper.__qualname__ = f"kvtrace_probe.{method_name}"
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    return wrapper


# KVCacheManager: the scheduler's calls. Each holds its records until it returns.

@_wrapper_for("new_step_starts")
def _new_step_starts(original: Callable) -> Callable:
    def new_step_starts(self):
        probe = getattr(self.block_pool, _PROBE_ATTR, None)
        if probe is None:
            return original(self)
        if probe._records:
            probe._flush()  # the last step's, when held for ``sink_many``
        try:
            announced = probe._announced_step
            if announced is None:
                step, ts_ns = probe._step + 1, time.time_ns() - probe.created_ns
            else:
                step, ts_ns = announced
                probe._announced_step = None
            probe._step = step
            probe._records.append(StepStarted(step, ts_ns))
        except Exception:
            probe.num_failures += 1
        result = original(self)
        if not probe._held:
            probe._flush()
        return result
    return new_step_starts


@_wrapper_for("get_computed_blocks")
def _get_computed_blocks(original: Callable) -> Callable:
    def get_computed_blocks(self, request, max_cache_hit_length):
        probe = getattr(self.block_pool, _PROBE_ATTR, None)
        if probe is None:
            return original(self, request, max_cache_hit_length)
        held, probe._held = probe._held, True
        try:
            req = probe._enter(request, self.block_pool.hash_block_size)
        except Exception:
            probe.num_failures += 1
            req = -1
        try:
            result = original(self, request, max_cache_hit_length)
        finally:
            probe._leave(held)
        try:
            probe._records.append(ComputedBlocksFound(req, result[1], result[2]))
        except Exception:
            probe.num_failures += 1
        if not held:
            probe._flush()
        return result
    return get_computed_blocks


@_wrapper_for("allocate_slots")
def _allocate_slots(original: Callable) -> Callable:
    def allocate_slots(self, request, num_new_tokens, num_new_computed_tokens,
                       new_computed_blocks, num_lookahead_tokens, num_external_computed_tokens,
                       delay_cache_blocks, num_encoder_tokens, full_sequence_must_fit,
                       reserved_blocks, has_scheduled_reqs, skip_zeroing_group_ids):
        probe = getattr(self.block_pool, _PROBE_ATTR, None)
        if probe is None:
            return original(self, request, num_new_tokens, num_new_computed_tokens,
                            new_computed_blocks, num_lookahead_tokens,
                            num_external_computed_tokens, delay_cache_blocks, num_encoder_tokens,
                            full_sequence_must_fit, reserved_blocks, has_scheduled_reqs,
                            skip_zeroing_group_ids)
        held, probe._held = probe._held, True
        records = probe._records
        try:
            # Fast path of ``_enter``: a known request with no newly completed hash unit.
            known = probe._reqs.get(request.request_id)
            if known is None or len(request.block_hashes) > known[1]:
                req = probe._enter(request, self.block_pool.hash_block_size)
            else:
                req = probe._req = known[0]
                probe._request = request
            num_computed_tokens, num_tokens = request.num_computed_tokens, request.num_tokens
        except Exception:
            probe.num_failures += 1
            req = num_computed_tokens = num_tokens = -1
        # The call's effects follow its input record, which needs the result: it goes in front.
        first_effect = len(records)
        result = None
        try:
            result = original(self, request, num_new_tokens, num_new_computed_tokens,
                              new_computed_blocks, num_lookahead_tokens,
                              num_external_computed_tokens, delay_cache_blocks,
                              num_encoder_tokens, full_sequence_must_fit, reserved_blocks,
                              has_scheduled_reqs, skip_zeroing_group_ids)
        finally:
            try:
                records.insert(first_effect, SlotsAllocated(
                    req, num_new_tokens, num_computed_tokens, num_new_computed_tokens,
                    num_lookahead_tokens, num_external_computed_tokens, num_tokens,
                    result is not None, full_sequence_must_fit, reserved_blocks,
                    has_scheduled_reqs))
            except Exception:
                probe.num_failures += 1
            probe._req, probe._request, probe._held = _NO_REQ, None, held
            if not held:
                probe._flush()
        return result
    return allocate_slots


@_wrapper_for("free", "pop_blocks_for_free")
def _release(original: Callable) -> Callable:
    def release(self, request):
        probe = getattr(self.block_pool, _PROBE_ATTR, None)
        if probe is None:
            return original(self, request)
        held, probe._held = probe._held, True
        probe._report_release(request)
        try:
            return original(self, request)
        finally:
            probe._forget_if_finished(request)
            probe._leave(held)
            if not held:
                probe._flush()
    return release


# BlockPool: the effects.

@_wrapper_for("get_new_blocks")
def _get_new_blocks(original: Callable) -> Callable:
    def get_new_blocks(self, num_blocks):
        probe = getattr(self, _PROBE_ATTR, None)
        if probe is None:
            return original(self, num_blocks)
        reason, probe._remove_reason = probe._remove_reason, _LRU_REUSE
        try:
            blocks = original(self, num_blocks)
        finally:
            probe._remove_reason = reason
        try:
            req = probe._req
            probe._records.extend([BlockAllocated(block.block_id, req) for block in blocks])
        except Exception:
            probe.num_failures += 1
        if not probe._held:
            probe._flush()
        return blocks
    return get_new_blocks


@_wrapper_for("touch")
def _touch(original: Callable) -> Callable:
    def touch(self, blocks):
        result = original(self, blocks)
        probe = getattr(self, _PROBE_ATTR, None)
        if probe is not None:
            try:
                req = probe._req
                probe._records.extend([BlockTouched(block.block_id, req) for block in blocks
                                       if not block.is_null])
            except Exception:
                probe.num_failures += 1
            if not probe._held:
                probe._flush()
        return result
    return touch


@_wrapper_for("free_blocks")
def _free_blocks(original: Callable) -> Callable:
    def free_blocks(self, ordered_blocks):
        probe = getattr(self, _PROBE_ATTR, None)
        if probe is None:
            return original(self, ordered_blocks)
        ordered_blocks = list(ordered_blocks)  # an iterator would be spent by vLLM
        if probe._req == _NO_REQ:  # not inside a cache-manager call: the engine frees directly
            try:
                probe._records.append(BlocksReleased([block.block_id for block in ordered_blocks
                                                      if not block.is_null]))
            except Exception:
                probe.num_failures += 1
        result = original(self, ordered_blocks)
        try:
            probe._records.extend([
                BlockFreed(block.block_id, block.ref_cnt, block.block_hash is not None)
                for block in ordered_blocks if not block.is_null])
        except Exception:
            probe.num_failures += 1
        if not probe._held:
            probe._flush()
        return result
    return free_blocks


def _context_wrapper(remove_reason: RemoveReason, store_kind: StoreKind | None = None, *,
                     checkpoint_aware: bool = False) -> Callable[[Callable], Callable]:
    """A wrapper that only says why hashes are removed (and how they are stored) during the
    call; ``checkpoint_aware``: a partial store inside a checkpoint publication is CHECKPOINT."""
    def factory(original: Callable) -> Callable:
        def wrapper(self, *args, **kwargs):
            probe = getattr(self, _PROBE_ATTR, None)
            if probe is None:
                return original(self, *args, **kwargs)
            saved = probe._remove_reason, probe._store_kind
            probe._remove_reason = remove_reason
            if checkpoint_aware:
                probe._store_kind = (StoreKind.CHECKPOINT if probe._in_checkpoint
                                     else StoreKind.PARTIAL)
            elif store_kind is not None:
                probe._store_kind = store_kind
            try:
                result = original(self, *args, **kwargs)
            finally:
                probe._remove_reason, probe._store_kind = saved
            if not probe._held:
                probe._flush()
            return result
        return wrapper
    return factory


_wrapper_for("cache_full_blocks")(_context_wrapper(_REKEY, StoreKind.FULL))
_wrapper_for("cache_partial_block")(_context_wrapper(_REKEY, checkpoint_aware=True))
_wrapper_for("move_block_hashes")(_context_wrapper(_REKEY, StoreKind.PARTIAL))
_wrapper_for("evict_blocks")(_context_wrapper(_CONNECTOR))


@_wrapper_for("reset_prefix_cache")
def _reset_prefix_cache(original: Callable) -> Callable:
    def reset_prefix_cache(self):
        probe = getattr(self, _PROBE_ATTR, None)
        if probe is None:
            return original(self)
        held = probe._keys_held_by_blocks(self)
        reset = original(self)
        if reset:
            probe._report_reset(held)
        if not probe._held:
            probe._flush()
        return reset
    return reset_prefix_cache


@_wrapper_for("_remove_cached_block_hashes")
def _remove_cached_block_hashes(original: Callable) -> Callable:
    def _remove_cached_block_hashes(self, block):
        removed = original(self, block)
        if removed:  # mostly not: get_new_blocks asks this of every block it hands out
            probe = getattr(self, _PROBE_ATTR, None)
            if probe is not None:
                probe._report_removed(block.block_id, removed)
                if not probe._held:
                    probe._flush()
        return removed
    return _remove_cached_block_hashes


@_wrapper_for("_insert_block_hash")
def _insert_block_hash(original: Callable) -> Callable:
    def _insert_block_hash(self, block_hash_with_group_id, block, num_tokens):
        probe = getattr(self, _PROBE_ATTR, None)
        if probe is None:
            return original(self, block_hash_with_group_id, block, num_tokens)
        if block.block_hash is None:
            # An unhashed block gets the key as its own unless the key already names it.
            result = original(self, block_hash_with_group_id, block, num_tokens)
            is_new = block.block_hash is not None
        else:
            try:
                is_new = not (block.block_hash == block_hash_with_group_id
                              or self.cached_block_hash_to_block.contain(
                                  block_hash_with_group_id, block.block_id))
            except Exception:
                probe.num_failures += 1
                is_new = False
            result = original(self, block_hash_with_group_id, block, num_tokens)
        if is_new:
            probe._report_stored(block.block_id, block_hash_with_group_id, num_tokens)
            if not probe._held:
                probe._flush()
        return result
    return _insert_block_hash


# MambaManager: checkpoints and offload reports.

@_wrapper_for("get_num_blocks_to_allocate")
def _get_num_blocks_to_allocate(original: Callable) -> Callable:
    def get_num_blocks_to_allocate(self, request_id, num_tokens, new_computed_blocks,
                                   total_computed_tokens, num_local_computed_tokens,
                                   num_tokens_main_model, apply_admission_cap, prefill_end):
        probe = getattr(self.block_pool, _PROBE_ATTR, None)
        checkpoints = getattr(self, "_checkpoints", None)  # only in "align" mode
        if probe is None or checkpoints is None or apply_admission_cap:
            return original(self, request_id, num_tokens, new_computed_blocks,
                            total_computed_tokens, num_local_computed_tokens,
                            num_tokens_main_model, apply_admission_cap, prefill_end)
        before = checkpoints.get(request_id)
        result = original(self, request_id, num_tokens, new_computed_blocks,
                          total_computed_tokens, num_local_computed_tokens,
                          num_tokens_main_model, apply_admission_cap, prefill_end)
        after = checkpoints.get(request_id)
        if after is not None and after is not before:
            probe._report_checkpoint(self, after, num_tokens_main_model)
            if not probe._held:
                probe._flush()
        return result
    return get_num_blocks_to_allocate


@_wrapper_for("allocate_new_blocks")
def _allocate_new_blocks(original: Callable) -> Callable:
    def allocate_new_blocks(self, request_id, num_tokens, num_tokens_main_model):
        probe = getattr(self.block_pool, _PROBE_ATTR, None)
        if probe is None:
            return original(self, request_id, num_tokens, num_tokens_main_model)
        num_offloads = len(self._pending_boundary_state_offloads)
        blocks = original(self, request_id, num_tokens, num_tokens_main_model)
        if len(self._pending_boundary_state_offloads) > num_offloads:
            probe._report_offloads(self, num_offloads)
        return blocks
    return allocate_new_blocks


@_wrapper_for("cache_blocks")
def _cache_blocks(original: Callable) -> Callable:
    def cache_blocks(self, request, num_tokens, retention_interval, *, replay_boundaries):
        probe = getattr(self.block_pool, _PROBE_ATTR, None)
        if probe is None:
            return original(self, request, num_tokens, retention_interval,
                            replay_boundaries=replay_boundaries)
        checkpoints = getattr(self, "_checkpoints", None)  # only in "align" mode
        checkpoint = None if checkpoints is None else checkpoints.get(request.request_id)
        num_offloads = len(self._pending_boundary_state_offloads)
        if checkpoint is None:  # most calls: no slot to publish or strip, no context to set
            result = original(self, request, num_tokens, retention_interval,
                              replay_boundaries=replay_boundaries)
        else:
            saved = probe._remove_reason, probe._in_checkpoint, probe._num_stripped
            probe._remove_reason = _STALE_CHECKPOINT
            probe._in_checkpoint = True
            probe._num_stripped = 0
            try:
                result = original(self, request, num_tokens, retention_interval,
                                  replay_boundaries=replay_boundaries)
                probe._report_checkpoint_decision(self, request, checkpoint)
            finally:
                probe._remove_reason, probe._in_checkpoint, probe._num_stripped = saved
        if len(self._pending_boundary_state_offloads) > num_offloads:
            probe._report_offloads(self, num_offloads)
        if not probe._held:
            probe._flush()
        return result
    return cache_blocks


def _probes_changed() -> None:
    """Which probe set observes which cache changed: the native wrappers forget what they saw."""
    if native.built is not None:
        native.built.probes_changed()


native.configure(StepStarted, SlotsAllocated, BlockStored, BlockRemoved, HashInterned,
                 BlockAllocated, BlockTouched, BlockFreed, BlocksReleased, _NO_REQ,
                 _STALE_CHECKPOINT, _LRU_REUSE)


class CacheProbes(object if native.built is None else native.built.ProbeState):
    """Turns calls on one vLLM prefix cache (or all of them) into trace records.

    ``interner`` maps hash bytes to dense ids (``events.HashInterner`` for capture; replay passes
    one that decodes the ids it encoded). ``req_number`` maps a vLLM request id to the trace's
    ``req`` (default: dense ints in arrival order). ``created_ns`` is the trace's wall-clock
    origin for ``StepStarted.ts_ns``. With ``emit_hash_bytes`` a ``HashInterned`` record precedes
    the first use of each new id.

    Records reach ``sink`` in order when the outermost wrapped call returns. With ``sink_many``
    they go there instead, as one list per engine step, handed over when the next step starts
    (and on ``disarm``): one call per step for a capture's buffer. Each list is new: the sink
    may keep it.
    """

    def __init__(self, sink: Callable[[Record], None], interner: HashIdInterner, *,
                 req_number: Callable[[str], int] | None = None, created_ns: int | None = None,
                 emit_hash_bytes: bool = False,
                 sink_many: Callable[[list[Record]], None] | None = None) -> None:
        self.sink = sink
        self.sink_many = sink_many
        self.interner = interner
        self.emit_hash_bytes = bool(emit_hash_bytes)
        # The native core interns into a plain HashInterner's dict itself; others go through
        # ``interner.intern`` (the Python wrappers).
        self._interned_ids = interner.ids if type(interner) is HashInterner else None
        self.created_ns = time.time_ns() if created_ns is None else created_ns
        self.num_failures = 0
        self._records: list[Record] = []
        # True while records wait: inside a KVCacheManager call (until it returns), and always
        # with ``sink_many`` (until the next step starts).
        self._held = sink_many is not None
        self._req_number = req_number
        self._reqs: dict[str, tuple[int, int]] = {}  # request id -> (req, hash units reported)
        self._num_requests = 0
        self._salt_ids: dict[str, int] = {}
        self._depth: dict[int, int] = {}  # hash id -> prefix length in tokens it covers
        self._step = -1
        self._announced_step: tuple[int, int] | None = None
        self._pool: Any = None
        self._armed = False
        # Context set by the outer method being called.
        self._req = _NO_REQ
        self._request: Any = None
        self._remove_reason = RemoveReason.UNKNOWN
        self._store_kind = StoreKind.FULL
        self._in_checkpoint = False
        self._num_stripped = 0

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
            wrappers = [(owner, name, function, _make_wrapper(name, function))
                        for owner, name, function in targets]
            for owner, name, function, wrapper in wrappers:
                _Patches.originals[(owner, name)] = function
                setattr(owner, name, wrapper)
        if block_pool is None:
            _Patches.catch_all = self
            setattr(_block_pool_class(), _PROBE_ATTR, self)
        else:
            block_pool.__dict__[_PROBE_ATTR] = self
        self._pool = block_pool
        _Patches.armed.append(self)
        self._armed = True
        _probes_changed()
        return self

    def disarm(self) -> None:
        """Stop observing; the last armed probe set restores the original functions exactly."""
        if not self._armed:
            return
        if self._pool is None:
            _Patches.catch_all = None
            delattr(_block_pool_class(), _PROBE_ATTR)
        else:
            self._pool.__dict__.pop(_PROBE_ATTR, None)
        _Patches.armed.remove(self)
        self._armed = False
        _probes_changed()
        if not _Patches.armed:
            for (owner, name), function in _Patches.originals.items():
                setattr(owner, name, function)
            _Patches.originals.clear()
        self._flush()

    def announce_step(self, step: int, ts_ns: int) -> None:
        """Give the next ``new_step_starts`` its step number and time (replay drives both)."""
        self._announced_step = (step, ts_ns)

    # --- emitting -----------------------------------------------------------------------------

    def _flush(self) -> None:
        """Hand the held records to the sink (never raising; a failing sink loses them)."""
        records = self._records
        if not records:
            return
        self._records = []
        if self.sink_many is not None:
            try:
                self.sink_many(records)
            except Exception:
                self.num_failures += 1
        else:
            sink = self.sink
            for record in records:
                try:
                    sink(record)
                except Exception:
                    self.num_failures += 1

    def _key(self, key: bytes) -> tuple[int, int]:
        """(hash id, group) of a ``BlockHashWithGroupId``: hash bytes + 4-byte big-endian group."""
        hash_bytes = key[:-4]
        hash_id, is_new = self.interner.intern(hash_bytes)
        if is_new and self.emit_hash_bytes:
            self._records.append(HashInterned(hash_id, hash_bytes))
        return hash_id, _GROUP_OF_KEY(key, -4)[0]

    def _keys_on(self, pool: Any, block: Any) -> list[bytes]:
        keys = [] if block.block_hash is None else [block.block_hash]
        keys.extend(pool.cached_block_hashes_by_block.get(block.block_id, ()))
        return keys

    # --- requests -----------------------------------------------------------------------------

    def _enter(self, request: Any, hash_block_size: int) -> int:
        """Make ``request`` the current one; report its arrival or newly completed hash units."""
        request_id = request.request_id
        known = self._reqs.get(request_id)
        hashes = request.block_hashes
        if known is None:
            # A counter, not len(self._reqs): finished requests are forgotten, and a reused
            # number would merge two requests in the trace.
            req = (self._req_number(request_id) if self._req_number else self._num_requests)
            self._num_requests += 1
            num_prompt_units = min(request.num_prompt_tokens // hash_block_size, len(hashes))
            self._records.append(RequestArrived(
                req, request.num_prompt_tokens,
                self._hash_ids(hashes, 0, num_prompt_units, hash_block_size),
                request.max_tokens,
                max(0, int(request.arrival_time * 1e9) - self.created_ns),
                self._salt_id(request), request_id))
            known = self._reqs[request_id] = (req, num_prompt_units)
        req, reported = known
        if len(hashes) > reported:
            self._records.append(HashesExtended(
                req, self._hash_ids(hashes, reported, len(hashes), hash_block_size)))
            self._reqs[request_id] = (req, len(hashes))
        self._req = req
        self._request = request
        return req

    def _hash_ids(self, hashes: list, start: int, stop: int, hash_block_size: int) -> list[int]:
        """Intern a request's hash units (a prompt has hundreds: comprehensions, not a loop; with
        a plain HashInterner and the native core, all of it in C)."""
        if self._interned_ids is not None and native.core is not None and type(hashes) is list:
            return native.core.intern_hashes(self, hashes, start, stop, hash_block_size)
        hashes = hashes[start:stop]
        interned = list(map(self.interner.intern, hashes))
        ids = [hash_id for hash_id, _ in interned]
        if self.emit_hash_bytes:
            self._records.extend([HashInterned(hash_id, bytes(hash_bytes))
                                  for (hash_id, is_new), hash_bytes in zip(interned, hashes)
                                  if is_new])
        self._depth.update(zip(ids, range((start + 1) * hash_block_size,
                                          (stop + 1) * hash_block_size, hash_block_size)))
        return ids

    def _salt_id(self, request: Any) -> int:
        lora = request.lora_request
        salt = request.cache_salt or (lora.name if lora is not None else None)
        if not salt:
            return 0
        return self._salt_ids.setdefault(salt, len(self._salt_ids) + 1)

    def _leave(self, held: bool) -> None:
        self._req = _NO_REQ
        self._request = None
        self._held = held

    def _report_release(self, request: Any) -> None:
        """A free of a finished request is its end; of a running one, a preemption (vLLM's
        ``_preempt_request`` frees first and marks the request PREEMPTED after). A request the
        probes never saw (it started before arming) is ``_UNSEEN_REQ`` meanwhile: its blocks
        are freed by the cache manager, not released by the engine (``BlocksReleased``)."""
        self._req = _UNSEEN_REQ
        try:
            known = self._reqs.get(request.request_id)
            if known is None:
                return
            req = known[0]
            if request.is_finished():
                aborted = request.status.name == "FINISHED_ABORTED"
                self._records.append(RequestFinished(
                    req, FinishStatus.ABORTED if aborted else FinishStatus.FINISHED))
            else:
                self._records.append(RequestPreempted(req))
            self._req = req
        except Exception:
            self.num_failures += 1

    def _forget_if_finished(self, request: Any) -> None:
        try:
            if request.is_finished():
                self._reqs.pop(request.request_id, None)
        except Exception:
            self.num_failures += 1

    # --- BlockPool: effects -------------------------------------------------------------------

    def _report_stored(self, block_id: int, key: bytes, num_tokens: int | None) -> None:
        try:
            hash_id, group = self._key(key)
            self._records.append(BlockStored(block_id, hash_id, group,
                                             self._depth.get(hash_id, num_tokens or 0),
                                             self._store_kind, self._req))
        except Exception:
            self.num_failures += 1

    def _report_removed(self, block_id: int, removed: list[bytes]) -> None:
        try:
            reason = self._remove_reason
            for key in removed:
                hash_id, group = self._key(key)
                self._records.append(BlockRemoved(block_id, hash_id, group,
                                                  self._depth.get(hash_id, 0), reason))
            if reason is _STALE_CHECKPOINT:
                self._num_stripped += len(removed)
        except Exception:
            self.num_failures += 1

    def _keys_held_by_blocks(self, pool: Any) -> list[tuple[int, bytes]]:
        try:
            return [(block.block_id, key) for block in pool.blocks
                    for key in self._keys_on(pool, block)]
        except Exception:
            self.num_failures += 1
            return []

    def _report_reset(self, held: list[tuple[int, bytes]]) -> None:
        try:
            for block_id, key in held:
                hash_id, group = self._key(key)
                self._records.append(BlockRemoved(block_id, hash_id, group,
                                                  self._depth.get(hash_id, 0),
                                                  RemoveReason.RESET))
        except Exception:
            self.num_failures += 1

    # --- MambaManager: checkpoints and offload reports ----------------------------------------

    def _report_checkpoint(self, manager: Any, checkpoint: tuple[int, int],
                           chunk_end: int) -> None:
        try:
            position, block_idx = checkpoint
            request = self._request
            if request is not None and position == request.shared_prefix_boundary:
                position_class = CheckpointClass.JUNCTION
            elif request is not None and chunk_end < request.num_prompt_tokens:
                position_class = CheckpointClass.TRANSIENT
            else:
                position_class = CheckpointClass.PROMPT_END
            self._records.append(CheckpointRecorded(
                self._req, manager.kv_cache_group_id, position, block_idx, position_class))
        except Exception:
            self.num_failures += 1

    def _report_offloads(self, manager: Any, num_before: int) -> None:
        try:
            for _, group, block, num_tokens in manager._pending_boundary_state_offloads[
                    num_before:]:
                self._records.append(BoundaryStateOffloaded(self._req, group, block.block_id,
                                                            num_tokens))
        except Exception:
            self.num_failures += 1

    def _report_checkpoint_decision(self, manager: Any, request: Any,
                                    checkpoint: tuple[int, int]) -> None:
        """After publication: a slot not keyed at the checkpoint kept it request-local; any key
        of another length left on it names a state the slot will not hold."""
        try:
            position, block_idx = checkpoint
            slot = manager.req_to_blocks[request.request_id][block_idx]
            if slot.is_null:
                return
            hash_ids = [self._key(key)[0] for key in self._keys_on(manager.block_pool, slot)]
            group = manager.kv_cache_group_id
            if not any(self._depth.get(hash_id) == position for hash_id in hash_ids):
                self._records.append(CheckpointSuppressed(self._req, group, position,
                                                          slot.block_id, self._num_stripped))
            for hash_id in hash_ids:
                key_num_tokens = self._depth.get(hash_id, 0)
                if key_num_tokens != position:
                    self._records.append(StaleKeyLeft(self._req, group, slot.block_id, hash_id,
                                                      key_num_tokens, position))
        except Exception:
            self.num_failures += 1


def _block_pool_class() -> type:
    module_name, class_name = _BLOCK_POOL.rsplit(".", 1)
    return getattr(importlib.import_module(module_name), class_name)
