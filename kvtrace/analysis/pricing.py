"""What prices the prefill a report's runs recompute: the GPU (``--gpu``), and the model
(``--model``) for the runs that name none.

Recomputed tokens are priced with the model each replay names in its header (``kvtrace replay``
writes its figures), or ``--model`` for runs that name none, on ``--gpu``; the shipped queries
take the figures as parameters (``Pricing.params``), so ``kvtrace sql`` reproduces them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvtrace.analysis.queries import Result
from kvtrace.geometry.cost import DEFAULT_GPU, CostModel, GpuThroughput, gpu_throughput

PRICED_BY_PARAMETERS = "(parameters)"  # cost_model of the runs the flops parameters priced


@dataclass(frozen=True)
class Pricing:
    """What prices recomputed tokens: the GPU, and ``model`` for the runs whose header names
    none (a capture replayed without --model)."""

    gpu: GpuThroughput
    model: CostModel | None = None

    def params(self) -> dict[str, str]:
        """The pricing parameters of recompute_gpu_seconds and variant_verdict."""
        values = {"gpu_flops_per_s": f"{self.gpu.flops_per_s:.17g}"}
        if self.model is not None:
            values["flops_per_token"] = str(self.model.flops.constant)
            values["flops_per_position"] = str(self.model.flops.per_position)
        return values

    def name_given_model(self, result: Result) -> Result:
        """``result`` with the cost_model of the runs the flops parameters priced named: the
        --model that set them."""
        if self.model is None or "cost_model" not in result.columns:
            return result
        index = result.columns.index("cost_model")
        label = f"{self.model.model.name} (--model)"
        return Result(result.columns, [
            row[:index] + (label if row[index] == PRICED_BY_PARAMETERS else row[index],)
            + row[index + 1:] for row in result.rows])

    def describe(self, models: Iterable[str | None]) -> str:
        """Which model and GPU priced the figures, in one sentence."""
        named = sorted({m for m in models if m and not m.endswith("(--model)")})
        parts = []
        if named:
            parts.append(f"{', '.join(named)} (the replays' own figures)")
        if self.model is not None:
            parts.append(f"{self.model.model.name} at TP {self.model.tensor_parallel_size} "
                         "(--model, for runs that name no model)")
        if not parts:
            return ("Not priced: no run names its model. Replay with --model NAME|CONFIG.json, "
                    "or give the report --model.")
        return (f"Priced as {' and '.join(parts)} on {self.gpu.title} ({self.gpu.source}: "
                f"{self.gpu.flops_per_s / 1e12:,.1f} TFLOP/s effective).")


def pricing_for(gpu: str = DEFAULT_GPU, model: str | None = None) -> Pricing:
    """``--gpu`` and ``--model`` of the report."""
    from kvtrace.geometry.cost import cost_model

    return Pricing(gpu_throughput(gpu), cost_model(model, None, gpu) if model else None)
