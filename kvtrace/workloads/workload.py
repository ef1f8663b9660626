"""A workload and the engine it is meant for, written as a trace of *input* records.

A workload trace has header ``source`` "synth" or "import", ``config`` = the ``EngineConfig`` it
is meant for (``EngineShape``), and its provenance in ``params``. Its records are, per request
in arrival order, a ``RequestArrived`` (prompt length, one hash id per FULL hash unit of the
prompt, decode length, arrival time) and, when the generator knows them, a ``HashesExtended``
naming the units the request's OUTPUT completes, so that a later turn whose prompt contains that
output shares them. Hash ids are dense ints in order of first appearance, chained like vLLM's
block hashes: equal ids at unit i mean equal tokens in units 0..i.

Producers: ``kvtrace.workloads.synth`` (synthetic presets) and ``kvtrace.workloads.mooncake``
(imported request logs).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from kvtrace import __version__
from kvtrace.engine_config import SchedulerSettings, check_pool_fits, validate
from kvtrace.errors import ConfigError, KvtraceError
from kvtrace.events import (
    EngineConfig,
    HashesExtended,
    KVCacheGroup,
    Record,
    RequestArrived,
    TraceHeader,
)
from kvtrace.traceio import TraceWriter

# A request holds at most this many Mamba pages: running state, previous running state, the
# internal checkpoint slot, and a copy-on-write page after a partial hit.
MAMBA_PAGES_PER_REQUEST = 4



# --- the engine a workload is meant for ---------------------------------------------------------

ENGINE_HELP = {
    "hash_unit": "prefix hash unit H in tokens (vLLM hash_block_size / prefix_match_unit)",
    "attention_block_size": "full-attention block size, tokens (a multiple of the hash unit)",
    "mamba_block_size": "Mamba/KDA 'align' block size, tokens (a multiple of the hash unit)",
    "checkpoint_alignment": "FlashKDA chunk: granularity of internal prefill checkpoints, tokens",
    "retention_interval": "prefix_cache_retention_interval: 0 = latest-only, 'dense' = keep all",
    "max_num_batched_tokens": "scheduler token budget per step (prompts longer than it prefill in chunks)",
    "max_num_seqs": "maximum running requests",
    "num_gpu_blocks": "block pool size; default: sized from the workload (see --pool-fraction)",
    "pool_fraction": "default pool = this share of the workload's distinct attention blocks "
                     "(default: the preset's, 0.25 for imports)",
}


@dataclass(frozen=True)
class EngineShape:
    """The hybrid-KDA cache a workload is generated for: one full-attention group and one Mamba
    "align" group with one internal prefill checkpoint block, retention 0 (vLLM's default).

    The defaults are a scaled-down Kimi-Linear-style engine that the real vLLM KVCacheManager
    replays quickly on CPU: hash unit 32 (fine-grained prefix hits), attention blocks of one
    unit, Mamba blocks of four, checkpoints on FlashKDA's 16-token chunks, and a token budget of
    1024 so that most prompts prefill in several chunks, which is when mid-prompt checkpoints are
    taken. The pool holds a share of the distinct attention blocks the workload touches, chosen
    per preset so that reusable prefixes compete for it (``Preset.pool_fraction``; never less
    than twice the largest request)."""

    hash_unit: int = 32
    attention_block_size: int = 32
    mamba_block_size: int = 128
    checkpoint_alignment: int = 16
    retention_interval: int | None = 0
    max_num_batched_tokens: int = 1024
    max_num_seqs: int = 32
    num_gpu_blocks: int | None = None
    pool_fraction: float | None = None  # None: the workload's own (Workload.pool_fraction)

    def __post_init__(self) -> None:
        if self.pool_fraction is not None and not 0 < self.pool_fraction <= 1:
            raise ConfigError(f"pool fraction must be in (0, 1], not {self.pool_fraction}",
                              "Use a share of the workload's distinct attention blocks, e.g. 0.25.")
        # The engine's own rules, checked before any work (the pool is checked once sized).
        config = self.engine_config(num_gpu_blocks=max(self.num_gpu_blocks or 2, 2))
        validate(config)
        SchedulerSettings.from_config(config)

    def engine_config(self, num_gpu_blocks: int, max_model_len: int = 0) -> EngineConfig:
        """The engine this shape describes, with a pool of ``num_gpu_blocks``."""
        return EngineConfig(
            kv_cache_groups=[
                KVCacheGroup(kind="full_attention", block_size=self.attention_block_size),
                KVCacheGroup(kind="mamba", block_size=self.mamba_block_size,
                             mamba_cache_mode="align", num_prefill_checkpoint_blocks=1,
                             prefill_checkpoint_alignment=self.checkpoint_alignment),
            ],
            hash_block_size=self.hash_unit,
            num_gpu_blocks=num_gpu_blocks,
            retention_interval=self.retention_interval,
            max_model_len=max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
        )


# --- workloads ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkloadRequest:
    arrival_ns: int
    prompt_len: int
    hash_ids: list[int]
    max_tokens: int
    output_hash_ids: list[int]  # the units decode completes, when known (else empty)
    request_id: str

    @property
    def num_tokens(self) -> int:
        """Prompt and output: the sequence the request reaches."""
        return self.prompt_len + self.max_tokens


@dataclass
class Workload:
    """Requests in arrival order, the source kind (``synth`` / ``import``) and provenance."""

    source: str
    requests: list[WorkloadRequest]
    hash_unit: int
    params: dict[str, str] = field(default_factory=dict)
    pool_fraction: float = 0.25  # the default pool's share of distinct attention blocks


def workload_records(workload: Workload) -> Iterator[Record]:
    for req, request in enumerate(workload.requests):
        yield RequestArrived(req=req, prompt_len=request.prompt_len, hash_ids=request.hash_ids,
                             max_tokens=request.max_tokens, arrival_ns=request.arrival_ns,
                             request_id=request.request_id)
        if request.output_hash_ids:
            yield HashesExtended(req=req, hash_ids=request.output_hash_ids)


def minimum_pool_blocks(request: WorkloadRequest, shape: EngineShape) -> int:
    """Blocks one request needs alone: its attention blocks at full length plus Mamba pages."""
    return -(-request.num_tokens // shape.attention_block_size) + MAMBA_PAGES_PER_REQUEST


def distinct_attention_blocks(workload: Workload, shape: EngineShape) -> int:
    """Attention blocks the workload fills, counting a shared prefix block once. Output blocks
    without declared ids are unique to their request."""
    units_per_block = shape.attention_block_size // shape.hash_unit
    shared: set[int] = set()
    unique = 0
    for request in workload.requests:
        units = request.hash_ids + request.output_hash_ids
        shared.update(units[units_per_block - 1::units_per_block])
        filled = request.num_tokens // shape.attention_block_size
        unique += filled - len(units) // units_per_block
    return len(shared) + unique


def pool_size(workload: Workload, shape: EngineShape) -> tuple[int, str]:
    """The pool size and how it was chosen (kept in the header's params): the one given, else
    a share of the workload's distinct attention blocks, never less than twice the largest
    request (with room for its Mamba pages)."""
    if shape.num_gpu_blocks is not None:
        return shape.num_gpu_blocks, "given"
    largest = max(minimum_pool_blocks(r, shape) for r in workload.requests)
    distinct = distinct_attention_blocks(workload, shape)
    fraction = workload.pool_fraction if shape.pool_fraction is None else shape.pool_fraction
    by_fraction = math.ceil(fraction * distinct)
    if by_fraction >= 2 * largest:
        return by_fraction, f"{fraction} x {distinct} distinct attention blocks"
    return 2 * largest, f"2 x the largest request ({largest} blocks)"


def engine_config_for(workload: Workload, shape: EngineShape, num_gpu_blocks: int) -> EngineConfig:
    """The engine a workload trace names: ``shape`` with ``num_gpu_blocks``, and a model length
    that holds its longest request (rounded up to the scheduler block)."""
    longest = max(r.num_tokens for r in workload.requests)
    scheduler_block = math.lcm(shape.attention_block_size, shape.mamba_block_size)
    return shape.engine_config(num_gpu_blocks, -(-longest // scheduler_block) * scheduler_block)


def write_workload(path: str | os.PathLike, workload: Workload, shape: EngineShape,
                   cmdline: Sequence[str] = ()) -> TraceHeader:
    """Write ``workload`` as a trace (atomically: nothing appears unless it is complete)."""
    if not workload.requests:
        raise KvtraceError("the workload has no requests", "Ask for at least one request.")
    if workload.hash_unit != shape.hash_unit:
        raise ConfigError(f"the workload was hashed at {workload.hash_unit} tokens, the engine "
                          f"uses {shape.hash_unit}")
    num_gpu_blocks, rule = pool_size(workload, shape)
    config = engine_config_for(workload, shape, num_gpu_blocks)
    validate(config)
    req, longest = max(enumerate(workload.requests), key=lambda item: item[1].num_tokens)
    check_pool_fits(config, req, longest.num_tokens)
    header = TraceHeader(
        kvtrace_version=__version__,
        created_ns=time.time_ns(),
        source=workload.source,
        config=config,
        cmdline=list(cmdline),
        includes_hash_bytes=False,
        params={**workload.params, "num_gpu_blocks_rule": rule},
    )
    try:
        writer = TraceWriter(path, header, atomic=True)
    except OSError as error:
        raise KvtraceError(f"cannot write {os.fspath(path)}: {error.strerror}",
                           "Check that the output directory exists and is writable.") from None
    with writer:
        writer.write_many(workload_records(workload))
    return header
