"""Live figures of a trace still being written: what ``kvtrace top`` shows and the metrics
endpoint serves.

* ``LiveFigures`` is fed the record batches a ``trace_tail.TraceTail`` hands over, and keeps
  the figures in memory bounded over hours: windows of the last minutes, a capped table of hot
  prefixes, per-cause totals. Each figure mirrors an offline definition, named in ``Figures``'
  docstring, so that a whole trace fed to it gives what ``kvtrace load`` and the shipped
  queries give (tests/test_live.py).
* ``LiveSource`` joins the two behind a lock, for a reader in another thread (the metrics
  server).
"""

from __future__ import annotations

import collections
import os
import tempfile
import threading

import msgspec
import numpy as np

from kvtrace.analysis.causes import CAUSES
from kvtrace.analysis.miss_table import ATTRIBUTION_TABLE
from kvtrace.analysis.stream import new_pass
from kvtrace.analysis.trace_tail import TraceTail
from kvtrace.events import (
    BlockAllocated,
    BlockFreed,
    BlockRemoved,
    BlockState,
    BlockStored,
    BlockTouched,
    CheckpointClass,
    CheckpointRecorded,
    ComputedBlocksFound,
    EventsDropped,
    GpuSampled,
    KeyCached,
    RemoveReason,
    RequestFinished,
    RequestPreempted,
    RequestQueue,
    RequestState,
    SlotsAllocated,
    SnapshotStarted,
    StepStarted,
    StoreKind,
    TraceHeader,
)
from kvtrace.traceio import ListColumn, RecordBatch

WINDOW_S = 60.0  # "now": the last minute
HISTORY_INTERVAL_S = 60.0
HISTORY_INTERVALS = 15
TOP_PREFIXES = 10
# Hash ids the hot-prefix table follows at most: exact while no more were evicted hot; then
# whenever it fills, its less evicted half is dropped (a prefix's count may start late)
MAX_TRACKED_PREFIXES = 2048
# checkpoint_pushouts.sql's parameters, at their defaults
MIN_HITS = 2
MIN_TRANSIENT = 1

_CHECKPOINT, _TRANSIENT = int(StoreKind.CHECKPOINT), int(CheckpointClass.TRANSIENT)
_LRU_REUSE, _RUNNING = int(RemoveReason.LRU_REUSE), int(RequestQueue.RUNNING)
_FIRST_LOOKUP = 1  # miss_attribution.lookup of a request's first admission


class IntervalRate(msgspec.Struct, frozen=True):
    """The first-admission hit rate of one interval of trace time."""

    start_s: float
    lookups: int
    hit_rate: float | None


class HotPrefix(msgspec.Struct, frozen=True):
    """A prefix evicted while hot: its hash id, its evictions and the pushouts among them, and
    the tokens it covers (the deepest of its entries)."""

    hash_id: int
    evictions: int
    pushouts: int
    depth_tokens: int


class Figures(msgspec.Struct, frozen=True):
    """What a live trace says now. Definitions (each mirrors an offline one):

    * ``ts_s``: trace time (seconds since the trace's ``created_ns``) of its newest timestamped
      record; windows end there.
    * ``lookups``, ``query_tokens``, ``hit_tokens``: requests' first admitted lookups so far,
      their prompts and hits (the ``lookups`` view, ``admission = 1``: counter_reconciliation's
      ``admitted_first_lookups``, ``query_tokens``, ``hit_tokens``). A lookup's time is the
      start of the scheduler step that admitted it (vLLM's looks it up in the same step).
    * ``hit_rate``: hit tokens / query tokens of the first admissions in the last ``window_s``
      (hit_rate_timeline's rate, by trace time instead of steps); ``hit_rate_history``: the same
      per ``interval_s`` of trace time, oldest first, the current interval last.
    * ``transient_checkpoints``: blocks whose newest key is a TRANSIENT checkpoint, that hold a
      key and that no request holds (cache_occupancy's ``transient_checkpoint``);
      ``checkpoint_share``: over the usable pool, ``num_gpu_blocks - 1`` (its ``pool_blocks``).
    * ``pushouts``: checkpoint pushouts so far, an LRU eviction of an entry hit at least twice
      while at least one transient checkpoint sat cached in the free queue (a
      checkpoint_pushouts row, at its default parameters); ``pushouts_per_min``: those of the
      last ``window_s`` per minute of it (of the trace so far while it is shorter).
    * ``hot_evicted``: prefixes whose entries were LRU-evicted with at least two hits, most
      evicted first (the evictions checkpoint_pushouts starts from, per hash id as
      pushed_out_prefixes counts them).
    * ``misses_by_cause``: missed tokens of the first admissions per miss-attribution cause, in
      ``causes.CAUSES`` order (``miss_attribution``, ``lookup = 1``): with ``hit_tokens``
      they sum to ``query_tokens``. Empty for a trace without an engine config.
    """

    ts_s: float | None = None
    records: int = 0
    lookups: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    window_s: float = WINDOW_S
    hit_rate: float | None = None
    interval_s: float = HISTORY_INTERVAL_S
    hit_rate_history: list[IntervalRate] = []
    pool_blocks: int | None = None
    transient_checkpoints: int = 0
    checkpoint_share: float | None = None
    pushouts: int = 0
    pushouts_per_min: float | None = None
    hot_evicted: list[HotPrefix] = []
    misses_by_cause: dict[str, int] = {}


class _Block:
    """A block's state as ``database.block_states_sql`` follows it: held by a request, how many
    keys it holds, whether its newest key is a transient checkpoint, and its newest entry."""

    __slots__ = ("in_use", "keys", "transient", "latest")

    def __init__(self) -> None:
        self.in_use, self.keys, self.transient = False, 0, False
        self.latest: list | None = None  # [hits, open] of the newest entry stored on it

    @property
    def cached_transient(self) -> bool:
        return self.transient and self.keys > 0 and not self.in_use


class LiveFigures:
    """Fed a trace's record batches in order (``feed``), answers ``figures()``.

    Memory stays bounded over hours: the windows hold one row per scheduler step of the last
    ``window_s`` (and ``history`` intervals), the hot-prefix table at most ``max_prefixes``
    hash ids, and the state follows the cache's blocks and the requests in flight. The miss
    attribution (``stream.new_pass``) keeps, as ``kvtrace load``'s does, a key per hash id,
    spilled to a file past a bounded share in memory (its C core)."""

    def __init__(self, header: TraceHeader, path: str = "", *, window_s: float = WINDOW_S,
                 interval_s: float = HISTORY_INTERVAL_S, history: int = HISTORY_INTERVALS,
                 top: int = TOP_PREFIXES, max_prefixes: int = MAX_TRACKED_PREFIXES) -> None:
        config = header.config
        self.window_ns, self.interval_ns = int(window_s * 1e9), int(interval_s * 1e9)
        self.history, self.top, self.max_prefixes = history, top, max(max_prefixes, 2 * top)
        self.pool_blocks = config.num_gpu_blocks - 1 if config is not None else None
        self._pass = (new_pass(header, path, spill_dir=tempfile.gettempdir())
                      if config is not None else None)
        self._misses = np.zeros(len(CAUSES), dtype=np.int64)
        self.records = 0
        self._first_ns: int | None = None
        self._newest_ns: int | None = None
        self._step_ns = 0  # start of the current step (or the snapshot), the events' time
        self._pending: dict[int, int] = {}  # req -> hit tokens of its lookup awaiting admission
        self._admissions: dict[int, int] = {}  # req -> admitted lookups so far
        self.lookups = self.query_tokens = self.hit_tokens = 0
        self._window: collections.deque = collections.deque()  # [time, query, hit]
        self._intervals: collections.deque = collections.deque()  # [index, lookups, query, hit]
        # cache entries
        self._blocks: dict[int, _Block] = {}
        self._open: dict[tuple[int, int, int], list[list]] = {}  # (block, hash, group) -> entries
        self._classes: dict[int, dict[tuple[int, int], int]] = {}  # req -> (group, pos) -> class
        self.transient_cached = 0
        self.pushouts = 0
        self._pushout_window: collections.deque = collections.deque()  # [time, count]
        self._hot: dict[int, list[int]] = {}  # hash id -> [evictions, pushouts, depth]
        self._handlers = {
            StepStarted: self._on_step, SnapshotStarted: self._on_snapshot,
            GpuSampled: self._on_timestamp, EventsDropped: self._on_dropped,
            ComputedBlocksFound: self._on_lookup, SlotsAllocated: self._on_allocated,
            RequestState: self._on_request_state, RequestFinished: self._on_finished,
            RequestPreempted: self._on_preempted, BlockAllocated: self._on_taken,
            BlockTouched: self._on_touched, BlockFreed: self._on_freed,
            BlockState: self._on_block_state, BlockStored: self._on_stored,
            KeyCached: self._on_key_cached, BlockRemoved: self._on_removed,
            CheckpointRecorded: self._on_checkpoint,
        }

    def feed(self, batch: RecordBatch) -> None:
        self.records += len(batch)
        if self._pass is not None:
            self._pass.feed(batch)
            for table, columns in self._pass.take_tables(0):
                if table == ATTRIBUTION_TABLE:
                    first = columns["lookup"] == _FIRST_LOOKUP
                    np.add.at(self._misses, columns["cause"][first], columns["tokens"][first])
        rows: list = [None] * len(batch.types)
        for index, (record_type, columns) in enumerate(zip(batch.types, batch.columns)):
            handler = self._handlers.get(record_type)
            if handler is not None:
                rows[index] = (handler, zip(*(column.to_lists() if isinstance(
                    column, ListColumn) else column for column in columns)))
        for kind in batch.kinds:
            entry = rows[kind]
            if entry is not None:
                entry[0](*next(entry[1]))
        self._prune()

    def _prune(self) -> None:
        """Drop the window rows older than the window, the intervals older than the history."""
        if self._newest_ns is None:
            return
        since = self._newest_ns - self.window_ns
        for window in (self._window, self._pushout_window):
            while window and window[0][0] <= since:
                window.popleft()
        last = self._newest_ns // self.interval_ns
        while self._intervals and self._intervals[0][0] <= last - self.history:
            self._intervals.popleft()

    # --- time -----------------------------------------------------------------------------------

    def _on_timestamp(self, ts_ns: int, *_) -> None:
        if self._first_ns is None:
            self._first_ns = ts_ns
        if self._newest_ns is None or ts_ns > self._newest_ns:
            self._newest_ns = ts_ns

    def _on_step(self, _step: int, ts_ns: int) -> None:
        self._step_ns = ts_ns
        self._on_timestamp(ts_ns)

    def _on_snapshot(self, ts_ns: int, *_) -> None:
        self._on_step(0, ts_ns)

    def _on_dropped(self, _count: int, ts_ns: int) -> None:
        self._on_timestamp(ts_ns)

    # --- first admissions (the lookups view) ----------------------------------------------------

    def _on_lookup(self, req: int, num_hit_tokens: int, _boundary: int) -> None:
        self._pending[req] = num_hit_tokens

    def _on_allocated(self, req: int, _new: int, _computed: int, _new_computed: int,
                      _lookahead: int, _external: int, num_tokens: int, success: bool,
                      *_) -> None:
        hit = self._pending.pop(req, None)
        if hit is None or not success:
            return
        admissions = self._admissions[req] = self._admissions.get(req, 0) + 1
        if admissions == 1:
            self.lookups += 1
            self.query_tokens += num_tokens
            self.hit_tokens += hit
            _add(self._window, self._step_ns, (num_tokens, hit))
            _add(self._intervals, self._step_ns // self.interval_ns, (1, num_tokens, hit))

    def _on_request_state(self, req: int, queue: int, _status: str, _prompt_len: int,
                          _hash_ids, _max_tokens: int, _num_tokens: int, _computed: int,
                          num_preemptions: int, *_) -> None:
        """In flight when the capture began: its admissions so far count (the view's
        ``prior``), so its next lookup is not a first admission if it had one."""
        admissions = num_preemptions + (queue == _RUNNING)
        if admissions > 0:
            self._admissions[req] = admissions

    def _on_finished(self, req: int, _status: int) -> None:
        self._pending.pop(req, None)
        self._admissions.pop(req, None)
        self._classes.pop(req, None)

    def _on_preempted(self, req: int) -> None:
        self._pending.pop(req, None)

    # --- cache entries (database.CACHE_ENTRIES_SQL) -----------------------------------------------

    def _block(self, block_id: int) -> _Block:
        block = self._blocks.get(block_id)
        if block is None:
            block = self._blocks[block_id] = _Block()
        return block

    def _set_in_use(self, block_id: int, in_use: bool) -> None:
        block = self._block(block_id)
        if block.in_use != in_use:
            before = block.cached_transient
            block.in_use = in_use
            self.transient_cached += block.cached_transient - before

    def _on_taken(self, block_id: int, _req: int) -> None:
        self._set_in_use(block_id, True)

    def _on_touched(self, block_id: int, _req: int) -> None:
        """A hit: the block's newest entry, if it is still there, gets it."""
        self._set_in_use(block_id, True)
        latest = self._blocks[block_id].latest
        if latest is not None and latest[1]:
            latest[0] += 1

    def _on_freed(self, block_id: int, ref_cnt: int, _hashed: bool) -> None:
        self._set_in_use(block_id, ref_cnt > 0)

    def _on_block_state(self, block_id: int, ref_cnt: int, *_) -> None:
        self._set_in_use(block_id, ref_cnt > 0)

    def _on_checkpoint(self, req: int, group: int, position: int, _block_idx: int,
                       position_class: int) -> None:
        self._classes.setdefault(req, {})[(group, position)] = position_class

    def _on_stored(self, block_id: int, hash_id: int, group: int, num_tokens: int, kind: int,
                   req: int) -> None:
        transient = kind == _CHECKPOINT and self._classes.get(req, {}).get(
            (group, num_tokens)) == _TRANSIENT
        self._store(block_id, hash_id, group, num_tokens, transient)

    def _on_key_cached(self, hash_id: int, group: int, num_tokens: int, block_ids) -> None:
        for block_id in block_ids:  # cached when the capture began: no class, not transient
            self._store(block_id, hash_id, group, num_tokens, False)

    def _store(self, block_id: int, hash_id: int, group: int, num_tokens: int,
               transient: bool) -> None:
        block = self._block(block_id)
        before = block.cached_transient
        entry = [0, True, num_tokens]  # hits, open, tokens
        self._open.setdefault((block_id, hash_id, group), []).append(entry)
        block.latest, block.transient = entry, transient
        block.keys += 1
        self.transient_cached += block.cached_transient - before

    def _on_removed(self, block_id: int, hash_id: int, group: int, _num_tokens: int,
                    reason: int) -> None:
        """Every open entry of that key on the block ends here, with the transient checkpoints
        cached just before (the removed one included)."""
        cached = self.transient_cached
        for entry in self._open.pop((block_id, hash_id, group), ()):
            entry[1] = False
            if reason == _LRU_REUSE and entry[0] >= MIN_HITS:
                self._hot_evicted(hash_id, entry[2], cached >= MIN_TRANSIENT)
        block = self._block(block_id)
        before = block.cached_transient
        block.keys -= 1
        self.transient_cached += block.cached_transient - before

    def _hot_evicted(self, hash_id: int, depth: int, pushout: bool) -> None:
        row = self._hot.get(hash_id)
        if row is None:
            if len(self._hot) >= self.max_prefixes:  # keep the most evicted half
                kept = sorted(self._hot.items(), key=lambda item: -item[1][0])
                self._hot = dict(kept[:self.max_prefixes // 2])
            row = self._hot[hash_id] = [0, 0, depth]
        row[0] += 1
        row[2] = max(row[2], depth)
        if pushout:
            row[1] += 1
            self.pushouts += 1
            _add(self._pushout_window, self._step_ns, (1,))

    # --- the answer -----------------------------------------------------------------------------

    def figures(self) -> Figures:
        newest = self._newest_ns
        if newest is None:
            return Figures(records=self.records, window_s=self.window_ns / 1e9,
                           interval_s=self.interval_ns / 1e9, pool_blocks=self.pool_blocks)
        last = newest // self.interval_ns
        query, hit = sum(row[1] for row in self._window), sum(row[2] for row in self._window)
        by_index = {row[0]: row for row in self._intervals}
        history = []
        for index in range(last - self.history + 1, last + 1):
            _, lookups, interval_query, interval_hit = by_index.get(index, (index, 0, 0, 0))
            history.append(IntervalRate(index * self.interval_ns / 1e9, lookups,
                                        _ratio(interval_hit, interval_query)))
        span = min(self.window_ns, newest - self._first_ns)
        hot = sorted(self._hot.items(), key=lambda item: (-item[1][0], item[0]))[:self.top]
        return Figures(
            ts_s=newest / 1e9, records=self.records, lookups=self.lookups,
            query_tokens=self.query_tokens, hit_tokens=self.hit_tokens,
            window_s=self.window_ns / 1e9, hit_rate=_ratio(hit, query),
            interval_s=self.interval_ns / 1e9, hit_rate_history=history,
            pool_blocks=self.pool_blocks, transient_checkpoints=self.transient_cached,
            checkpoint_share=(_ratio(self.transient_cached, self.pool_blocks)
                              if self.pool_blocks else None),
            pushouts=self.pushouts,
            pushouts_per_min=(sum(row[1] for row in self._pushout_window) * 60e9 / span
                              if span > 0 else None),
            hot_evicted=[HotPrefix(hash_id, *row) for hash_id, row in hot],
            misses_by_cause=(dict(zip(CAUSES, map(int, self._misses)))
                             if self._pass is not None else {}))


def _add(window: collections.deque, key: int, values: tuple[int, ...]) -> None:
    """Add ``values`` to the window's row of ``key`` (its newest, or a new one)."""
    if window and window[-1][0] == key:
        row = window[-1]
        for index, value in enumerate(values, 1):
            row[index] += value
    else:
        window.append([key, *values])


def _ratio(part: int, whole: int | None) -> float | None:
    return part / whole if whole else None


class LiveSource:
    """A source followed live: its ``TraceTail`` and, once its header is read, its
    ``LiveFigures`` (``options`` are theirs). One thread calls ``update``; any may call
    ``figures`` (the metrics server's)."""

    def __init__(self, source: str | os.PathLike, *, owners: tuple[int, ...] | None = None,
                 **options) -> None:
        self.tail = TraceTail(source, owners)
        self._options = options
        self._live: LiveFigures | None = None
        self._lock = threading.Lock()

    def update(self, max_batches: int | None = None) -> int:
        """Feed what was written since the last update (at most ``max_batches`` batches);
        return the number of records fed."""
        batches = self.tail.poll(max_batches)
        with self._lock:
            if self._live is None and self.tail.header is not None:
                self._live = LiveFigures(self.tail.header, self.tail.path, **self._options)
            for batch in batches:
                self._live.feed(batch)
        return sum(map(len, batches))

    def figures(self) -> Figures:
        with self._lock:
            if self._live is None:
                return Figures(window_s=self._options.get("window_s", WINDOW_S))
            return self._live.figures()

    def close(self) -> None:
        self.tail.close()
