"""Checkpoint-publication policies installed on the real vLLM ``MambaManager`` ("variants").

Variants differ from the installed vLLM 0.33.0 in exactly two decisions; everything else is
vLLM's own code:

1. *Which prefill chunks reserve an internal checkpoint.* #56794-era code reserves one for every
   chunk where the backend can export it. 0.33 passes ``prefill_end`` down from the coordinator
   under retention 0, and ``MambaManager._needs_internal_checkpoint`` then reserves one only on the
   chunk that reaches the prompt end. A variant that reserves on every chunk calls vLLM's
   ``get_num_blocks_to_allocate`` with ``prefill_end=0`` (what the coordinator passes under dense
   retention).
2. *Whether a recorded checkpoint is published* - the checkpoint branch of
   ``MambaManager._cache_partial_tail_block``. A variant replaces only that branch; a call without
   a checkpoint (the prompt-tail partial entry) goes to vLLM's own method.

The decision table (reference §5; R = retention interval, cp = checkpoint position):

============  ===================================  =========================================
variant       transient cp (R == 0, chunk ends     any other cp
              before the prompt, cp != junction)
============  ===================================  =========================================
unfixed       re-key the slot to cp, publish       re-key to cp unless already keyed at cp
fixed         strip every key on the slot, keep    same as unfixed
              the state request-local
naive         keep request-local, leave any key    same as unfixed
              on the slot (wrong-state hazard)
upstream      vLLM 0.33.0 untouched (its generalised gate: not the prompt's checkpoint, not
              retained by the retention mask, not the junction)
============  ===================================  =========================================

Variants are installed per manager instance (attributes that shadow the class methods), so
several backends with different variants can live in one process, and kvtrace's probes (which
wrap the class methods) still see every call the variant delegates to vLLM.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, Callable

from kvtrace.errors import ConfigError

# (manager, request, num_tokens, retention_interval, checkpoint) -> published key or None
PublishCheckpoint = Callable[[Any, Any, int, "int | None", tuple[int, int]], Any]


@dataclass(frozen=True)
class Variant:
    """A checkpoint policy: its two decisions, and where they come from (``source``)."""

    name: str
    summary: str
    source: str
    reserve_every_chunk: bool
    publish_checkpoint: PublishCheckpoint | None  # None: vLLM's own checkpoint branch

    def install(self, manager: Any) -> None:
        """Install this policy on one ``MambaManager`` in "align" mode (others are untouched)."""
        if getattr(manager, "mamba_cache_mode", None) != "align":
            return
        # Read by a live capture of kvtrace's own engine: the trace records the variant it ran.
        manager.kvtrace_variant = self.name
        if self.reserve_every_chunk:
            manager.get_num_blocks_to_allocate = types.MethodType(
                _reserve_on_every_chunk, manager)
        if self.publish_checkpoint is not None:
            publish = self.publish_checkpoint

            def cache_partial_tail_block(manager, request, num_tokens, retention_interval):
                checkpoint = manager._checkpoints.get(request.request_id)
                if checkpoint is None:
                    return type(manager)._cache_partial_tail_block(
                        manager, request, num_tokens, retention_interval)
                return publish(manager, request, num_tokens, retention_interval, checkpoint)

            manager._cache_partial_tail_block = types.MethodType(cache_partial_tail_block,
                                                                 manager)


def _reserve_on_every_chunk(manager, request_id, num_tokens, new_computed_blocks,
                            total_computed_tokens, num_local_computed_tokens,
                            num_tokens_main_model, apply_admission_cap=False, prefill_end=0):
    """vLLM's own sizing with ``prefill_end=0``: every valid chunk reserves a checkpoint."""
    return type(manager).get_num_blocks_to_allocate(
        manager, request_id, num_tokens, new_computed_blocks, total_computed_tokens,
        num_local_computed_tokens, num_tokens_main_model,
        apply_admission_cap=apply_admission_cap, prefill_end=0)


def _rekey_slot(manager, request, checkpoint: tuple[int, int]):
    """Pre-#56794 publication: the slot's content is replaced by the state at cp, so drop its
    old keys and key it at cp - unless it already is."""
    position, block_idx = checkpoint
    slot = manager.req_to_blocks[request.request_id][block_idx]
    if slot.block_hash_num_tokens == position:
        return None
    return manager.block_pool.cache_partial_block(
        request=request, block=slot, num_tokens=position,
        kv_cache_group_id=manager.kv_cache_group_id, block_size=manager.block_size,
        replace_existing_hashes=True)


def _is_transient_56794(request, num_tokens: int, retention_interval: int | None,
                        position: int) -> bool:
    """#56794's gate: latest-only retention, a chunk inside the prompt, not the junction."""
    return (retention_interval == 0 and num_tokens < request.num_prompt_tokens
            and position != request.shared_prefix_boundary)


def _publish_unfixed(manager, request, num_tokens, retention_interval, checkpoint):
    return _rekey_slot(manager, request, checkpoint)


def _publish_fixed(manager, request, num_tokens, retention_interval, checkpoint):
    if _is_transient_56794(request, num_tokens, retention_interval, checkpoint[0]):
        slot = manager.req_to_blocks[request.request_id][checkpoint[1]]
        manager.block_pool._maybe_evict_cached_block(slot)
        return None
    return _rekey_slot(manager, request, checkpoint)


def _publish_naive(manager, request, num_tokens, retention_interval, checkpoint):
    if _is_transient_56794(request, num_tokens, retention_interval, checkpoint[0]):
        return None
    return _rekey_slot(manager, request, checkpoint)


VARIANTS: dict[str, Variant] = {
    variant.name: variant
    for variant in (
        Variant("unfixed", "before #56794: every internal checkpoint is re-keyed and published",
                "vLLM #56794's base (Sy0307/vllm@9272157d): the checkpoint branch without the "
                "retention gate; no released vLLM ships it", True, _publish_unfixed),
        Variant("fixed", "#56794 as merged: transient checkpoints are stripped, not published",
                "vLLM #56794 (merged 2026-09-14; Sy0307/vllm@918d6099), as in vLLM 0.30.0",
                True, _publish_fixed),
        Variant("naive", "the #56794 gate without stripping stale keys (wrong-state hazard)",
                "vLLM #56794 with the _maybe_evict_cached_block call removed (reference §6.2)",
                True, _publish_naive),
        Variant("upstream", "the installed vLLM 0.33.0, untouched",
                "vllm 0.33.0 MambaManager (prefill_end reservation, generalised gate)",
                False, None),
    )
}


def get_variant(name: str) -> Variant:
    try:
        return VARIANTS[name]
    except KeyError:
        raise ConfigError(
            f"unknown variant {name!r}",
            f"Known variants: {', '.join(VARIANTS)}.") from None
