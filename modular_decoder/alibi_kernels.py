"""ALiBi from slopes: the two score functions this family adds to transformers' backends, and which
backends take them. The flex function also takes attention sinks (`sinks.py`), with or without slopes.

Eager and SDPA add the materialised (1, H, T_q, T_k) bias the model passes as `position_bias`.
FlexAttention and flash attention 2 take the per-head slopes instead (`alibi_slopes`), so no
T_q × T_k tensor is built: a `score_mod` for flex, and the kernel's own `alibi_slopes` argument for
flash. transformers' shared flash function drops unknown kwargs, hence our own
`flash_attention_with_alibi`. Both follow transformers' attention signature (`eager_attention.py`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import partial

import torch

from .backend_features import canonical_backend
from .compat import internals
from .sinks import renormalize_with_sinks


def flex_attention_with_alibi(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    scaling: float | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Flex attention with ALiBi slopes (and attention sinks, or sinks alone).

    ALiBi is a `score_mod`: score − slope_h · (q_idx + T_k − T_q − kv_idx), the
    distance with the queries aligned to the last keys, as `AlibiBias` and the flash kernel take it.
    Order of operations as in `eager_attention`: scale, soft-cap, bias, mask. The mask is
    transformers' BlockMask (padding, packing, window, causal).

    `s_aux` (H,): attention sinks, by the rows' log-sum-exp the kernel returns (`sinks.renormalize_with_sinks`);
    without `alibi_slopes` this is flex attention with sinks alone.
    """
    from torch.nn.attention.flex_attention import BlockMask

    flex = internals("flex")
    if kwargs.get("dropout", 0.0) > 0:
        raise ValueError("`flex_attention` does not support attention dropout while training; use `eager` or `sdpa`.")
    block_mask = attention_mask if isinstance(attention_mask, BlockMask) else None
    score_mask = None if block_mask is not None or attention_mask is None else attention_mask[..., : key.shape[-2]]
    slopes = None if alibi_slopes is None else alibi_slopes.to(device=query.device, dtype=torch.float32)
    # a tensor, not a Python int, so that decoding step after step does not recompile
    shift = torch.tensor(key.shape[-2] - query.shape[-2], device=query.device)

    def score_mod(score, batch_idx, head_idx, q_idx, kv_idx):
        if softcap is not None:
            score = softcap * torch.tanh(score / softcap)
        if slopes is not None:
            score = score - slopes[head_idx] * (q_idx + shift - kv_idx)
        if score_mask is not None:
            score = score + score_mask[batch_idx][0][q_idx][kv_idx]
        return score

    try:
        out = flex.compile_friendly_flex_attention(
            query,
            key,
            value,
            score_mod=score_mod,
            block_mask=block_mask,
            enable_gqa=query.shape[1] != key.shape[1],  # K/V heads are shared, never repeated
            scale=scaling,
            kernel_options=kwargs.get("kernel_options"),
            training=module.training,
            **flex.get_flex_attention_lse_kwargs(s_aux is not None),
        )
    except Exception as error:  # torch's compiled CPU flex returns no log-sum-exp (torch 2.13)
        if s_aux is not None and "return_lse" in str(error):
            raise ValueError(
                "`attention_sinks` on flex_attention needs the kernel's log-sum-exp, which torch's compiled flex "
                f"kernel does not return on {query.device.type}; use sdpa or eager there."
            ) from error
        raise
    if s_aux is not None:
        out, lse = out  # torch < 2.9 returns the log-sum-exp itself, later ones an AuxOutput holding it
        out = renormalize_with_sinks(out, getattr(lse, "lse", lse), s_aux)
    return out.transpose(1, 2).contiguous(), None  # (B, T_q, H, D_v)


def _flash_kernels(implementation: str):
    """(flash_attn_func, flash_attn_varlen_func, pad, unpad, kwargs builder) as transformers loads them."""
    (flash_fn, varlen_fn, _, pad_fn, unpad_fn), (process_kwargs, _) = internals("flash").lazy_import_flash_attention(
        implementation
    )
    if "alibi_slopes" not in inspect.signature(varlen_fn).parameters:
        raise ValueError(
            f"The flash kernel loaded for {implementation!r} takes no `alibi_slopes`, so it cannot run "
            "`position_embedding_type='alibi'`; use flash_attention_2 (flash-attn 2), flex_attention or sdpa."
        )
    return flash_fn, varlen_fn, pad_fn, unpad_fn, process_kwargs


def flash_attention_with_alibi(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    alibi_slopes: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' flash path (same layout, unpadding, packed-sequence cu_seqlens, window and
    softcap arguments) plus the kernel's `alibi_slopes`.

    The kernel adds −slope_h·|i + T_k − T_q − j| (bottom-right aligned), i.e. the ALiBi distance when
    the keys end at the last query, which holds for unpadded, unpadded-by-mask and packed inputs and
    for the dynamic cache (and differs by a constant per row, which softmax ignores, for a static one).
    """
    flash = internals("flash")
    flash_fn, varlen_fn, pad_fn, unpad_fn, process_kwargs = _flash_kernels(module.config._attn_implementation)
    batch, q_len = query.shape[0], query.shape[2]
    query, key, value = (x.transpose(1, 2) for x in (query, key, value))  # (B, T, H, D): the kernel's layout
    head_dim, v_head_dim = query.shape[-1], value.shape[-1]
    if v_head_dim != head_dim:  # the kernel wants one head width (MLA): pad V, crop the output
        value = torch.nn.functional.pad(value, [0, head_dim - v_head_dim])
    query, key, value = flash.fa_peft_integration_check(
        query, key, value, flash.get_target_dtype(query, module)
    )
    kernel_kwargs = partial(
        process_kwargs,
        query_length=q_len,
        key_length=key.shape[1],
        is_causal=module.is_causal if is_causal is None else is_causal,
        dropout=dropout,
        softmax_scale=scaling,
        sliding_window=sliding_window,
        use_top_left_mask=flash._use_top_left_mask,
        softcap=softcap,
    )
    slopes = alibi_slopes.to(device=query.device, dtype=torch.float32)  # the kernel wants fp32 (H,)

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k):
        out = varlen_fn(
            q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, alibi_slopes=slopes,
            **kernel_kwargs(max_seqlen_q=max_q, max_seqlen_k=max_k),
        )
        return out[0] if isinstance(out, tuple) else out

    given = [kwargs.get(name) for name in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")]
    if attention_mask is not None:  # padding: drop pad tokens, run ragged, scatter back
        q, k, v, indices_q, (cu_q, cu_k), (max_q, max_k) = flash._upad_input(
            query, key, value, attention_mask, q_len, unpad_fn
        )
        out = pad_fn(varlen(q, k, v, cu_q, cu_k, max_q, max_k), indices_q, batch, q_len)
    elif all(x is not None for x in given):  # a collator passed cu_seqlens itself
        q, k, v = (x.reshape(-1, *x.shape[-2:]) for x in (query, key, value))
        out = varlen(q, k, v, *given)
        out = out.view(batch, -1, *out.shape[-2:])
    elif flash._is_packed_sequence(position_ids, batch):  # packed documents: cu_seqlens from position_ids
        q, k, v, (cu_q, cu_k), (max_q, max_k) = flash._prepare_from_posids(query, key, value, position_ids)
        out = varlen(q, k, v, cu_q, cu_k, max_q, max_k)
        out = out.view(batch, -1, *out.shape[-2:])
    else:
        out = flash_fn(query, key, value, alibi_slopes=slopes, **kernel_kwargs())
        out = out[0] if isinstance(out, tuple) else out
    return out[..., :v_head_dim], None


# backend -> the function that takes ALiBi as slopes (the others get the additive `position_bias`)
ALIBI_SLOPE_FUNCTIONS: dict[str, Callable] = {
    "flex_attention": flex_attention_with_alibi,
    "flash_attention_2": flash_attention_with_alibi,
}


def takes_alibi_slopes(implementation: str | None) -> bool:
    """Whether the model should hand this backend ALiBi slopes rather than a bias tensor."""
    return implementation is not None and canonical_backend(implementation) in ALIBI_SLOPE_FUNCTIONS
