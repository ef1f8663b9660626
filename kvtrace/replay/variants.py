"""Checkpoint policies ("variants"): two decisions, stated once, carried out by every backend.

Variants differ from the project's vLLM (the newest supported release) in exactly two
decisions; everything else is vLLM's own code (``vllm`` backend) or kvtrace's model of it
(``model`` backend):

1. *Which prefill chunks reserve an internal checkpoint* (``Variant.reserve_every_chunk``).
   #56794-era code reserves one for every chunk where the backend can export it. From 0.31 on
   vLLM passes ``prefill_end`` down from the coordinator under retention 0, and
   ``MambaManager._needs_internal_checkpoint`` then reserves one only on the chunk that reaches
   the prompt end. A variant that reserves on every chunk sizes the chunk with
   ``prefill_end=0`` (what the coordinator passes under dense retention).
2. *Whether a recorded checkpoint is published* (``Variant.checkpoint_action``): the
   checkpoint branch of ``MambaManager._cache_partial_tail_block``. A call without a checkpoint
   (the prompt-tail partial entry) is vLLM's own behaviour in every variant.

The decision table (reference §5; R = retention interval, cp = checkpoint position):

============  ===================================  =========================================
variant       transient cp                         any other cp
============  ===================================  =========================================
unfixed       (none is transient)                  PUBLISH: re-key the slot to cp unless it
                                                   is already keyed at cp
fixed         #56794's: R == 0, chunk ends before  PUBLISH
              the prompt, cp != junction -> STRIP
              every key on the slot, publish none
naive         #56794's -> KEEP_LOCAL: publish      PUBLISH
              nothing, leave any key on the slot
              (wrong-state hazard)
upstream      the generalised gate (0.32.0 on):    PUBLISH
              not the prompt's checkpoint, not
              kept by the retention mask, not the
              junction -> STRIP
============  ===================================  =========================================

The ``vllm`` backend installs a policy on the real ``MambaManager`` (``Variant.install``):
attributes that shadow the class methods, per manager instance, so several backends with
different variants can live in one process and kvtrace's probes (which wrap the class methods)
still see every call the policy delegates to vLLM. ``upstream`` installs nothing there: vLLM's
own code makes its decisions, which is what holds the ``model`` backend's use of the same
table to the installed vLLM.
"""

from __future__ import annotations

import enum
import types
from dataclasses import dataclass
from typing import Any, Callable

from kvtrace.errors import ConfigError
from kvtrace.probes.signatures import release_has
from kvtrace.vllm_release_table import PROJECT_RELEASE, RELEASES


class CheckpointAction(enum.Enum):
    """What becomes of a recorded checkpoint's slot when its chunk is cached."""

    PUBLISH = "publish"  # re-key the slot at cp (dropping its other keys) unless keyed there
    STRIP = "strip"  # take every key off the slot, publish nothing (#56794)
    KEEP_LOCAL = "keep_local"  # publish nothing, leave the slot's keys (the naive gate)


@dataclass(frozen=True)
class CheckpointFacts:
    """What the publication decision looks at, for one checkpoint of one chunk."""

    retention_interval: int | None
    num_tokens: int  # the tokens the chunk caches (``MambaManager.cache_blocks``)
    num_prompt_tokens: int
    position: int  # the checkpoint position cp
    shared_prefix_boundary: int  # the request's junction (0: none)
    # The generalised gate's own terms (vLLM 0.32.0 on): cp is the prompt's checkpoint
    # position; cp is block-aligned and kept by the retention mask.
    is_prompt_checkpoint: bool
    is_retained: bool


def transient_56794(facts: CheckpointFacts) -> bool:
    """#56794's gate: latest-only retention, a chunk inside the prompt, not the junction."""
    return (facts.retention_interval == 0 and facts.num_tokens < facts.num_prompt_tokens
            and facts.position != facts.shared_prefix_boundary)


def transient_033(facts: CheckpointFacts) -> bool:
    """The generalised gate of vLLM 0.32.0 on (the project's vLLM's)."""
    return (not facts.is_prompt_checkpoint and not facts.is_retained
            and facts.position != facts.shared_prefix_boundary)


@dataclass(frozen=True)
class Variant:
    """A checkpoint policy: its two decisions, where they come from (``source``), and what it
    stands for in a report's verdict (``role``, ``gated``)."""

    name: str
    summary: str
    source: str
    reserve_every_chunk: bool
    is_transient: Callable[[CheckpointFacts], bool] | None  # None: no checkpoint is
    transient_action: CheckpointAction
    vllm_decides: bool = False  # the installed vLLM's code is this policy (nothing installed)
    release: str | None = None  # runs this vLLM release's own code (``vllm-X``); None: any
    role: str = ""  # in a verdict's sentence, what the variant stands for ("": no words)
    # A modelled policy that carries the #56794 gate: moving to it from unfixed is the upgrade
    # the verdict recommends (a ``vllm-X`` variant is a release's code, not a policy: False).
    gated: bool = False

    def checkpoint_action(self, facts: CheckpointFacts) -> CheckpointAction:
        """Decision 2 for one checkpoint."""
        if self.is_transient is not None and self.is_transient(facts):
            return self.transient_action
        return CheckpointAction.PUBLISH

    def install(self, manager: Any) -> None:
        """Install this policy on one vLLM ``MambaManager`` in "align" mode (others are
        untouched)."""
        if getattr(manager, "mamba_cache_mode", None) != "align":
            return
        # Read by a live capture of kvtrace's own engine: the trace records the variant it ran.
        manager.kvtrace_variant = self.name
        # Before 0.31 every chunk reserves a checkpoint anyway (no ``prefill_end``).
        if self.reserve_every_chunk and release_has(
                "MambaManager.get_num_blocks_to_allocate(prefill_end)"):
            manager.get_num_blocks_to_allocate = types.MethodType(
                _reserve_on_every_chunk, manager)
        if self.vllm_decides:
            return
        variant = self

        def cache_partial_tail_block(manager, request, num_tokens, retention_interval):
            checkpoint = manager._checkpoints.get(request.request_id)
            if checkpoint is None:
                return type(manager)._cache_partial_tail_block(
                    manager, request, num_tokens, retention_interval)
            facts = _vllm_checkpoint_facts(manager, request, num_tokens, retention_interval,
                                           checkpoint)
            return _carry_out(variant.checkpoint_action(facts), manager, request, checkpoint)

        manager._cache_partial_tail_block = types.MethodType(cache_partial_tail_block, manager)


def _reserve_on_every_chunk(manager, request_id, num_tokens, new_computed_blocks,
                            total_computed_tokens, num_local_computed_tokens,
                            num_tokens_main_model, apply_admission_cap=False, prefill_end=0):
    """vLLM's own sizing with ``prefill_end=0``: every valid chunk reserves a checkpoint."""
    return type(manager).get_num_blocks_to_allocate(
        manager, request_id, num_tokens, new_computed_blocks, total_computed_tokens,
        num_local_computed_tokens, num_tokens_main_model,
        apply_admission_cap=apply_admission_cap, prefill_end=0)


def _vllm_checkpoint_facts(manager, request, num_tokens: int, retention_interval: int | None,
                           checkpoint: tuple[int, int]) -> CheckpointFacts:
    """The facts of a checkpoint on the real ``MambaManager``, computed with vLLM's helpers."""
    from vllm.v1.kv_cache_interface import get_mamba_prefill_checkpoint_position

    position = checkpoint[0]
    alignment = manager.cache_hit_alignment_tokens
    lookahead = ({"num_hash_lookahead_tokens": manager.block_pool.num_hash_lookahead_tokens}
                 if release_has("BlockPool.num_hash_lookahead_tokens") else {})
    prompt_position = get_mamba_prefill_checkpoint_position(
        request.num_prompt_tokens, alignment, manager.drop_eagle_checkpoint_block, **lookahead)
    retained = False
    if position % manager.block_size == 0:
        block_idx = position // manager.block_size - 1
        mask = manager.reachable_block_mask(block_idx, block_idx + 1, alignment,
                                            manager.kv_cache_spec,
                                            manager.drop_eagle_checkpoint_block,
                                            retention_interval=retention_interval)
        retained = mask is None or mask[0]
    return CheckpointFacts(retention_interval, num_tokens, request.num_prompt_tokens, position,
                           request.shared_prefix_boundary, position == prompt_position, retained)


def _carry_out(action: CheckpointAction, manager, request, checkpoint: tuple[int, int]):
    """Do ``action`` on the real slot; return the published key or None."""
    position, block_idx = checkpoint
    slot = manager.req_to_blocks[request.request_id][block_idx]
    if action is CheckpointAction.STRIP:
        manager.block_pool._maybe_evict_cached_block(slot)
        return None
    if action is CheckpointAction.KEEP_LOCAL or slot.block_hash_num_tokens == position:
        return None
    # Pre-#56794 publication: the slot's content is replaced by the state at cp.
    return manager.block_pool.cache_partial_block(
        request=request, block=slot, num_tokens=position,
        kv_cache_group_id=manager.kv_cache_group_id, block_size=manager.block_size,
        replace_existing_hashes=True)


_STRIP, _KEEP_LOCAL = CheckpointAction.STRIP, CheckpointAction.KEEP_LOCAL

VARIANTS: dict[str, Variant] = {
    variant.name: variant
    for variant in (
        Variant("unfixed", "before #56794: every internal checkpoint is re-keyed and published",
                "vLLM main between 0.29.0 and 0.30.0, before #56794: the _checkpoints branch "
                "of _cache_partial_tail_block re-keys every checkpoint (cache_partial_block, "
                "replace_existing_hashes=True), no retention gate; no released vLLM ships it "
                "(0.29.0 has no _checkpoints, 0.30.0 has the gate)", True, None, _STRIP,
                role="before #56794"),
        Variant("fixed", "#56794 as merged: transient checkpoints are stripped, not published",
                "vLLM #56794 (merged 2026-09-14; Sy0307/vllm@918d6099), as in vLLM 0.30.0",
                True, transient_56794, _STRIP, role="#56794 as merged", gated=True),
        Variant("naive", "the #56794 gate without stripping stale keys (wrong-state hazard)",
                "vLLM #56794 with the _maybe_evict_cached_block call removed (reference §6.2)",
                True, transient_56794, _KEEP_LOCAL,
                role="#56794's gate without stripping stale keys"),
        Variant("upstream", "the vLLM it runs on, untouched (the project's: "
                f"{PROJECT_RELEASE.version})", f"that vLLM's MambaManager "
                f"({PROJECT_RELEASE.version}: {PROJECT_RELEASE.checkpoints})",
                False, transient_033, _STRIP, vllm_decides=True,
                role=f"vLLM {PROJECT_RELEASE.version}'s own checkpoint logic", gated=True),
    )
}
# Each supported release as it is, run in a process of its own (``release_worker``): its
# decisions are its own code's, which only the vllm backend has (``is_transient`` None).
VARIANTS.update({
    f"vllm-{row.version}": Variant(
        f"vllm-{row.version}", f"vLLM {row.version}'s own code, untouched",
        f"vllm {row.version}, installed beside the project's vLLM (kvtrace vllm install): "
        f"{row.checkpoints}", False, None, _STRIP, vllm_decides=True, release=row.version)
    for row in RELEASES})
# The variants both backends have: the modelled policies (a release's code is the vllm backend's).
MODELLED_VARIANTS = tuple(name for name, variant in VARIANTS.items() if variant.release is None)


def get_variant(name: str) -> Variant:
    try:
        return VARIANTS[name]
    except KeyError:
        raise ConfigError(
            f"unknown variant {name!r}",
            f"Known variants: {', '.join(VARIANTS)}.") from None
