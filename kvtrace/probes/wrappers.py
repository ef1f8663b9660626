"""The wrappers that replace vLLM 0.33's prefix-cache methods, and the process-wide patch table.

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
optional native core (``csrc/``, see ``kvtrace.native``) is on, the ten hottest
wrappers run their common case in C and hand every other case to the Python wrapper below,
which stays the reference.

A wrapper finds its probe set (a ``CacheProbes``, ``cache_probes.py``) on the block pool and
talks to it only through ``WrappedProbeState`` (``probe_state.py``).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import time
from typing import Any, Callable

from kvtrace import native
from kvtrace.events import (
    BlockAllocated,
    BlockFreed,
    BlockRemoved,
    BlocksCached,
    BlocksReleased,
    BlockStored,
    BlockTouched,
    ComputedBlocksFound,
    HashInterned,
    RemoveReason,
    SlotsAllocated,
    StepStarted,
    StoreKind,
)
from kvtrace.probes.probe_state import PROBE_ATTR
from kvtrace.probes.signatures import ProbeSignatureError, parameter_names

# --- wrappers -------------------------------------------------------------------------------------
# They run on every cache operation of the engine, so each is one Python frame: it has the
# wrapped method's own parameters (``_make_wrapper`` copies the original's defaults), finds its
# probe set with one attribute read, and does the common work inline; rare paths call into
# ``CacheProbes``. Records are appended to the probe set's list and handed over in batches
# (``CacheProbes._flush``): when the outermost wrapped call returns, or for ``sink_many`` (a
# live capture) once per engine step.

_WRAPPER_FACTORIES: dict[str, Callable[[Callable], Callable]] = {}

# The wrappers with a native fast path (csrc/probes.c), used when the classes are patched
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


def wrapper_key(owner: type, method_name: str) -> str:
    """The registry key of ``owner.method_name``'s wrapper: ``Class.method`` where two classes
    have methods of one name and different jobs (``KVCacheManager.cache_blocks``), else the
    method's name."""
    qualified = f"{owner.__name__}.{method_name}"
    return qualified if qualified in _WRAPPER_FACTORIES else method_name


def _make_wrapper(method_name: str, original: Callable) -> Callable:
    """The wrapper that replaces ``original`` (``method_name``: its ``wrapper_key``); same
    parameters and defaults unless it takes ``*args`` (the rarely called methods). With the
    native core, a hot method's wrapper is its C fast path, which hands other cases to the
    Python wrapper."""
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
        if parameter_names(wrapper) != parameter_names(original):
            wrapper = _factory_for(method_name, parameter_names(original))(original)
        if parameter_names(wrapper) != parameter_names(original):
            raise ProbeSignatureError(f"kvtrace's wrapper of {method_name} has parameters "
                                      f"{parameter_names(wrapper)}, vLLM's "
                                      f"{parameter_names(original)}")
        wrapper.__defaults__ = original.__defaults__
        wrapper.__kwdefaults__ = original.__kwdefaults__
    wrapper.__name__ = method_name.rpartition(".")[2]
    wrapper.__qualname__ = f"kvtrace_probe.{method_name}"
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    return wrapper


_RELEASE_FACTORIES: dict[tuple[str, tuple[str, ...]], Callable[[Callable], Callable]] = {}


def _factory_for(method_name: str, names: tuple[str, ...]) -> Callable[[Callable], Callable]:
    """The wrapper factory of ``method_name`` rebuilt for a release whose method has only the
    parameters ``names``. The wrappers below are written against the newest release, and an
    older one lacks only trailing parameters (``signatures.SINCE``); those are taken out of the
    wrapper's ``def`` and of its calls of ``original``, so that the wrapper is still one frame
    with the method's own parameters. A wrapper that uses a missing parameter otherwise is
    refused."""
    key = (method_name, names)
    if key not in _RELEASE_FACTORIES:
        factory = _WRAPPER_FACTORIES[method_name]
        module = ast.parse(textwrap.dedent(inspect.getsource(factory)))
        (factory_def,) = module.body
        factory_def.decorator_list = []  # registered already
        wrapper_def = next(node for node in factory_def.body
                           if isinstance(node, ast.FunctionDef))
        arguments = wrapper_def.args
        missing = {a.arg for a in arguments.args + arguments.kwonlyargs} - {
            name.lstrip("*") for name in names}
        arguments.args = [a for a in arguments.args if a.arg not in missing]
        kept = [(a, d) for a, d in zip(arguments.kwonlyargs, arguments.kw_defaults)
                if a.arg not in missing]
        arguments.kwonlyargs, arguments.kw_defaults = [a for a, _ in kept], [d for _, d in kept]
        for node in ast.walk(wrapper_def):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == "original"):
                node.args = [a for a in node.args
                             if not (isinstance(a, ast.Name) and a.id in missing)]
                node.keywords = [k for k in node.keywords if k.arg not in missing]
        used = {node.id for node in ast.walk(wrapper_def) if isinstance(node, ast.Name)}
        if used & missing:
            raise ProbeSignatureError(f"kvtrace's wrapper of {method_name} uses "
                                      f"{', '.join(sorted(used & missing))}, which this vLLM's "
                                      "method does not have")
        ast.increment_lineno(module, inspect.getsourcelines(factory)[1] - 1)
        namespace: dict[str, Any] = {}
        exec(compile(module, inspect.getsourcefile(factory), "exec"), factory.__globals__,
             namespace)
        _RELEASE_FACTORIES[key] = namespace[factory_def.name]
    return _RELEASE_FACTORIES[key]


# KVCacheManager: the scheduler's calls. Each holds its records until it returns.

@_wrapper_for("new_step_starts")
def _new_step_starts(original: Callable) -> Callable:
    def new_step_starts(self):
        probe = getattr(self.block_pool, PROBE_ATTR, None)
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
        probe = getattr(self.block_pool, PROBE_ATTR, None)
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
        probe = getattr(self.block_pool, PROBE_ATTR, None)
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
            num_in_flight_tokens = request.num_in_flight_tokens
        except Exception:
            probe.num_failures += 1
            req = num_computed_tokens = num_tokens = num_in_flight_tokens = -1
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
                    has_scheduled_reqs, num_in_flight_tokens))
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
        probe = getattr(self.block_pool, PROBE_ATTR, None)
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


@_wrapper_for("KVCacheManager.cache_blocks")
def _manager_cache_blocks(original: Callable) -> Callable:
    def cache_blocks(self, request, num_computed_tokens):
        probe = getattr(self.block_pool, PROBE_ATTR, None)
        if probe is None:
            return original(self, request, num_computed_tokens)
        held, probe._held = probe._held, True
        try:
            req = probe._enter(request, self.block_pool.hash_block_size)
            probe._records.append(BlocksCached(req, num_computed_tokens,
                                               request.num_computed_tokens, request.num_tokens))
        except Exception:
            probe.num_failures += 1
        try:
            return original(self, request, num_computed_tokens)
        finally:
            probe._leave(held)
            if not held:
                probe._flush()
    return cache_blocks


# BlockPool: the effects.

@_wrapper_for("get_new_blocks")
def _get_new_blocks(original: Callable) -> Callable:
    def get_new_blocks(self, num_blocks):
        probe = getattr(self, PROBE_ATTR, None)
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
        probe = getattr(self, PROBE_ATTR, None)
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
        probe = getattr(self, PROBE_ATTR, None)
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
            probe = getattr(self, PROBE_ATTR, None)
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
        probe = getattr(self, PROBE_ATTR, None)
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
            probe = getattr(self, PROBE_ATTR, None)
            if probe is not None:
                probe._report_removed(block.block_id, removed)
                if not probe._held:
                    probe._flush()
        return removed
    return _remove_cached_block_hashes


@_wrapper_for("_insert_block_hash")
def _insert_block_hash(original: Callable) -> Callable:
    def _insert_block_hash(self, block_hash_with_group_id, block, num_tokens):
        probe = getattr(self, PROBE_ATTR, None)
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
        probe = getattr(self.block_pool, PROBE_ATTR, None)
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
        probe = getattr(self.block_pool, PROBE_ATTR, None)
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
        probe = getattr(self.block_pool, PROBE_ATTR, None)
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

