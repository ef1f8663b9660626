"""The model whose recurrent state execute mode re-executes and whose prefill it prices.

``ModelShape`` holds what both need from a hybrid MLA + KDA + MoE model's config: the KDA state
geometry (heads, key / value head dims, state dtype, layers) and the projection, attention and
MLP sizes of the FLOPs model. Until kvtrace's geometry module feeds it, the one bundled shape is
Kimi-Linear-48B-A3B, read from its ``config.json``
(https://huggingface.co/moonshotai/Kimi-Linear-48B-A3B-Instruct): ``hidden_size`` 2304, 27
layers of which 20 KDA (``linear_attn_config.kda_layers``) and 7 MLA
(``full_attn_layers``), KDA 32 heads x ``head_dim`` 128 with a short convolution of 4, MLA 32
heads with ``kv_lora_rank`` 512, ``qk_nope_head_dim`` 128, ``qk_rope_head_dim`` 64,
``v_head_dim`` 128 and no ``q_lora_rank``; MoE with 256 experts, 8 per token and 1 shared,
``moe_intermediate_size`` 1024; the first layer (``first_k_dense_replace`` 1) a dense MLP of
``intermediate_size`` 9216. The KDA state is fp32 (vLLM's
``get_mamba_state_dtype_from_config`` for Kimi-Linear).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvtrace.errors import ConfigError

# --state-scale on CPU unless given: layers, heads and head dims at 1/16 (a 20-layer, 32 x 128
# x 128 KDA stack becomes 2 layers of 2 heads of 8 x 8 in one Mamba group).
CPU_STATE_SCALE = 1 / 16
MIN_HEAD_DIM = 8  # below this a scaled state is too small to tell prefixes apart reliably
STATE_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    """A hybrid MLA + KDA + MoE model, as far as state shapes and prefill FLOPs go."""

    name: str
    hidden_size: int
    num_kda_layers: int
    num_mla_layers: int
    # KDA (Kimi Delta Attention): the recurrent state is [heads, key_head_dim, value_head_dim].
    kda_heads: int
    kda_key_head_dim: int
    kda_value_head_dim: int
    kda_conv_kernel: int
    kda_gate_rank: int  # f_a / g_a project hidden -> this rank, f_b / g_b back up
    # MLA (multi-head latent attention).
    mla_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # MLP: the first ``num_dense_layers`` are dense, the rest MoE.
    num_dense_layers: int
    dense_intermediate_size: int
    num_experts: int
    experts_per_token: int
    num_shared_experts: int
    moe_intermediate_size: int
    state_dtype: str = "float32"

    @property
    def num_layers(self) -> int:
        return self.num_kda_layers + self.num_mla_layers


def kimi_family_shape(name: str, config: dict) -> ModelShape:
    """The shape of a Kimi-family model (MLA + KDA + MoE: Kimi-Linear, Kimi-K3) from its
    ``config.json`` (``text_config`` for Kimi-K3): the fields named in the module docstring.
    A full-rank KDA gate (``use_full_rank_gate``) projects to heads x head_dim."""
    linear = config["linear_attn_config"]
    heads, head_dim = linear["num_heads"], linear["head_dim"]
    return ModelShape(
        name=name, hidden_size=config["hidden_size"],
        num_kda_layers=len(linear["kda_layers"]), num_mla_layers=len(linear["full_attn_layers"]),
        kda_heads=heads, kda_key_head_dim=head_dim, kda_value_head_dim=head_dim,
        kda_conv_kernel=linear.get("short_conv_kernel_size", 4),
        kda_gate_rank=heads * head_dim if linear.get("use_full_rank_gate") else head_dim,
        mla_heads=config["num_attention_heads"], q_lora_rank=config.get("q_lora_rank"),
        kv_lora_rank=config["kv_lora_rank"], qk_nope_head_dim=config["qk_nope_head_dim"],
        qk_rope_head_dim=config["qk_rope_head_dim"], v_head_dim=config["v_head_dim"],
        num_dense_layers=config.get("first_k_dense_replace", 0),
        dense_intermediate_size=config["intermediate_size"],
        num_experts=config["num_experts"], experts_per_token=config["num_experts_per_token"],
        num_shared_experts=config.get("num_shared_experts", 0),
        moe_intermediate_size=config["moe_intermediate_size"])


KIMI_LINEAR_48B_A3B = ModelShape(
    name="kimi-linear-48b-a3b", hidden_size=2304, num_kda_layers=20, num_mla_layers=7,
    kda_heads=32, kda_key_head_dim=128, kda_value_head_dim=128, kda_conv_kernel=4,
    kda_gate_rank=128, mla_heads=32, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, num_dense_layers=1, dense_intermediate_size=9216,
    num_experts=256, experts_per_token=8, num_shared_experts=1, moe_intermediate_size=1024)

MODELS = {KIMI_LINEAR_48B_A3B.name: KIMI_LINEAR_48B_A3B}
# For a source that names no model (a capture, an older trace).
DEFAULT_MODEL = KIMI_LINEAR_48B_A3B.name


def get_model(name: str | None) -> ModelShape:
    """A model's shape: a Kimi-family preset of ``kvtrace geometry`` (or config.json path);
    None: ``DEFAULT_MODEL``."""
    name = name or DEFAULT_MODEL
    if name in MODELS:
        return MODELS[name]
    from kvtrace.geometry.presets import resolve_model

    source = resolve_model(name)  # a ConfigError naming the presets when unknown
    config = source.text_config
    if "linear_attn_config" not in config or "kv_lora_rank" not in config:
        raise ConfigError(
            f"execute mode's state and FLOPs model covers the Kimi family (MLA + KDA + MoE); "
            f"{name} ({source.architecture}) is not one",
            "Use --execute on a Kimi-Linear or Kimi-K3 workload (its header names the model).")
    return kimi_family_shape(name, config)


@dataclass(frozen=True)
class StateShape:
    """The recurrent state one block of one Mamba group holds: ``[layers * heads, key_dim,
    value_dim]`` (one independent recurrence per layer and head), scaled by ``scale``."""

    layers: int
    heads: int
    key_dim: int
    value_dim: int
    dtype: str
    scale: float

    @property
    def recurrences(self) -> int:
        return self.layers * self.heads

    @property
    def nbytes(self) -> int:
        return (self.recurrences * self.key_dim * self.value_dim
                * STATE_DTYPE_BYTES[self.dtype])

    def describe(self) -> str:
        return (f"{self.layers} layers x {self.heads} heads x {self.key_dim} x {self.value_dim} "
                f"{self.dtype} (scale {self.scale:g})")


def state_shape(model: ModelShape, num_mamba_groups: int, scale: float) -> StateShape:
    """One group's share of the model's KDA layers (vLLM splits them into groups of equal
    layer count, padding the last), each dimension multiplied by ``scale`` and rounded up."""
    if not 0 < scale <= 1:
        raise ConfigError(f"--state-scale must be in (0, 1], not {scale:g}",
                          "1 is the model's full state; 0.0625 (1/16) suits a CPU.")
    layers = math.ceil(model.num_kda_layers / max(1, num_mamba_groups))

    def scaled(size: int, least: int) -> int:
        return min(size, max(least, math.ceil(size * scale)))

    return StateShape(layers=scaled(layers, 1), heads=scaled(model.kda_heads, 1),
                      key_dim=scaled(model.kda_key_head_dim, MIN_HEAD_DIM),
                      value_dim=scaled(model.kda_value_head_dim, MIN_HEAD_DIM),
                      dtype=model.state_dtype, scale=scale)
