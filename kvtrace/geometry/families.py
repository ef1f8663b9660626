"""What vLLM 0.33 builds per layer for the hybrid architectures kvtrace knows, on an H200.

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

# Layer kinds of a LayerPlan.
ATTENTION = "attention"  # vLLM Attention -> FullAttentionSpec
MLA = "mla"  # vLLM MLAAttention -> MLAAttentionSpec
MAMBA = "mamba"  # a MambaBase layer -> MambaSpec

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

    def layers(self, text: dict[str, Any]) -> list[LayerPlan]:
        raise NotImplementedError

    def checkpointing(self, text: dict[str, Any], model_dtype: str,
                      ssm_state_dtype: str) -> MambaCheckpointing:
        raise NotImplementedError


class KimiFamily(Family):
    """Kimi-Linear and Kimi-K3 (``vllm/models/kimi_k3/nvidia/model.py``)."""

    def layers(self, text: dict[str, Any]) -> list[LayerPlan]:
        """``KimiDecoderLayer``: ``config.is_kda_layer(i)`` ((i + 1) in ``kda_layers``, 1-based)
        holds a KDA layer, every other layer MultiHeadLatentAttention."""
        linear = text.get("linear_attn_config") or {}
        kda = set(linear.get("kda_layers") or ())
        return [LayerPlan(f"layers.{i}.self_attn", MAMBA) if i + 1 in kda
                else LayerPlan(f"layers.{i}.self_attn.mla_attn", MLA)
                for i in range(text["num_hidden_layers"])]

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

    def layers(self, text: dict[str, Any]) -> list[LayerPlan]:
        """``config.layer_types`` (transformers derives it from ``full_attention_interval``)."""
        count = text["num_hidden_layers"]
        interval = text.get("full_attention_interval", 4)
        types = text.get("layer_types") or [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(count)]
        return [LayerPlan(f"layers.{i}.linear_attn", MAMBA) if kind == "linear_attention"
                else LayerPlan(f"layers.{i}.self_attn.attn", ATTENTION)
                for i, kind in enumerate(types)]

    def checkpointing(self, text: dict[str, Any], model_dtype: str,
                      ssm_state_dtype: str) -> MambaCheckpointing:
        """``_resolve_gdn_prefill_backend`` picks FlashInfer on SM90 ("auto"); then
        ``QwenGatedDeltaNetAttention`` declares ``FLASHINFER_GDN_CHECKPOINT_ALIGNMENT`` and its
        spec takes one checkpoint block on the prefix-cache grid (qwen_gdn_linear_attn.py)."""
        return MambaCheckpointing(FLASHINFER_GDN_CHECKPOINT_ALIGNMENT, 1, GRID, "flashinfer")


class NemotronHFamily(Family):
    """Nemotron-H (``vllm/model_executor/models/nemotron_h.py``)."""

    def layers(self, text: dict[str, Any]) -> list[LayerPlan]:
        """``hybrid_override_pattern``: M = Mamba2 mixer, * = attention, - / E = MLP / MoE
        (no cache)."""
        pattern = text["hybrid_override_pattern"]
        plans = []
        for i, symbol in enumerate(pattern):
            if symbol == "M":
                plans.append(LayerPlan(f"layers.{i}.mixer", MAMBA))
            elif symbol == "*":
                plans.append(LayerPlan(f"layers.{i}.mixer.attn", ATTENTION))
        return plans

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
