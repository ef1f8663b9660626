"""The cache geometry vLLM 0.33 builds for a model: what ``kvtrace geometry`` prints, and the
``KVCacheGroup`` list a replay runs on. Stdlib, msgspec and events only."""

from __future__ import annotations

import msgspec

from kvtrace.events import KVCacheGroup

GIB = 1 << 30


class GeometryGroup(msgspec.Struct, frozen=True, kw_only=True):
    """One KV-cache group (vLLM ``KVCacheGroupSpec``) as ``get_kv_cache_groups`` built it."""

    kind: str  # vLLM's kv_cache_spec_kind: mla_attention, full_attention, mamba
    num_layers: int
    block_size: int
    layers: list[str] = []
    num_prefill_checkpoint_blocks: int = 0
    prefill_checkpoint_alignment: int | None = None


class MemorySplit(msgspec.Struct, frozen=True, kw_only=True):
    """How the GPU's memory divides (per GPU, bytes), as vLLM's start-up profile would."""

    gpu_memory_bytes: int
    gpu_memory_utilization: float
    weight_bytes: int  # the model's weights / tensor_parallel_size
    weight_parameters: int  # logical parameters of the whole model
    non_kv_bytes: int  # activations, CUDA graphs, non-torch memory: an estimate, or given
    non_kv_assumed: bool  # True: kvtrace's estimate; False: given with --non-kv-memory-gib
    kv_cache_bytes: int


class Geometry(msgspec.Struct, frozen=True, kw_only=True):
    """Everything ``kvtrace geometry`` reports for one model and deployment."""

    model: str
    architecture: str
    source: dict[str, str]
    vllm_version: str
    attention_backend: str  # the CUDA backend vLLM picks on an H200 (SM90)
    mamba_prefill_backend: str
    kv_cache_dtype: str
    tensor_parallel_size: int
    max_num_batched_tokens: int
    block_size: int  # attention block, tokens
    mamba_block_size: int  # equal to block_size in align mode
    hash_block_size: int  # the prefix-match unit (resolve_kv_cache_block_sizes)
    scheduler_block_size: int
    attention_page_bytes_per_token: int  # one layer
    page_bytes: int  # one block of one layer, every group (Mamba pages padded to it)
    mamba_state_bytes: int  # one Mamba layer's state before padding
    # Tokens; None: the Mamba layers export no internal (mid-prefill) checkpoints.
    checkpoint_alignment: int | None
    checkpoint_blocks: int  # block ids one checkpoint holds: one per Mamba group
    checkpoint_bytes: int  # the pool memory those block ids hold
    bytes_per_block: int  # one block id across every group's layers (the pool's unit)
    num_gpu_blocks: int
    groups: list[GeometryGroup]
    memory: MemorySplit

    @property
    def tokens_per_attention_block(self) -> int:
        return self.block_size

    def engine_groups(self) -> list[KVCacheGroup]:
        """The groups as kvtrace's replay builds them. An MLA group is a full-attention group
        to the prefix cache (vLLM maps ``MLAAttentionSpec`` to ``FullAttentionManager``)."""
        return [KVCacheGroup(
            kind="full_attention" if group.kind == "mla_attention" else group.kind,
            block_size=group.block_size,
            mamba_cache_mode="align" if group.kind == "mamba" else "",
            num_prefill_checkpoint_blocks=group.num_prefill_checkpoint_blocks,
            prefill_checkpoint_alignment=group.prefill_checkpoint_alignment,
        ) for group in self.groups]

    def to_json(self) -> dict:
        """The ``--json`` document: the issue's keys first, then the rest."""
        document = msgspec.to_builtins(self)
        for group in document["groups"]:
            del group["layers"]
        head = {key: document.pop(key) for key in (
            "block_size", "mamba_block_size", "num_gpu_blocks", "page_bytes",
            "checkpoint_alignment", "groups")}
        return {**head, "tokens_per_attention_block": self.block_size, **document}
