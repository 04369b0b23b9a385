"""The gated delta rule (Gated DeltaNet, https://arxiv.org/abs/2412.06464) and its short causal convolution:
PyTorch reference kernels and the dispatch to the GPU kernel libraries.

Per value head, with an L2-normalised key k_t and query q_t (scaled by d_k^-1/2), a decay α_t = exp(g_t) in
(0, 1] and a write strength β_t in (0, 1), the state S (d_k x d_v) evolves as

    S_t = α_t · S_{t-1} + β_t · k_t ⊗ (v_t - α_t · S_{t-1}ᵀ k_t)        o_t = S_tᵀ q_t

Two ways to compute it, equal within fp32 rounding (both in fp32, as transformers' reference does; float64 for a
float64 model):

* `recurrent_gated_delta_rule`: token by token (a decode step, one token against the cached state);
* `chunked_gated_delta_rule`: chunks of `CHUNK_SIZE` tokens; inside a chunk the updates are condensed by the
  WY / UT transform into (C x C) triangular systems, across chunks the state is carried. Memory and work are
  O(T·C) per head: no (query x key) matrix over the whole sequence is ever built.

Where `flash-linear-attention` (`fla`) and `causal-conv1d` import and the tensors sit on a device they support,
`kernels_for` returns their fused kernels instead (the GPU path; transformers' own availability checks decide);
otherwise the PyTorch functions here run. The GPU kernels were not run on this project's CPU-only machines: their
dispatch is tested there with stand-ins.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .recurrent_cache import state_dtype

# Tokens per chunk of the chunked rule (transformers' and fla's default)
CHUNK_SIZE = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(Σx² + eps) over the last dim (fla's and transformers' form)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def heads_first_fp32(query, key, value, g, beta):
    """(B, T, H, D) -> (B, H, T, D) in fp32 (float64 for a float64 model), q/k repeated to the value heads (each q/k
    head serves H_v / H_k consecutive value heads), q and k L2-normalised and q scaled by d_k^-1/2."""
    groups = value.shape[2] // key.shape[2]
    if groups > 1:
        query, key = query.repeat_interleave(groups, dim=2), key.repeat_interleave(groups, dim=2)
    dtype = state_dtype(value.dtype)
    query, key, value, g, beta = (x.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format)
                                  for x in (query, key, value, g, beta))
    query, key = l2norm(query), l2norm(key)
    return query * query.shape[-1] ** -0.5, key, value, g, beta


def recurrent_gated_delta_rule(query, key, value, g, beta, initial_state=None):
    """The gated delta rule, one token at a time (what a decode step runs).

    query/key (B, T, H_k, d_k), value (B, T, H_v, d_v), g/beta (B, T, H_v) (or g per key channel, (B, T, H_v, d_k):
    KDA's decay, `kda_rule.py`), initial_state (B, H_v, d_k, d_v) or None. Returns the output (B, T, H_v, d_v) in
    value's dtype and the final state (B, H_v, d_k, d_v) in fp32, a new tensor (`initial_state` is not written).

    The state's reads (kᵀS, qᵀS) are batched products and its write (S += k ⊗ δ) one in-place batched product: three
    passes over the state per token and one elementwise (the decay), where the same formula as elementwise
    products and sums makes about eight and a temporary the state's size for each (transformers' reference)."""
    dtype = value.dtype
    q, k, v, g, beta = heads_first_fp32(query, key, value, g, beta)
    batch, heads, length, d_k = k.shape
    d_v = v.shape[-1]
    state = (torch.zeros(batch, heads, d_k, d_v, dtype=v.dtype, device=v.device)
             if initial_state is None else initial_state.to(v.dtype))
    out = torch.empty_like(v)
    decays = g.exp()  # (B, H, T) or, KDA's, (B, H, T, d_k)
    decays = decays[..., None] if decays.dim() == 4 else decays[..., None, None]
    rows = batch * heads  # the batched products' batch: one (d_k x d_v) state per sequence and head
    for t in range(length):
        # decayed into a new tensor at the first token (the caller's state stays as it was), in place after it
        state = (state * decays[:, :, t]).contiguous() if t == 0 else state.mul_(decays[:, :, t])
        states = state.view(rows, d_k, d_v)
        k_t = k[:, :, t].reshape(rows, 1, d_k)
        remembered = torch.bmm(k_t, states).view(batch, heads, d_v)  # what the state recalls for k_t
        delta = (v[:, :, t] - remembered) * beta[:, :, t, None]
        states.baddbmm_(k_t.transpose(1, 2), delta.reshape(rows, 1, d_v))  # S += k_t ⊗ δ
        out[:, :, t] = torch.bmm(q[:, :, t].reshape(rows, 1, d_k), states).view(batch, heads, d_v)
    return out.transpose(1, 2).contiguous().to(dtype), state


def in_chunks(query, key, value, g, beta, chunk_size: int) -> tuple[torch.Tensor, ...]:
    """The rule's inputs heads first in fp32 (`heads_first_fp32`), padded to whole chunks and cut into them: each
    (B, H, N, C, ...). The padding tokens neither write (β = 0) nor decay (g = 0); their outputs are dropped."""
    q, k, v, g, beta = heads_first_fp32(query, key, value, g, beta)
    length = v.shape[2]
    pad = (chunk_size - length % chunk_size) % chunk_size
    chunked = []
    for x in (q, k, v, g, beta):
        per_token = x.dim() == 3  # β, and Gated DeltaNet's g: one value per head and token
        if pad:
            x = F.pad(x, (0, pad) if per_token else (0, 0, 0, pad))
        chunked.append(x.reshape(*x.shape[:2], -1, chunk_size, *x.shape[3:]))
    return tuple(chunked)


def chunked_gated_delta_rule(query, key, value, g, beta, initial_state=None, chunk_size: int = CHUNK_SIZE):
    """The rule by chunks of `chunk_size` tokens (arguments and results as `recurrent_gated_delta_rule`).

    Within a chunk, with cumulative log-decays γ, the pairwise decays D_ij = exp(γ_i - γ_j) (i >= j) turn the
    chunk's sequential updates into one unit lower-triangular system (I + tril(β k kᵀ ∘ D, -1)) [U W] =
    [β v, β k ∘ exp(γ)], solved once for both right-hand sides; the chunk's output is its read of the carried
    state plus the causal (q kᵀ ∘ D) product with the corrected values, and the state moves on by one product.
    """
    length, d_v, d_k = value.shape[1], value.shape[-1], key.shape[-1]
    q, k, v, g, beta = in_chunks(query, key, value, g, beta, chunk_size)  # (B, H, N, C, ...)

    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=v.device).triu(1)
    gamma = g.cumsum(dim=-1)  # (B, H, N, C): log-decay from the chunk's start
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(upper, float("-inf")).exp()  # (B, H, N, C, C)
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay  # its strict lower triangle; the diagonal is taken as 1
    rhs = torch.cat((v * beta[..., None], k_beta * gamma.exp()[..., None]), dim=-1)  # (B, H, N, C, d_v + d_k)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    new_values, decayed_keys = solved.split((d_v, d_k), dim=-1)
    inner = (q @ k.transpose(-1, -2)) * decay  # (B, H, N, C, C), causal within the chunk
    q = q * gamma.exp()[..., None]
    k = k * (gamma[..., -1:] - gamma).exp()[..., None]
    chunk_decay = gamma[..., -1].exp()[..., None, None]  # (B, H, N, 1, 1)

    return carry_state(q, k, inner, new_values, decayed_keys, chunk_decay, initial_state, length, value.dtype)


def carry_state(q, k, inner, new_values, decayed_keys, chunk_decay, initial_state, length: int, dtype):
    """The chunks in order, carrying the state: chunk n reads the state (its queries `q` decayed from the chunk's
    start), adds its own causal part (`inner` x the values corrected by what the state already recalls), and moves
    the state on (decayed by `chunk_decay`, plus its keys decayed to the chunk's end, `k`). Inputs (B, H, N, C, ...);
    returns the output (B, T, H, d_v) in `dtype` and the final state (B, H, d_k, d_v) in fp32."""
    batch, heads, chunks, _, d_v = new_values.shape
    state = (torch.zeros(batch, heads, k.shape[-1], d_v, dtype=new_values.dtype, device=new_values.device)
             if initial_state is None else initial_state.to(new_values.dtype))
    out = torch.empty_like(new_values)
    for n in range(chunks):
        corrected = new_values[:, :, n] - decayed_keys[:, :, n] @ state  # (B, H, C, d_v)
        out[:, :, n] = q[:, :, n] @ state + inner[:, :, n] @ corrected
        state = state * chunk_decay[:, :, n] + k[:, :, n].transpose(-1, -2) @ corrected
    out = out.reshape(batch, heads, -1, d_v)[:, :, :length]
    return out.transpose(1, 2).contiguous().to(dtype), state


def by_document(rule: Callable) -> Callable:
    """A chunked rule run over one row (batch 1) of packed documents, each from a zero state.

    The returned function takes (query, key, value, g, beta, documents), `documents` a
    `packed_documents.PackedDocuments`, and returns the output (1, T, H_v, d_v) and each document's final state
    (N, H_v, d_k, d_v), as fla's kernels with `cu_seqlens` do."""

    def run(query, key, value, g, beta, documents):
        outputs, states = [], []
        for start, end in zip(documents.bounds[:-1], documents.bounds[1:]):
            out, state = rule(*(x[:, start:end] for x in (query, key, value, g, beta)))
            outputs.append(out)
            states.append(state)
        return torch.cat(outputs, dim=1), torch.cat(states)

    run.__name__ = f"{rule.__name__}_by_document"
    return run


chunked_gated_delta_rule_by_document = by_document(chunked_gated_delta_rule)


def causal_conv1d(x: torch.Tensor, conv: torch.nn.Conv1d, activation: Callable) -> torch.Tensor:
    """activation(depthwise causal conv) of x (B, C, T) through the module `conv` (padding K - 1 on both sides:
    the first T outputs are the causal ones), so hooks and adapters on it run."""
    return activation(conv(x)[..., : x.shape[-1]])


def causal_conv1d_last(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The depthwise causal convolution's output at x's last column, (B, C, 1), from x's last K columns (x: (B, C,
    T >= K), weight (C, 1, K) as `nn.Conv1d` holds it): a decode step's one output, a dot product per channel, as
    one batched product (a convolution call with its padded outputs costs several times as much at these sizes)."""
    batch, channels, taps = x.shape[0], x.shape[1], weight.shape[-1]
    window = x[..., -taps:].transpose(0, 1)  # (C, B, K)
    out = torch.bmm(window, weight.view(channels, taps, 1)).transpose(0, 1)  # (B, C, 1)
    return out if bias is None else out + bias[:, None]


@dataclass(frozen=True)
class Kernels:
    """The functions a Gated DeltaNet layer computes with on one device (see `kernels_for`)."""

    chunked: Callable = chunked_gated_delta_rule
    recurrent: Callable = recurrent_gated_delta_rule
    conv: Callable | None = None  # causal-conv1d's `causal_conv1d_fn`: (x, weight, bias, activation) -> out
    conv_update: Callable | None = None  # its `causal_conv1d_update`: (x, state, weight, bias, activation)
    name: str = "torch"
    # packed documents (one row, each document from a zero state): (q, k, v, g, beta, documents) -> (out, states)
    chunked_documents: Callable = chunked_gated_delta_rule_by_document


TORCH_KERNELS = Kernels()
# The devices the GPU libraries run on (transformers' `_PACKAGE_SUPPORTED_DEVICES` names the same)
_FLA_DEVICES = ("cuda", "xpu")
_CAUSAL_CONV1D_DEVICES = ("cuda",)


def kernels_for(device: torch.device) -> Kernels:
    """The gated delta rule's kernels for tensors on `device`: fla's and causal-conv1d's where they run, else PyTorch's.

    fla's chunked and fused recurrent gated delta rule and causal-conv1d's convolutions where transformers says they
    are available (`is_flash_linear_attention_available`, `is_causal_conv1d_available`) and `device` is one they run
    on; the PyTorch functions otherwise."""
    return _kernels_for(device.type)


@functools.lru_cache(maxsize=None)
def _kernels_for(device_type: str) -> Kernels:
    return build_kernels(device_type, TORCH_KERNELS, "flash_linear_attention_kernels")


def build_kernels(device_type: str, torch_kernels: Kernels, fla_kernels: str) -> Kernels:
    """`torch_kernels` with fla's (`compat.<fla_kernels>()`: the chunked and the fused recurrent kernel, or None)
    and causal-conv1d's where they are available and run on `device_type`."""
    from . import compat

    chunked, recurrent, documents, conv, conv_update = (torch_kernels.chunked, torch_kernels.recurrent,
                                                        torch_kernels.chunked_documents, None, None)
    names = []
    if device_type in _FLA_DEVICES and (fla := getattr(compat, fla_kernels)()) is not None:
        chunked, recurrent, documents = _fla_rule(fla[0]), _fla_rule(fla[1]), _fla_documents_rule(fla[0])
        names.append("fla")
    if device_type in _CAUSAL_CONV1D_DEVICES and (conv1d := compat.causal_conv1d_kernels()) is not None:
        conv, conv_update = conv1d
        names.append("causal-conv1d")
    return Kernels(chunked, recurrent, conv, conv_update, "+".join(names) or "torch", documents)


def _fla_rule(kernel: Callable) -> Callable:
    """An fla gated-delta-rule kernel behind this module's signature: q/k repeated to the value heads first (every
    fla release since transformers' minimum takes equal head counts), L2 norm inside the kernel, the state in
    fp32 and the output in value's dtype."""

    def rule(query, key, value, g, beta, initial_state=None, **kwargs):
        groups = value.shape[2] // key.shape[2]
        if groups > 1:
            query, key = query.repeat_interleave(groups, dim=2), key.repeat_interleave(groups, dim=2)
        query, key, value, g, beta = (x.contiguous() for x in (query, key, value, g, beta))  # views of one projection
        out, state = kernel(query, key, value, g=g, beta=beta, initial_state=initial_state, output_final_state=True,
                            use_qk_l2norm_in_kernel=True, **kwargs)
        return out.to(value.dtype), state.to(torch.float32)

    rule.__name__ = kernel.__name__
    return rule


def _fla_documents_rule(kernel: Callable) -> Callable:
    """fla's chunked kernel over packed documents: the same call with `cu_seqlens` (batch 1; the state restarts at
    each document, one final state per document)."""
    rule = _fla_rule(kernel)

    def by_document(query, key, value, g, beta, documents):
        return rule(query, key, value, g, beta, cu_seqlens=documents.cu_seqlens)

    by_document.__name__ = f"{kernel.__name__}_by_document"
    return by_document


__all__ = ["CHUNK_SIZE", "Kernels", "TORCH_KERNELS", "build_kernels", "by_document", "carry_state", "causal_conv1d", "causal_conv1d_last",
           "chunked_gated_delta_rule",
           "chunked_gated_delta_rule_by_document", "kernels_for", "l2norm", "recurrent_gated_delta_rule"]
