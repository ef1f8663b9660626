"""The probe state: turns the wrapped calls on vLLM 0.33's prefix cache into kvtrace records.

``CacheProbes(sink, interner).arm(block_pool)`` patches the real classes (by qualified name, after
checking every method's signature against 0.33.0, ``signatures.py``, refusing before anything is
patched) and routes calls on *that* pool's cache to ``sink(record)``; ``arm()`` with no pool
observes every cache in the process (live capture). Several probes can be armed at once (one per
replay backend); the class patches (``wrappers.py``) stay while any is armed and ``disarm`` of
the last restores the original function objects exactly.

The wrappers keep the common work inline and call the ``_enter`` / ``_leave`` / ``_report_*``
methods here for the rest; ``probe_state.WrappedProbeState`` lists what they use. The reporting
methods never raise: a failure is counted in ``num_failures``.
"""

from __future__ import annotations

import struct
import time
from typing import Any, Callable, Protocol

from kvtrace import native
from kvtrace.errors import KvtraceError
from kvtrace.events import (
    BlockRemoved,
    BlockStored,
    BoundaryStateOffloaded,
    CheckpointClass,
    CheckpointRecorded,
    CheckpointSuppressed,
    FinishStatus,
    HashesExtended,
    HashInterned,
    HashInterner,
    Record,
    RemoveReason,
    RequestArrived,
    RequestFinished,
    RequestPreempted,
    StaleKeyLeft,
    StoreKind,
)
from kvtrace.probes.probe_state import PROBE_ATTR, WrappedProbeState
from kvtrace.probes.signatures import block_pool_class, probe_targets
from kvtrace.probes.wrappers import (
    _NO_REQ,
    _STALE_CHECKPOINT,
    _UNSEEN_REQ,
    _make_wrapper,
    _probes_changed,
    wrapper_key,
)

_GROUP_OF_KEY = struct.Struct(">I").unpack_from  # (key, -4): a key ends in its 4-byte group


class _Patches:
    """The process-wide class patches, shared by every armed probe set."""

    originals: dict[tuple[type, str], Callable] = {}
    armed: list[WrappedProbeState] = []
    catch_all: WrappedProbeState | None = None


class HashIdInterner(Protocol):
    def intern(self, hash_bytes: bytes) -> tuple[int, bool]: ...


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
        # request id -> the ids of the hash units reported, for a ring's keyframe to read back
        # instead of interning every request's hashes again while the scheduler waits
        self._hash_ids_of: dict[str, list[int]] = {}
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
            wrappers = [(owner, name, function,
                         _make_wrapper(wrapper_key(owner, name), function))
                        for owner, name, function in targets]
            for owner, name, function, wrapper in wrappers:
                _Patches.originals[(owner, name)] = function
                setattr(owner, name, wrapper)
        if block_pool is None:
            _Patches.catch_all = self
            setattr(block_pool_class(), PROBE_ATTR, self)
        else:
            block_pool.__dict__[PROBE_ATTR] = self
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
            delattr(block_pool_class(), PROBE_ATTR)
        else:
            self._pool.__dict__.pop(PROBE_ATTR, None)
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

    def intern_keys(self, keys: list[bytes]) -> list[tuple[int, int]]:
        """(hash id, group) of many keys at once (the start snapshot's thousands, which
        announces its new hashes itself): with a plain ``HashInterner``, new ids are given in
        bulk, in order of first appearance."""
        groups = [_GROUP_OF_KEY(key, -4)[0] for key in keys]
        hashes = [key[:-4] for key in keys]
        ids = self._interned_ids
        if ids is None:
            return [(self.interner.intern(h)[0], g) for h, g in zip(hashes, groups)]
        new = [h for h in dict.fromkeys(hashes) if h not in ids]
        first = len(ids)
        ids.update(zip(new, range(first, first + len(new))))
        return list(zip(map(ids.__getitem__, hashes), groups))

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
            hash_ids = self._hash_ids(hashes, 0, num_prompt_units, hash_block_size)
            self._records.append(RequestArrived(
                req, request.num_prompt_tokens, hash_ids, request.max_tokens,
                max(0, int(request.arrival_time * 1e9) - self.created_ns),
                self._salt_id(request), request_id))
            known = self._reqs[request_id] = (req, num_prompt_units)
            self._hash_ids_of[request_id] = list(hash_ids)  # the record keeps its own
        req, reported = known
        if len(hashes) > reported:
            hash_ids = self._hash_ids(hashes, reported, len(hashes), hash_block_size)
            self._records.append(HashesExtended(req, hash_ids))
            self._reqs[request_id] = (req, len(hashes))
            self._hash_ids_of.setdefault(request_id, []).extend(hash_ids)
        self._req = req
        self._request = request
        return req

    def adopt_request(self, request: Any, hash_block_size: int) -> tuple[int, list[int]]:
        """Take over a request already in flight when the capture armed (the start snapshot):
        number it and intern every block hash it has; no ``RequestArrived`` is reported for
        it. Returns its ``req`` and hash ids. A request the probes know already (a ring's
        keyframe, after ``report_request``) keeps its number."""
        request_id = request.request_id
        hashes = request.block_hashes
        known = self._reqs.get(request_id)
        if known is not None:
            reported = self._hash_ids_of.get(request_id)
            if reported is not None and len(reported) == len(hashes):
                return known[0], list(reported)
            return known[0], self._hash_ids(hashes, 0, len(hashes), hash_block_size)
        req = self._req_number(request_id) if self._req_number else self._num_requests
        self._num_requests += 1
        hash_ids = self._hash_ids(hashes, 0, len(hashes), hash_block_size)
        self._reqs[request_id] = (req, len(hashes))
        self._hash_ids_of[request_id] = list(hash_ids)
        return req, hash_ids

    def report_request(self, request: Any, hash_block_size: int) -> None:
        """Report what the trace does not yet say of a request in flight (its arrival, the
        hash units it completed since), as its next probed call would: before a keyframe,
        so that the trace read on through the keyframe and the trace read from it agree."""
        held = self._held
        try:
            self._enter(request, hash_block_size)
        finally:
            self._leave(held)

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
                self._hash_ids_of.pop(request.request_id, None)
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


