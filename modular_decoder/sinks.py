"""Attention sinks (`attention_sinks`, gpt-oss) on every backend: a learned logit per head in each softmax.

The logit joins every softmax's denominator, so a head can give part of its attention (or all of it, where every
key is masked) to nothing:

    p_ij = exp(s_ij) / (exp(sink_h) + Σ_j' exp(s_ij'))        out_i = Σ_j p_ij · v_j

Each layer holds them as `self_attn.sinks` (H,), transformers' name, and hands them to the backend as `s_aux`,
transformers' keyword (vLLM's Transformers backend finds them there, `attention_layer.py`). How each backend
computes the same function, without the (T_q x T_k) scores that its kernel avoids:

- eager (the reference, `eager_attention.py`): one more column of the softmax, dropped after it.
- sdpa (`sdpa_attention_with_sinks`): torch's SDPA takes no sink. The sink becomes one more key, in front of the
  others, whose score is exactly the sink: each head's width grows by one aligned block of zeros (8 features,
  so torch's fused kernels still apply); the query carries sink_h / scale in the first of them, the sink key a
  1 there and zeros elsewhere, every real key zeros there (their scores are unchanged), and the sink's value
  is zero. A mask gets one more column that keeps the sink; without a mask (SDPA's own causal alignment,
  top-left), one zero query row goes in front as well, so that query i + 1 sees the sink and keys 0..i, and its
  output is dropped. Cost: K and V are copied once into the wider layout per call (no score matrix). A step of a
  few queries (decode, a speculative verify step) skips that copy of the whole cache, which would cost more than
  its attention: its scores, a few rows, are computed directly (`few_queries_with_sinks`), each group of query
  heads against its K/V head, the sink added to each softmax's denominator.
- flex (`alibi_kernels.flex_attention_with_alibi`, with or without ALiBi slopes): the kernel returns the
  log-sum-exp L of each row's scores; the output is renormalised by exp(L) / (exp(L) + exp(sink)) =
  σ(L - sink), as transformers' flex path does on GPUs (torch's compiled flex on CPU cannot return it).
- flash (`flash_attention_with_sinks`): transformers' flash path, whose kernel takes the sinks itself where it
  has the argument (vLLM's FA3 `s_aux`, FA4's `learnable_sink`); a kernel without it is refused when called,
  as flash-attn 2 is at load (`backend_features.py`), since transformers' path would drop them in silence.

Part of the remote-code files: torch and transformers only.
"""

from __future__ import annotations

import inspect
from functools import lru_cache, partial

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .backend_features import BOTTOM_RIGHT_CAUSAL
from .compat import internals

# The keyword a flash kernel takes the sinks by: vLLM's FA3 build, FA4 (transformers maps `s_aux` to either)
SINK_KERNEL_ARGUMENTS = ("s_aux", "learnable_sink")
# Features added per head for the sink's score: one block that keeps the width a multiple of 8 elements (16
# bytes in half precision), which torch's flash and memory-efficient SDPA kernels need on GPUs
SINK_FEATURES = 8
# A step of at most this many queries, whose fp32 scores take at most `FEW_QUERY_SCORES` elements, scores its keys
# directly instead of copying K and V into SDPA's wider layout (decode steps: benchmarks/results_sinks.json)
FEW_QUERIES = 8
FEW_QUERY_SCORES = 1 << 24


def sink_parameters(config) -> int:
    """Parameters the sinks add to one layer: one logit per query head (none without `attention_sinks`)."""
    return config.num_attention_heads if config.attention_sinks else 0


def _with_sink_key(x: torch.Tensor, width: int, sink_row: torch.Tensor | None) -> torch.Tensor:
    """(B, H, T, D) -> (B, H, 1 + T, width): zero-padded to `width` features, `sink_row` (or zeros) in front."""
    padded = nn.functional.pad(x, [0, width - x.shape[-1]])
    front = padded.new_zeros(*padded.shape[:2], 1, width) if sink_row is None else sink_row.expand(*padded.shape[:2], 1, width)
    return torch.cat((front, padded), dim=2)


def sdpa_attention_with_sinks(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    s_aux: torch.Tensor | None = None,
    position_bias: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """SDPA attention with sinks: transformers' SDPA function, the sink as one more key.

    q/k/v are widened by `SINK_FEATURES` so that a sink key in front of the keys scores exactly `s_aux` (the
    module docstring says how). query (B, H, T_q, D), key (B, H_kv, T_k, D),
    value (B, H_kv, T_k, D_v) -> ((B, T_q, H, D_v), None)."""
    head_dim, v_dim, q_len = query.shape[-1], value.shape[-1], query.shape[2]
    scaling = head_dim**-0.5 if scaling is None else scaling  # SDPA would take the widened width's
    if (q_len <= FEW_QUERIES and (attention_mask is not None or q_len == 1) and not kwargs.get("dropout")
            and query.shape[0] * query.shape[1] * q_len * key.shape[2] <= FEW_QUERY_SCORES):
        return few_queries_with_sinks(query, key, value, attention_mask, scaling, s_aux, position_bias), None
    width = max(head_dim, v_dim) + SINK_FEATURES
    width += -width % SINK_FEATURES
    sink_query = (s_aux.to(query.dtype) / scaling).view(1, -1, 1, 1).expand(*query.shape[:3], 1)  # (B, H, T_q, 1)
    query = torch.cat((query, sink_query), dim=-1)
    query = nn.functional.pad(query, [0, width - head_dim - 1])  # (B, H, T_q, width)
    sink_key = key.new_zeros(width)
    sink_key[head_dim] = 1.0
    key = _with_sink_key(key, width, sink_key.view(1, 1, 1, width))  # (B, H_kv, 1 + T_k, width)
    value = _with_sink_key(value, width, None)  # (B, H_kv, 1 + T_k, width), the sink's value zero
    kv_len = key.shape[2] - 1
    leading_query = attention_mask is None and q_len > 1  # SDPA's causal mask (top-left) must keep the sink
    if attention_mask is not None:
        mask = attention_mask[..., :kv_len]
        keep_sink = torch.ones_like(mask[..., :1]) if mask.dtype == torch.bool else torch.zeros_like(mask[..., :1])
        attention_mask = torch.cat((keep_sink, mask), dim=-1)
    if leading_query:
        query = torch.cat((query.new_zeros(*query.shape[:2], 1, width), query), dim=2)
    if position_bias is not None:  # (B or 1, H, T_q, T_k): nothing added to the sink's score
        position_bias = nn.functional.pad(position_bias[..., :kv_len], [1, 0, int(leading_query), 0])
    out, _ = ALL_ATTENTION_FUNCTIONS["sdpa"](
        module, query, key, value, attention_mask, scaling=scaling, position_bias=position_bias, **kwargs
    )
    return out[:, int(leading_query):, :, :v_dim], None  # (B, T_q, H, D_v)


def few_queries_with_sinks(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, scaling: float, s_aux: torch.Tensor,
                           position_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Attention with sinks for a step of a few queries, without copying the keys and values.

    query (B, H, T, D), key (B, H_kv, S, D), value (B, H_kv, S, D_v), a boolean or additive mask (B or 1, 1, T,
    >= S) or None (every key visible), a bias (B or 1, H, T, >= S) or None -> (B, T, H, D_v). Each K/V head's group
    of query heads is one matrix product against its keys (no repeated K/V); the softmax, in fp32, has the sink in
    its denominator.
    """
    batch, heads, q_len, _ = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    group = heads // kv_heads
    grouped = query.reshape(batch, kv_heads, group * q_len, -1)  # head h = kv_head * group + j, as `repeat_kv`
    scores = torch.matmul(grouped, key.transpose(-1, -2))
    scores = (scores.mul_(scaling) if scores.dtype is torch.float32 else scores.float().mul_(scaling))
    scores = scores.view(batch, kv_heads, group, q_len, kv_len)  # (B, H_kv, g, T, S)
    if position_bias is not None:
        scores = scores + position_bias[..., :kv_len].float().view(position_bias.shape[0], kv_heads, group, q_len, kv_len)
    if attention_mask is not None:
        mask = attention_mask[..., :kv_len].unsqueeze(2)  # (B, 1, 1, T, S)
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask.float()
    # The sink is one more logit of each head's row, outside the values: a softmax over [scores | sink] (finite
    # wherever the sink is, even where the mask hides every key), its last column dropped
    sink = s_aux.view(1, kv_heads, group, 1, 1).expand(scores.shape[0], -1, -1, q_len, 1)
    weights = torch.softmax(torch.cat((scores, sink.to(scores.dtype)), dim=-1), dim=-1)[..., :kv_len]
    out = torch.matmul(weights.to(value.dtype).view(batch, kv_heads, group * q_len, kv_len), value)
    return out.view(batch, heads, q_len, -1).transpose(1, 2)  # (B, T, H, D_v)


def renormalize_with_sinks(out: torch.Tensor, lse: torch.Tensor, s_aux: torch.Tensor) -> torch.Tensor:
    """Add each head's sink to the softmax of an attention output, from its rows' log-sum-exp.

    A softmax-weighted output (B, H, T, D) and its rows' log-sum-exp L (B, H, T) -> the output with each head's
    sink in the denominator: out · exp(L) / (exp(L) + exp(sink)) = out · σ(L - sink) (0 where L = -inf)."""
    factor = torch.sigmoid(lse.float() - s_aux.float().view(1, -1, 1))  # (B, H, T)
    return (out * factor.unsqueeze(-1).to(out.dtype)).to(out.dtype)


@lru_cache(maxsize=None)
def _takes_sinks(kernel) -> bool:
    try:
        parameters = inspect.signature(kernel).parameters
    except (TypeError, ValueError):
        return False
    return any(name in parameters for name in SINK_KERNEL_ARGUMENTS)


def flash_attention_with_sinks(
    interface, module: nn.Module, query, key, value, attention_mask, s_aux: torch.Tensor | None = None, **kwargs
):
    """Flash attention with sinks, refused where the loaded kernel takes none.

    transformers' flash path (`interface`) passes `s_aux` to the kernel where it takes sinks, after checking that
    the kernel loaded for this implementation does (transformers would drop them in silence)."""
    implementation = module.config._attn_implementation
    (flash_fn, varlen_fn, *_), _ = internals("flash").lazy_import_flash_attention(implementation)
    # transformers reads the kernel's keywords off its varlen function, for both of its paths
    if not _takes_sinks(varlen_fn if varlen_fn is not None else flash_fn):
        raise ValueError(
            f"The flash kernel loaded for {implementation!r} takes no sinks ({' / '.join(SINK_KERNEL_ARGUMENTS)}), so "
            "it cannot run `attention_sinks`: use a kernel that does (vLLM's FA3 build, FA4), flex_attention or sdpa."
        )
    return interface(module, query, key, value, attention_mask, s_aux=s_aux, **kwargs)


def sink_function(backend: str, interface):
    """The function that computes attention with sinks on `backend`.

    On declared `backend` (`canonical_backend`): this family's
    for SDPA and the flash kernels (module docstring; flex: `alibi_kernels.flex_attention_with_alibi`, which the
    attention layer picks); `interface` itself elsewhere (the eager reference, vLLM's attention, a backend the
    user registered: each is handed `s_aux`, as transformers' models hand it)."""
    if backend == "sdpa":
        return sdpa_attention_with_sinks
    if backend in BOTTOM_RIGHT_CAUSAL:
        return partial(flash_attention_with_sinks, interface)
    return interface


__all__ = ["SINK_FEATURES", "flash_attention_with_sinks", "few_queries_with_sinks", "renormalize_with_sinks",
           "sdpa_attention_with_sinks", "sink_function", "sink_parameters"]
