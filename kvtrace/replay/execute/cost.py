"""Prefill FLOPs of a hybrid model, and the GPU time they take: lost hits priced in GPU-seconds.

The layer decomposition follows Marconi (Pan et al., MLSys '25, arXiv:2411.19379; ``utils.py``
of its artifact): a layer's forward FLOPs are 2 per multiply-accumulate of its weight matrices
per token, plus the attention-score work that grows with the context (Marconi: attention
``8LD^2 + 4L^2D``, MLP ``16LD^2``, Mamba ``12LD^2 + 16LDN + 10LD`` for L tokens, hidden D,
state N). Marconi's terms assume dense square projections; here each term is counted from the
model's own shapes (``model.ModelShape``), and attention is causal: the token at depth ``d``
(``d`` tokens before it) attends to ``d + 1`` positions. Per token at depth ``d``::

    flops(d) = F0 + F1 * (d + 1)
    F1 = mla_layers * 2 * mla_heads * ((qk_nope + qk_rope) + v_head)      # QK^T and AV
    F0 = sum over layers of 2 * (weights the token multiplies)
         + kda_layers * (2 * conv_kernel * 3 * kda_heads * dk              # q/k/v short conv
                         + 7 * kda_heads * dk * dv)                        # the KDA recurrence

with, per layer kind, the weights a token multiplies (Kimi-Linear's projections):

- MLA: ``q_proj`` D x H(nope+rope) (or the two ``q_lora`` matrices), ``kv_a_proj_with_mqa``
  D x (kv_lora + rope), ``kv_b_proj`` kv_lora x H(nope+v), ``o_proj`` Hv x D;
- KDA: ``q/k/v_proj`` 3 x D x H*dk, ``f_a``/``g_a`` D x r and ``f_b``/``g_b`` r x H*dk,
  ``b_proj`` D x H, ``o_proj`` H*dv x D; the recurrence per head and token: decay (dk*dv),
  k^T S (2 dk*dv), the rank-1 update (2 dk*dv), S^T q (2 dk*dv);
- MLP: dense 3 x D x I (gate, up, down); MoE: router D x E plus (top-k + shared) experts of
  3 x D x I_moe each.

Left out: norms, activations, rotary embeddings and the LM head (prefill computes logits for
the last token only, the same whether the prefix hit or not, so it cancels in a lost hit).

Recomputing tokens ``[h, T)`` (a hit of ``h`` tokens in a ``T``-token prompt) costs
``F0 * (T - h) + F1 * (T(T+1) - h(h+1)) / 2`` FLOPs; divided by an effective device
throughput (a preset's published dense BF16 peak times ``UTILISATION``, or a figure given in
TFLOP/s) that is GPU-seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtrace.errors import ConfigError
from kvtrace.replay.execute.model import ModelShape

# Model FLOP utilisation assumed for prefill: an assumption, not a measurement (large-batch
# prefill of dense models is often quoted at 40-60% of peak; MoE expert GEMMs run lower).
# Override with an effective figure: --gpu TFLOPS.
UTILISATION = 0.4

# Published peak dense BF16 tensor-core throughput (NVIDIA data sheets list 1,979 TFLOP/s
# "with sparsity" for both; dense is half).
GPU_PRESETS: dict[str, tuple[str, float]] = {
    "h200": ("NVIDIA H200 SXM", 989.4e12),
    "h100": ("NVIDIA H100 SXM", 989.4e12),
}

# Recurrence FLOPs per head and token, in units of dk * dv (see the module docstring).
KDA_RECURRENCE_FLOPS = 7


@dataclass(frozen=True)
class FlopsPerToken:
    """``flops(d) = constant + per_position * (d + 1)`` for a token at depth ``d``."""

    constant: int
    per_position: int

    def at_depth(self, depth: int) -> int:
        return self.constant + self.per_position * (depth + 1)

    def recompute(self, hit_tokens: int, num_tokens: int) -> int:
        """FLOPs of prefilling tokens ``[hit_tokens, num_tokens)``."""
        if num_tokens <= hit_tokens:
            return 0
        positions = (num_tokens * (num_tokens + 1) - hit_tokens * (hit_tokens + 1)) // 2
        return self.constant * (num_tokens - hit_tokens) + self.per_position * positions


def mla_weights(m: ModelShape) -> int:
    qk_head = m.qk_nope_head_dim + m.qk_rope_head_dim
    if m.q_lora_rank:
        q = m.hidden_size * m.q_lora_rank + m.q_lora_rank * m.mla_heads * qk_head
    else:
        q = m.hidden_size * m.mla_heads * qk_head
    kv_a = m.hidden_size * (m.kv_lora_rank + m.qk_rope_head_dim)
    kv_b = m.kv_lora_rank * m.mla_heads * (m.qk_nope_head_dim + m.v_head_dim)
    out = m.mla_heads * m.v_head_dim * m.hidden_size
    return q + kv_a + kv_b + out


def kda_weights(m: ModelShape) -> int:
    key_proj = m.kda_heads * m.kda_key_head_dim
    qkv = 3 * m.hidden_size * key_proj
    gates = 2 * (m.hidden_size * m.kda_gate_rank + m.kda_gate_rank * key_proj)  # f and g
    beta = m.hidden_size * m.kda_heads
    out = m.kda_heads * m.kda_value_head_dim * m.hidden_size
    return qkv + gates + beta + out


def kda_token_flops(m: ModelShape) -> int:
    """Per token and KDA layer, besides its weights: the short convolutions and recurrence."""
    key_proj = m.kda_heads * m.kda_key_head_dim
    conv = 2 * m.kda_conv_kernel * 3 * key_proj
    recurrence = KDA_RECURRENCE_FLOPS * m.kda_heads * m.kda_key_head_dim * m.kda_value_head_dim
    return conv + recurrence


def moe_weights(m: ModelShape) -> int:
    router = m.hidden_size * m.num_experts
    experts = (m.experts_per_token + m.num_shared_experts) * 3 * m.hidden_size \
        * m.moe_intermediate_size
    return router + experts


def dense_mlp_weights(m: ModelShape) -> int:
    return 3 * m.hidden_size * m.dense_intermediate_size


def flops_per_token(m: ModelShape) -> FlopsPerToken:
    num_moe = m.num_layers - m.num_dense_layers
    weights = (m.num_kda_layers * kda_weights(m) + m.num_mla_layers * mla_weights(m)
               + m.num_dense_layers * dense_mlp_weights(m) + num_moe * moe_weights(m))
    constant = 2 * weights + m.num_kda_layers * kda_token_flops(m)
    per_position = m.num_mla_layers * 2 * m.mla_heads * (
        m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim)
    return FlopsPerToken(constant, per_position)


@dataclass(frozen=True)
class GpuThroughput:
    """The effective FLOP/s a lost hit is priced at, and where the figure comes from."""

    name: str
    flops_per_s: float
    source: str


def gpu_throughput(spec: str) -> GpuThroughput:
    """``spec``: a preset (``h200``, ``h100``: peak times ``UTILISATION``) or an effective
    throughput in TFLOP/s (``350``)."""
    key = spec.strip().lower()
    if key in GPU_PRESETS:
        name, peak = GPU_PRESETS[key]
        return GpuThroughput(key, peak * UTILISATION,
                             f"{name}: {peak / 1e12:.1f} TFLOP/s dense BF16 peak x "
                             f"{UTILISATION:.0%} utilisation (assumed)")
    try:
        tflops = float(key)
    except ValueError:
        tflops = 0.0
    if not tflops > 0:
        raise ConfigError(f"--gpu {spec!r} is neither a device preset nor a throughput",
                          f"Give one of {', '.join(GPU_PRESETS)}, or effective TFLOP/s "
                          "(e.g. --gpu 350).")
    return GpuThroughput(f"{tflops:g} TFLOP/s", tflops * 1e12, "given with --gpu")


@dataclass(frozen=True)
class CostModel:
    """Prices recomputed tokens: ``model``'s FLOPs at ``gpu``'s effective throughput."""

    model: ModelShape
    gpu: GpuThroughput

    @property
    def flops(self) -> FlopsPerToken:
        return flops_per_token(self.model)

    def gpu_seconds(self, hit_tokens: int, num_tokens: int) -> float:
        return self.flops.recompute(hit_tokens, num_tokens) / self.gpu.flops_per_s

    def header_params(self) -> dict[str, str]:
        """The figures the analysis side reads from a replay trace's header (``kvtrace sql
        --query recompute_gpu_seconds``): it never imports replay."""
        flops = self.flops
        return {"execute.model": self.model.name,
                "execute.flops_per_token": str(flops.constant),
                "execute.flops_per_token_per_position": str(flops.per_position),
                "execute.gpu": self.gpu.name,
                "execute.gpu_flops_per_s": repr(self.gpu.flops_per_s)}
