"""The block pool of vLLM 0.33's prefix cache (``vllm/v1/core/block_pool.py``), on int arrays.

State, one entry per block id (block 0 is the null block, never pooled, hashed or counted):
``ref`` (reference counts), the block's *primary* key (``key_hash``, ``key_group``, and
``key_tokens``, the prefix length it covers; -1 / None without one), and the links of the free
queue (``next_free`` / ``prev_free``, with ``HEAD`` and ``TAIL`` as fake ends). Secondary keys
(a partial entry added to a keyed block) are rare and live in a dict. ``cached[group]`` maps a
hash id to the block holding it (an int) or, when several blocks hold it (vLLM never
deduplicates: block tables are append-only), a list of them in insertion order.

Behaviour, as vLLM's: the free queue's head is reused (and evicted) first; freed blocks that
carry a key go to its tail (LRU), others to its head; a prefix hit takes a block out of the
queue without moving it otherwise. Every operation reports the same records, in the same
order, as kvtrace's probes report for the real pool (``kvtrace/probes/cache_probes.py``):
reports go to ``out`` (``reports.Records``, which the backend hands to its sink after each call,
or ``reports.Tally``).
"""

from __future__ import annotations

from kvtrace.events import (
    BlockAllocated,
    BlockFreed,
    BlockRemoved,
    BlocksReleased,
    BlockStored,
    BlockTouched,
    RemoveReason,
    StoreKind,
)
from kvtrace.replay.model.reports import Records, Tally

NULL_BLOCK = 0
NO_TOKENS = -1  # ``key_tokens`` of a block without a key

LRU_REUSE, REKEY, STALE_CHECKPOINT = (RemoveReason.LRU_REUSE, RemoveReason.REKEY,
                                      RemoveReason.STALE_CHECKPOINT)
FULL, PARTIAL, CHECKPOINT = StoreKind.FULL, StoreKind.PARTIAL, StoreKind.CHECKPOINT


class BlockPool:
    """vLLM's ``BlockPool`` over block ids. ``depth`` is the hash id -> prefix length map the
    records report (the probes' own: the lengths the requests' hash ids were reported at)."""

    def __init__(self, num_blocks: int, num_groups: int, hash_block_size: int,
                 enable_caching: bool, depth: dict[int, int], out: Records | Tally) -> None:
        self.num_blocks = num_blocks
        self.hash_block_size = hash_block_size
        self.enable_caching = enable_caching
        self.depth = depth
        self.out = out
        self.ref = [0] * num_blocks
        self.key_hash: list[int | None] = [None] * num_blocks
        self.key_group = [0] * num_blocks
        self.key_tokens = [NO_TOKENS] * num_blocks
        self.extra_keys: dict[int, list[tuple[int, int]]] = {}
        self.cached: list[dict[int, int | list[int]]] = [{} for _ in range(num_groups)]
        # Free queue: ids 1..N-1 in id order (block 0 is taken out at once as the null block).
        self.head, self.tail = num_blocks, num_blocks + 1
        self.next_free = [-1] * (num_blocks + 2)
        self.prev_free = [-1] * (num_blocks + 2)
        order = [self.head, *range(1, num_blocks), self.tail]
        for before, after in zip(order, order[1:]):
            self.next_free[before] = after
            self.prev_free[after] = before
        self.num_free = num_blocks - 1

    # --- the hash map --------------------------------------------------------------------------

    def cached_block(self, hash_id: int, group: int) -> int | None:
        """The block a lookup of ``hash_id`` in ``group`` hits: the first one keyed with it."""
        holder = self.cached[group].get(hash_id)
        if holder is None or type(holder) is int:
            return holder
        return holder[0]

    def _holds(self, hash_id: int, group: int, block: int) -> bool:
        holder = self.cached[group].get(hash_id)
        if holder is None:
            return False
        if type(holder) is int:
            return holder == block
        return block in holder

    def _unmap(self, hash_id: int, group: int, block: int) -> bool:
        table = self.cached[group]
        holder = table.get(hash_id)
        if holder is None:
            return False
        if type(holder) is int:
            if holder != block:
                return False
            del table[hash_id]
            return True
        if block not in holder:
            return False
        holder.remove(block)
        if not holder:
            del table[hash_id]
        return True

    def keys_on(self, block: int) -> list[tuple[int, int]]:
        """(hash id, group) of every key on ``block``: the primary first."""
        hash_id = self.key_hash[block]
        keys = [] if hash_id is None else [(hash_id, self.key_group[block])]
        keys.extend(self.extra_keys.get(block, ()))
        return keys

    def insert_key(self, hash_id: int, group: int, block: int, num_tokens: int,
                   kind: StoreKind, req: int) -> None:
        """``_insert_block_hash``: key ``block`` (its primary if it has none); a key the block
        already holds is left alone. A new key is reported."""
        primary = self.key_hash[block]
        if primary == hash_id and self.key_group[block] == group:
            return
        if self._holds(hash_id, group, block):
            return
        if primary is None:
            self.key_hash[block] = hash_id
            self.key_group[block] = group
            self.key_tokens[block] = num_tokens
        else:
            self.extra_keys.setdefault(block, []).append((hash_id, group))
        table = self.cached[group]
        holder = table.get(hash_id)
        if holder is None:
            table[hash_id] = block
        elif type(holder) is int:
            table[hash_id] = [holder, block]
        else:
            holder.append(block)
        self.out.report(BlockStored, block, hash_id, group, self.depth.get(hash_id, num_tokens),
                        kind, req)

    def strip_keys(self, block: int, reason: RemoveReason) -> list[tuple[int, int]]:
        """``_remove_cached_block_hashes`` (+ its events): take every key off ``block``, report
        and return the removed ones."""
        hash_id = self.key_hash[block]
        if hash_id is None:
            return []
        keys = [(hash_id, self.key_group[block])]
        extra = self.extra_keys.pop(block, None)
        if extra:
            keys.extend(extra)
        self.key_hash[block] = None
        self.key_tokens[block] = NO_TOKENS
        depth, out = self.depth, self.out
        removed = []
        for hash_id, group in keys:
            if self._unmap(hash_id, group, block):
                out.report(BlockRemoved, block, hash_id, group, depth.get(hash_id, 0), reason)
                removed.append((hash_id, group))
        return removed

    def move_keys(self, source: int, target: int, req: int) -> None:
        """``move_block_hashes``: the keys of ``source`` now name ``target`` (a private copy)."""
        num_tokens = self.key_tokens[source]
        for hash_id, group in self.strip_keys(source, REKEY):
            self.insert_key(hash_id, group, target, num_tokens, PARTIAL, req)

    # --- the free queue ------------------------------------------------------------------------

    def get_new_blocks(self, count: int, req: int) -> list[int]:
        """Pop ``count`` blocks off the queue's head, evicting their keys (LRU reuse)."""
        if count > self.num_free:
            raise ValueError(f"Cannot get {count} free blocks from the pool")
        if count == 0:
            return []
        next_free, prev_free = self.next_free, self.prev_free
        blocks = []
        block = next_free[self.head]
        for _ in range(count):
            blocks.append(block)
            following = next_free[block]
            next_free[block] = prev_free[block] = -1
            block = following
        next_free[self.head] = block
        prev_free[block] = self.head
        self.num_free -= count
        ref, key_hash, out = self.ref, self.key_hash, self.out
        if self.enable_caching:
            for block in blocks:
                if key_hash[block] is not None:
                    self.strip_keys(block, LRU_REUSE)
        for block in blocks:
            ref[block] = 1
            out.report(BlockAllocated, block, req)
        return blocks

    def touch(self, blocks: list[int], req: int) -> None:
        """A prefix hit takes ``blocks``: out of the free queue if unreferenced."""
        ref, next_free, prev_free, out = self.ref, self.next_free, self.prev_free, self.out
        for block in blocks:
            if block == NULL_BLOCK:
                continue
            if ref[block] == 0:
                before, after = prev_free[block], next_free[block]
                next_free[before] = after
                prev_free[after] = before
                next_free[block] = prev_free[block] = -1
                self.num_free -= 1
            ref[block] += 1
        for block in blocks:
            if block != NULL_BLOCK:
                out.report(BlockTouched, block, req)

    def free_blocks(self, blocks: list[int], released: bool = False) -> None:
        """Drop one reference of each block, in eviction order: unreferenced keyed blocks go to
        the queue's tail (kept as cache), unkeyed ones to its head (reused first).
        ``released``: the engine frees them itself, outside any cache-manager call."""
        out = self.out
        if released:
            out.report(BlocksReleased, [block for block in blocks if block != NULL_BLOCK])
        ref, key_hash = self.ref, self.key_hash
        first, last = [], []
        caching = self.enable_caching
        for block in blocks:
            if block == NULL_BLOCK:
                continue
            count = ref[block] - 1
            ref[block] = count
            if count == 0:
                if key_hash[block] is None or not caching:
                    first.append(block)
                else:
                    last.append(block)
        next_free, prev_free = self.next_free, self.prev_free
        if first:
            previous, old_first = self.head, next_free[self.head]
            for block in first:
                prev_free[block] = previous
                next_free[previous] = block
                previous = block
            next_free[previous] = old_first
            prev_free[old_first] = previous
        if last:
            previous = prev_free[self.tail]
            for block in last:
                prev_free[block] = previous
                next_free[previous] = block
                previous = block
            next_free[previous] = self.tail
            prev_free[self.tail] = previous
        self.num_free += len(first) + len(last)
        for block in blocks:
            if block != NULL_BLOCK:
                out.report(BlockFreed, block, ref[block], key_hash[block] is not None)

    def restore(self, snapshot) -> None:
        """Take a start snapshot's pool (``replay.snapshot.StartSnapshot``): reference counts,
        primary keys, every key's holders in lookup order, the free queue's order."""
        ref, key_hash, key_group, key_tokens = self.ref, self.key_hash, self.key_group, self.key_tokens
        for state in snapshot.blocks:
            ref[state.block_id] = state.ref_cnt
            if state.hash_id >= 0:
                key_hash[state.block_id] = state.hash_id
                key_group[state.block_id] = state.group
                key_tokens[state.block_id] = state.num_tokens
        for key in snapshot.keys:
            table = self.cached[key.group]
            for block in key.block_ids:
                if (key_hash[block], key_group[block]) != (key.hash_id, key.group):
                    self.extra_keys.setdefault(block, []).append((key.hash_id, key.group))
            holders = list(key.block_ids)
            table[key.hash_id] = holders[0] if len(holders) == 1 else holders
        next_free, prev_free = self.next_free, self.prev_free
        next_free[:] = prev_free[:] = [-1] * len(next_free)
        order = [self.head, *snapshot.free_queue, self.tail]
        for before, after in zip(order, order[1:]):
            next_free[before] = after
            prev_free[after] = before
        self.num_free = len(snapshot.free_queue)

    def free_queue(self) -> list[int]:
        """The free queue from head (reused first) to tail (for tests and inspection)."""
        blocks, block = [], self.next_free[self.head]
        while block != self.tail:
            blocks.append(block)
            block = self.next_free[block]
        return blocks

    # --- publishing keys -----------------------------------------------------------------------

    def cache_full_blocks(self, hash_ids: list[int], blocks: list[int], num_cached: int,
                          num_full: int, block_size: int, group: int, mask: list[bool] | None,
                          req: int) -> None:
        """Key ``blocks[num_cached:num_full]`` with the request's block-aligned hashes (skipping
        null and masked blocks); a block holding a shorter partial key is promoted."""
        scale = block_size // self.hash_block_size
        key_hash, key_tokens = self.key_hash, self.key_tokens
        for index in range(num_cached, min(num_full, len(blocks))):
            block = blocks[index]
            if block == NULL_BLOCK or (mask is not None and not mask[index - num_cached]):
                continue
            num_tokens = (index + 1) * block_size
            if key_hash[block] is not None:
                if key_tokens[block] >= num_tokens:
                    raise AssertionError(f"block {block} is keyed past {num_tokens} tokens")
                self.strip_keys(block, REKEY)
            self.insert_key(hash_ids[(index + 1) * scale - 1], group, block, num_tokens, FULL,
                            req)

    def cache_partial_block(self, hash_ids: list[int], num_hashes: int, block: int,
                            num_tokens: int, group: int, replace: bool, kind: StoreKind,
                            req: int) -> int | None:
        """Key ``block`` at the hash boundary ``num_tokens`` inside it; ``replace``: its content
        was replaced, so every old key goes first. Return the hash id (None for the null
        block)."""
        if block == NULL_BLOCK:
            return None
        unit = self.hash_block_size
        num_units = num_tokens // unit
        if num_tokens % unit or not 0 < num_units <= num_hashes:
            raise AssertionError(f"no hash unit ends at {num_tokens} tokens")
        hash_id = hash_ids[num_units - 1]
        if replace:
            self.strip_keys(block, REKEY)
        elif (self.key_hash[block] is not None
              and not (self.key_hash[block] == hash_id and self.key_group[block] == group)
              and not self._holds(hash_id, group, block)
              and self.key_tokens[block] < num_units * unit):
            self.strip_keys(block, REKEY)  # an upgrade to a longer prefix
        self.insert_key(hash_id, group, block, num_units * unit, kind, req)
        return hash_id
