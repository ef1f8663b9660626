"""vLLM 0.33's hit search (``KVCacheCoordinator.find_longest_cache_hit``) over a hypothetical
cache: the miss attribution asks it what a lookup would have hit with each restriction of the
ideal cache applied. A cache is given as levels: per hash-unit depth, the first restriction that
takes its key (a key is cached when its level is above the threshold asked about)."""

from __future__ import annotations

from dataclasses import dataclass

from kvtrace.events import EngineConfig


@dataclass(frozen=True)
class Geometry:
    """The parts of an engine config the hit search depends on (vLLM ``KVCacheCoordinator``)."""

    unit: int
    attention_groups: tuple[int, ...]
    mamba_groups: tuple[int, ...]
    attention_block: int
    mamba_block: int
    alignment: int  # hits land on this many tokens: the hash unit with fine-grained hits
    # use_eagle (EAGLE/MTP): full attention looks ``eagle_margin`` tokens past the cap, then
    # drops ``eagle_drop`` tokens from its hit (0: the engine drops nothing).
    eagle_drop: int = 0
    eagle_margin: int = 0

    @classmethod
    def of(cls, config: EngineConfig) -> Geometry:
        groups = config.kv_cache_groups
        attention = tuple(i for i, g in enumerate(groups) if g.kind != "mamba")
        mamba = tuple(i for i, g in enumerate(groups) if g.kind == "mamba")
        unit = config.hash_block_size
        # coordinator.enable_partial_hash_hits: an align-mode Mamba group coarser than the unit.
        fine = any(groups[i].block_size > unit and groups[i].mamba_cache_mode in ("", "align")
                   for i in mamba)
        attention_block = groups[attention[0]].block_size if attention else unit
        alignment = unit if fine else config.scheduler_block_size
        drop = margin = 0
        if config.use_eagle and attention:
            # FullAttentionManager drops min(alignment, block); the hybrid coordinator first
            # widens the search by eagle_proof_margin (a hash unit fine-grained, else a block);
            # one group (UnitaryKVCacheCoordinator) searches to the cap alone. Mamba groups
            # never drop (MambaManager ignores drop_eagle_block).
            drop = min(alignment, attention_block)
            if len(groups) > 1:
                margin = unit if fine and attention_block > unit else attention_block
        return cls(unit=unit, attention_groups=attention, mamba_groups=mamba,
                   attention_block=attention_block,
                   mamba_block=groups[mamba[0]].block_size if mamba else unit,
                   alignment=alignment, eagle_drop=drop, eagle_margin=margin)

    def attention_reach(self, levels: list[int], threshold: int, num_units: int, cap: int) -> int:
        """Full attention's hit (``FullAttentionManager.find_longest_cache_hit``): whole blocks
        left to right, then, fine-grained, the first missed block's interior high to low; with
        use_eagle, searched ``eagle_margin`` past the cap, less ``eagle_drop`` tokens, aligned.
        A depth ``d`` (in units) is cached when ``levels[d] > threshold``."""
        if not self.attention_groups:
            return cap
        unit, block = self.unit, self.attention_block
        limit = cap + self.eagle_margin if self.eagle_drop else cap
        per_block = block // unit
        known = len(levels) - 1
        num_blocks = min(limit // block, num_units // per_block)
        found = 0
        while found < num_blocks:
            depth = (found + 1) * per_block
            if depth > known or levels[depth] <= threshold:
                break
            found += 1
        reach = found * block
        if self.alignment < block and block % self.alignment == 0:
            first = found * per_block
            last = min(first + per_block - 1, limit // unit, num_units, known)
            for depth in range(last, first, -1):
                if levels[depth] > threshold:
                    reach = depth * unit
                    break
        if self.eagle_drop and reach > 0:
            reach -= self.eagle_drop
            reach -= reach % self.alignment
        return reach

    def eagle_ideal(self, ideal: int, cap: int) -> int:
        """The hit an unbounded cache gives with EAGLE's drop, at hash-unit granularity (the
        search's own block alignment is left to ``block_quantisation``)."""
        reach = min(ideal, (cap + self.eagle_margin) // self.unit * self.unit)
        return max(reach - self.eagle_drop, 0)

    def mamba_state(self, levels: list[int], threshold: int, num_units: int, limit: int) -> int:
        """The deepest cached Mamba state at or below ``limit`` tokens
        (``MambaManager.find_longest_cache_hit``), or ``limit`` without Mamba groups."""
        if not self.mamba_groups:
            return limit
        unit, block = self.unit, self.mamba_block
        known = len(levels) - 1
        if self.alignment < block and block % self.alignment == 0:
            for depth in range(min(limit // unit, num_units, known), 0, -1):
                if levels[depth] > threshold:
                    return depth * unit
            return 0
        per_block = block // unit
        for index in range(limit // block - 1, -1, -1):
            depth = (index + 1) * per_block
            if (depth <= known and levels[depth] > threshold
                    and (index + 1) * block % self.alignment == 0):
                return (index + 1) * block
        return 0

    def joint_hit(self, attention: list[int], mamba: list[int], threshold: int, num_units: int,
                  cap: int) -> int:
        """The coordinator's hit: the deepest Mamba state within full attention's reach."""
        reach = self.attention_reach(attention, threshold, num_units, cap)
        return self.mamba_state(mamba, threshold, num_units, reach)

