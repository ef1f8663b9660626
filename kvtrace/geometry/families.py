"""The hybrid architectures kvtrace knows: each family reads its ``config.json`` into the one
description of a model's decoder (``architecture.Architecture``), and says what vLLM 0.33 builds
per layer on an H200.

vLLM learns a layer's cache kind and its prefill-checkpoint settings by constructing the layer
(``get_kv_cache_spec`` on the built module), which needs CUDA kernels; so this module reproduces
those decisions from the config, each citing the vLLM code it follows. Tests check the layer
counts against the configs and the cited constants against the installed vLLM.
Nothing here imports vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtrace.errors import ConfigError
from kvtrace.geometry.architecture import (
    Architecture,
    Attention,
    Block,
    DenseMlp,
    GatedDeltaNet,
    KimiDeltaAttention,
    LatentAttention,
    Mamba2,
    MixtureOfExperts,
)
from kvtrace.geometry.presets import ModelSource

# The prefill-checkpoint alignment of a GDN layer is the prefix-cache grid: vLLM's
# ``get_mamba_prefill_checkpoint_grid`` = the Mamba block size when ``prefix_match_unit`` is
# unset (it always is here).
GRID = "grid"

# vllm/v1/attention/backends/gdn_attn.py FLASHINFER_GDN_CHECKPOINT_ALIGNMENT.
FLASHINFER_GDN_CHECKPOINT_ALIGNMENT = 64
# vllm/model_executor/layers/mamba/kda_checkpoint.py kda_prefill_checkpoint_alignment("flashkda").
FLASHKDA_CHECKPOINT_ALIGNMENT = 16


@dataclass(frozen=True)
class LayerPlan:
    name: str  # the layer's module path below the decoder (``layers.3.self_attn``)
    kind: str  # ATTENTION, MLA or MAMBA


@dataclass(frozen=True)
class MambaCheckpointing:
    """How the Mamba layers of a model take prefill checkpoints on an H200.

    ``layer_alignment``: what every layer's ``get_prefill_checkpoint_alignment()`` returns,
    which ``_align_hybrid_block_size`` folds into the block size (None: not declared).
    ``spec_blocks`` / ``spec_alignment``: the ``MambaSpec`` fields the layer's
    ``get_kv_cache_spec`` sets (``num_prefill_checkpoint_blocks``,
    ``prefill_checkpoint_alignment``; ``GRID`` = the Mamba block size).
    """

    layer_alignment: int | None
    spec_blocks: int
    spec_alignment: int | str | None
    prefill_backend: str  # the prefill kernel vLLM picks on SM90, for the report


@dataclass(frozen=True)
class Family:
    architectures: tuple[str, ...]
    description: str
    mamba_type: str  # the layers' MambaAttentionBackendEnum name (their ``mamba_type``)

    def blocks(self, text: dict[str, Any]) -> list[Block]:
        """The decoder's blocks, in order, read from the config's language-model fields."""
        raise NotImplementedError

    def state_dtype(self, text: dict[str, Any]) -> str:
        """The recurrent state's dtype under ``--mamba-ssm-cache-dtype auto`` (vLLM's
        ``get_mamba_state_dtype_from_config``)."""
        raise NotImplementedError

    def layers(self, text: dict[str, Any]) -> list[LayerPlan]:
        """The blocks that keep something in the KV cache, with their vLLM module paths."""
        return [LayerPlan(block.path, block.part.cache_kind) for block in self.blocks(text)
                if block.part.cache_kind]

    def checkpointing(self, text: dict[str, Any], model_dtype: str,
                      ssm_state_dtype: str) -> MambaCheckpointing:
        raise NotImplementedError


def _field(text: dict[str, Any], key: str, family: str):
    """A config field the family's layout needs: a clear error when it is missing."""
    if text.get(key) is None:
        raise ConfigError(f"the config has no {key!r}, which the {family} layout needs",
                          "Give the model's config.json as Hugging Face publishes it.")
    return text[key]


def _model_dtype(text: dict[str, Any]) -> str:
    return str(text.get("dtype") or text.get("torch_dtype") or "bfloat16")


class KimiFamily(Family):
    """Kimi-Linear and Kimi-K3 (``vllm/models/kimi_k3/nvidia/model.py``)."""

    def blocks(self, text: dict[str, Any]) -> list[Block]:
        """``KimiDecoderLayer``: ``config.is_kda_layer(i)`` ((i + 1) in ``kda_layers``, 1-based)
        holds a KDA layer, every other layer MultiHeadLatentAttention; then a MoE where
        ``num_experts`` is set, from ``first_k_dense_replace`` on, every ``moe_layer_freq``-th
        layer, else a dense MLP (``KimiMoE``, ``KimiMLP``)."""
        name = "Kimi"
        linear = text.get("linear_attn_config") or {}
        kda = set(linear.get("kda_layers") or ())
        hidden = _field(text, "hidden_size", name)
        experts = text.get("num_experts") or 0
        blocks = []
        for i in range(_field(text, "num_hidden_layers", name)):
            if i + 1 in kda:
                blocks.append(Block(i, KimiDeltaAttention(
                    heads=_field(linear, "num_heads", name),
                    head_dim=_field(linear, "head_dim", name),
                    conv_kernel=linear.get("short_conv_kernel_size", 4),
                    full_rank_gate=bool(linear.get("use_full_rank_gate"))),
                    f"layers.{i}.self_attn"))
            else:
                blocks.append(Block(i, LatentAttention(
                    heads=_field(text, "num_attention_heads", name),
                    q_lora_rank=text.get("q_lora_rank"),
                    kv_lora_rank=_field(text, "kv_lora_rank", name),
                    qk_nope_head_dim=_field(text, "qk_nope_head_dim", name),
                    qk_rope_head_dim=_field(text, "qk_rope_head_dim", name),
                    v_head_dim=_field(text, "v_head_dim", name),
                    output_gate=bool(text.get("mla_use_output_gate"))),
                    f"layers.{i}.self_attn.mla_attn"))
            moe = experts and i >= text.get("first_k_dense_replace", 0) and i % text.get(
                "moe_layer_freq", 1) == 0
            if moe:
                moe_width = _field(text, "moe_intermediate_size", name)
                blocks.append(Block(i, MixtureOfExperts(
                    experts=experts, top_k=_field(text, "num_experts_per_token", name),
                    intermediate=moe_width,
                    shared_intermediate=(text.get("num_shared_experts") or 0) * moe_width,
                    expert_hidden=text.get("routed_expert_hidden_size") or hidden)))
            else:
                blocks.append(Block(i, DenseMlp(_field(text, "intermediate_size", name))))
        return blocks

    def state_dtype(self, text: dict[str, Any]) -> str:
        """``MambaStateDtypeCalculator.kda_state_dtype``: float32 under "auto"."""
        return "float32"

    def checkpointing(self, text: dict[str, Any], model_dtype: str,
                      ssm_state_dtype: str) -> MambaCheckpointing:
        """A full-rank gate selects ``KimiK3DeltaAttention`` (nvidia/kda.py), whose
        ``resolve_kda_prefill_backend`` picks FlashKDA when ``is_flashkda_supported`` (SM90,
        head_dim 128, bf16 input, bf16/fp32 state, a gate lower bound); its
        ``get_kv_cache_spec`` then sets one checkpoint block at 16 tokens. Neither it nor the
        Triton-only ``KimiGatedDeltaNetAttention`` (Kimi-Linear) overrides
        ``get_prefill_checkpoint_alignment``, so the block-size rule sees None."""
        linear = text.get("linear_attn_config") or {}
        flashkda = (linear.get("use_full_rank_gate", False)
                    and linear.get("head_dim") == 128 and model_dtype == "bfloat16"
                    and ssm_state_dtype in ("bfloat16", "float32")
                    and linear.get("gate_lower_bound") is not None)
        if flashkda:
            return MambaCheckpointing(None, 1, FLASHKDA_CHECKPOINT_ALIGNMENT, "flashkda")
        return MambaCheckpointing(None, 0, None, "triton")


class Qwen3NextFamily(Family):
    """Qwen3-Next (``vllm/model_executor/models/qwen3_next.py``)."""

    def blocks(self, text: dict[str, Any]) -> list[Block]:
        """``config.layer_types`` (transformers derives it from ``full_attention_interval``) of
        the first ``num_hidden_layers`` layers (an ``--hf-overrides`` of the layer count keeps
        the list: vLLM builds that many layers, each of its listed type): Gated DeltaNet or
        gated attention; then a sparse MoE block unless the layer is in
        ``mlp_only_layers`` or off the ``decoder_sparse_step`` (``Qwen3NextSparseMoeBlock``:
        routed experts, one shared expert and its scalar gate), else a dense MLP."""
        name = "Qwen3-Next"
        count = _field(text, "num_hidden_layers", name)
        interval = text.get("full_attention_interval", 4)
        types = text.get("layer_types") or [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(count)]
        if len(types) < count:
            raise ConfigError(f"the config's layer_types names {len(types)} layers and its "
                              f"num_hidden_layers {count}: vLLM's Qwen3-Next reads a type for "
                              "each layer",
                              "Give a layer_types entry for every layer (or fewer layers).")
        types = types[:count]  # vLLM builds num_hidden_layers layers, each of its listed type
        hidden = _field(text, "hidden_size", name)
        mlp_only = set(text.get("mlp_only_layers") or ())
        experts = text.get("num_experts") or 0
        blocks = []
        for i, kind in enumerate(types):
            if kind == "linear_attention":
                blocks.append(Block(i, GatedDeltaNet(
                    key_heads=_field(text, "linear_num_key_heads", name),
                    value_heads=_field(text, "linear_num_value_heads", name),
                    key_head_dim=_field(text, "linear_key_head_dim", name),
                    value_head_dim=_field(text, "linear_value_head_dim", name),
                    conv_kernel=text.get("linear_conv_kernel_dim", 4)),
                    f"layers.{i}.linear_attn"))
            else:
                blocks.append(Block(i, Attention(
                    heads=_field(text, "num_attention_heads", name),
                    kv_heads=_field(text, "num_key_value_heads", name),
                    head_dim=_field(text, "head_dim", name),
                    output_gate=text.get("attn_output_gate", True)),
                    f"layers.{i}.self_attn.attn"))
            if i not in mlp_only and experts and (i + 1) % text.get("decoder_sparse_step", 1) == 0:
                blocks.append(Block(i, MixtureOfExperts(
                    experts=experts, top_k=_field(text, "num_experts_per_tok", name),
                    intermediate=_field(text, "moe_intermediate_size", name),
                    shared_intermediate=text.get("shared_expert_intermediate_size") or 0,
                    expert_hidden=hidden, shared_gate=True)))
            else:
                blocks.append(Block(i, DenseMlp(_field(text, "intermediate_size", name))))
        return blocks

    def state_dtype(self, text: dict[str, Any]) -> str:
        """``gated_delta_net_state_dtype``: the model's dtype under "auto"."""
        return _model_dtype(text)

    def checkpointing(self, text: dict[str, Any], model_dtype: str,
                      ssm_state_dtype: str) -> MambaCheckpointing:
        """``_resolve_gdn_prefill_backend`` picks FlashInfer on SM90 ("auto"); then
        ``QwenGatedDeltaNetAttention`` declares ``FLASHINFER_GDN_CHECKPOINT_ALIGNMENT`` and its
        spec takes one checkpoint block on the prefix-cache grid (qwen_gdn_linear_attn.py)."""
        return MambaCheckpointing(FLASHINFER_GDN_CHECKPOINT_ALIGNMENT, 1, GRID, "flashinfer")


# transformers 5's layer types (``layers_block_type``, and the legacy names it remaps) as
# ``hybrid_override_pattern`` symbols.
NEMOTRON_H_SYMBOLS = {"linear_attention": "M", "mamba": "M", "full_attention": "*",
                      "attention": "*", "mlp": "-", "moe": "E"}


def nemotron_h_pattern(text: dict[str, Any]) -> str:
    """A Nemotron-H config's ``hybrid_override_pattern``; configs that transformers 5 saves
    have only ``layers_block_type``, one type a block, from which it is spelled here."""
    if text.get("hybrid_override_pattern") is not None or text.get("layers_block_type") is None:
        return _field(text, "hybrid_override_pattern", "Nemotron-H")
    types = text["layers_block_type"]
    unknown = sorted({str(t) for t in types} - NEMOTRON_H_SYMBOLS.keys())
    if unknown:
        raise ConfigError(f"layers_block_type has a block {unknown[0]!r} that the Nemotron-H "
                          f"layout does not know ({', '.join(NEMOTRON_H_SYMBOLS)})",
                          "Give the model's config.json as Hugging Face publishes it.")
    return "".join(NEMOTRON_H_SYMBOLS[t] for t in types)


class NemotronHFamily(Family):
    """Nemotron-H (``vllm/model_executor/models/nemotron_h.py``)."""

    def blocks(self, text: dict[str, Any]) -> list[Block]:
        """``hybrid_override_pattern`` (``nemotron_h_pattern``), one block per symbol: M =
        Mamba2 mixer, * = attention, - = MLP (squared ReLU, no gate), E = MoE
        (``NemotronHMoE``: routed and shared experts, squared ReLU)."""
        name = "Nemotron-H"
        blocks = []
        for i, symbol in enumerate(nemotron_h_pattern(text)):
            if symbol == "M":
                blocks.append(Block(i, Mamba2(
                    heads=_field(text, "mamba_num_heads", name),
                    head_dim=_field(text, "mamba_head_dim", name),
                    n_groups=_field(text, "n_groups", name),
                    state_size=_field(text, "ssm_state_size", name),
                    conv_kernel=_field(text, "conv_kernel", name)), f"layers.{i}.mixer"))
            elif symbol == "*":
                blocks.append(Block(i, Attention(
                    heads=_field(text, "num_attention_heads", name),
                    kv_heads=_field(text, "num_key_value_heads", name),
                    head_dim=_field(text, "head_dim", name)), f"layers.{i}.mixer.attn"))
            elif symbol == "-":
                blocks.append(Block(i, DenseMlp(_field(text, "intermediate_size", name),
                                                gated=False)))
            elif symbol == "E":
                blocks.append(Block(i, MixtureOfExperts(
                    experts=_field(text, "n_routed_experts", name),
                    top_k=_field(text, "num_experts_per_tok", name),
                    intermediate=_field(text, "moe_intermediate_size", name),
                    shared_intermediate=text.get("moe_shared_expert_intermediate_size") or 0,
                    expert_hidden=_field(text, "hidden_size", name), gated=False)))
            else:
                raise ConfigError(f"hybrid_override_pattern has a block {symbol!r} that the "
                                  "Nemotron-H layout does not know (M, *, - or E)",
                                  "Give the model's config.json as Hugging Face publishes it.")
        return blocks

    def state_dtype(self, text: dict[str, Any]) -> str:
        """``NemotronHForCausalLMConfig.update_mamba_ssm_cache_dtype``: the config's
        ``mamba_ssm_cache_dtype``, else float32."""
        return str(text.get("mamba_ssm_cache_dtype") or "float32")

    def checkpointing(self, text: dict[str, Any], model_dtype: str,
                      ssm_state_dtype: str) -> MambaCheckpointing:
        """``MambaMixer2.get_kv_cache_spec`` sets one checkpoint block at alignment 1 and
        does not override ``get_prefill_checkpoint_alignment`` (mamba_mixer2.py)."""
        return MambaCheckpointing(None, 1, 1, "mamba_mixer2")


FAMILIES: tuple[Family, ...] = (
    # KDA layers subclass GatedDeltaNetAttention (gdn/base.py: mamba_type GDN_ATTN).
    KimiFamily(("KimiLinearForCausalLM", "KimiK3ForConditionalGeneration"),
               "Kimi (MLA + KDA)", "GDN_ATTN"),
    Qwen3NextFamily(("Qwen3NextForCausalLM",), "Qwen3-Next (gated attention + Gated DeltaNet)",
                    "GDN_ATTN"),
    NemotronHFamily(("NemotronHForCausalLM",), "Nemotron-H (attention + Mamba2)", "MAMBA2"),
)


def family_of(architecture: str) -> Family:
    for family in FAMILIES:
        if architecture in family.architectures:
            return family
    known = ", ".join(a for f in FAMILIES for a in f.architectures)
    raise ConfigError(
        f"kvtrace does not know the layer layout of {architecture or 'this model'!r}",
        f"The geometry command covers these hybrid architectures: {known}.")


def architecture_of(source: ModelSource) -> Architecture:
    """The decoder of a preset or a user's config.json (``presets.resolve_model``)."""
    family = family_of(source.architecture)
    text = source.text_config
    return Architecture(name=source.name, description=family.description,
                        hidden_size=_field(text, "hidden_size", family.description),
                        blocks=tuple(family.blocks(text)), state_dtype=family.state_dtype(text))
