"""The KDA recurrence (gated delta rule with channel-wise decay), in torch.

Shapes follow one independent recurrence per row ``n`` (a layer's head): state ``[N, K, V]``;
keys and log-space decays ``[N, T, K]``, values ``[N, T, V]``, betas ``[N, T]``. Per token::

    S = diag(exp(g_t)) S
    S = S + k_t (beta_t (v_t - S^T k_t))^T

(Kimi Delta Attention, the ``naive_recurrent_kda`` of flash-linear-attention). Only the state
matters here, so queries and outputs are left out.

``chunk_kda_state`` computes the same chunkwise: within a chunk of C tokens the updates are
solved at once in the WY form (a unit lower-triangular C x C system per chunk and row), and only
the state is carried from chunk to chunk, as FlashKDA and fla's ``chunk_kda`` do.
``recurrent_kda_state`` is the token-by-token reference; ``FlaKernel`` wraps fla's
``chunk_kda`` where it is importable (CUDA).
"""

from __future__ import annotations

import torch


def recurrent_kda_state(state: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                        beta: torch.Tensor) -> torch.Tensor:
    """The state after the tokens of ``k, v, g, beta``, one token at a time (the reference)."""
    for t in range(k.shape[1]):
        state = state * g[:, t, :, None].exp()
        read = torch.einsum("nk,nkv->nv", k[:, t], state)
        state = state + k[:, t, :, None] * (beta[:, t, None] * (v[:, t] - read))[:, None, :]
    return state


def chunk_kda_state(state: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """The state after the tokens, chunk by chunk. A ragged last chunk is padded with tokens
    that leave the state unchanged (k = v = g = beta = 0).

    Within a chunk, with ``c`` the inclusive cumulative sum of ``g``, token i's update is
    ``u_i = beta_i (v_i - S0^T (e^{c_i} k_i) - sum_{j<i} (k_i e^{c_i - c_j} . k_j) u_j)``: so
    ``U = (I + A)^-1 diag(beta) (V - K~ S0)`` with ``A_ij = beta_i k_i e^{c_i - c_j} . k_j``
    (j < i), and the chunk's end state is ``e^{c_C} S0 + sum_j (e^{c_C - c_j} k_j) u_j^T``.
    That is affine in ``S0``: ``S_end = P S0 + Q`` with ``P = diag(e^{c_C}) - K_end W`` and
    ``Q = K_end U0`` (``W = (I + A)^-1 diag(beta) K~``, ``U0 = (I + A)^-1 diag(beta) V``). The
    chunks' maps are composed pairwise, log2(chunks) batched steps instead of one per chunk."""
    num_rows, num_tokens, key_dim = k.shape
    pad = -num_tokens % chunk_size
    if pad:
        k, v, g = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (k, v, g))
        beta = torch.nn.functional.pad(beta, (0, pad))
    chunks = (num_tokens + pad) // chunk_size
    k = k.reshape(num_rows, chunks, chunk_size, key_dim)
    v = v.reshape(num_rows, chunks, chunk_size, -1)
    beta = beta.reshape(num_rows, chunks, chunk_size)
    decay = g.reshape(num_rows, chunks, chunk_size, key_dim).cumsum(2)
    # e^{c_i - c_j} split as e^{c_i} e^{-c_j}: within a chunk |c| stays small (inputs.py bounds
    # g), so neither factor can overflow.
    k_up = k * decay.exp()
    k_down = k * (-decay).exp()
    a = (k_up @ k_down.transpose(-1, -2)).tril(-1) * beta[..., :, None]
    eye = torch.eye(chunk_size, dtype=k.dtype, device=k.device)
    solve = torch.linalg.solve_triangular(a + eye, torch.diag_embed(beta), upper=False,
                                          unitriangular=True)
    end = decay[:, :, -1:, :]
    k_end = (k * (end - decay).exp()).transpose(-1, -2)  # [N, M, K, C]
    maps = torch.diag_embed(end.squeeze(2).exp()) - k_end @ (solve @ k_up)  # [N, M, K, K]
    offsets = k_end @ (solve @ v)  # [N, M, K, V]
    while maps.shape[1] > 1:  # compose neighbours: (P2, Q2) after (P1, Q1)
        if maps.shape[1] % 2:
            maps = torch.cat([maps, torch.eye(key_dim, dtype=k.dtype, device=k.device).expand(
                num_rows, 1, key_dim, key_dim)], 1)
            offsets = torch.nn.functional.pad(offsets, (0, 0, 0, 0, 0, 1))
        second = maps[:, 1::2]
        offsets = second @ offsets[:, 0::2] + offsets[:, 1::2]
        maps = second @ maps[:, 0::2]
    return torch.baddbmm(offsets[:, 0], maps[:, 0], state)


class TorchKernel:
    """The chunkwise recurrence above, at a fixed chunk size."""

    name = "torch-chunk"

    def __init__(self, chunk_size: int) -> None:
        self.chunk_size = chunk_size

    def __call__(self, state, k, v, g, beta):
        return chunk_kda_state(state, k, v, g, beta, self.chunk_size)


class FlaKernel:
    """flash-linear-attention's ``chunk_kda`` (CUDA, Triton): the rows become heads of one
    sequence; the keys stand in for the queries, whose outputs are not used."""

    name = "fla.chunk_kda"

    def __init__(self) -> None:
        from fla.ops.kda import chunk_kda

        self.chunk_kda = chunk_kda

    def __call__(self, state, k, v, g, beta):
        def heads(x):
            return x.transpose(0, 1).unsqueeze(0).contiguous()

        keys = heads(k)
        _, final = self.chunk_kda(q=keys, k=keys, v=heads(v), g=heads(g), beta=heads(beta),
                                  initial_state=state.unsqueeze(0), output_final_state=True)
        return final.squeeze(0).to(state.dtype)


def fla_kernel() -> FlaKernel | None:
    """fla's kernel when fla is importable, else None."""
    try:
        return FlaKernel()
    except ImportError:
        return None
