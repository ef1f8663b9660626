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

import functools
import math
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import msgspec

from kvtrace import __version__
from kvtrace.engine_config import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    MAX_INT64,
    MAX_KV_CACHE_GROUPS,
    SchedulerSettings,
    check_pool_fits,
    check_pool_memory,
    check_request,
    validate,
)
from kvtrace.errors import ConfigError, KvtraceError
from kvtrace.events import (
    EngineConfig,
    HashesExtended,
    KVCacheGroup,
    Record,
    RequestArrived,
    TraceHeader,
)
from kvtrace.files import cannot_write
from kvtrace.geometry import Geometry
from kvtrace.geometry.bundled import geometry_for
from kvtrace.traceio import TraceWriter

# A request holds at most this many Mamba pages: running state, previous running state, the
# internal checkpoint slot, and a copy-on-write page after a partial hit.
MAMBA_PAGES_PER_REQUEST = 4



# --- the engine a workload is meant for ---------------------------------------------------------

DEFAULT_MODEL = "kimi-k3"  # the seed's model (Kimi-K3 served with FlashKDA)

ENGINE_HELP = {
    "model": "the hybrid model whose cache geometry (vLLM 0.33's, on one H200) the workload is "
             "for: a preset (kimi-k3, kimi-linear-48b-a3b, qwen3-next-80b-a3b, nemotron-h-8b) "
             "or a Hugging Face config.json; see kvtrace geometry",
    "tensor_parallel_size": "tensor-parallel size of that deployment (default: the preset's "
                            "usual one, else 1)",
    "hash_unit": "prefix hash unit H in tokens, vLLM's prefix_match_unit (default: the "
                 "model's block size, vLLM's default)",
    "attention_block_size": "expert override of the model's full-attention block size, tokens",
    "mamba_block_size": "expert override of the model's Mamba/KDA 'align' block size, tokens "
                        "(align mode makes it equal to the attention block)",
    "checkpoint_alignment": "expert override of the model's internal-checkpoint alignment, tokens",
    "mamba_groups": "expert override of the number of Mamba/KDA groups (the attention group "
                    "first, then these); not the model's count needs --allow-unreal-geometry",
    "retention_interval": "prefix_cache_retention_interval: 0 = latest-only, 'none' = keep all",
    "max_num_batched_tokens": "scheduler token budget per step (prompts longer than it prefill "
                              "in chunks)",
    "max_num_seqs": "maximum running requests",
    "num_gpu_blocks": "block pool size; default: sized from the workload (see --pool-fraction)",
    "pool_fraction": "default pool = this share of the workload's distinct attention blocks "
                     "(default: the preset's, 0.25 for imports)",
    "allow_unreal_geometry": "accept block sizes vLLM would never build (a Mamba block that "
                             "differs from the attention block)",
}


@dataclass(frozen=True)
class EngineShape:
    """The hybrid cache a workload is generated for: the geometry vLLM 0.33 builds for a real
    model (``kvtrace.geometry``: one attention group and several Mamba/KDA groups, block size =
    Mamba block in ``align`` mode, hundreds of tokens, the model's checkpoint settings), with
    retention 0 (vLLM's default) and vLLM's scheduler defaults.

    The block sizes, hash unit and checkpoint alignment can be overridden as expert flags; a
    Mamba block that differs from the attention block contradicts ``align`` mode and is refused
    unless ``allow_unreal_geometry``. The pool holds a share of the distinct attention blocks
    the workload touches, chosen per preset so that reusable prefixes compete for it
    (``Preset.pool_fraction``; never less than twice the largest request)."""

    model: str = DEFAULT_MODEL
    tensor_parallel_size: int | None = None
    hash_unit: int | None = None
    attention_block_size: int | None = None
    mamba_block_size: int | None = None
    checkpoint_alignment: int | None = None
    mamba_groups: int | None = None
    retention_interval: int | None = 0
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    num_gpu_blocks: int | None = None
    pool_fraction: float | None = None  # None: the workload's own (Workload.pool_fraction)
    allow_unreal_geometry: bool = False

    def __post_init__(self) -> None:
        if self.pool_fraction is not None and not 0 < self.pool_fraction <= 1:
            raise ConfigError(f"pool fraction must be in (0, 1], not {self.pool_fraction}",
                              "Use a share of the workload's distinct attention blocks, e.g. 0.25.")
        if self.mamba_groups is not None and not 1 <= self.mamba_groups < MAX_KV_CACHE_GROUPS:
            raise ConfigError(f"--mamba-groups must be from 1 to {MAX_KV_CACHE_GROUPS - 1}, "
                              f"not {self.mamba_groups}", "The presets have 3 to 6.")
        groups = self.groups()
        blocks = {g.kind: g.block_size for g in groups}
        model_groups = sum(g.kind == "mamba" for g in self.geometry.groups)
        if (self.mamba_groups not in (None, model_groups)
                and not self.allow_unreal_geometry):
            raise ConfigError(
                f"{self.model} has {model_groups} Mamba/KDA groups as vLLM groups its layers, "
                f"not {self.mamba_groups}",
                "Drop --mamba-groups, or add --allow-unreal-geometry for a what-if vLLM would "
                "never build.")
        if len({g.block_size for g in groups}) > 1 and not self.allow_unreal_geometry:
            raise ConfigError(
                f"attention block {blocks.get('full_attention')} and Mamba block "
                f"{blocks.get('mamba')} differ: vLLM's align mode sets the Mamba block equal to "
                f"the attention block ({self.model}: {self.geometry.block_size} tokens)",
                "Drop --attention-block-size / --mamba-block-size (or give both the same "
                "value), or add --allow-unreal-geometry for a what-if vLLM would never build.")
        # The engine's own rules, checked before any work (the pool is checked once sized).
        config = self.engine_config(num_gpu_blocks=max(self.num_gpu_blocks or 2, 2))
        validate(config)
        SchedulerSettings.from_config(config)

    @functools.cached_property
    def geometry(self) -> Geometry:
        """The model's geometry as vLLM 0.33 builds it (a shipped file for a preset)."""
        return geometry_for(self.model, self.tensor_parallel_size)

    @property
    def hash_block_size(self) -> int:
        """The hash unit the workload is hashed at: the override, else the model's."""
        return self.hash_unit or self.geometry.hash_block_size

    @property
    def attention_block(self) -> int:
        return self.attention_block_size or self.geometry.block_size

    def groups(self) -> list[KVCacheGroup]:
        """The model's KV-cache groups with the expert overrides applied."""
        groups = []
        for group in self.geometry.engine_groups():
            if group.kind == "mamba":
                # align mode: the Mamba block follows the attention block unless told apart
                changes = {"block_size": self.mamba_block_size or self.attention_block}
                if self.checkpoint_alignment is not None:
                    changes["prefill_checkpoint_alignment"] = self.checkpoint_alignment
            else:
                changes = {"block_size": self.attention_block}
            groups.append(msgspec.structs.replace(group, **changes))
        if self.mamba_groups is not None:
            mamba = next(g for g in groups if g.kind == "mamba")
            groups = [g for g in groups if g.kind != "mamba"] + [mamba] * self.mamba_groups
        return groups

    def engine_config(self, num_gpu_blocks: int, max_model_len: int = 0) -> EngineConfig:
        """The engine this shape describes, with a pool of ``num_gpu_blocks``."""
        return EngineConfig(
            kv_cache_groups=self.groups(),
            hash_block_size=self.hash_block_size,
            num_gpu_blocks=num_gpu_blocks,
            retention_interval=self.retention_interval,
            max_model_len=max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
        )

    def describe(self) -> dict[str, str]:
        """Where the geometry came from, for the workload header's params."""
        geometry = self.geometry
        params = {"model": self.model, "model_architecture": geometry.architecture,
                  "tensor_parallel_size": str(geometry.tensor_parallel_size),
                  "geometry": f"vLLM {geometry.vllm_version}, {geometry.attention_backend}, "
                              f"block {geometry.block_size}, {len(geometry.groups)} groups"}
        overrides = {name: getattr(self, name) for name in (
            "hash_unit", "attention_block_size", "mamba_block_size", "checkpoint_alignment",
            "mamba_groups")
            if getattr(self, name) is not None}
        if overrides:
            params["geometry_overrides"] = ", ".join(f"{k}={v}" for k, v in overrides.items())
        if self.allow_unreal_geometry:
            params["unreal_geometry"] = "allowed"
        return params


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
    """Blocks one request needs alone: its attention blocks at full length plus, in every
    Mamba group, its Mamba pages."""
    mamba_groups = sum(group.kind == "mamba" for group in shape.groups())
    return (-(-request.num_tokens // shape.attention_block)
            + MAMBA_PAGES_PER_REQUEST * mamba_groups)


def distinct_attention_blocks(workload: Workload, attention_block: int) -> int:
    """Attention blocks of ``attention_block`` tokens the workload fills, counting a shared
    prefix block once. Output blocks without declared ids are unique to their request."""
    units_per_block = attention_block // workload.hash_unit
    shared: set[int] = set()
    unique = 0
    for request in workload.requests:
        units = [*request.hash_ids, *request.output_hash_ids]
        shared.update(units[units_per_block - 1::units_per_block])
        filled = request.num_tokens // attention_block
        unique += filled - len(units) // units_per_block
    return len(shared) + unique


def pool_size(workload: Workload, shape: EngineShape) -> tuple[int, str]:
    """The pool size and how it was chosen (kept in the header's params): the one given, else
    a share of the workload's distinct attention blocks, never less than twice the largest
    request (with room for its Mamba pages)."""
    if shape.num_gpu_blocks is not None:
        return shape.num_gpu_blocks, "given"
    largest = max(minimum_pool_blocks(r, shape) for r in workload.requests)
    distinct = distinct_attention_blocks(workload, shape.attention_block)
    fraction = workload.pool_fraction if shape.pool_fraction is None else shape.pool_fraction
    by_fraction = math.ceil(fraction * distinct)
    if by_fraction >= 2 * largest:
        return by_fraction, f"{fraction} x {distinct} distinct attention blocks"
    return 2 * largest, f"2 x the largest request ({largest} blocks)"


def engine_config_for(workload: Workload, shape: EngineShape, num_gpu_blocks: int) -> EngineConfig:
    """The engine a workload trace names: ``shape`` with ``num_gpu_blocks``, and a model length
    that holds its longest request (rounded up to the scheduler block)."""
    longest = max(r.num_tokens for r in workload.requests)
    scheduler_block = math.lcm(*(group.block_size for group in shape.groups()))
    return shape.engine_config(num_gpu_blocks, -(-longest // scheduler_block) * scheduler_block)


def write_workload(path: str | os.PathLike, workload: Workload, shape: EngineShape,
                   cmdline: Sequence[str] = ()) -> TraceHeader:
    """Write ``workload`` as a trace (atomically: nothing appears unless it is complete)."""
    if not workload.requests:
        raise KvtraceError("the workload has no requests", "Ask for at least one request.")
    if workload.hash_unit != shape.hash_block_size:
        raise ConfigError(f"the workload was hashed at {workload.hash_unit} tokens, the engine "
                          f"uses {shape.hash_block_size}",
                          "Hash the workload at the engine's hash unit (shape.hash_block_size).")
    _check_requests(workload, shape)
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
        params={**workload.params, **shape.describe(), "num_gpu_blocks_rule": rule},
    )
    try:
        with TraceWriter(path, header, atomic=True) as writer:
            writer.write_many(workload_records(workload))
    except OSError as error:
        raise cannot_write(path, error) from None
    return header


def _check_requests(workload: Workload, shape: EngineShape) -> None:
    """Refuse a request no replay could run: one that arrives beyond a trace's clock, or
    that alone needs a pool this machine cannot hold."""
    for request in workload.requests:
        check_request(request.request_id, request.prompt_len, request.max_tokens,
                      request.hash_ids, workload.hash_unit)
        if not 0 <= request.arrival_ns <= MAX_INT64:
            raise ConfigError(
                f"request {request.request_id} arrives at {request.arrival_ns} ns, outside a "
                "trace's 64-bit clock (0 to 292 years)", "Check its arrival time.")
    longest = max(workload.requests, key=lambda request: request.num_tokens)
    blocks = minimum_pool_blocks(longest, shape)
    check_pool_memory(blocks, f"request {longest.request_id} alone ({longest.num_tokens:,} "
                              f"tokens, {blocks:,} blocks)",
                      "Check the request's prompt and output lengths.")
