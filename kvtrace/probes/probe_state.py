"""The seam between the wrappers (``wrappers.py``) and their probe set (``CacheProbes``,
``cache_probes.py``): where a wrapper finds its probe set, and all it uses of it."""

from __future__ import annotations

from typing import Any, Protocol

from kvtrace.events import Record, RemoveReason, StoreKind

PROBE_ATTR = "_kvtrace_probes"  # a BlockPool's probe set: on the instance, or on the class (all)


class WrappedProbeState(Protocol):
    """What the wrappers read, write and call on their probe set (``CacheProbes``).

    The wrappers do the common work inline on these attributes and call the methods for the
    rare paths. The native fast paths (``csrc/probes.c``) read the same attributes through
    ``native.built.ProbeState``'s slots (plus ``_depth``, ``_interned_ids``,
    ``emit_hash_bytes`` and ``sink_many``) and call ``_flush``, ``_report_checkpoint`` and
    ``_report_offloads``. ``tests/test_probes.py`` checks that the wrappers use nothing else.
    """

    # The records of the current call (or step, with ``sink_many``), not yet handed over.
    _records: list[Record]
    # True while records wait: inside a KVCacheManager call, and always with ``sink_many``.
    _held: bool
    # Context set by the outer method being called: the request and why hashes move.
    _req: int  # the current request's trace number; ``_NO_REQ`` / ``_UNSEEN_REQ`` otherwise
    _request: Any  # the current vLLM ``Request``, or None
    _reqs: dict[str, tuple[int, int]]  # request id -> (req, hash units reported)
    _remove_reason: RemoveReason
    _store_kind: StoreKind
    _in_checkpoint: bool  # inside ``MambaManager.cache_blocks`` publishing a checkpoint
    _num_stripped: int  # stale keys stripped off the checkpoint's slot so far
    # Steps: the last number, and one replay announced for the next ``new_step_starts``.
    _step: int
    _announced_step: tuple[int, int] | None
    created_ns: int
    num_failures: int

    def _flush(self) -> None: ...
    def _enter(self, request: Any, hash_block_size: int) -> int: ...
    def _leave(self, held: bool) -> None: ...
    def _report_release(self, request: Any) -> None: ...
    def _forget_if_finished(self, request: Any) -> None: ...
    def _report_stored(self, block_id: int, key: bytes, num_tokens: int | None) -> None: ...
    def _report_removed(self, block_id: int, removed: list[bytes]) -> None: ...
    def _keys_held_by_blocks(self, pool: Any) -> list[tuple[int, bytes]]: ...
    def _report_reset(self, held: list[tuple[int, bytes]]) -> None: ...
    def _report_checkpoint(self, manager: Any, checkpoint: tuple[int, int],
                           chunk_end: int) -> None: ...
    def _report_offloads(self, manager: Any, num_before: int) -> None: ...
    def _report_checkpoint_decision(self, manager: Any, request: Any,
                                    checkpoint: tuple[int, int]) -> None: ...
