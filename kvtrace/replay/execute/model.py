"""The recurrent state execute mode re-executes: one group's share of a model's recurrent
layers, each a ``[key_dim, value_dim]`` state per head, in the model's state dtype.

The layers, heads, dims and dtype come from the model's architecture
(``kvtrace.geometry.families.architecture_of``: Kimi's KDA, Qwen3-Next's Gated DeltaNet,
Nemotron-H's Mamba2), the one description that also serves the cache geometry and the cost
model. Execute mode runs KDA's recurrence on that shape whatever the family: it proves which
state a hit hands over, not the model's numerics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvtrace.errors import ConfigError
from kvtrace.geometry.architecture import Architecture

# --state-scale on CPU unless given: layers, heads and head dims at 1/16 (a 20-layer, 32 x 128
# x 128 KDA stack becomes 2 layers of 2 heads of 8 x 8 in one Mamba group).
CPU_STATE_SCALE = 1 / 16
MIN_HEAD_DIM = 8  # below this a scaled state is too small to tell prefixes apart reliably
STATE_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


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


def state_shape(model: Architecture, num_mamba_groups: int, scale: float) -> StateShape:
    """One group's share of the model's recurrent layers (vLLM splits them into groups of equal
    layer count, padding the last), each dimension multiplied by ``scale`` and rounded up."""
    if not 0 < scale <= 1:
        raise ConfigError(f"--state-scale must be in (0, 1], not {scale:g}",
                          "1 is the model's full state; 0.0625 (1/16) suits a CPU.")
    if model.state_dtype not in STATE_DTYPE_BYTES:
        raise ConfigError(f"{model.name}'s recurrent state is {model.state_dtype}, which "
                          "execute mode does not hold",
                          f"Execute mode holds {', '.join(STATE_DTYPE_BYTES)} states.")
    layers = math.ceil(model.recurrent_layers / max(1, num_mamba_groups))
    state = model.recurrent_state

    def scaled(size: int, least: int) -> int:
        return min(size, max(least, math.ceil(size * scale)))

    return StateShape(layers=scaled(layers, 1), heads=scaled(state.heads, 1),
                      key_dim=scaled(state.key_dim, MIN_HEAD_DIM),
                      value_dim=scaled(state.value_dim, MIN_HEAD_DIM),
                      dtype=model.state_dtype, scale=scale)
