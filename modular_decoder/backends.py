"""Attention backends: what each one honours (declared once, checked at load), and the two
score functions this family adds to transformers' registry for ALiBi.

Every backend is a plain function with transformers' attention signature
`fn(module, query, key, value, attention_mask, *, scaling, dropout, sliding_window, softcap, ...)`
taking query (B, H, T_q, D_qk), key (B, H_kv, T_k, D_qk), value (B, H_kv, T_k, D_v) and returning
((B, T_q, H, D_v), weights or None). They never look at how q/k/v were made, so standard attention
and MLA (D_qk != D_v) share them.

A model whose contract needs a feature its backend lacks raises `ValueError` naming the field when
it is built or loaded, never silently computing different math. The README's compatibility table
is rendered from `BACKEND_FEATURES` by `compatibility_table()`.

ALiBi: eager and SDPA add the materialised (1, H, T_q, T_k) bias the model passes as
`position_bias`. FlexAttention and flash attention 2 take the per-head slopes instead
(`alibi_slopes`), so no T_q × T_k tensor is built: a `score_mod` for flex, and the kernel's own
`alibi_slopes` argument for flash. transformers' shared flash function drops unknown kwargs, hence
our own `flash_attention_with_alibi`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import partial

import torch
from transformers.modeling_flash_attention_utils import (
    FLASH_ATTN_KERNEL_FALLBACK,
    _is_packed_sequence,
    _prepare_from_posids,
    _upad_input,
    fa_peft_integration_check,
    lazy_import_flash_attention,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

# Contract features a config may need, and the field that asks for each.
FEATURE_FIELDS = {
    "gqa": "num_key_value_heads < num_attention_heads",
    "sliding_window": "sliding_window / layer_types",
    "softcap": "attn_logit_softcapping",
    "scale": "query_pre_attn_scalar",
    "alibi": "position_embedding_type='alibi'",
    "mla": "attention_type='mla' (q/k width differs from v width)",
}
# Input layouts every backend handles (proven in tests/test_backends*.py), listed for the table.
INPUT_LAYOUTS = {
    "padded": "2-D attention_mask with padding",
    "packed": "position_ids restarting at 0, batch 1, no attention_mask",
}

ALL_FEATURES = frozenset(FEATURE_FIELDS)

# backend -> contract features it can honour
BACKEND_FEATURES: dict[str, frozenset[str]] = {
    "eager": ALL_FEATURES,
    # torch SDPA has no logit soft-capping (transformers raises on `softcap`)
    "sdpa": ALL_FEATURES - {"softcap"},
    "flex_attention": ALL_FEATURES,
    # flash-attn 2 takes `alibi_slopes`; the FA3 (hopper) and FA4 (cute) interfaces have no ALiBi argument
    "flash_attention_2": ALL_FEATURES,
    "flash_attention_3": ALL_FEATURES - {"alibi"},
    "flash_attention_4": ALL_FEATURES - {"alibi"},
}

# Caveats that are not contract features but that a user of the backend should know.
BACKEND_NOTES: dict[str, str] = {
    "sdpa": "GQA without repeating K/V only when there is no mask (torch's `enable_gqa`); "
    "ALiBi as an additive bias",
    "flex_attention": "no attention dropout while training (transformers raises); on CPU torch compiles it "
    "(about a minute the first time); ALiBi as a `score_mod` from the slopes",
    "flash_attention_2": "ALiBi through the kernel's `alibi_slopes`; V padded to the q/k width for MLA",
}


def canonical_backend(name: str) -> str:
    """The declared backend behind `name`: drops `paged|`, and maps the Hub kernels transformers
    falls back to when flash-attn is not installed to the flash version they stand in for."""
    name = name.removeprefix("paged|")
    # ROCm maps FA2 and FA3 to one kernel: the later (FA3, fewer features) wins, the safe reading.
    by_kernel = {repo: impl for impl, repo in FLASH_ATTN_KERNEL_FALLBACK.items()}
    return by_kernel.get(name, name)


def required_features(config) -> set[str]:
    needed = set()
    if config.num_key_value_heads < config.num_attention_heads:
        needed.add("gqa")
    if "sliding_attention" in config.layer_types:
        needed.add("sliding_window")
    if config.attn_logit_softcapping is not None:
        needed.add("softcap")
    if config.query_pre_attn_scalar is not None:
        needed.add("scale")
    if config.position_embedding_type == "alibi":
        needed.add("alibi")
    if config.attention_type == "mla":
        needed.add("mla")
    return needed


def missing_features(config, backend: str) -> set[str]:
    supported = BACKEND_FEATURES.get(canonical_backend(backend))
    if supported is None:  # a backend registered by the user: trust it
        return set()
    return required_features(config) - supported


def check_backend(config, backend: str) -> None:
    """Raise `ValueError` if `backend` cannot compute what `config` asks for."""
    missing = missing_features(config, backend)
    if missing:
        fields = ", ".join(f"`{FEATURE_FIELDS[f]}`" for f in sorted(missing))
        usable = [name for name in BACKEND_FEATURES if not required_features(config) - BACKEND_FEATURES[name]]
        raise ValueError(
            f"attn_implementation={backend!r} cannot honour {fields} of this config; "
            f"use one of {usable}."
        )


def default_backend(config) -> str:
    """SDPA where it can honour the config (the fast CPU default), else the eager reference."""
    return "sdpa" if not missing_features(config, "sdpa") else "eager"


def compatibility_table() -> str:
    """Markdown: contract feature (and input layout) × backend, from the declarations above."""
    backends = list(BACKEND_FEATURES)
    rows = ["| feature (field) | " + " | ".join(backends) + " |", "|---" * (len(backends) + 1) + "|"]
    for feature, field in FEATURE_FIELDS.items():
        marks = ["yes" if feature in BACKEND_FEATURES[b] else "**no** (ValueError at load)" for b in backends]
        rows.append(f"| {feature} (`{field}`) | " + " | ".join(marks) + " |")
    for layout, meaning in INPUT_LAYOUTS.items():
        rows.append(f"| {layout} input ({meaning}) | " + " | ".join("yes" for _ in backends) + " |")
    notes = [f"- `{name}`: {note}." for name, note in BACKEND_NOTES.items()]
    return "\n".join(rows + [""] + notes)


# ---------------------------------------------------------------------------------------------
# ALiBi from slopes


def flex_attention_with_alibi(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    scaling: float | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    alibi_offset: int | torch.Tensor = 0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """FlexAttention with ALiBi as a `score_mod`: score + slope_h · (kv_idx − q_idx − alibi_offset).

    `alibi_offset` is (position of query 0) − (position of key 0): 0 without a cache, the number of
    tokens seen with a full dynamic cache. Order of operations as in `eager_attention`: scale,
    soft-cap, bias, mask. The mask is transformers' BlockMask (padding, packing, window, causal).
    """
    from torch.nn.attention.flex_attention import BlockMask
    from transformers.integrations.flex_attention import (
        compile_friendly_flex_attention,
        get_flex_attention_lse_kwargs,
    )

    if kwargs.get("dropout", 0.0) > 0:
        raise ValueError("`flex_attention` does not support attention dropout while training; use `eager` or `sdpa`.")
    block_mask = attention_mask if isinstance(attention_mask, BlockMask) else None
    score_mask = None if block_mask is not None or attention_mask is None else attention_mask[..., : key.shape[-2]]
    slopes = alibi_slopes.to(device=query.device, dtype=torch.float32)
    # a tensor, not a Python int, so that decoding step after step does not recompile
    offset = torch.as_tensor(alibi_offset, device=query.device)

    def score_mod(score, batch_idx, head_idx, q_idx, kv_idx):
        if softcap is not None:
            score = softcap * torch.tanh(score / softcap)
        score = score + slopes[head_idx] * (kv_idx - q_idx - offset)
        if score_mask is not None:
            score = score + score_mask[batch_idx][0][q_idx][kv_idx]
        return score

    out = compile_friendly_flex_attention(
        query,
        key,
        value,
        score_mod=score_mod,
        block_mask=block_mask,
        enable_gqa=query.shape[1] != key.shape[1],  # K/V heads are shared, never repeated
        scale=scaling,
        kernel_options=kwargs.get("kernel_options"),
        training=module.training,
        **get_flex_attention_lse_kwargs(False),
    )
    return out.transpose(1, 2).contiguous(), None  # (B, T_q, H, D_v)


def _flash_kernels(implementation: str):
    """(flash_attn_func, flash_attn_varlen_func, pad, unpad, kwargs builder) as transformers loads them."""
    (flash_fn, varlen_fn, _, pad_fn, unpad_fn), (process_kwargs, _) = lazy_import_flash_attention(implementation)
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
    for the dynamic cache; `alibi_offset` (for flex) is therefore not needed here.
    """
    from transformers.integrations.flash_attention import _use_top_left_mask, get_target_dtype

    flash_fn, varlen_fn, pad_fn, unpad_fn, process_kwargs = _flash_kernels(module.config._attn_implementation)
    batch, q_len = query.shape[0], query.shape[2]
    query, key, value = (x.transpose(1, 2) for x in (query, key, value))  # (B, T, H, D): the kernel's layout
    head_dim, v_head_dim = query.shape[-1], value.shape[-1]
    if v_head_dim != head_dim:  # the kernel wants one head width (MLA): pad V, crop the output
        value = torch.nn.functional.pad(value, [0, head_dim - v_head_dim])
    query, key, value = fa_peft_integration_check(query, key, value, get_target_dtype(query, module))
    kernel_kwargs = partial(
        process_kwargs,
        query_length=q_len,
        key_length=key.shape[1],
        is_causal=module.is_causal if is_causal is None else is_causal,
        dropout=dropout,
        softmax_scale=scaling,
        sliding_window=sliding_window,
        use_top_left_mask=_use_top_left_mask,
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
        q, k, v, indices_q, (cu_q, cu_k), (max_q, max_k) = _upad_input(
            query, key, value, attention_mask, q_len, unpad_fn
        )
        out = pad_fn(varlen(q, k, v, cu_q, cu_k, max_q, max_k), indices_q, batch, q_len)
    elif all(x is not None for x in given):  # a collator passed cu_seqlens itself
        q, k, v = (x.reshape(-1, *x.shape[-2:]) for x in (query, key, value))
        out = varlen(q, k, v, *given)
        out = out.view(batch, -1, *out.shape[-2:])
    elif _is_packed_sequence(position_ids, batch):  # packed documents: cu_seqlens from position_ids
        q, k, v, (cu_q, cu_k), (max_q, max_k) = _prepare_from_posids(query, key, value, position_ids)
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


def attention_function(implementation: str, default: Callable, alibi_slopes: bool = False) -> Callable:
    """The score function for `implementation`: ours where ALiBi comes as slopes, else the one
    transformers' registry holds (so a user's `AttentionInterface.register` override still wins)."""
    if alibi_slopes:
        return ALIBI_SLOPE_FUNCTIONS[canonical_backend(implementation)]
    return ALL_ATTENTION_FUNCTIONS.get_interface(implementation, default)
