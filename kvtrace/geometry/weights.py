"""Weight memory of a model, counted from its config: what vLLM's loaded weights take per GPU.

vLLM measures the weights it loaded (``model_memory_usage``); here they are counted tensor by
tensor from the config fields (embedding, attention / MLA, KDA / GDN / Mamba2 mixers, MLP / MoE
with every expert, norms, lm_head, and Kimi-K3's vision tower), at the config's dtype. Routed
experts of an ``mxfp4-pack-quantized`` checkpoint take 4 bits a weight plus one scale byte
per 32. The tests check the counts against the parameter totals published with the
checkpoints. Nothing here imports vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtrace.geometry.architecture import MAMBA
from kvtrace.geometry.families import nemotron_h_pattern

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
MXFP4_GROUP = 32  # compressed-tensors mxfp4-pack-quantized: one uint8 scale per 32 weights


@dataclass(frozen=True)
class Weights:
    """Logical parameters, and the bytes they take (quantized experts packed)."""

    parameters: int
    nbytes: int


class _Counter:
    def __init__(self, dtype_bytes: int) -> None:
        self.dtype_bytes = dtype_bytes
        self.parameters = 0
        self.nbytes = 0

    def dense(self, *shape: int, count: int = 1) -> None:
        elements = count
        for dim in shape:
            elements *= dim
        self.parameters += elements
        self.nbytes += elements * self.dtype_bytes

    def mxfp4(self, rows: int, cols: int, count: int = 1) -> None:
        """A [rows, cols] linear stored as packed 4-bit values plus a byte per 32."""
        self.parameters += rows * cols * count
        self.nbytes += (rows * cols // 2 + rows * cols // MXFP4_GROUP) * count


def model_weights(architecture: str, config: dict[str, Any]) -> Weights:
    """The model's weights; ``architecture`` picks the layout (families.py names them)."""
    text = config.get("text_config") or config
    dtype = text.get("dtype") or text.get("torch_dtype") or config.get("torch_dtype") or "bfloat16"
    counter = _Counter(DTYPE_BYTES.get(str(dtype), 2))
    hidden, vocab = text["hidden_size"], text["vocab_size"]
    counter.dense(vocab, hidden, count=1 if text.get("tie_word_embeddings") else 2)
    counter.dense(hidden)  # final norm
    if architecture in ("KimiLinearForCausalLM", "KimiK3ForConditionalGeneration"):
        _kimi(counter, text)
        if "vision_config" in config:
            _kimi_vision(counter, config["vision_config"], hidden)
    elif architecture == "Qwen3NextForCausalLM":
        _qwen3_next(counter, text)
    elif architecture == "NemotronHForCausalLM":
        _nemotron_h(counter, text)
    else:
        raise ValueError(f"no weight layout for {architecture}")
    return Weights(counter.parameters, counter.nbytes)


def _kimi(c: _Counter, t: dict[str, Any]) -> None:
    hidden, layers = t["hidden_size"], t["num_hidden_layers"]
    linear = t["linear_attn_config"]
    kda = set(linear["kda_layers"])
    heads, full_rank = linear["num_heads"], linear.get("use_full_rank_gate", False)
    head_dim, conv = linear["head_dim"], linear["short_conv_kernel_size"]
    projection = heads * head_dim
    attn_res = t.get("attn_res_block_size") is not None
    mla_heads = t["num_attention_heads"]
    nope, rope, v_dim = t["qk_nope_head_dim"], t["qk_rope_head_dim"], t["v_head_dim"]
    kv_lora, q_lora = t["kv_lora_rank"], t.get("q_lora_rank")
    experts = t.get("num_experts") or 0
    expert_dim = t.get("routed_expert_hidden_size") or hidden
    moe_dim = t.get("moe_intermediate_size") or 0
    quantized = (t.get("quantization_config") or {}).get("format") == "mxfp4-pack-quantized"
    if attn_res:
        c.dense(hidden, count=2)  # output_attn_res_norm, output_attn_res_proj
    for i in range(layers):
        c.dense(hidden, count=2)  # input / post-attention norms
        if attn_res:
            c.dense(hidden, count=4)  # self_attention / mlp res norm + res proj
        if i + 1 in kda:
            c.dense(projection, hidden, count=3)  # q, k, v
            c.dense(projection, conv, count=3)  # q, k, v short convolutions
            c.dense(head_dim, hidden)  # f_a
            c.dense(projection, head_dim)  # f_b
            if full_rank:
                c.dense(projection, hidden)  # g_proj
            else:
                c.dense(head_dim, hidden)  # g_a
                c.dense(projection, head_dim)  # g_b
            c.dense(heads, hidden)  # b_proj
            c.dense(head_dim if full_rank else heads)  # A_log
            c.dense(projection)  # dt_bias
            c.dense(head_dim)  # o_norm
            c.dense(hidden, projection)  # o_proj
        else:
            if q_lora:
                c.dense(q_lora, hidden)
                c.dense(q_lora)
                c.dense(mla_heads * (nope + rope), q_lora)
            else:
                c.dense(mla_heads * (nope + rope), hidden)
            c.dense(kv_lora + rope, hidden)  # kv_a_proj_with_mqa
            c.dense(kv_lora)  # kv_a_layernorm
            c.dense(mla_heads * (nope + v_dim), kv_lora)  # kv_b_proj
            c.dense(hidden, mla_heads * v_dim)  # o_proj
            if t.get("mla_use_output_gate"):
                c.dense(mla_heads * v_dim, hidden)  # g_proj
        moe = experts and i >= t.get("first_k_dense_replace", 0) and i % t.get(
            "moe_layer_freq", 1) == 0
        if not moe:
            c.dense(t["intermediate_size"], hidden, count=3)
            continue
        c.dense(experts, hidden)  # router
        c.dense(experts)  # e_score_correction_bias
        if expert_dim != hidden:  # latent MoE: routed experts work in expert_dim
            c.dense(expert_dim, hidden, count=2)
            if t.get("latent_moe_use_norm"):
                c.dense(expert_dim)
        for rows, cols in ((moe_dim, expert_dim), (expert_dim, moe_dim), (moe_dim, expert_dim)):
            (c.mxfp4 if quantized else c.dense)(rows, cols, count=experts)
        c.dense(t.get("num_shared_experts", 0) * moe_dim, hidden, count=3)


def _kimi_vision(c: _Counter, v: dict[str, Any], text_hidden: int) -> None:
    width, inner = v["vt_hidden_size"], v["vt_intermediate_size"]
    qkv = v["qkv_hidden_size"]
    c.dense(3 * qkv, width, count=v["vt_num_hidden_layers"])  # wqkv
    c.dense(width, qkv, count=v["vt_num_hidden_layers"])  # wo
    c.dense(2 * inner * width + 2 * width, count=v["vt_num_hidden_layers"])  # fc0, fc1, norms
    c.dense(width)  # final_layernorm
    c.dense(v["init_pos_emb_height"], v["init_pos_emb_width"], width)
    c.dense(width, 3, v["patch_size"], v["patch_size"])
    merged = v["mm_hidden_size"] * v["merge_kernel_size"][0] * v["merge_kernel_size"][1]
    c.dense(merged, merged)  # mm_projector.proj.0
    c.dense(text_hidden, merged)  # mm_projector.proj.2
    c.dense(text_hidden)  # mm_projector.post_norm


def _qwen3_next(c: _Counter, t: dict[str, Any]) -> None:
    from kvtrace.geometry.families import Qwen3NextFamily

    hidden, head_dim = t["hidden_size"], t["head_dim"]
    heads, kv_heads = t["num_attention_heads"], t["num_key_value_heads"]
    key_dim = t["linear_num_key_heads"] * t["linear_key_head_dim"]
    value_heads = t["linear_num_value_heads"]
    value_dim = value_heads * t["linear_value_head_dim"]
    mlp_only = set(t.get("mlp_only_layers") or ())
    for i, plan in enumerate(Qwen3NextFamily((), "", "").layers(t)):
        c.dense(hidden, count=2)
        if plan.kind == MAMBA:
            c.dense(2 * key_dim + 2 * value_dim, hidden)  # in_proj_qkvz
            c.dense(2 * value_heads, hidden)  # in_proj_ba
            c.dense(2 * key_dim + value_dim, t["linear_conv_kernel_dim"])  # conv1d
            c.dense(value_heads, count=2)  # dt_bias, A_log
            c.dense(t["linear_value_head_dim"])  # gated norm
            c.dense(hidden, value_dim)  # out_proj
        else:
            c.dense(2 * heads * head_dim, hidden)  # q_proj with the output gate
            c.dense(kv_heads * head_dim, hidden, count=2)  # k, v
            c.dense(hidden, heads * head_dim)  # o_proj
            c.dense(head_dim, count=2)  # q_norm, k_norm
        sparse = i not in mlp_only and t.get("num_experts") and (
            i + 1) % t.get("decoder_sparse_step", 1) == 0
        if not sparse:
            c.dense(t["intermediate_size"], hidden, count=3)
            continue
        c.dense(t["num_experts"], hidden)  # router
        c.dense(t["moe_intermediate_size"], hidden, count=3 * t["num_experts"])
        c.dense(t["shared_expert_intermediate_size"], hidden, count=3)
        c.dense(hidden)  # shared_expert_gate


def _nemotron_h(c: _Counter, t: dict[str, Any]) -> None:
    hidden, head_dim = t["hidden_size"], t["head_dim"]
    mamba_inner = t["mamba_num_heads"] * t["mamba_head_dim"]
    groups_state = t["n_groups"] * t["ssm_state_size"]
    conv_dim = mamba_inner + 2 * groups_state
    for symbol in nemotron_h_pattern(t):
        c.dense(hidden)  # the block's norm
        if symbol == "M":
            c.dense(2 * mamba_inner + 2 * groups_state + t["mamba_num_heads"], hidden)
            c.dense(conv_dim, t["conv_kernel"])
            if t.get("use_conv_bias", True):
                c.dense(conv_dim)
            c.dense(t["mamba_num_heads"], count=3)  # dt_bias, A_log, D
            c.dense(mamba_inner)  # gated norm
            c.dense(hidden, mamba_inner)  # out_proj
        elif symbol == "*":
            c.dense(t["num_attention_heads"] * head_dim, hidden)
            c.dense(t["num_key_value_heads"] * head_dim, hidden, count=2)
            c.dense(hidden, t["num_attention_heads"] * head_dim)
        elif symbol == "-":
            c.dense(t["intermediate_size"], hidden, count=2)  # up, down (relu2: no gate)
        else:
            raise ValueError(f"unsupported Nemotron-H block {symbol!r}")
