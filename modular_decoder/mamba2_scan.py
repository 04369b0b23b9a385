"""Mamba-2's selective state-space scan (https://arxiv.org/abs/2405.21060): PyTorch reference kernels and the
dispatch to `mamba_ssm` and `causal-conv1d`.

Per head h (of H, each P wide) with a state of N per channel, a step size dt_t > 0 (already through
softplus, the bias and the clamp), A_h = -exp(A_log_h) < 0, and B_t, C_t (N) shared by the heads of one group:

    S_t = exp(dt_t · A_h) · S_{t-1} + dt_t · x_t ⊗ B_t          (S: P x N, fp32)
    y_t = S_t · C_t + D_h · x_t

Two ways to compute it, equal within fp32 rounding (both in fp32, as transformers' reference and mamba_ssm do):

* `recurrent_scan`: token by token (a decode step against the cached state);
* `chunked_scan`: the state-space dual form by chunks of `chunk_size` tokens. Inside a chunk the outputs are a
  causal (C Bᵀ ∘ decay) product, across chunks the state is carried. Memory and work are O(T·chunk) per head:
  no (query x key) matrix over the whole sequence is ever built, only (chunk x chunk) blocks.

A token whose dt is 0 neither decays nor writes the state (its output is still D·x): padding is given dt = 0.

Where `mamba_ssm` (>= 2.0.4) and `causal-conv1d` import and the tensors sit on CUDA, `kernels_for` returns their
fused kernels instead (`mamba_chunk_scan_combined`, `selective_state_update`; transformers' own availability checks
decide). Their dispatch is tested with stand-ins on this project's CPU-only machines.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .recurrent_cache import upcast

# Tokens per chunk where a config does not say (transformers' Bamba / Granite / Falcon-H1 default)
CHUNK_SIZE = 256


def _by_heads(B: torch.Tensor, heads: int) -> torch.Tensor:
    """(..., G, N) per group -> (..., H, N) per head: each group serves H / G consecutive heads."""
    return B.repeat_interleave(heads // B.shape[-2], dim=-2)


def recurrent_scan(x, dt, A, B, C, D, initial_state=None):
    """The scan token by token. x (b, T, H, P), dt (b, T, H), A (H,), B/C (b, T, G, N), D (H,), initial_state
    (b, H, P, N) or None. Returns y (b, T, H, P) and the final state (b, H, P, N), both fp32."""
    x, dt = upcast(x), upcast(dt)
    B, C = _by_heads(upcast(B), x.shape[2]), _by_heads(upcast(C), x.shape[2])  # (b, T, H, N)
    batch, length, heads, width = x.shape
    state = (x.new_zeros(batch, heads, width, B.shape[-1]) if initial_state is None
             else upcast(initial_state))
    decay = torch.exp(dt * upcast(A))  # (b, T, H)
    out = torch.empty_like(x)
    for t in range(length):
        written = (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]  # (b, H, P, N)
        state = state * decay[:, t, :, None, None] + written
        out[:, t] = (state @ C[:, t, :, :, None]).squeeze(-1)  # (b, H, P)
    return out + upcast(D)[:, None] * x, state


def _segment_sums(a: torch.Tensor) -> torch.Tensor:
    """(..., L) log-decays -> (..., L, L) with [i, j] = a_{j+1} + ... + a_i for i >= j, -inf above the diagonal:
    each sum of its own terms (as transformers' `segment_sum`), not a difference of two cumulative sums."""
    length = a.shape[-1]
    below = torch.ones(length, length, dtype=torch.bool, device=a.device).tril(-1)
    sums = a[..., None, :].expand(*a.shape, length).transpose(-1, -2).masked_fill(~below, 0).cumsum(dim=-2)
    return sums.masked_fill(~below.logical_or(torch.eye(length, dtype=torch.bool, device=a.device)), float("-inf"))


def chunked_scan(x, dt, A, B, C, D, initial_state=None, chunk_size: int = CHUNK_SIZE):
    """The scan by chunks of `chunk_size` tokens (arguments and results as `recurrent_scan`).

    With a = dt·A and γ its cumulative sum inside a chunk: the chunk's own contribution is
    y_i = Σ_{j<=i} (C_i·B_j) exp(γ_i - γ_j) dt_j x_j (its (chunk x chunk) decays summed term by term), the
    carried state adds exp(γ_i) C_i·S, and the state moves on as S <- exp(γ_last) S + Σ_j exp(γ_last - γ_j)
    dt_j x_j ⊗ B_j.
    """
    batch, length, heads, width = x.shape
    groups, size = B.shape[-2], B.shape[-1]
    chunk_size = max(1, min(chunk_size, length))  # a shorter sequence is one chunk of its length: no padded tokens
    pad = (chunk_size - length % chunk_size) % chunk_size
    x, dt, B, C = upcast(x), upcast(dt), upcast(B), upcast(C)
    skip = upcast(D)[:, None] * x
    if pad:  # zero tokens at the end: dt = 0 neither decays nor writes; their outputs are dropped
        x, B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, B, C))
        dt = F.pad(dt, (0, 0, 0, pad))
    chunks, per = (length + pad) // chunk_size, heads // groups
    # (b, c, l, G, r, P): heads as (group, head within group), so B and C stay per group
    xdt = (x * dt[..., None]).reshape(batch, chunks, chunk_size, groups, per, width)
    B, C = (t.reshape(batch, chunks, chunk_size, groups, size) for t in (B, C))
    a = (dt * upcast(A)).reshape(batch, chunks, chunk_size, groups, per).permute(0, 1, 3, 4, 2)  # (b, c, G, r, l)
    gamma = a.cumsum(dim=-1)
    scores = torch.einsum("bclgn,bcsgn->bcgls", C, B)  # (b, c, G, l, s): C_i·B_j
    weights = scores[:, :, :, None] * torch.exp(_segment_sums(a))  # (b, c, G, r, l, s), causal
    out = torch.einsum("bcgrls,bcsgrp->bclgrp", weights, xdt)
    to_end = torch.exp(gamma[..., -1:] - gamma)  # (b, c, G, r, l)
    written = torch.einsum("bclgn,bcgrl,bclgrp->bcgrpn", B, to_end, xdt)  # each chunk's own state
    from_start = torch.exp(gamma)  # (b, c, G, r, l)
    chunk_decay = torch.exp(gamma[..., -1])[..., None, None]  # (b, c, G, r, 1, 1)
    state = (x.new_zeros(batch, groups, per, width, size) if initial_state is None
             else upcast(initial_state).reshape(batch, groups, per, width, size))
    for n in range(chunks):
        carried = torch.einsum("blgn,bgrpn,bgrl->blgrp", C[:, n], state, from_start[:, n])
        out[:, n] += carried
        state = state * chunk_decay[:, n] + written[:, n]
    out = out.reshape(batch, -1, heads, width)[:, :length]
    return out + skip, state.reshape(batch, heads, width, size)


def chunked_scan_by_document(x, dt, A, B, C, D, documents, chunk_size: int = CHUNK_SIZE):
    """The chunked scan over one row (batch 1) of packed documents, each from a zero state (`documents`: a
    `packed_documents.PackedDocuments`). Returns y (1, T, H, P) and each document's final state (N_docs, H, P, N),
    as mamba_ssm's kernel with `seq_idx` and `cu_seqlens` does."""
    outputs, states = [], []
    for start, end in zip(documents.bounds[:-1], documents.bounds[1:]):
        out, state = chunked_scan(*(t[:, start:end] for t in (x, dt)), A, *(t[:, start:end] for t in (B, C)), D,
                                  chunk_size=chunk_size)
        outputs.append(out)
        states.append(state)
    return torch.cat(outputs, dim=1), torch.cat(states)


@dataclass(frozen=True)
class ScanKernels:
    """The functions a Mamba-2 layer computes with on one device (see `kernels_for`)."""

    chunked: Callable = chunked_scan
    recurrent: Callable = recurrent_scan
    # packed documents (one row, each from a zero state): (x, dt, A, B, C, D, documents, chunk_size) -> (y, states)
    chunked_documents: Callable = chunked_scan_by_document
    conv: Callable | None = None  # causal-conv1d's `causal_conv1d_fn`: (x, weight, bias, activation) -> out
    conv_update: Callable | None = None  # its `causal_conv1d_update`: (x, state, weight, bias, activation)
    name: str = "torch"


TORCH_KERNELS = ScanKernels()
# The devices the GPU libraries run on (transformers' availability checks ask for CUDA)
_MAMBA_SSM_DEVICES = ("cuda",)
_CAUSAL_CONV1D_DEVICES = ("cuda",)


def kernels_for(device: torch.device) -> ScanKernels:
    """The kernels for tensors on `device`: mamba_ssm's chunked scan and state update, causal-conv1d's
    convolutions, where transformers says they are available (`is_mamba_2_ssm_available`,
    `is_causal_conv1d_available`) and `device` is one they run on; the PyTorch functions otherwise."""
    return _kernels_for(device.type)


@functools.lru_cache(maxsize=None)
def _kernels_for(device_type: str) -> ScanKernels:
    from .compat import causal_conv1d_kernels, mamba_ssm_kernels

    chunked, recurrent, documents, conv, conv_update = (TORCH_KERNELS.chunked, TORCH_KERNELS.recurrent,
                                                        TORCH_KERNELS.chunked_documents, None, None)
    names = []
    if device_type in _MAMBA_SSM_DEVICES and (mamba := mamba_ssm_kernels()) is not None:
        chunked, recurrent, documents = _mamba_chunked(mamba[0]), _mamba_step(mamba[1]), _mamba_documents(mamba[0])
        names.append("mamba_ssm")
    if device_type in _CAUSAL_CONV1D_DEVICES and (conv1d := causal_conv1d_kernels()) is not None:
        conv, conv_update = conv1d
        names.append("causal-conv1d")
    return ScanKernels(chunked, recurrent, documents, conv, conv_update, "+".join(names) or "torch")


def _mamba_chunked(kernel: Callable) -> Callable:
    """mamba_ssm's `mamba_chunk_scan_combined` behind `chunked_scan`'s signature: dt already final (no bias,
    softplus or clamp inside the kernel), the results in fp32."""

    def scan(x, dt, A, B, C, D, initial_state=None, chunk_size: int = CHUNK_SIZE, **kwargs):
        out, state = kernel(x.contiguous(), dt.contiguous(), A.float(), B.contiguous(), C.contiguous(), chunk_size,
                            D=D.float(), initial_states=initial_state, return_final_states=True, **kwargs)
        return out.float(), state.float()

    scan.__name__ = kernel.__name__
    return scan


def _mamba_documents(kernel: Callable) -> Callable:
    """The same kernel over packed documents: `seq_idx` restarts the state at each, `cu_seqlens` returns each
    document's final state (batch 1)."""

    def by_document(x, dt, A, B, C, D, documents, chunk_size: int = CHUNK_SIZE):
        seq_idx = documents.index.to(torch.int32)[None]  # (1, T)
        out, states = kernel(x.contiguous(), dt.contiguous(), A.float(), B.contiguous(), C.contiguous(), chunk_size,
                             D=D.float(), seq_idx=seq_idx, cu_seqlens=documents.cu_seqlens, return_varlen_states=True)
        return out.float(), states.float()

    by_document.__name__ = f"{kernel.__name__}_by_document"
    return by_document


def _mamba_step(kernel: Callable) -> Callable:
    """mamba_ssm's `selective_state_update` (one token, the state updated in place) behind `recurrent_scan`'s
    signature: its per-channel arguments expanded from the per-head ones, dt already final."""

    def step(x, dt, A, B, C, D, initial_state=None):
        batch, length, heads, width = x.shape
        assert length == 1, "the fused step takes one token"
        size = B.shape[-1]
        # a new state tensor (the kernel updates its argument in place; a recording cache keeps the one before)
        state = x.new_zeros(batch, heads, width, size, dtype=torch.float32) if initial_state is None else \
            initial_state.clone()
        out = kernel(state, x[:, 0], dt[:, 0, :, None].expand(-1, -1, width), A.float()[:, None, None].expand(
            -1, width, size), B[:, 0], C[:, 0], D=D.float()[:, None].expand(-1, width))
        return out.float()[:, None], state

    step.__name__ = kernel.__name__
    return step


__all__ = ["CHUNK_SIZE", "ScanKernels", "TORCH_KERNELS", "chunked_scan", "chunked_scan_by_document", "kernels_for",
           "recurrent_scan"]
