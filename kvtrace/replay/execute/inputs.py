"""Deterministic per-token inputs of the recurrence, derived from hash ids.

A hash unit's tokens get keys, values, decays and betas that are a pure function of the unit's
hash id (and of the row and channel), so that the state after a prefix is a pure function of
that prefix's chain of hash ids: any request that computes the prefix gets the same state, and
a block holding another prefix's state is told apart. Each token and row gets a 32-bit seed
from its unit's id (a multiply-xorshift mix on 32-bit values held in int64, no product above
2^63); each channel's value is a fixed table of uniforms looked up at that seed xor a per-channel
constant. All of it is integer arithmetic and a gather, so CPU and CUDA derive the same inputs,
and only one mix per token and row is computed (a mix per value cost 60% of execute mode's CPU
time).
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
_SEED_STEP = 0x61C88647  # odd, < 2^31: products with 32-bit values stay below 2^63
_INDEX_STEP = 0x2545F491
_MIX_A = 0x7FEB352D
_MIX_B = 0x5BD1E995
DECAY_RANGE = (-0.05, -0.001)  # log-space decay per token and channel: e^g in [0.951, 0.999]
BETA_RANGE = (0.1, 0.9)
TAIL_DOMAIN = 0x5EED  # seeds of a prompt's tokens past its last full hash unit
_TABLE_BITS = 16


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = (x * _MIX_A) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MIX_B) & _MASK32
    return x ^ (x >> 16)


class UnitInputs:
    """Inputs for ``rows`` recurrences of ``key_dim`` x ``value_dim``, ``unit`` tokens per
    hash id, on ``device``."""

    def __init__(self, rows: int, key_dim: int, value_dim: int, unit: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.rows, self.key_dim, self.value_dim, self.unit = rows, key_dim, value_dim, unit
        self.dtype, self.device = dtype, device
        self.width = 2 * key_dim + value_dim + 1  # k, g, v, beta
        self._index = (torch.arange(rows * unit, dtype=torch.int64, device=device)
                       * _INDEX_STEP).view(rows, 1, unit)  # [row, unit, token]
        size = 1 << _TABLE_BITS
        self._table = (_mix32(torch.arange(size, dtype=torch.int64, device=device)) >> 8).to(
            dtype) * (1.0 / (1 << 24))
        self._channels = _mix32(torch.arange(size, size + self.width, dtype=torch.int64,
                                             device=device) * _SEED_STEP & _MASK32)

    def __call__(self, hash_ids: list[int], domain: int = 0):
        """(k, v, g, beta) for the units ``hash_ids``, in order: ``[rows, len * unit, ...]``."""
        ids = torch.tensor(hash_ids, dtype=torch.int64, device=self.device)
        seeds = _mix32(((ids & _MASK32) ^ ((ids >> 32) & _MASK32) ^ domain) & _MASK32)
        token_seeds = _mix32(((seeds[:, None] * _SEED_STEP) + self._index) & _MASK32)
        slots = (token_seeds[..., None] ^ self._channels) & ((1 << _TABLE_BITS) - 1)
        uniform = self._table.index_select(0, slots.view(-1)).view(
            self.rows, len(hash_ids) * self.unit, self.width)
        k_end, g_end = self.key_dim, 2 * self.key_dim
        k = torch.nn.functional.normalize(uniform[..., :k_end] * 2 - 1, dim=-1)
        low, high = DECAY_RANGE
        g = low + (high - low) * uniform[..., k_end:g_end]
        v = uniform[..., g_end:-1] * 2 - 1
        low, high = BETA_RANGE
        beta = low + (high - low) * uniform[..., -1]
        return k, v.contiguous(), g.contiguous(), beta.contiguous()
