"""Kimi Delta Attention's rule (KDA, Kimi Linear, https://arxiv.org/abs/2510.26692): the gated delta rule with a
decay per key channel instead of per head, in PyTorch, and the dispatch to fla's `chunk_kda` / `fused_recurrent_kda`.

Per head, with an L2-normalised key k_t and query q_t (scaled by d_k^-1/2), decays α_t = exp(g_t) in (0, 1]^d_k (one
per key channel) and a write strength β_t, the state S (d_k x d_v) evolves as

    S_t = Diag(α_t) S_{t-1} + β_t · k_t ⊗ (v_t - (Diag(α_t) S_{t-1})ᵀ k_t)        o_t = S_tᵀ q_t

Token by token it is `delta_rule.recurrent_gated_delta_rule` with its g per channel (a decode step). By chunks
(`chunked_kda`), as Gated DeltaNet's: inside a chunk the updates become one unit lower-triangular system whose
entries now carry the decay of each channel, Σ_c β_i k_ic k_jc exp(γ_ic - γ_jc) (γ the cumulative log-decays). Those
pairwise products are formed for `PAIR_BLOCK` key positions at a time (memory O(T·PAIR_BLOCK·d_k) per head, no
(query x key) matrix over the sequence), with the exponent clamped at 0 so the masked (future) pairs never overflow.
Both in fp32, as transformers' reference (`chunk_kimi_delta_attention`, `recurrent_kimi_delta_attention`) computes.
"""

from __future__ import annotations

import functools

import torch

from .delta_rule import (CHUNK_SIZE, Kernels, build_kernels, by_document, carry_state, in_chunks,
                         recurrent_gated_delta_rule)

# Key positions of a chunk whose pairwise per-channel decays are formed at once
PAIR_BLOCK = 16


def chunked_kda(query, key, value, g, beta, initial_state=None, chunk_size: int = CHUNK_SIZE):
    """KDA by chunks of `chunk_size` tokens. query/key (B, T, H, d_k), value (B, T, H, d_v), g (B, T, H, d_k) (the
    log-decays, <= 0), beta (B, T, H), initial_state (B, H, d_k, d_v) or None. Returns the output (B, T, H, d_v) in
    value's dtype and the final state (B, H, d_k, d_v) in fp32."""
    length, d_v, d_k = value.shape[1], value.shape[-1], key.shape[-1]
    q, k, v, g, beta = in_chunks(query, key, value, g, beta, chunk_size)  # (B, H, N, C, ...)

    gamma = g.cumsum(dim=-2)  # (B, H, N, C, d_k): log-decay of each channel from the chunk's start
    k_beta = k * beta[..., None]
    system, inner = _decayed_products(k_beta, q, k, gamma)  # (B, H, N, C, C) each, lower triangles
    rhs = torch.cat((v * beta[..., None], k_beta * gamma.exp()), dim=-1)  # (B, H, N, C, d_v + d_k)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    new_values, decayed_keys = solved.split((d_v, d_k), dim=-1)
    q = q * gamma.exp()
    k = k * (gamma[..., -1:, :] - gamma).exp()
    chunk_decay = gamma[..., -1, :].exp()[..., None]  # (B, H, N, d_k, 1)

    return carry_state(q, k, inner, new_values, decayed_keys, chunk_decay, initial_state, length, value.dtype)


def _decayed_products(k_beta, q, k, gamma):
    """Within each chunk, Σ_c a_ic k_jc exp(γ_ic - γ_jc) for a = β k (strictly below the diagonal: the system) and
    a = q (on and below it: the chunk's own read), `PAIR_BLOCK` columns j at a time."""
    size = gamma.shape[-2]
    system = torch.empty(*gamma.shape[:-1], size, dtype=gamma.dtype, device=gamma.device)
    inner = torch.empty_like(system)
    for start in range(0, size, PAIR_BLOCK):
        cols = slice(start, min(start + PAIR_BLOCK, size))
        # (B, H, N, C, b, d_k); exponents of masked pairs (j > i) would be positive: clamped, then masked
        decay = (gamma[..., :, None, :] - gamma[..., None, cols, :]).clamp(max=0).exp()
        keys = k[..., None, cols, :] * decay
        system[..., cols] = (k_beta[..., :, None, :] * keys).sum(-1)
        inner[..., cols] = (q[..., :, None, :] * keys).sum(-1)
    rows = torch.arange(size, device=gamma.device)
    system = system.masked_fill(rows[:, None] <= rows[None, :], 0.0)
    inner = inner.masked_fill(rows[:, None] < rows[None, :], 0.0)
    return system, inner


chunked_kda_by_document = by_document(chunked_kda)
TORCH_KDA_KERNELS = Kernels(chunked=chunked_kda, recurrent=recurrent_gated_delta_rule,
                            chunked_documents=chunked_kda_by_document)


def kda_kernels_for(device: torch.device) -> Kernels:
    """The kernels for tensors on `device`: fla's `chunk_kda` and `fused_recurrent_kda` and causal-conv1d's
    convolutions where they are available and run there (`delta_rule.build_kernels`), the PyTorch functions
    otherwise."""
    return _kda_kernels_for(device.type)


@functools.lru_cache(maxsize=None)
def _kda_kernels_for(device_type: str) -> Kernels:
    return build_kernels(device_type, TORCH_KDA_KERNELS, "fla_kda_kernels")


__all__ = ["PAIR_BLOCK", "TORCH_KDA_KERNELS", "chunked_kda", "chunked_kda_by_document", "kda_kernels_for"]
