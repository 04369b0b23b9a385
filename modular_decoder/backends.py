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
from torch import nn

from .compat import flash_kernel_fallbacks, internals

# Contract features a config may need, and the field that asks for each.
FEATURE_FIELDS = {
    "gqa": "num_key_value_heads < num_attention_heads",
    "sliding_window": "sliding_window / layer_types",
    "softcap": "attn_logit_softcapping",
    "scale": "query_pre_attn_scalar",
    "alibi": "position_embedding_type='alibi'",
    "mla": "attention_type='mla' (q/k width differs from v width)",
    # Latent scores (MLA served from its latent cache) with a cap or a window: transformers' backends score
    # expanded keys like any others; vLLM's latent attention takes neither.
    "latent_softcap": "attn_logit_softcapping with attention_type='mla'",
    "latent_window": "sliding_window / layer_types with attention_type='mla'",
    "latent_head_dim": "head_dim other than kv_lora_rank + qk_rope_head_dim with attention_type='mla'",
    # Not attention, but what an engine that runs the whole model (vLLM: its own lm_head and experts) must honour
    "logits_scaling": "logits_scaling (logits divided by it)",
    "experts_activation": "hidden_act other than 'silu' with mlp_type='moe'",
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
    # vLLM's Transformers modeling backend (`LLM(folder, model_impl="transformers")`) sets this
    # implementation while it builds the model: its attention never receives ALiBi slopes or a bias, its
    # latent (MLA) attention has no cap or window and sizes its cache by `head_dim`, its lm_head multiplies by `logit_scale` rather than
    # dividing by `logits_scaling`, and its fused experts apply SiLU whatever `hidden_act` says.
    "vllm": ALL_FEATURES - {"alibi", "latent_softcap", "latent_window", "latent_head_dim", "logits_scaling",
                            "experts_activation"},
}
# Names an engine gives one declared backend ("vllm_mla": vLLM's latent attention, set after the build)
BACKEND_ALIASES = {"vllm_mla": "vllm"}

# Caveats that are not contract features but that a user of the backend should know.
BACKEND_NOTES: dict[str, str] = {
    "sdpa": "GQA without repeating K/V only when there is no mask (torch's `enable_gqa`); "
    "ALiBi as an additive bias",
    "flex_attention": "no attention dropout while training (transformers raises); on CPU torch compiles it "
    "(about a minute the first time); ALiBi as a `score_mod` from the slopes",
    "flash_attention_2": "ALiBi through the kernel's `alibi_slopes`; V padded to the q/k width for MLA",
    "vllm": "set by vLLM's Transformers modeling backend, which serves a saved folder with its own attention "
    "(paged cache; MLA from its latent cache), lm_head and fused experts",
}


def canonical_backend(name: str) -> str:
    """The declared backend behind `name`: drops `paged|`, and maps the Hub kernels transformers
    falls back to when flash-attn is not installed to the flash version they stand in for."""
    name = name.removeprefix("paged|")
    name = BACKEND_ALIASES.get(name, name)
    if name in BACKEND_FEATURES:  # a declared backend: no lookup (forward calls this; export traces it)
        return name
    # ROCm maps FA2 and FA3 to one kernel: the later (FA3, fewer features) wins, the safe reading.
    by_kernel = {repo: impl for impl, repo in flash_kernel_fallbacks().items()}
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
    if config.logits_scaling != 1.0:
        needed.add("logits_scaling")
    return needed | config.attention_kind.backend_features(config) | config.mlp_kind.backend_features(config)


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
        if canonical_backend(backend) == "vllm":
            raise ValueError(
                f"vLLM's Transformers modeling backend cannot serve {fields} of this config (it would compute "
                "different results); generate with transformers instead."
            )
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
# The attention call every kind makes, and the eager reference


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
) -> torch.Tensor:
    """Scaled scores (B, H, T_q, T_k) -> probabilities: soft-cap, bias, mask, softmax in (at least) fp32, dropout.

    The order (soft-cap, bias, mask) is Gemma 2's and FlexAttention's. `attention_mask` is a 4-D
    boolean keep-mask or additive mask (sliced to T_k). Without autograd the steps reuse the scores
    tensor (same arithmetic, no new B x H x T_q x T_k tensor per step); autograd needs each kept.
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
    # At least fp32 (half precision is upcast), never below the scores' own precision: a float64
    # model's mask fill (finfo(float64).min) would become -inf in fp32, and a row with no key to
    # see (a left-padding query) would turn into NaN that reaches the real tokens through its values.
    softmax_dtype = torch.promote_types(scores.dtype, torch.float32)
    probs = nn.functional.softmax(scores, dim=-1, dtype=softmax_dtype).to(scores.dtype)
    return nn.functional.dropout(probs, p=dropout, training=module.training)


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
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: softmax(softcap(q·kᵀ·scale) + bias + mask)·v, softmax in fp32.

    query (B, H, T_q, D_qk), key (B, H_kv, T_k, D_qk), value (B, H_kv, T_k, D_v) -> (B, T_q, H, D_v).
    """
    n_rep = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, n_rep), repeat_kv(value, n_rep)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling  # (B, H, T_q, T_k)
    probs = attention_probs(module, scores, attention_mask, softcap, position_bias, dropout)
    out = torch.matmul(probs, value)  # (B, H, T_q, D_v)
    return out.transpose(1, 2).contiguous(), probs


# How a backend reads `attention_mask=None` for several queries: torch SDPA's `is_causal` aligns the
# causal mask at the first key (top-left; transformers passes None to sdpa only where that is right,
# e.g. a prefill into an empty static cache), the flash kernels at the last key (bottom-right).
BOTTOM_RIGHT_CAUSAL = frozenset({"flash_attention_2", "flash_attention_3", "flash_attention_4"})


def explicit_mask(
    attention_mask: torch.Tensor | None,
    q_len: int,
    kv_len: int,
    sliding_window: int | None,
    implementation: str,
) -> torch.Tensor | None:
    """The mask backend `implementation` received, as the 4-D mask `attention_probs` takes, for
    attention that scores the keys itself (MLA's absorbed path), so it attends to exactly the keys
    the backend would.

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


class AttentionLayer(nn.Module):
    """What every attention kind's module carries for the backends: its config and layer, the score
    scale, soft-cap and window of its layer type, causality and the RoPE pair layout.

    A kind's `forward` makes exactly one call through transformers' attention interface, written out
    in its own source as `attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(...)` and
    `attention_interface(self, q, k, v, mask, scaling=self.scaling, **self.score_kwargs(kwargs))`:
    `attn_implementation` picks the backend, and vLLM's Transformers modeling backend finds each
    layer's attention by reading that call (with `scaling=self.<attr>` and `layer_idx`)."""

    def __init__(self, config, layer_idx: int, scaling: float):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.layer_type = config.layer_types[layer_idx]
        self.scaling = scaling
        self.softcap = config.attn_logit_softcapping
        self.sliding_window = config.sliding_window if self.layer_type == "sliding_attention" else None
        self.is_causal = True
        self.interleaved = config.rope_interleaved

    def score_kwargs(self, kwargs: dict) -> dict:
        """What a backend takes beside q, k, v, the mask and `scaling`: the dropout while training, this
        layer's window and soft-cap, and the model's keyword arguments (position_ids, ALiBi, ...)."""
        kwargs = dict(kwargs, dropout=self.config.attention_dropout if self.training else 0.0,
                      sliding_window=self.sliding_window)
        if self.softcap is not None:
            kwargs["softcap"] = self.softcap
        return kwargs


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
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """FlexAttention with ALiBi as a `score_mod`: score − slope_h · (q_idx + T_k − T_q − kv_idx), the
    distance with the queries aligned to the last keys, as `AlibiBias` and the flash kernel take it.
    Order of operations as in `eager_attention`: scale, soft-cap, bias, mask. The mask is
    transformers' BlockMask (padding, packing, window, causal).
    """
    from torch.nn.attention.flex_attention import BlockMask

    flex = internals("flex")
    if kwargs.get("dropout", 0.0) > 0:
        raise ValueError("`flex_attention` does not support attention dropout while training; use `eager` or `sdpa`.")
    block_mask = attention_mask if isinstance(attention_mask, BlockMask) else None
    score_mask = None if block_mask is not None or attention_mask is None else attention_mask[..., : key.shape[-2]]
    slopes = alibi_slopes.to(device=query.device, dtype=torch.float32)
    # a tensor, not a Python int, so that decoding step after step does not recompile
    shift = torch.tensor(key.shape[-2] - query.shape[-2], device=query.device)

    def score_mod(score, batch_idx, head_idx, q_idx, kv_idx):
        if softcap is not None:
            score = softcap * torch.tanh(score / softcap)
        score = score - slopes[head_idx] * (q_idx + shift - kv_idx)
        if score_mask is not None:
            score = score + score_mask[batch_idx][0][q_idx][kv_idx]
        return score

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
        **flex.get_flex_attention_lse_kwargs(False),
    )
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
