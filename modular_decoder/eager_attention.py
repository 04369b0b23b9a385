"""The eager reference attention that every backend is tested against, and its parts.

softmax(softcap(q·kᵀ·scale) + bias + mask)·v, written out (with attention sinks, each head's sink logit joins the
softmax as one more column whose probability is dropped), and its parts for attention that scores the keys itself
(MLA's absorbed path): K/V head repetition, scores to probabilities, and the mask a backend received made explicit.

Every backend is a plain function with transformers' attention signature
`fn(module, query, key, value, attention_mask, *, scaling, dropout, sliding_window, softcap, ...)`
taking query (B, H, T_q, D_qk), key (B, H_kv, T_k, D_qk), value (B, H_kv, T_k, D_v) and returning
((B, T_q, H, D_v), weights or None). They never look at how q/k/v were made, so standard attention
and MLA (D_qk != D_v) share them. ALiBi reaches the eager reference (and SDPA) as the materialised
(1, H, T_q, T_k) bias the model passes as `position_bias`.
"""

from __future__ import annotations

import torch
from torch import nn

from .backend_features import BOTTOM_RIGHT_CAUSAL, canonical_backend


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, H_kv, T, D) -> (B, H_kv·n_rep, T, D), each K/V head serving n_rep query heads."""
    if n_rep == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, t, d).reshape(b, h * n_rep, t, d)


def attention_probs(
    module: nn.Module,
    scores: torch.Tensor,
    attention_mask: torch.Tensor | None,
    softcap: float | None = None,
    position_bias: torch.Tensor | None = None,
    dropout: float = 0.0,
    fused_upcast: bool = False,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scaled scores (B, H, T_q, T_k) -> probabilities: soft-cap, bias, mask, softmax in (at least) fp32, dropout.

    `sinks` (H,): each head's sink logit joins its softmax as one more key column (after the cap, bias and
    mask: a sink is a logit, not a score), whose probability is dropped, so a row sums to less than 1 (to 0
    where every key is masked).

    The order (soft-cap, bias, mask) is Gemma 2's and FlexAttention's. `attention_mask` is a 4-D
    boolean keep-mask or additive mask (sliced to T_k). Without autograd the steps reuse the scores
    tensor (same arithmetic, no new B x H x T_q x T_k tensor per step); autograd needs each kept.

    `fused_upcast`: half-precision scores go to torch's softmax as they are, which accumulates in fp32 and
    rounds once: the values of an fp32 softmax cast back (bit-equal on this CPU), in one kernel instead of
    two. The reference (`eager_attention`) keeps transformers' explicit form.
    """
    fresh = not scores.requires_grad
    if softcap is not None:
        scores = scores.div_(softcap).tanh_().mul_(softcap) if fresh else softcap * torch.tanh(scores / softcap)
    if position_bias is not None:
        scores = scores.add_(position_bias) if fresh else scores + position_bias
    if attention_mask is not None:
        attention_mask = attention_mask[..., : scores.shape[-1]]
        if attention_mask.dtype == torch.bool:
            fill = torch.finfo(scores.dtype).min
            scores = scores.masked_fill_(~attention_mask, fill) if fresh else scores.masked_fill(~attention_mask, fill)
        else:
            scores = scores.add_(attention_mask) if fresh else scores + attention_mask
    dtype = scores.dtype
    if sinks is not None:
        sink_column = sinks.to(dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)  # (B, H, T_q, 1)
        scores = torch.cat((scores, sink_column), dim=-1)  # (B, H, T_q, T_k + 1)
    # At least fp32 (half precision is upcast), never below the scores' own precision: a float64
    # model's mask fill (finfo(float64).min) would become -inf in fp32, and a row with no key to
    # see (a left-padding query) would turn into NaN that reaches the real tokens through its values.
    if fused_upcast:  # (the cast is free, except under CUDA autocast, whose softmax returns fp32)
        probs = nn.functional.softmax(scores, dim=-1).to(dtype)
    else:
        softmax_dtype = torch.promote_types(dtype, torch.float32)
        probs = nn.functional.softmax(scores, dim=-1, dtype=softmax_dtype).to(dtype)
    if sinks is not None:
        probs = probs[..., :-1]  # the sink's share attends to nothing
    return nn.functional.dropout(probs, p=dropout, training=module.training) if dropout else probs


def eager_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    softcap: float | None = None,
    position_bias: torch.Tensor | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: softmax(softcap(q·kᵀ·scale) + bias + mask)·v, softmax in fp32; `s_aux` (H,) the sinks
    (transformers' name for them), a column of the softmax whose probability is dropped.

    query (B, H, T_q, D_qk), key (B, H_kv, T_k, D_qk), value (B, H_kv, T_k, D_v) -> (B, T_q, H, D_v).
    """
    n_rep = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, n_rep), repeat_kv(value, n_rep)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling  # (B, H, T_q, T_k)
    probs = attention_probs(module, scores, attention_mask, softcap, position_bias, dropout, sinks=s_aux)
    out = torch.matmul(probs, value)  # (B, H, T_q, D_v)
    return out.transpose(1, 2).contiguous(), probs


def explicit_mask(
    attention_mask: torch.Tensor | None,
    q_len: int,
    kv_len: int,
    sliding_window: int | None,
    implementation: str,
) -> torch.Tensor | None:
    """The mask a backend received, made explicit (4-D), for attention that scores the keys itself.

    As `attention_probs` takes it, for MLA's absorbed path, so it attends to exactly the keys backend
    `implementation` would.

    - 4-D (eager, sdpa): already explicit; sliced to the keys.
    - `None`: one query sees every key; several are causal, aligned as the backend aligns them
      (`BOTTOM_RIGHT_CAUSAL`), with the window on sliding layers.
    - 2-D (B, S) (flash with padding or a static cache): the real tokens among the first S keys
      (S < T_k for a static cache, whose later slots are empty), queries aligned to key S.
    """
    if attention_mask is not None and attention_mask.dim() == 4:
        return attention_mask[..., :kv_len]
    padding = None if attention_mask is None else attention_mask[:, -kv_len:].bool()
    if padding is None and q_len == 1 and (sliding_window is None or kv_len <= sliding_window):
        return None  # one query that may see every key
    bottom_right = padding is not None or canonical_backend(implementation) in BOTTOM_RIGHT_CAUSAL
    filled = kv_len if padding is None else padding.shape[-1]
    device = attention_mask.device if attention_mask is not None else None
    query = torch.arange(q_len, device=device)[:, None] + (filled - q_len if bottom_right else 0)
    key = torch.arange(kv_len, device=device)[None, :]
    keep = key <= query
    if sliding_window is not None:
        keep = keep & (key > query - sliding_window)
    keep = keep[None, None]  # (1, 1, T_q, T_k)
    if padding is not None:
        keep = keep & nn.functional.pad(padding, [0, kv_len - filled])[:, None, None, :]
    return keep
