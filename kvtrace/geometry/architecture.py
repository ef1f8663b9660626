"""A hybrid model's decoder, block by block: the one description kvtrace keeps of a model's
architecture.

``families.py`` reads each family's ``config.json`` into an ``Architecture`` (once, in one
place). It serves the cache geometry (which blocks hold KV or recurrent state:
``Family.layers``), execute mode's state shapes (``Architecture.recurrent_state``) and the
prefill cost model (``cost.flops_per_token``).

A block is one part of a decoder layer: a token mixer (attention, multi-head latent attention,
a delta-rule mixer - Kimi's KDA or Qwen3-Next's Gated DeltaNet - or a Mamba2 mixer) or a
feed-forward part (a dense MLP or a mixture of experts). A part lists the weight matrices a
token multiplies (``Linear``) as vLLM 0.33 lays them out under tensor parallelism: most are
split across the ranks, the ``replicated`` ones are computed whole on every rank (vLLM's
``ReplicatedLinear``, and the shards its merged projections keep whole). Besides its matrices a
part costs ``token_flops`` per token (short convolutions, recurrences) and ``position_flops``
per position a token attends to. Left out, everywhere: norms, activations, rotary embeddings,
biases and the per-layer scalar gates (O(hidden) per token). Nothing here imports vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

# Cache kinds of a block (families.LayerPlan.kind): what vLLM's layer asks of the KV cache.
ATTENTION = "attention"  # vLLM Attention -> FullAttentionSpec
MLA = "mla"  # vLLM MLAAttention -> MLAAttentionSpec
MAMBA = "mamba"  # a MambaBase layer (KDA, GDN, Mamba2) -> MambaSpec

# Per head and token, in units of key_dim x value_dim of the state: the delta rule's decay
# (1), k^T S (2), the rank-1 update (2) and the read-out S^T q (2); Mamba2's SSD update the
# decay (1), the input's outer product with B (2) and the read-out against C (2).
DELTA_RULE_FLOPS = 7
MAMBA2_SSD_FLOPS = 5


@dataclass(frozen=True)
class Linear:
    """A weight matrix ``inputs x outputs`` a token passes ``count`` times (its routed
    experts); ``replicated``: every tensor-parallel rank computes it whole."""

    name: str
    inputs: int
    outputs: int
    count: int = 1
    replicated: bool = False

    @property
    def weights(self) -> int:
        return self.inputs * self.outputs * self.count


@dataclass(frozen=True)
class RecurrentState:
    """The recurrent state of one layer: a ``[key_dim, value_dim]`` matrix per head."""

    heads: int
    key_dim: int
    value_dim: int


class Part:
    """One block's computation. ``cache_kind``: what it keeps in the KV cache (None: nothing)."""

    cache_kind: str | None = None

    def linears(self, hidden: int, tp: int = 1, every_expert: bool = False) -> list[Linear]:
        """The matrices a token multiplies at tensor-parallel size ``tp``; ``every_expert``:
        all of a mixture's experts (its parameters), not the ones a token is routed to."""
        raise NotImplementedError

    def token_flops(self) -> int:
        return 0

    def position_flops(self) -> int:
        return 0

    @property
    def recurrent_state(self) -> RecurrentState | None:
        return None


@dataclass(frozen=True)
class Attention(Part):
    """Grouped-query attention (``q/k/v/o_proj``); ``output_gate``: ``q_proj`` also yields a
    sigmoid gate on the output (Qwen3-Next). vLLM's ``QKVParallelLinear`` replicates KV heads
    when there are fewer than ranks, so the group computes ``max(kv_heads, tp)`` of them."""

    heads: int
    kv_heads: int
    head_dim: int
    output_gate: bool = False
    cache_kind = ATTENTION

    def linears(self, hidden: int, tp: int = 1, every_expert: bool = False) -> list[Linear]:
        query = self.heads * self.head_dim
        kv_heads = max(self.kv_heads, tp) if tp > 1 else self.kv_heads
        return [Linear("q_proj", hidden, query * (2 if self.output_gate else 1)),
                Linear("k_proj", hidden, kv_heads * self.head_dim),
                Linear("v_proj", hidden, kv_heads * self.head_dim),
                Linear("o_proj", query, hidden)]

    def position_flops(self) -> int:
        return 2 * self.heads * (self.head_dim + self.head_dim)  # QK^T and AV


@dataclass(frozen=True)
class LatentAttention(Part):
    """Multi-head latent attention (Kimi's MLA, ``vllm/models/kimi_k3/nvidia/mla.py``): the
    latent projections (``kv_a_proj_with_mqa``, and ``q_a`` with a ``q_lora_rank``) are
    replicated across ranks, the up-projections and ``o_proj`` split."""

    heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    output_gate: bool = False
    cache_kind = MLA

    def linears(self, hidden: int, tp: int = 1, every_expert: bool = False) -> list[Linear]:
        query = self.heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)
        value = self.heads * self.v_head_dim
        if self.q_lora_rank:
            found = [Linear("q_a_proj", hidden, self.q_lora_rank, replicated=True),
                     Linear("q_b_proj", self.q_lora_rank, query)]
        else:
            found = [Linear("q_proj", hidden, query)]
        found += [Linear("kv_a_proj_with_mqa", hidden, self.kv_lora_rank + self.qk_rope_head_dim,
                         replicated=True),
                  Linear("kv_b_proj", self.kv_lora_rank,
                         self.heads * (self.qk_nope_head_dim + self.v_head_dim))]
        if self.output_gate:
            found.append(Linear("g_proj", hidden, value))
        return found + [Linear("o_proj", value, hidden)]

    def position_flops(self) -> int:
        return 2 * self.heads * (self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim)


@dataclass(frozen=True)
class KimiDeltaAttention(Part):
    """Kimi Delta Attention (``kimi_gdn_linear_attn.py``, Kimi-K3's ``nvidia/kda.py``): q, k, v
    of ``heads x head_dim``, a low-rank decay gate ``f_a -> f_b`` whose ``f_a`` shard every rank
    keeps whole, an output gate (``g_a -> g_b``, ``g_a`` replicated; or one full-rank
    ``g_proj``), beta per head, short convolutions on q, k and v, and the delta rule."""

    heads: int
    head_dim: int
    conv_kernel: int
    full_rank_gate: bool = False
    cache_kind = MAMBA

    def linears(self, hidden: int, tp: int = 1, every_expert: bool = False) -> list[Linear]:
        projection = self.heads * self.head_dim
        found = [Linear("q_proj", hidden, projection), Linear("k_proj", hidden, projection),
                 Linear("v_proj", hidden, projection),
                 Linear("f_a_proj", hidden, self.head_dim, replicated=True),
                 Linear("f_b_proj", self.head_dim, projection)]
        if self.full_rank_gate:
            found.append(Linear("g_proj", hidden, projection))
        else:
            found += [Linear("g_a_proj", hidden, self.head_dim, replicated=True),
                      Linear("g_b_proj", self.head_dim, projection)]
        return found + [Linear("b_proj", hidden, self.heads), Linear("o_proj", projection, hidden)]

    def token_flops(self) -> int:
        convolution = 2 * self.conv_kernel * 3 * self.heads * self.head_dim
        return convolution + DELTA_RULE_FLOPS * self.heads * self.head_dim * self.head_dim

    @property
    def recurrent_state(self) -> RecurrentState:
        return RecurrentState(self.heads, self.head_dim, self.head_dim)


@dataclass(frozen=True)
class GatedDeltaNet(Part):
    """Qwen3-Next's Gated DeltaNet (``qwen_gdn_linear_attn.py``): ``in_proj_qkvz`` (q, k of the
    key heads, v and the output gate z of the value heads), ``in_proj_ba`` (beta and the decay
    per value head), a short convolution on q, k and v, the delta rule per value head (key
    heads shared), ``out_proj``."""

    key_heads: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    cache_kind = MAMBA

    def linears(self, hidden: int, tp: int = 1, every_expert: bool = False) -> list[Linear]:
        key, value = self.key_heads * self.key_head_dim, self.value_heads * self.value_head_dim
        return [Linear("in_proj_qkvz", hidden, 2 * key + 2 * value),
                Linear("in_proj_ba", hidden, 2 * self.value_heads),
                Linear("out_proj", value, hidden)]

    def token_flops(self) -> int:
        channels = 2 * self.key_heads * self.key_head_dim + self.value_heads * self.value_head_dim
        return (2 * self.conv_kernel * channels
                + DELTA_RULE_FLOPS * self.value_heads * self.key_head_dim * self.value_head_dim)

    @property
    def recurrent_state(self) -> RecurrentState:
        return RecurrentState(self.value_heads, self.key_head_dim, self.value_head_dim)


@dataclass(frozen=True)
class Mamba2(Part):
    """A Mamba2 mixer (``mamba_mixer2.py``): ``in_proj`` to x, z (``heads x head_dim`` each),
    B and C (``n_groups x state_size`` each) and dt per head, a short convolution on x, B and
    C, the SSD recurrence, ``out_proj``. With fewer groups than ranks vLLM duplicates the
    groups, so B and C are computed on every rank."""

    heads: int
    head_dim: int
    n_groups: int
    state_size: int
    conv_kernel: int
    cache_kind = MAMBA

    def linears(self, hidden: int, tp: int = 1, every_expert: bool = False) -> list[Linear]:
        inner = self.heads * self.head_dim
        return [Linear("in_proj (x, z, dt)", hidden, 2 * inner + self.heads),
                Linear("in_proj (B, C)", hidden, 2 * self.n_groups * self.state_size,
                       replicated=self.n_groups % tp != 0),
                Linear("out_proj", inner, hidden)]

    def token_flops(self) -> int:
        channels = self.heads * self.head_dim + 2 * self.n_groups * self.state_size
        return (2 * self.conv_kernel * channels
                + MAMBA2_SSD_FLOPS * self.heads * self.head_dim * self.state_size)

    @property
    def recurrent_state(self) -> RecurrentState:
        # vLLM's SSM state is [heads, head_dim, state_size]: B (state) plays the key, x the value.
        return RecurrentState(self.heads, self.state_size, self.head_dim)


@dataclass(frozen=True)
class DenseMlp(Part):
    """``gate_up_proj`` + ``down_proj`` (SwiGLU); ``gated`` False: ``up_proj`` + ``down_proj``
    (Nemotron-H's squared ReLU)."""

    intermediate: int
    gated: bool = True

    def linears(self, hidden: int, tp: int = 1, every_expert: bool = False) -> list[Linear]:
        return [Linear("gate_up_proj" if self.gated else "up_proj", hidden, self.intermediate,
                       count=2 if self.gated else 1),
                Linear("down_proj", self.intermediate, hidden)]


@dataclass(frozen=True)
class MixtureOfExperts(Part):
    """A router (replicated: vLLM's ``GateLinear``), ``top_k`` routed experts of
    ``intermediate`` width working in ``expert_hidden`` (a latent MoE, Kimi-K3: replicated
    down / up projections around them; else the hidden size), shared experts of
    ``shared_intermediate`` width in all (0: none), and Qwen3-Next's scalar
    ``shared_expert_gate``. The experts' weights split across ranks (no expert parallelism)."""

    experts: int
    top_k: int
    intermediate: int
    shared_intermediate: int
    expert_hidden: int
    gated: bool = True
    shared_gate: bool = False

    def linears(self, hidden: int, tp: int = 1, every_expert: bool = False) -> list[Linear]:
        routed = self.experts if every_expert else self.top_k
        found = [Linear("router", hidden, self.experts, replicated=True)]
        if self.expert_hidden != hidden:
            found += [Linear("routed_expert_down_proj", hidden, self.expert_hidden,
                             replicated=True),
                      Linear("routed_expert_up_proj", self.expert_hidden, hidden,
                             replicated=True)]
        found += [Linear("experts.gate_up_proj" if self.gated else "experts.up_proj",
                         self.expert_hidden, self.intermediate,
                         count=routed * (2 if self.gated else 1)),
                  Linear("experts.down_proj", self.intermediate, self.expert_hidden,
                         count=routed)]
        if self.shared_intermediate:
            found += DenseMlp(self.shared_intermediate, self.gated).linears(hidden)
        if self.shared_gate:
            found.append(Linear("shared_expert_gate", hidden, 1, replicated=True))
        return found


@dataclass(frozen=True)
class Block:
    """One block of the decoder: decoder layer ``layer``'s ``part``; ``path``: the module path
    of its cache layer below the decoder (``layers.3.self_attn``), '' when it keeps none."""

    layer: int
    part: Part
    path: str = ""


@dataclass(frozen=True)
class Architecture:
    """A model's decoder blocks and the dtype of its recurrent state (vLLM's
    ``get_mamba_state_dtype_from_config``)."""

    name: str
    description: str
    hidden_size: int
    blocks: tuple[Block, ...]
    state_dtype: str

    @property
    def recurrent_layers(self) -> int:
        return sum(1 for block in self.blocks if block.part.recurrent_state is not None)

    @property
    def recurrent_state(self) -> RecurrentState:
        """The state of one recurrent layer (every one of a model's is alike)."""
        return next(block.part.recurrent_state for block in self.blocks
                    if block.part.recurrent_state is not None)

    def linears(self, tp: int = 1, every_expert: bool = False) -> list[Linear]:
        return [linear for block in self.blocks
                for linear in block.part.linears(self.hidden_size, tp, every_expert)]
