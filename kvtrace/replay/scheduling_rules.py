"""vLLM 0.33.0 scheduler rules that the scheduler model (``scheduler``), the model backend's
Mamba manager (``model.managers``) and ``kvtrace engine`` share: the Mamba block-aligned split
(``Scheduler._mamba_block_aligned_split``) and its checkpoint positions, the verifier's answer to
a step's drafts, and the batches an async engine keeps in flight.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvtrace.engine_config import SchedulerSettings
from kvtrace.events import EngineConfig

ASYNC_BATCHES = 2  # VllmConfig.max_concurrent_batches with async scheduling, no pipeline


def accepted_drafts(request_id: str, num_output_tokens: int, num_drafts: int,
                    acceptance: float) -> int:
    """How many of a decode step's ``num_drafts`` draft tokens the verifier accepts: each with
    probability ``acceptance``, up to the first rejected; drawn from the request and its
    outputs so far, so that ``kvtrace engine`` (which answers vLLM's scheduler with it) and the
    scheduler model draw alike."""
    draw = random.Random(f"{request_id}:{num_output_tokens}").random
    accepted = 0
    while accepted < num_drafts and draw() < acceptance:
        accepted += 1
    return accepted


def mamba_checkpoint_position(num_tokens: int, unit: int, drop_eagle_block: bool,
                              hash_lookahead: int = 0) -> int:
    """The last reusable Mamba state boundary for a prefill of ``num_tokens`` (on ``unit``).

    At least one token stays for the logits, and with lookahead block hashes the tokens the
    boundary's hash covers; with EAGLE's dropped block one more unit is dropped instead (vLLM
    ``get_mamba_prefill_checkpoint_position``)."""
    limit = num_tokens if drop_eagle_block else num_tokens - max(1, hash_lookahead)
    position = limit // unit * unit - (unit if drop_eagle_block else 0)
    return max(position, 0)


@dataclass(frozen=True)
class MambaAlignedSplit:
    """Where a prefill chunk must end so that ``align``-mode Mamba state lands on a cacheable
    boundary (vLLM ``Scheduler._mamba_block_aligned_split``)."""

    block_size: int  # the Mamba block (cache_config.block_size)
    hash_block_size: int
    max_prefill_tokens: int  # min(budget, long-prefill threshold if set)
    partial_cache_hit: bool  # fine-grained (hash-unit) Mamba hits
    has_checkpoint_blocks: bool
    checkpoint_alignment: int | None
    drop_eagle_block: bool = False
    hash_lookahead: int = 0

    @classmethod
    def for_config(cls, config: EngineConfig, settings: SchedulerSettings) -> MambaAlignedSplit | None:
        """The split for an engine, or None when no group is an ``align`` Mamba group."""
        mamba = [g for g in config.kv_cache_groups if g.kind == "mamba"]
        if not any(g.mamba_cache_mode == "align" for g in mamba):
            return None
        block_size = config.cache_block_size or mamba[0].block_size
        threshold = settings.long_prefill_token_threshold
        return cls(
            block_size=block_size,
            hash_block_size=config.hash_block_size,
            max_prefill_tokens=min(settings.max_num_batched_tokens, threshold or settings.max_num_batched_tokens),
            # coordinator.enable_partial_hash_hits: an align group coarser than the hash unit.
            partial_cache_hit=config.hash_block_size < config.scheduler_block_size
            and any(g.mamba_cache_mode == "align" and g.block_size > config.hash_block_size for g in mamba),
            has_checkpoint_blocks=all(g.num_prefill_checkpoint_blocks > 0 for g in mamba),
            checkpoint_alignment=mamba[0].prefill_checkpoint_alignment,
            drop_eagle_block=config.use_eagle,
            hash_lookahead=config.num_hash_lookahead_tokens,
        )

    def checkpoint_position(self, num_tokens: int, unit: int) -> int:
        """``mamba_checkpoint_position`` under this engine's EAGLE/MTP rules."""
        return mamba_checkpoint_position(num_tokens, unit, self.drop_eagle_block,
                                         self.hash_lookahead)

    def checkpoint_valid(self, start: int, end: int, position: int) -> bool:
        """Whether the backend can export an internal checkpoint at ``position`` from the chunk
        [start, end) (vLLM ``is_mamba_prefill_checkpoint_valid``)."""
        if self.checkpoint_alignment is None:
            return False
        unit, block = self.hash_block_size, self.block_size
        initial_state_block = (start - 1) // block
        checkpoint_block = -(-end // block) - 2
        return (
            start % unit == 0
            and checkpoint_block > initial_state_block
            and start + unit <= position
            and start < position < end
            and (position - start) % self.checkpoint_alignment == 0
        )

    def clip(self, num_new_tokens: int, start: int, num_prompt_tokens: int, num_tokens: int,
             shared_prefix_boundary: int) -> int:
        """Clip a chunk of ``num_new_tokens`` starting at ``start`` (computed + new hits)."""
        prefill_end = max(num_prompt_tokens, num_tokens - 1)
        if start >= prefill_end:
            return num_new_tokens
        block = self.block_size
        end = start + num_new_tokens
        last_cache_position = self.checkpoint_position(num_tokens, block)
        checkpoint_unit = self.hash_block_size if self.partial_cache_hit else block
        internal_checkpoint = (
            self.has_checkpoint_blocks
            and end >= prefill_end
            and self.checkpoint_valid(start, end,
                                      self.checkpoint_position(prefill_end, checkpoint_unit))
        )
        if internal_checkpoint:
            last_cache_position = 0  # the backend saves the state inside the final chunk
        if end < prefill_end:
            # Chunk ends must be block aligned; a block wider than any chunk advances sub-block.
            aligned_end = end // block * block
            if aligned_end > start or block <= self.max_prefill_tokens:
                end = aligned_end
        tail_checkpoint = (
            self.checkpoint_position(num_prompt_tokens, self.hash_block_size)
            if self.partial_cache_hit and not internal_checkpoint
            else 0
        )
        junction = shared_prefix_boundary
        junction_stop = start + (junction - start) // block * block
        stops = (
            (start // block + 1) * block if start % block and not internal_checkpoint else 0,
            last_cache_position,
            tail_checkpoint if last_cache_position < tail_checkpoint < num_prompt_tokens else 0,
            junction_stop if start < junction < end else 0,
        )
        end = min((s for s in stops if start < s < end), default=end)
        return max(end - start, 0)
