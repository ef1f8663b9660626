"""What recomputing prefill costs: FLOPs per token from a model's own architecture, and the
GPU-seconds they take on a given GPU.

The layer decomposition follows Marconi (Pan et al., MLSys '25, arXiv:2411.19379; ``utils.py``
of its artifact): a layer's forward FLOPs are 2 per multiply-accumulate of its weight matrices
per token, plus the attention-score work that grows with the context. Marconi's terms assume
dense square projections; here each term is counted from the model's own blocks
(``architecture.Architecture``: attention or MLA, KDA / Gated DeltaNet / Mamba2 mixers, dense
MLPs, and the experts a token is routed to in a mixture), and attention is causal: the token at
depth ``d`` (``d`` tokens before it) attends to ``d + 1`` positions. Per token at depth ``d``,
summed over the ``tp`` GPUs of a tensor-parallel group::

    flops(d) = F0 + F1 * (d + 1)
    F0 = 2 * (sum of the matrices a token multiplies; a replicated one tp times)
         + the blocks' per-token work (short convolutions, recurrences)
    F1 = the attention blocks' score work per position (QK^T and AV)

Left out: norms, activations, rotary embeddings, the embedding lookup and the LM head (prefill
computes logits for the last token only, the same whether the prefix hit or not, so it cancels
in a lost hit).

Recomputing tokens ``[h, T)`` (a hit of ``h`` tokens in a ``T``-token prompt) costs
``F0 * (T - h) + F1 * (T(T+1) - h(h+1)) / 2`` FLOPs; divided by an effective GPU throughput (a
preset's published dense BF16 peak times ``UTILISATION``, or a figure given in TFLOP/s) that
is GPU-seconds: GPU time summed over the group's GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from kvtrace.errors import ConfigError
from kvtrace.geometry.architecture import Architecture
from kvtrace.geometry.families import architecture_of
from kvtrace.geometry.presets import resolve_model

# Model FLOP utilisation assumed for prefill: an assumption, not a measurement (large-batch
# prefill of dense models is often quoted at 40-60% of peak; MoE expert GEMMs run lower).
# Override with an effective figure: --gpu TFLOPS.
UTILISATION = 0.4

# Published peak dense BF16 tensor-core throughput. NVIDIA's data sheets list 1,979 TFLOP/s
# "with sparsity" for the H100 and H200 SXM and 4.5 PFLOP/s for the B200 (HGX B200, per GPU);
# dense is half.
GPU_PRESETS: dict[str, tuple[str, float]] = {
    "h200": ("NVIDIA H200 SXM", 989.4e12),
    "h100": ("NVIDIA H100 SXM", 989.4e12),
    "b200": ("NVIDIA B200", 2250e12),
}
DEFAULT_GPU = "h200"


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


def flops_per_token(model: Architecture, tensor_parallel_size: int = 1) -> FlopsPerToken:
    """The model's prefill FLOPs per token, over its tensor-parallel group."""
    tp = tensor_parallel_size
    matrices = sum(linear.weights * (tp if linear.replicated else 1)
                   for linear in model.linears(tp))
    per_token = sum(block.part.token_flops() for block in model.blocks)
    per_position = sum(block.part.position_flops() for block in model.blocks)
    return FlopsPerToken(2 * matrices + per_token, per_position)


@dataclass(frozen=True)
class GpuThroughput:
    """The effective FLOP/s a recomputed token is priced at, and where the figure comes from."""

    name: str
    flops_per_s: float
    source: str  # how the figure was arrived at
    title: str  # for a sentence: "an NVIDIA H200 SXM", "a GPU of 350 TFLOP/s effective"


def gpu_throughput(spec: str) -> GpuThroughput:
    """``spec``: a preset (``h200``, ``h100``, ``b200``: peak times ``UTILISATION``) or an
    effective throughput in TFLOP/s (``350``)."""
    key = spec.strip().lower()
    if key in GPU_PRESETS:
        name, peak = GPU_PRESETS[key]
        return GpuThroughput(key, peak * UTILISATION,
                             f"{peak / 1e12:,.1f} TFLOP/s dense BF16 peak x "
                             f"{UTILISATION:.0%} utilisation (assumed)", f"an {name}")
    try:
        tflops = float(key)
    except ValueError:
        tflops = 0.0
    if not 0 < tflops < float("inf"):
        raise ConfigError(f"--gpu {spec!r} is neither a device preset nor a throughput",
                          f"Give one of {', '.join(GPU_PRESETS)}, or effective TFLOP/s "
                          "(e.g. --gpu 350).")
    return GpuThroughput(f"{tflops:g} TFLOP/s", tflops * 1e12, "given with --gpu",
                         f"a GPU of {tflops:g} TFLOP/s effective")


@dataclass(frozen=True)
class CostModel:
    """Prices recomputed tokens: ``model``'s FLOPs at ``tensor_parallel_size`` on ``gpu``."""

    model: Architecture
    tensor_parallel_size: int
    gpu: GpuThroughput

    @cached_property
    def flops(self) -> FlopsPerToken:
        return flops_per_token(self.model, self.tensor_parallel_size)

    def gpu_seconds(self, hit_tokens: int, num_tokens: int) -> float:
        return self.flops.recompute(hit_tokens, num_tokens) / self.gpu.flops_per_s

    def header_params(self) -> dict[str, str]:
        """The model's figures, for a replay trace's header: the analysis side prices the
        run's lookups with them (``kvtrace sql --query recompute_gpu_seconds``) and never
        imports the replay."""
        flops = self.flops
        return {"cost.model": self.model.name,
                "cost.tensor_parallel_size": str(self.tensor_parallel_size),
                "cost.flops_per_token": str(flops.constant),
                "cost.flops_per_token_per_position": str(flops.per_position)}


def cost_model(model: str, tensor_parallel_size: int | None = None,
               gpu: str = DEFAULT_GPU) -> CostModel:
    """The cost model of ``model`` (a preset or a config.json path, with vLLM's --hf-overrides
    as ``presets.model_spec`` writes them) at ``tensor_parallel_size``
    (default: a preset's usual one, ``bundled.PRESET_TENSOR_PARALLEL``, else 1) on ``gpu``."""
    from kvtrace.geometry.bundled import PRESET_TENSOR_PARALLEL

    if tensor_parallel_size is not None and tensor_parallel_size < 1:
        raise ConfigError(f"tensor parallel size {tensor_parallel_size} is not positive",
                          "Give the number of GPUs that serve one copy of the model.")
    source = resolve_model(model)
    architecture = architecture_of(source)  # its name: the preset's, or the path (+ overrides)
    return CostModel(architecture,
                     tensor_parallel_size or PRESET_TENSOR_PARALLEL.get(source.base_name, 1),
                     gpu_throughput(gpu))
