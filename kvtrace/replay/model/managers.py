"""The per-group managers of vLLM 0.33's prefix cache (``single_type_kv_cache_manager.py``):
full attention and Mamba in "align" mode, over the block ids of a ``BlockPool``.

A request's block table is a list of block ids indexed by block position (0 = the null block
standing in for a skipped position). Each manager keeps vLLM's per-request bookkeeping in dicts
keyed by the request number: the table, how many leading entries are cached (present only while
the request runs), a pending copy-on-write after a partial hit; the Mamba manager also its
checkpoint reservation, retirement frontier, last running-state slot and produced partial tail.
Method names follow vLLM's; the records they make are the probes' (see ``pool.py``).
"""

from __future__ import annotations

from kvtrace.events import (
    BoundaryStateOffloaded,
    CheckpointClass,
    CheckpointRecorded,
    CheckpointSuppressed,
    StaleKeyLeft,
)
from kvtrace.replay.model.pool import CHECKPOINT, NULL_BLOCK, PARTIAL, STALE_CHECKPOINT, BlockPool
from kvtrace.replay.model.reports import Records, Tally
from kvtrace.replay.scheduling_rules import MambaAlignedSplit, mamba_checkpoint_position
from kvtrace.replay.snapshot import SnapshotError
from kvtrace.replay.variants import CheckpointAction, CheckpointFacts, Variant

_STRIP, _KEEP_LOCAL = CheckpointAction.STRIP, CheckpointAction.KEEP_LOCAL


class Request:
    """What the cache reads of a request (vLLM's ``Request``): its hash ids at the hash unit
    (known ones, then made-up ones as decode completes units), token counts and junction.
    ``num_reported``: the hash units the records have named (None before its first lookup)."""

    __slots__ = ("req", "prompt_len", "max_tokens", "hash_ids", "num_hashes", "num_tokens",
                 "num_computed_tokens", "shared_prefix_boundary", "num_reported",
                 "num_in_flight_tokens")

    def __init__(self, req: int, prompt_len: int, max_tokens: int, hash_ids: list[int],
                 hash_block_size: int) -> None:
        self.req = req
        self.prompt_len = prompt_len
        self.max_tokens = max_tokens
        self.hash_ids = hash_ids
        self.num_hashes = prompt_len // hash_block_size
        self.num_tokens = prompt_len
        self.num_computed_tokens = 0
        self.shared_prefix_boundary = 0
        self.num_reported: int | None = None
        self.num_in_flight_tokens = 0  # async scheduling: tokens of steps still in flight

    @property
    def num_prompt_tokens(self) -> int:
        return self.prompt_len


class FullAttentionManager:
    """vLLM's ``FullAttentionManager``: every block of the sequence, keyed densely."""

    is_mamba = False

    def __init__(self, group: int, block_size: int, pool: BlockPool, enable_caching: bool,
                 alignment: int) -> None:
        self.group = group
        self.block_size = block_size
        self.pool = pool
        self.enable_caching = enable_caching
        self.alignment = alignment  # cache_hit_alignment_tokens
        self.tables: dict[int, list[int]] = {}
        self.num_cached: dict[int, int] = {}
        self.partial_hits: dict[int, tuple[int, int]] = {}  # req -> (block index, source)
        self.cow_copies: list[tuple[int, int]] = []  # (source, copy) until the step's end

    # --- allocation ----------------------------------------------------------------------------

    def blocks_to_allocate(self, request: Request, num_tokens: int, hit: list[int],
                           total_computed: int, num_local_computed: int, num_tokens_main: int,
                           admission: bool, prefill_end: int) -> int:
        """``get_num_blocks_to_allocate`` (no skipped tokens in full attention)."""
        required = -(-num_tokens // self.block_size)
        table = self.tables.get(request.req)
        num_new = required - len(table) if table else required
        if request.req in self.num_cached:  # running: no new hits
            return num_new if num_new > 0 else 0
        if not hit:
            return num_new if num_new > 0 else 0
        num_new = max(num_new - len(hit), 0)
        if num_local_computed % self.block_size:
            num_new += 1  # the copy-on-write block of a partial hit
        return num_new + self.num_evictable(hit)

    def num_evictable(self, hit: list[int]) -> int:
        """Hit blocks in the free queue: touching them takes them out of it."""
        ref = self.pool.ref
        return sum(1 for block in hit if block != NULL_BLOCK and ref[block] == 0)

    def skipped_blocks(self, total_computed: int) -> int:
        """Leading blocks of a hit that attention no longer reads (none in full attention)."""
        return 0

    def add_hit(self, request: Request, hit: list[int], num_local_computed: int,
                total_computed: int) -> None:
        """``add_local_computed_blocks``: take the hit blocks (touch), null the skipped ones."""
        req = request.req
        table = self.tables.setdefault(req, [])
        if table:
            raise AssertionError(f"request {req} already holds blocks")
        skipped = self.skipped_blocks(total_computed)
        if skipped > 0:
            hit = hit[skipped:]
        if self.enable_caching:
            self.pool.touch(hit, req)
        elif any(hit):
            raise AssertionError("prefix hits without prefix caching")
        table.extend([NULL_BLOCK] * skipped)
        table.extend(hit)
        self.num_cached[req] = len(table)
        if hit and num_local_computed % self.block_size:
            index = num_local_computed // self.block_size
            self.partial_hits[req] = (index, hit[-1])
            self.num_cached[req] = index

    def apply_cow(self, req: int, index: int, source: int, copy: int) -> None:
        """Redirect a partial hit to a private copy; both stay referenced until the step's
        copies have run (``end_schedule``)."""
        table = self.tables[req]
        if not (index < len(table) and table[index] == source and source != NULL_BLOCK
                and self.pool.ref[source] > 0):
            raise AssertionError(f"request {req}: no shared block {source} at {index}")
        table[index] = copy
        self.cow_copies.append((source, copy))
        self.pool.ref[copy] += 1

    def allocate(self, request: Request, num_tokens: int, num_tokens_main: int) -> None:
        """``allocate_new_blocks``."""
        req = request.req
        table = self.tables.setdefault(req, [])
        partial = self.partial_hits.pop(req, None)
        if partial is not None:
            copy = self.pool.get_new_blocks(1, req)[0]
            self.apply_cow(req, partial[0], partial[1], copy)
        num_new = -(-num_tokens // self.block_size) - len(table)
        if num_new > 0:
            table.extend(self.pool.get_new_blocks(num_new, req))

    # --- caching -------------------------------------------------------------------------------

    def mask(self, start: int, end: int, retention_interval: int | None,
             boundaries: list[int]) -> list[bool] | None:
        """``reachable_block_mask``: full attention caches densely."""
        return None

    def num_full_blocks(self, request: Request, num_tokens: int) -> int:
        """Blocks of the first ``num_tokens`` tokens that are full and hashed."""
        limit = request.num_hashes * self.pool.hash_block_size
        return (num_tokens if num_tokens < limit else limit) // self.block_size

    def cache_full(self, request: Request, num_cached: int, num_full: int,
                   retention_interval: int | None, boundaries: tuple[int, ...]) -> None:
        """The base ``cache_blocks`` once blocks ``num_cached..num_full`` are full: key those
        the mask keeps."""
        req = request.req
        reachable = list(boundaries)
        if request.shared_prefix_boundary:
            reachable.append(request.shared_prefix_boundary)
        mask = self.mask(num_cached, num_full, retention_interval, reachable)
        self.pool.cache_full_blocks(request.hash_ids, self.tables.get(req, []), num_cached,
                                    num_full, self.block_size, self.group, mask, req)
        self.num_cached[req] = num_full

    def cache(self, request: Request, num_tokens: int, retention_interval: int | None,
              boundaries: tuple[int, ...]) -> None:
        """``cache_blocks``, then the prompt tail inside a block (when blocks span units)."""
        num_cached = self.num_cached.get(request.req, 0)
        num_full = self.num_full_blocks(request, num_tokens)
        if num_full > num_cached:
            self.cache_full(request, num_cached, num_full, retention_interval, boundaries)
        if self.block_size == self.pool.hash_block_size:
            return
        unit = self.pool.hash_block_size
        boundary = min((request.prompt_len - 1) // unit, request.num_hashes) * unit
        if boundary == 0 or boundary > num_tokens or boundary % self.block_size == 0:
            return
        index = boundary // self.block_size
        table = self.tables.get(request.req, [])
        if index >= len(table):
            return
        self.pool.cache_partial_block(request.hash_ids, request.num_hashes, table[index],
                                      boundary, self.group, False, PARTIAL, request.req)

    # --- a start snapshot ----------------------------------------------------------------------

    def restore_request(self, req: int, block_ids: list[int], fields: dict[str, list[int]]) -> None:
        """A request in flight at a start snapshot: its blocks and the per-request state vLLM's
        manager keeps, given by vLLM's attribute names (``probes.snapshot.REQUEST_FIELDS``)."""
        self.tables[req] = list(block_ids)
        for name, values in fields.items():
            if not self.restore_field(req, name, values):
                raise SnapshotError(f"the start snapshot gives request {req} {name} in "
                                    f"KV-cache group {self.group}, which keeps no such state")

    def restore_field(self, req: int, name: str, values: list[int]) -> bool:
        if name == "num_cached_block":
            self.num_cached[req] = values[0]
        elif name == "_partial_hit_reqs":
            self.partial_hits[req] = (values[0], values[1])
        else:
            return False
        return True

    # --- release -------------------------------------------------------------------------------

    def release(self, req: int) -> None:
        """``free``: the request's blocks back to the pool, tail first (evicted first)."""
        table = self.tables.pop(req, [])
        self.num_cached.pop(req, None)
        self.partial_hits.pop(req, None)
        start = 0
        while start < len(table) and table[start] == NULL_BLOCK:
            start += 1  # the leading null blocks are not handed back
        self.pool.free_blocks(table[start:][::-1])


class MambaManager(FullAttentionManager):
    """vLLM's ``MambaManager`` in "align" mode: a state block where a chunk ends (the others
    null), an internal checkpoint slot per chunk where the variant reserves one, states retired
    one chunk later, and the two checkpoint decisions taken from ``variant``."""

    is_mamba = True

    def __init__(self, group: int, block_size: int, pool: BlockPool, enable_caching: bool,
                 alignment: int, variant: Variant, num_checkpoint_blocks: int,
                 checkpoint_alignment: int | None, records: Records | Tally) -> None:
        super().__init__(group, block_size, pool, enable_caching, alignment)
        self.variant = variant
        self.records = records
        self.has_checkpoint_blocks = num_checkpoint_blocks > 0
        self.validity = MambaAlignedSplit(
            block_size=block_size, hash_block_size=pool.hash_block_size, max_prefill_tokens=0,
            partial_cache_hit=False, has_checkpoint_blocks=self.has_checkpoint_blocks,
            checkpoint_alignment=checkpoint_alignment)
        self.cached_this_step: set[int] = set()
        self.last_state: dict[int, int] = {}
        self.num_retired: dict[int, int] = {}
        self.allocated: set[int] = set()
        self.checkpoints: dict[int, tuple[int, int]] = {}  # req -> (position, block index)
        self.producer_tails: dict[int, tuple[int, int]] = {}  # req -> (block, boundary)

    # --- allocation ----------------------------------------------------------------------------

    def blocks_to_allocate(self, request: Request, num_tokens: int, hit: list[int],
                           total_computed: int, num_local_computed: int, num_tokens_main: int,
                           admission: bool, prefill_end: int) -> int:
        """``get_num_blocks_to_allocate``: one state block per chunk, plus the checkpoint slot
        and a partial hit's copy; and decision 1: whether this chunk reserves a checkpoint."""
        pool = self.pool
        if hit and pool.key_hash[hit[-1]] in self.cached_this_step:
            return pool.num_blocks + 1  # a state keyed this step is not computed yet: wait
        req = request.req
        block_size = self.block_size
        table = self.tables.get(req, ())
        required = -(-num_tokens_main // block_size)
        num_new = required - len(hit) - len(table)
        has_partial_hit = (num_local_computed % block_size != 0 if hit else False) \
            or req in self.partial_hits
        if has_partial_hit:
            num_new = max(num_new, 0) + 1
        if self.variant.reserve_every_chunk:
            prefill_end = 0
        position = 0
        if self.has_checkpoint_blocks and num_tokens_main >= prefill_end:
            position = mamba_checkpoint_position(num_tokens_main, self.alignment, False)
            if not self.needs_checkpoint(req, table, total_computed, num_tokens_main, position):
                position = 0
        if not admission:
            if position > 0:
                checkpoint = (position, required - 2)
                self.checkpoints[req] = checkpoint
                self.records.report(CheckpointRecorded, req, self.group, position,
                                    checkpoint[1],
                                    self.checkpoint_class(request, position, num_tokens_main))
            else:
                self.checkpoints.pop(req, None)
        if num_new > 0:
            num_new = min(num_new, 1 + has_partial_hit + (position > 0))
        return num_new + self.num_evictable(hit) if hit else num_new

    @staticmethod
    def checkpoint_class(request: Request, position: int, chunk_end: int) -> CheckpointClass:
        if position == request.shared_prefix_boundary:
            return CheckpointClass.JUNCTION
        if chunk_end < request.prompt_len:
            return CheckpointClass.TRANSIENT
        return CheckpointClass.PROMPT_END

    def needs_checkpoint(self, req: int, table, start: int, end: int, position: int) -> bool:
        """``_needs_internal_checkpoint`` for a chunk that reaches the reserving end: the kernel
        can export the state at ``position`` in it and its slot is free."""
        index = -(-end // self.block_size) - 2
        return (start < position and self.validity.checkpoint_valid(start, end, position)
                and index >= 0 and (index >= len(table) or table[index] == NULL_BLOCK))

    def skipped_blocks(self, total_computed: int) -> int:
        """Mamba needs only the state after the last computed token."""
        return (total_computed - 1) // self.block_size

    def allocate(self, request: Request, num_tokens: int, num_tokens_main: int) -> None:
        """``allocate_new_blocks`` in "align" mode: null gaps, the checkpoint slot and the
        running state; a running producer's partial tail moves its keys to a private copy."""
        req = request.req
        pool = self.pool
        table = self.tables.setdefault(req, [])
        required = -(-num_tokens_main // self.block_size)
        has_checkpoint = req in self.checkpoints
        partial = self.partial_hits.get(req)
        if required <= len(table) and partial is None and not has_checkpoint:
            self.allocated.add(req)
            return
        num_held = len(table)
        was_allocated = req in self.allocated
        if was_allocated or num_held > 0:
            self.last_state[req] = num_held - 1
        null_end = required - 1 - has_checkpoint
        if num_held < null_end:
            table.extend([NULL_BLOCK] * (null_end - num_held))
        num_new = max(required - len(table), 0) + (partial is not None)
        if num_new > 1 + (partial is not None) + has_checkpoint:
            raise AssertionError(f"request {req}: {num_new} new Mamba blocks")
        new_blocks = pool.get_new_blocks(num_new, req)
        if partial is not None:
            index, source = partial
            copy = new_blocks.pop(0)
            if was_allocated:
                # A running request's table is append-only: it keeps writing ``source``; the
                # cache entry moves to the copy the step's copies fill.
                if table[index] != source:
                    raise AssertionError(f"request {req}: block {source} left slot {index}")
                pool.move_keys(source, copy, req)
                self.cow_copies.append((source, copy))
                pool.ref[source] += 1
                tail = self.producer_tails.pop(req, None)
                if tail is not None:
                    self.records.report(BoundaryStateOffloaded, req, self.group, copy, tail[1])
                if pool.key_hash[copy] is not None:
                    self.cached_this_step.add(pool.key_hash[copy])
            else:
                self.apply_cow(req, index, source, copy)
        table.extend(new_blocks)
        self.allocated.add(req)
        self.partial_hits.pop(req, None)

    def retire(self, request: Request, num_processed: int) -> None:
        """``remove_skipped_blocks``: free the states before the last processed token, then the
        previous running state once the request is past it."""
        req = request.req
        block_size = self.block_size
        table = self.tables.get(req)
        if num_processed - 1 > 0 and table:
            last = min((num_processed - 1) // block_size, len(table))
            first = self.num_retired.get(req, 0)
            if first < last:
                freed = []
                for index in range(last - 1, first - 1, -1):
                    block = table[index]
                    if block != NULL_BLOCK:
                        freed.append(block)
                        table[index] = NULL_BLOCK
                if freed:
                    self.pool.free_blocks(freed)
                self.num_retired[req] = last
        index = self.last_state.get(req)
        if index is not None and index < -(-num_processed // block_size) - 1:
            block = table[index]
            if block != NULL_BLOCK:
                self.pool.free_blocks([block])
                table[index] = NULL_BLOCK

    # --- caching -------------------------------------------------------------------------------

    def mask(self, start: int, end: int, retention_interval: int | None,
             boundaries: list[int]) -> list[bool] | None:
        """``reachable_block_mask``: dense (None) without retention; else the state blocks
        ending on a retention segment and those a replay or junction resumes at."""
        if retention_interval is None:
            return None
        block_size = self.block_size
        keep = [False] * (end - start)
        if retention_interval:
            per_segment = retention_interval // block_size
            if per_segment <= 1:
                return None
            first = (start + per_segment) // per_segment * per_segment - 1
            for index in range(first - start, len(keep), per_segment):
                keep[index] = True
        alignment = self.alignment
        for boundary in boundaries:
            index = boundary // alignment * alignment // block_size - 1
            if start <= index < end:
                keep[index - start] = True
        return keep

    def cache(self, request: Request, num_tokens: int, retention_interval: int | None,
              boundaries: tuple[int, ...]) -> None:
        """``cache_blocks``: the masked full-block pass, then the checkpoint decision (or the
        prompt-tail partial entry), the same-step guard and the offload reports."""
        req = request.req
        checkpoint = self.checkpoints.get(req)
        before = self.num_cached.get(req, 0)
        num_full = self.num_full_blocks(request, num_tokens)
        if num_full > before:
            self.cache_full(request, before, num_full, retention_interval, boundaries)
            after = num_full
        else:
            after = before
        num_stripped = 0
        key = None
        if checkpoint is not None:
            key, num_stripped = self.decide_checkpoint(request, num_tokens, retention_interval,
                                                       checkpoint)
        elif num_tokens > 0 and num_tokens % self.pool.hash_block_size == 0:
            key = self.cache_prompt_tail(request, num_tokens)
        if key is not None:
            self.cached_this_step.add(key)
        offloads = []
        if after > before:
            table = self.tables[req]
            key_hash, key_tokens = self.pool.key_hash, self.pool.key_tokens
            for index in range(before, after):
                block = table[index]
                if block == NULL_BLOCK or key_hash[block] is None:
                    continue
                self.cached_this_step.add(key_hash[block])
                offloads.append((block, key_tokens[block]))
        if checkpoint is not None:
            self.report_decision(request, checkpoint, num_stripped)
        for block, boundary in offloads:
            self.records.report(BoundaryStateOffloaded, req, self.group, block, boundary)

    def decide_checkpoint(self, request: Request, num_tokens: int,
                          retention_interval: int | None,
                          checkpoint: tuple[int, int]) -> tuple[int | None, int]:
        """Decision 2 on the checkpoint slot: (published hash id or None, keys stripped)."""
        position, index = checkpoint
        table = self.tables[request.req]
        if not 0 <= index < len(table):
            raise AssertionError(f"request {request.req}: no checkpoint slot {index}")
        slot = table[index]
        facts = CheckpointFacts(
            retention_interval, num_tokens, request.prompt_len, position,
            request.shared_prefix_boundary,
            position == mamba_checkpoint_position(request.prompt_len, self.alignment, False),
            self.is_retained(position, retention_interval))
        action = self.variant.checkpoint_action(facts)
        pool = self.pool
        if action is _STRIP:
            return None, len(pool.strip_keys(slot, STALE_CHECKPOINT))
        if action is _KEEP_LOCAL or pool.key_tokens[slot] == position:
            return None, 0
        return pool.cache_partial_block(request.hash_ids, request.num_hashes, slot, position,
                                        self.group, True, CHECKPOINT, request.req), 0

    def is_retained(self, position: int, retention_interval: int | None) -> bool:
        """vLLM 0.33: a block-aligned position the retention mask keeps (no boundaries)."""
        if position % self.block_size:
            return False
        index = position // self.block_size - 1
        keep = self.mask(index, index + 1, retention_interval, [])
        return keep is None or keep[0]

    def cache_prompt_tail(self, request: Request, num_tokens: int) -> int | None:
        """The prompt's last hash boundary (``num_tokens``, a positive multiple of the hash
        unit) as a partial entry on its state block; inside a block, the producer then keeps
        writing it and hands the entry to a copy."""
        if num_tokens != mamba_checkpoint_position(request.prompt_len,
                                                   self.pool.hash_block_size, False):
            return None
        index = -(-num_tokens // self.block_size) - 1
        table = self.tables.get(request.req, [])
        if index >= len(table):
            return None
        source = table[index]
        if source == NULL_BLOCK or self.pool.key_tokens[source] == num_tokens:
            return None
        key = self.pool.cache_partial_block(request.hash_ids, request.num_hashes, source,
                                            num_tokens, self.group, False, PARTIAL, request.req)
        if key is not None and num_tokens % self.block_size:
            req = request.req
            self.partial_hits[req] = (index, source)
            self.num_cached[req] = index
            self.producer_tails[req] = (source, num_tokens)
        return key

    def report_decision(self, request: Request, checkpoint: tuple[int, int],
                        num_stripped: int) -> None:
        """As the probes: a slot not keyed at the checkpoint kept it request-local; a key of
        another length left on it names a state the slot will not hold."""
        position, index = checkpoint
        slot = self.tables[request.req][index]
        if slot == NULL_BLOCK:
            return
        depth = self.pool.depth
        hash_ids = [hash_id for hash_id, _ in self.pool.keys_on(slot)]
        if not any(depth.get(hash_id) == position for hash_id in hash_ids):
            self.records.report(CheckpointSuppressed, request.req, self.group, position, slot,
                                num_stripped)
        for hash_id in hash_ids:
            key_num_tokens = depth.get(hash_id, 0)
            if key_num_tokens != position:
                self.records.report(StaleKeyLeft, request.req, self.group, slot, hash_id,
                                    key_num_tokens, position)

    def restore_field(self, req: int, name: str, values: list[int]) -> bool:
        if name == "last_state_block_idx":
            self.last_state[req] = values[0]
        elif name == "_num_retired_blocks":
            self.num_retired[req] = values[0]
        elif name == "_allocated_block_reqs":
            self.allocated.add(req)
        elif name == "_checkpoints":
            self.checkpoints[req] = (values[0], values[1])
        elif name == "_producer_partial_tail_reqs":
            self.producer_tails[req] = (values[0], values[1])
        else:
            return super().restore_field(req, name, values)
        return True

    # --- release -------------------------------------------------------------------------------

    def release(self, req: int) -> None:
        self.allocated.discard(req)
        self.last_state.pop(req, None)
        self.num_retired.pop(req, None)
        self.checkpoints.pop(req, None)
        self.producer_tails.pop(req, None)
        super().release(req)

    def new_step(self) -> None:
        """``new_step_starts``: states keyed last step are computed now."""
        self.cached_this_step.clear()
