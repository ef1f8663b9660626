"""The reference replay backend: vLLM 0.33.0's own ``KVCacheManager``, built on CPU.

The cache is the real one (block pool, hybrid coordinator, full-attention and Mamba "align"
managers) built from a trace's ``EngineConfig``, with a checkpoint variant installed on its
``MambaManager`` and kvtrace's probes armed on its block pool, so every call comes back as the
same records a live capture writes. Requests are real ``vllm.v1.request.Request`` objects whose
block hashes *are* the workload's hash ids (8 big-endian bytes each, through a custom
block hasher), so the probes decode the ids back and replay traces keep the workload's ids.
Token ids are placeholders (0) and never leave this module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvtrace.engine_config import (FIRST_MADE_UP_HASH_ID, check_added_request, num_hashed_units,
                                   validate)
from kvtrace.errors import ConfigError, KvtraceError
from kvtrace.events import EngineConfig, FinishStatus, HashInterner
from kvtrace.probes import CacheProbes
from kvtrace.probes.signatures import installed_vllm_version, release_has
from kvtrace.replay.backend import RecordSink, started, take_pending_hit, tokens_to_sync
from kvtrace.replay.variants import get_variant
from kvtrace.vllm_release_table import PROJECT_RELEASE

if TYPE_CHECKING:
    from kvtrace.replay.snapshot import StartSnapshot

_HASH_ID_BYTES = 8
UNLIMITED_MODEL_LEN = 1 << 24  # what a max_model_len of 0 (unlimited) becomes


def hash_bytes_of(hash_id: int) -> bytes:
    return hash_id.to_bytes(_HASH_ID_BYTES, "big")


class EncodedHashIds:
    """The probes' interner for replay: a hash *is* its id, so decode instead of interning."""

    __slots__ = ()

    def intern(self, hash_bytes: bytes) -> tuple[int, bool]:
        return int.from_bytes(hash_bytes, "big"), False



class MadeUpHashIds:
    """Hands out made-up hash ids, counting up from ``FIRST_MADE_UP_HASH_ID`` and past every id
    it was told is taken (a replay of a replay brings made-up ids of its own)."""

    __slots__ = ("_next",)

    def __init__(self) -> None:
        self._next = FIRST_MADE_UP_HASH_ID

    def __call__(self) -> int:
        self._next += 1
        return self._next - 1

    def skip_past(self, hash_id: int) -> None:
        self._next = max(self._next, hash_id + 1)


class _RequestHashes:
    """A request's block hasher: hands out the next hash ids as its tokens fill hash units
    (with lookahead block hashes, as the tokens after them arrive too)."""

    __slots__ = ("hash_ids", "hash_block_size", "hash_lookahead", "made_up_hash_id")

    def __init__(self, hash_ids: list[int], hash_block_size: int, hash_lookahead: int,
                 made_up_hash_id: Callable[[], int]) -> None:
        self.hash_ids = hash_ids
        self.hash_block_size = hash_block_size
        self.hash_lookahead = hash_lookahead
        self.made_up_hash_id = made_up_hash_id  # for units past the known ones (decode)

    def __call__(self, request: Any) -> list[bytes]:
        start = len(request.block_hashes)
        stop = num_hashed_units(request.num_tokens, self.hash_block_size, self.hash_lookahead)
        while len(self.hash_ids) < stop:
            self.hash_ids.append(self.made_up_hash_id())
        return [hash_bytes_of(hash_id) for hash_id in self.hash_ids[start:stop]]


class VllmBackend:
    """``CacheBackend`` on the installed vLLM's real prefix cache (see module docstring).

    ``hash_ids_from_bytes`` (default True) keeps the workload's hash ids in the records; False
    re-interns them densely in order of first appearance, as a live capture numbers them.
    ``sink`` None arms no probes on this pool, so a live capture's process-wide probes (which
    a pool's own probe set would take precedence over) see the calls (``kvtrace engine``).
    """

    backend_name = "vllm"

    def __init__(self, config: EngineConfig, variant: str, sink: RecordSink | None, *,
                 hash_ids_from_bytes: bool = True) -> None:
        self.config = config
        self.variant = get_variant(variant)
        self.num_gpu_blocks = config.num_gpu_blocks
        self.manager = _build_manager(config)
        for manager in self.manager.coordinator.single_type_managers:
            self.variant.install(manager)
        self.probes = None if sink is None else CacheProbes(
            sink, EncodedHashIds() if hash_ids_from_bytes else _ByteInterner(),
            req_number=int, created_ns=0).arm(self.manager.block_pool)
        self._requests: dict[int, Any] = {}
        self._pending_hits: dict[int, tuple[Any, int]] = {}
        self.made_up_hash_id = MadeUpHashIds()

    # --- CacheBackend ---------------------------------------------------------------------------

    def new_step(self, step: int, ts_ns: int) -> None:
        if self.probes is not None:
            self.probes.announce_step(step, ts_ns)
        self.manager.new_step_starts()

    def add_request(self, req: int, prompt_len: int, hash_ids: list[int], max_tokens: int,
                    output_hash_ids: list[int] | None = None) -> None:
        check_added_request(self.config, req, prompt_len, hash_ids, max_tokens,
                            req in self._requests)
        known_ids = [*hash_ids, *(output_hash_ids or ())]
        self._requests[req] = new_request(req, prompt_len, max_tokens, known_ids, self.config,
                                          self.made_up_hash_id)

    def get_computed_blocks(self, req: int) -> tuple[int, int]:
        request = self._requests[req]
        blocks, num_hit_tokens, shared_prefix_boundary = self.manager.get_computed_blocks(request)
        # As vLLM's scheduler does on admission: the junction steers the Mamba retention mask.
        request.shared_prefix_boundary = shared_prefix_boundary
        self._pending_hits[req] = (blocks, num_hit_tokens)
        return num_hit_tokens, shared_prefix_boundary

    def allocate_slots(self, req: int, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       num_lookahead_tokens: int = 0, *, full_sequence_must_fit: bool = False,
                       reserved_blocks: int = 0, has_scheduled_reqs: bool = False) -> bool:
        from vllm.v1.request import RequestStatus

        request = self._requests[req]
        hit_blocks = take_pending_hit(self._pending_hits, req, num_new_computed_tokens)
        blocks = self.manager.allocate_slots(request, num_new_tokens, num_new_computed_tokens,
                                             hit_blocks, num_lookahead_tokens,
                                             full_sequence_must_fit=full_sequence_must_fit,
                                             reserved_blocks=reserved_blocks,
                                             has_scheduled_reqs=has_scheduled_reqs)
        if blocks is None:
            return False
        self._pending_hits.pop(req, None)
        request.status = RequestStatus.RUNNING
        if num_new_computed_tokens:
            request.num_computed_tokens += num_new_computed_tokens
        return True

    def end_schedule(self) -> None:
        """As ``Scheduler.schedule()`` after its allocations: take the step's copy-on-write
        copies (the worker would run them) and free their retained blocks; drain the Mamba
        boundary-state offers nobody takes here."""
        _, retained = self.manager.take_kv_cache_block_copies()
        if retained:
            self.manager.block_pool.free_blocks(retained)
        self.manager.take_boundary_state_offloads()

    def advance(self, req: int, num_tokens: int) -> None:
        request = self._requests[req]
        request.num_computed_tokens += num_tokens
        if request.num_computed_tokens >= request.num_tokens:
            request.append_output_token_ids(0)  # the step sampled a token

    def cache_blocks(self, req: int, num_tokens_to_cache: int) -> None:
        self.manager.cache_blocks(self._requests[req], num_tokens_to_cache)

    def free(self, req: int, status: FinishStatus = FinishStatus.FINISHED) -> None:
        from vllm.v1.request import RequestStatus

        request = self._requests.pop(req)
        self._pending_hits.pop(req, None)
        request.status = (RequestStatus.FINISHED_ABORTED if status == FinishStatus.ABORTED
                          else RequestStatus.FINISHED_STOPPED)
        self.manager.free(request)

    def preempt(self, req: int) -> None:
        from vllm.v1.request import RequestStatus

        request = self._requests[req]
        self._pending_hits.pop(req, None)
        self.manager.free(request)  # still RUNNING here, as in Scheduler._preempt_request
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1

    def num_free_blocks(self) -> int:
        return self.manager.block_pool.get_num_free_blocks()

    def restore(self, snapshot: StartSnapshot) -> None:
        """Start from a capture's start snapshot (``probes.snapshot.restore`` writes it into the
        real cache): its requests in flight become vLLM ``Request``s with their progress, and
        the probes learn them as the capture's did, so none is reported as arriving."""
        from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id
        from vllm.v1.request import RequestStatus

        from kvtrace.probes import snapshot as live_snapshot

        for state in snapshot.requests:
            known_ids = [*state.hash_ids, *snapshot.output_hash_ids.get(state.req, ())]
            request = new_request(state.req, state.prompt_len, state.max_tokens, known_ids,
                                  self.config, self.made_up_hash_id)
            if state.num_tokens > state.prompt_len:
                request.append_output_token_ids([0] * (state.num_tokens - state.prompt_len))
            request.num_computed_tokens = state.num_computed_tokens
            request.status = RequestStatus[state.status]
            request.num_preemptions = state.num_preemptions
            request.num_in_flight_tokens = state.num_in_flight_tokens
            request.shared_prefix_boundary = state.shared_prefix_boundary
            self._requests[state.req] = request
            if self.probes is not None:
                self.probes.adopt_request(request, self.config.hash_block_size)
        if self.probes is not None:
            for key in snapshot.keys:
                if key.num_tokens > 0:
                    self.probes._depth.setdefault(key.hash_id, key.num_tokens)
        live_snapshot.restore(
            self.manager, snapshot,
            lambda hash_id, group: make_block_hash_with_group_id(hash_bytes_of(hash_id), group),
            self._requests.__getitem__)

    # --- beyond the protocol: lockstep and inspection -------------------------------------------

    def sync_request(self, req: int, num_computed_tokens: int, num_tokens: int,
                     num_in_flight_tokens: int = 0) -> None:
        """Set a request's progress to captured values (lockstep): computed tokens, output
        tokens appended until it holds ``num_tokens``, tokens in steps in flight."""
        request = self._requests[req]
        request.num_computed_tokens = num_computed_tokens
        request.num_in_flight_tokens = num_in_flight_tokens
        missing = tokens_to_sync(req, request.num_tokens, num_tokens)
        if missing:
            request.append_output_token_ids([0] * missing)

    def release_blocks(self, block_ids: list[int]) -> None:
        """Free blocks by id, as the engine did outside the cache manager (lockstep)."""
        pool = self.manager.block_pool
        held = [block_id for block_id in block_ids
                if 0 <= block_id < len(pool.blocks) and pool.blocks[block_id].ref_cnt > 0]
        if held != block_ids:
            unheld = sorted(set(block_ids) - set(held))
            raise KvtraceError(
                f"the trace releases block(s) {unheld[:5]} that the replayed cache does not hold",
                "The trace's inputs are inconsistent with its engine config; was it edited, or "
                "captured from a different engine?")
        pool.free_blocks([pool.blocks[block_id] for block_id in block_ids])

    def cached_block_id(self, hash_id: int, group: int) -> int | None:
        """The block a lookup of ``hash_id`` in KV-cache group ``group`` would hit, or None."""
        blocks = self.manager.block_pool.get_cached_block(hash_bytes_of(hash_id), [group])
        return None if blocks is None else blocks[0].block_id

    def request(self, req: int) -> Any:
        """The live vLLM ``Request`` (for tests and drivers that need its counters)."""
        return self._requests[req]

    def close(self) -> None:
        """Disarm the probes (the last backend alive restores vLLM's original methods)."""
        if self.probes is not None:
            self.probes.disarm()

    def __enter__(self) -> "VllmBackend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_vllm_backend(config: EngineConfig, variant: str, sink: RecordSink,
                      snapshot: StartSnapshot | None = None) -> VllmBackend:
    """The registered factory (``backend.BACKENDS``): a ``VllmBackend``, started from
    ``snapshot`` when one is given."""
    return started(VllmBackend(config, variant, sink), snapshot)


class _ByteInterner:
    """Dense ids in order of first appearance over the backend's own 8-byte hashes."""

    __slots__ = ("_interner",)

    def __init__(self) -> None:
        self._interner = HashInterner()

    def intern(self, hash_bytes: bytes) -> tuple[int, bool]:
        return self._interner.intern(hash_bytes)[0], False


def new_request(req: int, prompt_len: int, max_tokens: int, hash_ids: list[int],
                config: EngineConfig, made_up_hash_id: MadeUpHashIds) -> Any:
    """A vLLM ``Request`` for workload request ``req``: placeholder tokens, the workload's hash
    ids as its block hashes (hashed as ``config``'s engine hashes), made-up ones past them."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    if hash_ids:
        made_up_hash_id.skip_past(max(hash_ids))
    return Request(str(req), [0] * prompt_len,
                   SamplingParams(max_tokens=max(1, max_tokens)), None,
                   arrival_time=0.0,
                   block_hasher=_RequestHashes(hash_ids, config.hash_block_size,
                                               config.num_hash_lookahead_tokens,
                                               made_up_hash_id))


def kv_cache_config_of(config: EngineConfig) -> Any:
    """vLLM's ``KVCacheConfig`` for a trace's engine: one spec per KV-cache group."""
    from vllm.utils.hashing import sha256
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                            MambaSpec)

    validate(config)
    init_none_hash(sha256)  # vLLM asserts it is set; our hashes never use it
    # Page contents are never allocated (no tensors); the dtype only sizes pages.
    float32 = STR_DTYPE_TO_TORCH_DTYPE["float32"]
    specs = []
    for index, group in enumerate(config.kv_cache_groups):
        if group.kind == "mamba":
            spec = MambaSpec(block_size=group.block_size, shapes=((1, 1),),
                             dtypes=(float32,),
                             mamba_cache_mode=group.mamba_cache_mode or "align",
                             num_prefill_checkpoint_blocks=group.num_prefill_checkpoint_blocks,
                             prefill_checkpoint_alignment=group.prefill_checkpoint_alignment,
                             num_speculative_blocks=config.num_speculative_tokens)
        else:
            spec = FullAttentionSpec(block_size=group.block_size, num_kv_heads=1, head_size=1,
                                     dtype=float32)
        specs.append(KVCacheGroupSpec([f"layer{index}"], spec))
    return KVCacheConfig(num_blocks=config.num_gpu_blocks, kv_cache_tensors=[],
                         kv_cache_groups=specs,
                         prefix_cache_retention_interval=config.retention_interval)


def _build_manager(config: EngineConfig) -> Any:
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    kv_cache_config = kv_cache_config_of(config)
    lookahead = lookahead_hashes(config)
    try:
        return KVCacheManager(kv_cache_config,
                              max_model_len=config.max_model_len or UNLIMITED_MODEL_LEN,
                              scheduler_block_size=config.scheduler_block_size,
                              hash_block_size=config.hash_block_size,
                              enable_caching=config.enable_caching, use_eagle=config.use_eagle,
                              num_prefill_lookahead=config.num_prefill_lookahead_tokens,
                              **lookahead)
    except (AssertionError, ValueError) as error:
        raise ConfigError(f"vLLM rejected the engine config: {error or type(error).__name__}"
                          ) from error


def lookahead_hashes(config: EngineConfig) -> dict[str, int]:
    """The running release's ``KVCacheManager`` argument for ``config``'s lookahead block
    hashes: none before 0.33, which had none (its EAGLE/MTP dropped the last block instead,
    a rule this trace's hashes, each covering the next tokens, cannot be replayed under)."""
    if release_has("BlockPool.num_hash_lookahead_tokens"):
        return {"num_hash_lookahead_tokens": config.num_hash_lookahead_tokens}
    if config.num_hash_lookahead_tokens:
        raise ConfigError(
            f"the engine hashed each block with the {config.num_hash_lookahead_tokens} tokens "
            f"after it (lookahead block hashes), which vLLM {installed_vllm_version()} does "
            "not have",
            f"Replay it on vLLM {PROJECT_RELEASE.version} (a variant that is not a vllm-X release).")
    return {}
