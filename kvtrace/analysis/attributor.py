"""Miss attribution's Python reference (``MissAttributor``): for every admitted prefix lookup, where
its query tokens went. ``kvtrace._forensics_core`` is its C twin (csrc/forensics_lookup.c and
csrc/forensics_records.c: same names, same steps); ``kvtrace.analysis.stream`` drives either.

A *lookup* is a ``ComputedBlocksFound`` whose request's next ``allocate_slots`` succeeded
(a failed admission is looked up again later; only the admitted lookup decides what is
prefilled). ``lookup`` numbers a request's admitted lookups: 1 is its first admission, 2 and
on are resumptions after preemption. ``T`` is the request's ``num_tokens`` then (its prompt on
the first admission), ``H`` the hash unit. Definitions (``docs/miss-attribution.md``):

* **ideal**: the longest prefix of the request's hash units that an unbounded cache would hold
  under the same schedule - every unit that a successful ``allocate_slots`` of any request
  (this one's earlier admissions included) had scheduled before the lookup, kept in every
  KV-cache group at every hash-unit boundary - and at least the achieved hit (a hit proves its
  units were computed, if before the trace began). Not capped: the last-token rule is a cause.
* **hit**: the joint hit the cache returned (``ComputedBlocksFound.num_hit_tokens``).
* The **shortfall** ``ideal - hit`` is split by a waterfall: restrictions of the ideal cache are
  applied one at a time in ``SHORTFALL_CAUSES`` order (``kvtrace.analysis.causes``), the hit
  is recomputed after each with a model of vLLM 0.33's hit search (``hit_search``: full
  attention left to right with the fine-grained tail probe, and with ``use_eagle`` EAGLE's
  dropped unit; Mamba/KDA the deepest state at or below the attention hit), and each cause
  gets the tokens its restriction took. The search's own rules come first, over the ideal
  cache: the last-token cap (``hit_cap``), then the unit an EAGLE/MTP engine drops from every
  hit (``eagle_dropped_unit``). The last restriction leaves exactly the keys the cache held at
  the lookup; what the model then still finds above the real hit is ``other``. Every hit is
  clamped to at least the real hit, so each cause is >= 0 and they sum to ``ideal - hit``
  exactly; a cause only gets tokens the causes before it did not already take.
* Beyond the ideal, ``T - ideal`` is ``cold`` (whole hash units nobody had computed) and
  ``partial_unit`` / ``short_prompt`` (the tokens after the last whole hash unit, which no hash
  covers; ``short_prompt`` when the query is shorter than one unit). So for every lookup
  ``hit + sum(all causes) == T``.

The pass streams a trace's record batches once, keeping per KV-cache group which keys are
cached and, for a key no longer cached, the removal that took its last copy (with the transient
checkpoints cached in the free queue at that moment: a checkpoint pushout, as
``kvtrace/sql/checkpoint_pushouts.sql`` defines it). Costs in GPU-seconds are not computed
here: each segment carries its token range (``start``, ``end``), which is what a prefill cost
model needs.
"""

from __future__ import annotations

import inspect
import itertools
from typing import NamedTuple

import numpy as np

from kvtrace.analysis.causes import SHORTFALL_CAUSES
from kvtrace.analysis.hit_search import Geometry
from kvtrace.analysis.lookups import NO_REQ, LookupAttribution, LostKey, Removal, Segment
from kvtrace.engine_config import check_possible
from kvtrace.errors import ConfigError, KvtraceError
from kvtrace.events import (
    BlockAllocated,
    BlockFreed,
    BlockRemoved,
    BlockStored,
    BlockTouched,
    CheckpointClass,
    CheckpointRecorded,
    CheckpointSuppressed,
    ComputedBlocksFound,
    EngineConfig,
    EventsDropped,
    HashesExtended,
    KeyCached,
    RemoveReason,
    RequestArrived,
    RequestFinished,
    RequestPreempted,
    RequestQueue,
    RequestState,
    SlotsAllocated,
    StepStarted,
    StoreKind,
    TraceHeader,
)
from kvtrace.traceio import ListColumn, RecordBatch

_LEVEL = {name: index for index, name in enumerate(SHORTFALL_CAUSES)}
_KEY_CLASSES = range(_LEVEL["block_quantisation"], _LEVEL["other"])  # causes keys can carry
_PRESENT = len(SHORTFALL_CAUSES)  # a key the cache held at the lookup
_REAL = _LEVEL["other"] - 1  # keys with a level above this are the ones the cache held
_PUSHOUT_EXAMPLES = 3
_SKIP = 255  # a record kind index no batch uses: a record feed() passes over
_BLOCK_REFERENCES = (BlockAllocated, BlockTouched, BlockFreed)
_CHECKPOINT, _TRANSIENT = int(StoreKind.CHECKPOINT), int(CheckpointClass.TRANSIENT)
_LRU_REUSE, _STALE_CHECKPOINT = int(RemoveReason.LRU_REUSE), int(RemoveReason.STALE_CHECKPOINT)
_REKEY = int(RemoveReason.REKEY)
_RUNNING = int(RequestQueue.RUNNING)


class AttributionError(KvtraceError):
    """A trace that cannot be attributed (no engine config)."""

    default_hint = "Attribute a replay output or a capture (their headers carry the engine)."


class _PendingLookup(NamedTuple):
    seq: int
    step: int
    hit: int
    shared_prefix_boundary: int


class MissAttributor:
    """Attributes every admitted lookup of one trace; feed it the trace's batches in order.

    ``request``: attribute only that request's lookups (the cache is still followed in full),
    named by its number in the trace or by the engine's request id (``RequestArrived``).
    ``explain``: keep every key a restriction took (for ``kvtrace why``), not only the
    decisive one, and examples of the transient checkpoints behind each eviction."""

    def __init__(self, config: EngineConfig, *, request: int | str | None = None,
                 explain: bool = False) -> None:
        self.geometry = Geometry.of(config)
        self.unit = config.hash_block_size
        self.request_id = request if isinstance(request, str) else None
        self.only_request = NO_REQ if self.request_id is not None else request
        self.explain = explain
        self.lookups: list[LookupAttribution] = []
        self.dropped_events = 0
        num_groups = len(config.kv_cache_groups)
        self.num_blocks = config.num_gpu_blocks
        self.is_mamba = [g.kind == "mamba" for g in config.kv_cache_groups]
        self._copies: list[dict[int, int]] = [{} for _ in range(num_groups)]  # key -> blocks
        # key -> the fields of the Removal that took its last copy (a tuple: one per eviction)
        self._removals: list[dict[int, tuple]] = [{} for _ in range(num_groups)]
        self._copies_of = {groups: [self._copies[group] for group in groups]  # per kind
                           for groups in (self.geometry.attention_groups,
                                          self.geometry.mamba_groups)}
        self._units: dict[int, list[int]] = {}
        self._scheduled_units: dict[int, int] = {}  # req -> its units already counted computed
        self._computed: set[int] = set()  # hash ids some allocation scheduled
        self._states: set[int] = set()  # hash ids where a Mamba state was computed
        self._suppressed: set[int] = set()  # hash ids of checkpoints a variant kept local
        # req -> (group, position) -> the class of its latest CheckpointRecorded there (dropped
        # when the request finishes: no key is stored for a finished request)
        self._checkpoint_class: dict[int, dict[tuple[int, int], int]] = {}
        self._in_flight: set[int] = set()  # requests of the start snapshot
        self._pending: dict[int, _PendingLookup] = {}
        self._admissions: dict[int, int] = {}
        self._in_use: set[int] = set()
        # block -> [req, group, position, keys on the block] of its transient checkpoint key
        self._transient: dict[int, list[int]] = {}
        self._evictable_transient: dict[int, list[int]] = {}
        self._candidates_of: RecordBatch | None = None
        self._candidates = np.empty(0, dtype=np.int64)
        self._allocating = NO_REQ  # the request inside whose allocate_slots we are
        self._allocation_ok = False
        self._step = 0
        self._seq = 0
        handlers = {
            StepStarted: self._on_step, RequestArrived: self._on_arrived,
            HashesExtended: self._on_extended, ComputedBlocksFound: self._on_lookup,
            SlotsAllocated: self._on_allocated, RequestFinished: self._on_finished,
            RequestPreempted: self._on_preempted, BlockAllocated: self._on_taken,
            BlockTouched: self._on_taken, BlockFreed: self._on_freed,
            BlockStored: self._on_stored, BlockRemoved: self._on_removed,
            CheckpointRecorded: self._on_checkpoint, CheckpointSuppressed: self._on_suppressed,
            EventsDropped: self._on_dropped, KeyCached: self._on_key_cached,
            RequestState: self._on_request_state,
        }
        # Each handler is passed the fields its parameters name, found by name in the record.
        self._handlers = {
            record_type: (handler, tuple(map(record_type.__struct_fields__.index,
                                             inspect.signature(handler).parameters)))
            for record_type, handler in handlers.items()}

    def feed(self, batch: RecordBatch) -> None:
        """Follow one batch of records (in file order).

        Block references matter only for blocks that may hold a transient checkpoint (the
        pushout test); the others' allocations, touches and frees - most of a trace - are
        skipped without a Python call."""
        kinds = np.frombuffer(batch.kinds, dtype=np.uint8)
        order = None
        rows: list = [None] * 256
        for index, (record_type, columns) in enumerate(zip(batch.types, batch.columns)):
            entry = self._handlers.get(record_type)
            if entry is None:
                continue
            handler, fields = entry
            values = [columns[field].to_lists() if isinstance(columns[field], ListColumn)
                      else columns[field] for field in fields]
            if record_type in _BLOCK_REFERENCES:
                block_ids = columns[record_type.__struct_fields__.index("block_id")]
                blocks = np.frombuffer(block_ids, dtype=block_ids.typecode)
                outside = (blocks < -1) | (blocks >= self.num_blocks)
                if outside.any():
                    self._seq = batch.first_seq + int(
                        np.flatnonzero(kinds == index)[np.argmax(outside)])
                    self._check_block(batch.tags[index], int(blocks[np.argmax(outside)]))
                candidates = self._candidate_blocks(batch)
                keep = (np.isin(blocks, candidates, kind="table") if len(candidates)
                        else np.zeros(len(blocks), dtype=bool))
                if not keep.all():
                    if order is None:
                        order = kinds.copy()
                    order[np.flatnonzero(kinds == index)[~keep]] = _SKIP
                    values = [list(itertools.compress(v, keep)) for v in values]
            rows[index] = (handler, iter(zip(*values)) if values else itertools.repeat(()))
        seq = batch.first_seq
        for kind in (kinds if order is None else order).tobytes():
            entry = rows[kind]
            if entry is not None:
                self._seq = seq
                entry[0](*next(entry[1]))
            seq += 1

    def _candidate_blocks(self, batch: RecordBatch) -> np.ndarray:
        """Blocks that may hold a transient checkpoint during ``batch``: those that do, and
        those a checkpoint is stored on in it (computed once per batch)."""
        if batch is not self._candidates_of:
            stored = [columns for record_type, columns in zip(batch.types, batch.columns)
                      if record_type is BlockStored]
            found = list(self._transient)
            if stored:
                names = BlockStored.__struct_fields__
                store_blocks = stored[0][names.index("block_id")]
                store_kinds = stored[0][names.index("kind")]
                found += itertools.compress(store_blocks, (k == _CHECKPOINT for k in store_kinds))
            self._candidates_of, self._candidates = batch, np.array(found, dtype=np.int64)
        return self._candidates

    # --- inputs ---------------------------------------------------------------------------------

    def _on_step(self) -> None:
        self._step += 1
        self._allocating = NO_REQ

    def _on_arrived(self, req, hash_ids, request_id) -> None:
        self._allocating = NO_REQ
        self._units.setdefault(req, list(hash_ids))
        if request_id == self.request_id:
            self.only_request = req

    def _on_extended(self, req, hash_ids) -> None:
        self._allocating = NO_REQ
        self._units.setdefault(req, []).extend(hash_ids)

    def _on_lookup(self, req, num_hit_tokens, shared_prefix_boundary) -> None:
        self._allocating = NO_REQ
        self._pending[req] = _PendingLookup(self._seq, self._step, num_hit_tokens,
                                            shared_prefix_boundary)

    def _on_allocated(self, req, num_new_tokens, num_computed_tokens, num_new_computed_tokens,
                      num_external_computed_tokens, num_tokens, success) -> None:
        self._allocating, self._allocation_ok = req, bool(success)
        lookup = self._pending.pop(req, None)
        if not success:
            return
        if lookup is not None:
            admission = self._admissions[req] = self._admissions.get(req, 0) + 1
            if self.only_request is None or self.only_request == req:
                self.lookups.append(self._attribute(req, admission, lookup, num_tokens))
        end = min(num_computed_tokens + num_new_computed_tokens + num_external_computed_tokens
                  + num_new_tokens, num_tokens)
        units = self._units.get(req, ())
        done = min(end // self.unit, len(units))
        start = self._scheduled_units.get(req, 0)
        if done > start:
            self._computed.update(units[start:done])
            self._scheduled_units[req] = done
        if end % self.unit == 0 and 0 < end // self.unit <= len(units):
            self._states.add(units[end // self.unit - 1])  # the chunk's running state

    def _on_finished(self, req) -> None:
        self._allocating = NO_REQ
        self._units.pop(req, None)
        self._scheduled_units.pop(req, None)
        self._pending.pop(req, None)
        self._checkpoint_class.pop(req, None)

    def _on_preempted(self, req) -> None:
        self._allocating = NO_REQ
        self._pending.pop(req, None)

    def _on_dropped(self, count) -> None:
        self.dropped_events += count

    # --- the start snapshot ---------------------------------------------------------------------

    def _on_key_cached(self, hash_id, group, block_ids) -> None:
        """A key cached when the capture began: present (so never cold), on these blocks."""
        self._check_group("key_cached", group)
        for block_id in block_ids:
            self._check_block("key_cached", block_id)
        if block_ids:
            copies = self._copies[group]
            copies[hash_id] = copies.get(hash_id, 0) + len(block_ids)
            self._computed.add(hash_id)

    def _on_request_state(self, req, queue, hash_ids, num_computed_tokens, num_preemptions,
                          request_id) -> None:
        """A request in flight when the capture began: its units so far, those its computed
        tokens covered, and its admissions (the first, one after each preemption, and none
        more while it waits)."""
        units = self._units[req] = list(hash_ids)
        done = min(max(num_computed_tokens // self.unit, 0), len(units))
        self._computed.update(units[:done])
        self._scheduled_units[req] = done
        self._in_flight.add(req)
        admissions = num_preemptions + (queue == _RUNNING)
        if admissions > 0:
            self._admissions[req] = admissions
        if request_id == self.request_id:
            self.only_request = req

    # --- records the header contradicts ---------------------------------------------------------

    def _check_group(self, kind: str, group: int) -> None:
        num_groups = len(self.is_mamba)
        if not 0 <= group < num_groups:
            raise ValueError(f"record {self._seq} ({kind}) names KV-cache group {group}, but the "
                             f"header has {num_groups} group{'' if num_groups == 1 else 's'} "
                             f"(0 to {num_groups - 1})")

    def _check_block(self, kind: str, block_id: int) -> None:
        """-1 is no block a source could name (vLLM's own KV events); the rest, the pool's."""
        if not -1 <= block_id < self.num_blocks:
            raise ValueError(f"record {self._seq} ({kind}) names block {block_id}, outside the "
                             f"header's pool of {self.num_blocks} blocks")

    def _check_key(self, kind: str, block_id: int, group: int) -> None:
        self._check_group(kind, group)
        self._check_block(kind, block_id)

    # --- effects --------------------------------------------------------------------------------

    def _on_taken(self, block_id) -> None:
        if block_id in self._transient:
            self._in_use.add(block_id)
            self._evictable_transient.pop(block_id, None)

    def _on_freed(self, block_id, ref_cnt) -> None:
        if ref_cnt == 0 and block_id in self._transient:
            self._in_use.discard(block_id)
            self._recheck(block_id)

    def _recheck(self, block_id: int) -> None:
        """Whether ``block_id`` is a transient checkpoint entry cached in the free queue: its
        newest key is a TRANSIENT checkpoint, it still holds a key, and no request holds it.

        Only such blocks are followed, from the store of their checkpoint key on: vLLM stores
        keys only on blocks a request holds, and publishing a checkpoint replaces every key
        the slot had (``replace_existing_hashes``), so the block holds that one key then."""
        info = self._transient.get(block_id)
        if info is not None and info[3] and block_id not in self._in_use:
            self._evictable_transient[block_id] = info
        else:
            self._evictable_transient.pop(block_id, None)

    def _on_stored(self, block_id, hash_id, group, num_tokens, kind, req) -> None:
        self._check_key("block_stored", block_id, group)
        copies = self._copies[group]
        copies[hash_id] = copies.get(hash_id, 0) + 1
        if (kind == _CHECKPOINT and self._checkpoint_class.get(req, {}).get(
                (group, num_tokens)) == _TRANSIENT):
            self._transient[block_id] = [req, group, num_tokens, 1]  # ..., keys on the block
            self._in_use.add(block_id)
            self._evictable_transient.pop(block_id, None)
        elif block_id in self._transient:  # a newer key: no longer a transient entry
            del self._transient[block_id]
            self._in_use.discard(block_id)
            self._evictable_transient.pop(block_id, None)

    def _on_removed(self, block_id, hash_id, group, reason) -> None:
        self._check_key("block_removed", block_id, group)
        copies = self._copies[group]
        left = copies.get(hash_id, 0) - 1
        if left > 0:
            copies[hash_id] = left
        else:  # the last copy: remember how it went
            copies[hash_id] = 0
            behind, examples, by_req = 0, (), NO_REQ
            if reason == _LRU_REUSE:
                by_req = self._allocating
                others = self._evictable_transient
                if others:
                    behind = len(others) - (block_id in others)
                    if behind and self.explain:
                        examples = tuple(itertools.islice(
                            ((r, p, b) for b, (r, _g, p, _k) in reversed(others.items())
                             if b != block_id), _PUSHOUT_EXAMPLES))
            self._removals[group][hash_id] = (reason, self._seq, self._step, block_id, by_req,
                                              behind, examples)
        info = self._transient.get(block_id)
        if info is not None:
            info[3] = max(info[3] - 1, 0)
            self._recheck(block_id)

    def _on_checkpoint(self, req, group, position, position_class) -> None:
        self._check_group("checkpoint_recorded", group)
        self._checkpoint_class.setdefault(req, {})[(group, position)] = position_class
        units = self._units.get(req, ())
        if (self._allocating == req and self._allocation_ok
                and 0 < position // self.unit <= len(units)):
            self._states.add(units[position // self.unit - 1])

    def _on_suppressed(self, req, group, position) -> None:
        self._check_group("checkpoint_suppressed", group)
        units = self._units.get(req, ())
        if 0 < position // self.unit <= len(units):
            self._suppressed.add(units[position // self.unit - 1])

    # --- one lookup -----------------------------------------------------------------------------

    def _level(self, group: int, hash_id: int) -> int:
        """Which restriction of the ideal cache takes ``hash_id`` in ``group`` (``_PRESENT``:
        none, the cache held it)."""
        copies = self._copies[group].get(hash_id)
        if copies:
            return _PRESENT
        mamba = self.is_mamba[group]
        if copies is None:  # never stored
            if not mamba:
                return _LEVEL["block_quantisation"]
            if hash_id in self._suppressed:
                return _LEVEL["mamba_suppressed"]
            if hash_id in self._states:
                return _LEVEL["mamba_not_retained"]
            return _LEVEL["mamba_not_reserved"]
        reason, *_, transient_behind, _examples = self._removals[group][hash_id]
        if reason == _LRU_REUSE:
            if transient_behind:
                return _LEVEL["checkpoint_pushout"]
            return _LEVEL["mamba_evicted" if mamba else "evicted"]
        if reason == _STALE_CHECKPOINT:
            return _LEVEL["mamba_suppressed"]
        if reason == _REKEY:
            return _LEVEL["rekeyed"]
        return _LEVEL["invalidated"]

    def _levels(self, groups: tuple[int, ...], units: list[int], depth: int) -> list[int]:
        """Per unit depth 1..depth: the first restriction that takes the key from any of
        ``groups`` (vLLM looks groups of one kind up together: all must hold it)."""
        copies, level = self._copies_of[groups], self._level
        levels = [0]
        for hash_id in units[:depth]:
            missing = [group for group, held in zip(groups, copies) if not held.get(hash_id)]
            levels.append(min([level(group, hash_id) for group in missing]) if missing
                          else _PRESENT)
        return levels

    def _attribute(self, req: int, admission: int, lookup: _PendingLookup,
                   num_tokens: int) -> LookupAttribution:
        unit, geometry = self.unit, self.geometry
        units = self._units.get(req, [])
        num_units = min(len(units), num_tokens // unit)
        seen = 0
        while seen < num_units and units[seen] in self._computed:
            seen += 1
        hit = lookup.hit
        ideal = max(seen * unit, hit)
        depth = min(ideal // unit, num_units)
        attention = self._levels(geometry.attention_groups, units, depth)
        mamba = self._levels(geometry.mamba_groups, units, depth)
        cap = num_tokens - 1
        result = LookupAttribution(
            req, admission, lookup.seq, lookup.step, num_tokens, ideal, hit,
            lookup.shared_prefix_boundary,
            geometry.attention_reach(attention, _REAL, num_units, cap)
            if geometry.attention_groups else None,
            geometry.mamba_state(mamba, _REAL, num_units, cap) if geometry.mamba_groups else None,
            in_flight=req in self._in_flight)
        # The waterfall: the hit after each restriction, clamped to [hit, the previous one].
        # First the rules of the search over the ideal cache (the last-token cap, then with
        # use_eagle the dropped unit), then vLLM's hit search (which drops it too) over the
        # keys left after removing each class in turn (block quantisation always: the search
        # itself quantises). A class no key carries changes nothing and is skipped. (Most
        # lookups get the ideal hit.)
        hits = []
        if ideal > hit:
            carried = set(attention) | set(mamba)
            rules = {"hit_cap": min(ideal, cap // unit * unit)}
            if geometry.eagle_drop:
                rules["eagle_dropped_unit"] = geometry.eagle_ideal(ideal, cap)
            hits = [(cause, None, rules[cause]) if cause in rules else (cause, level, 0)
                    for level, cause in enumerate(SHORTFALL_CAUSES[:_LEVEL["other"]])
                    if cause in rules or level in _KEY_CLASSES
                    and (level in carried or cause == "block_quantisation")]
        previous = ideal
        for cause, level, rule_hit in hits:
            if previous == hit:
                break
            now = (rule_hit if level is None else
                   geometry.joint_hit(attention, mamba, level, num_units, cap))
            now = max(hit, min(previous, now))
            if now < previous:
                keys = self._lost_keys(cause, now, previous, units, attention, mamba)
                result.segments.append(Segment(cause, now, previous, keys))
            previous = now
        if previous > hit:
            result.segments.append(Segment("other", hit, previous))
        whole_units = num_tokens // unit * unit
        if whole_units > ideal:
            result.segments.append(Segment("cold", ideal, whole_units))
        if num_tokens > whole_units:
            tail = "short_prompt" if whole_units == 0 else "partial_unit"
            result.segments.append(Segment(tail, max(whole_units, ideal), num_tokens))
        return result

    def _lost_keys(self, cause: str, start: int, end: int, units: list[int],
                   attention: list[int], mamba: list[int]) -> tuple[LostKey, ...]:
        """The keys of ``cause`` that its restriction took between ``start`` and ``end``: the
        Mamba state where the hit would have ended first (when it is one of them), then the
        full-attention blocks (and interior keys) in the range, shallowest first."""
        level = _LEVEL.get(cause)
        if level not in _KEY_CLASSES:
            return ()
        unit, geometry = self.unit, self.geometry
        keys = []
        last = end // unit
        if 0 <= last < len(mamba) and mamba[last] == level:
            keys.append(self._lost_key(geometry.mamba_groups, level, last, units))
        per_block = geometry.attention_block // unit
        for depth in range(max(start // unit + 1, 1), min(last, len(attention) - 1) + 1):
            if attention[depth] == level and (depth % per_block == 0 or depth == last):
                keys.append(self._lost_key(geometry.attention_groups, level, depth, units))
            if keys and not self.explain:
                break
        return tuple(keys if self.explain else keys[:1])

    def _lost_key(self, groups: tuple[int, ...], level: int, depth: int,
                  units: list[int]) -> LostKey:
        hash_id = units[depth - 1]
        group = next(g for g in groups if self._level(g, hash_id) == level)
        removal = self._removals[group].get(hash_id)  # none: never stored
        return LostKey(group, depth * self.unit, hash_id,
                       Removal._make(removal) if removal else None)



def new_attributor(header: TraceHeader, path: str, **options) -> MissAttributor:
    """The attributor of one trace, once its engine config is one an engine can have."""
    if header.config is None:
        raise AttributionError(f"{path} has no engine config in its header, so its lookups "
                               "cannot be attributed")
    try:
        check_possible(header.config)
    except ConfigError as error:
        raise ConfigError(f"{path}: {error}", error.hint) from None
    return MissAttributor(header.config, **options)
