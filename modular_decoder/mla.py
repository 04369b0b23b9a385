"""Multi-head latent attention (MLA, DeepSeek-V2 https://arxiv.org/abs/2405.04434).

Each position's hidden vector h is projected to a joint KV latent c = Norm(h W_DKV) of width d_c
(`kv_lora_rank`) and a shared rotary key k_R = RoPE(h W_KR) of width d_R (`qk_rope_head_dim`);
the cache stores only (c, k_R) (see `latent_cache.py`). Per head, content keys k_C = c W_UK and
values v = c W_UV (both inside `kv_b_proj`) are derived from the latent. Queries are projected
directly (`q_proj`) or through their own bottleneck (`q_a_proj` -> `q_a_layernorm` -> `q_b_proj`
when `q_lora_rank` is set); each head's query is [q_C (`qk_nope_head_dim`), q_R (d_R)].

Two ways to compute the same attention:

* expanded: k = [c W_UK, k_R], v = c W_UV for every key, then the model's attention backend (sdpa,
  flash, flex: fused kernels that never hold the scores; eager: the reference) as for any attention.
  Building per-head K/V costs one up-projection of the whole cache per step, shared by all queries.
* absorbed: q_C·k_Cᵀ = (q_C W_UKᵀ)·cᵀ, so each query moves into latent space once and is scored
  directly against the cached latents; the weighted sum of latents goes through W_UV afterwards. No
  per-head key or value is built, but the scores are explicit: (`absorbed_query_block` x S) per head
  at a time (all T_new at once on the eager reference), S the keys the cache returns.

`scoring_path` picks one per step, as vLLM and SGLang split MLA, by the number of new tokens T against the S
keys the cache returns (a dynamic cache: the tokens it holds; a static cache: all its slots, filled or not, which
both forms then compute over). In inference with a cache, a step of at most `absorbed_max_new_tokens` new
tokens with S > T runs absorbed: a decode step, a short chunk or assisted-decoding check, and a short prefill
into a static cache (whose empty slots the expanded form would up-project too). Everything else runs expanded,
expanding the cache once per step as transformers' `DeepseekV3Attention` does: a longer step, a prefill into an
empty dynamic cache (S = T, where the two forms cost the same), training, no cache. (vLLM's bounded alternative
to expanding, up-projecting the cache chunk by chunk and merging by log-sum-exp, needs each chunk's
log-sum-exp, which SDPA does not return through a public API.) The thresholds are `tuning.tuning()`'s settings;
the measurements behind them are named there. The absorbed form reads `kv_b_proj.weight` instead of calling the
module, so it engages only where `kv_b_proj` is a plain `nn.Linear` on a plain weight (no PEFT layer, hook,
quantized or tensor-parallel weight).

Module names follow DeepSeek's (`q_a_proj`, `kv_a_proj_with_mqa`, `kv_b_proj`, `o_proj`, ...), so
checkpoints convert by a near-identity map and PEFT targets read naturally.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .attention import linear_parameters
from .attention_layer import AttentionLayer
from .eager_attention import attention_probs, eager_attention, explicit_mask
from .kinds import AttentionKind, require_bool, require_int, require_number
from .latent_cache import LatentLayerMixin, latent_layer
from .split_products import is_fx_proxy, project, weight_is_readable
from .norms import build_norm, norm_parameters
from .positions import apply_rotary
from .sinks import sink_parameters
from .tuning import Tuning, tuning

# "auto": `scoring_path`'s rule; the other two force one path (tests, benchmarks), still only where
# the absorbed form may read `kv_b_proj`'s weight.
DECODE_MODES = ("auto", "absorbed", "expanded")

# The shipped defaults of `tuning.Tuning.absorbed_max_new_tokens` and `.absorbed_query_block` (the settings
# `scoring_path` and `absorbed_attention` read; `tuning.py` names the measurements behind them)
ABSORBED_MAX_NEW_TOKENS = Tuning.absorbed_max_new_tokens
ABSORBED_QUERY_BLOCK = Tuning.absorbed_query_block


@dataclass(kw_only=True)
class LatentAttentionFields:
    r"""Latent attention's options beside its widths.

    Args:
        latent_norm_eps (`float`, *optional*): Epsilon of the latent norms (`q_a_layernorm`, `kv_a_layernorm`).
            Defaults to `norm_eps`. transformers builds DeepSeek's and Kimi Linear's with 1e-6 whatever their block
            norms' (Kimi Linear's: 1e-5). MLA (and DSA) only.
    """

    latent_norm_eps: float | None = None


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1·mscale·ln(s) + 1 (1 for s <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def mla_softmax_scale(config, layer_type: str = "full_attention") -> float:
    """The score scale: (`query_pre_attn_scalar` or d_qk)^-1/2, times mscale(factor, mscale_all_dim)²
    when the rope dict sets `mscale_all_dim`.

    DeepSeek's YaRN splits the temperature in two: cos/sin carry mscale / mscale_all_dim (from
    transformers' yarn init), and every score, content and rotary part alike, carries
    mscale_all_dim² here (as transformers' `DeepseekV2/V3Attention.scaling` does).
    """
    scale = (config.query_pre_attn_scalar or config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = config.rope_parameters_for(layer_type) or {}
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
        scale *= yarn_mscale(params["factor"], params["mscale_all_dim"]) ** 2
    return scale


class MultiHeadLatentAttention(AttentionLayer):
    """MLA with a latent cache; `decode_mode` (one of `DECODE_MODES`) picks absorbed or expanded scores."""

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx, scaling=mla_softmax_scale(config, config.layer_types[layer_idx]))
        self.num_heads = config.num_attention_heads
        self.num_key_value_groups = 1  # keys are expanded per head on the expanded path
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.latent_dim = config.v_head_dim, config.kv_lora_rank
        self.qk_dim = self.nope_dim + self.rope_dim
        self.decode_mode = "auto"
        d, h, bias = config.hidden_size, self.num_heads, config.attention_bias
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(d, h * self.qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, config.q_lora_rank, bias=bias)
            self.q_a_layernorm = build_norm(config, config.q_lora_rank, config.latent_norm_eps)
            self.q_b_proj = nn.Linear(config.q_lora_rank, h * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.latent_dim + self.rope_dim, bias=bias)
        # Identity without the latent norm: same module chain, no parameters (see `kv_latent_norm`)
        self.kv_a_layernorm = (build_norm(config, self.latent_dim, config.latent_norm_eps) if config.kv_latent_norm
                               else nn.Identity())
        # No bias here: it is what makes W_UK / W_UV absorbable into the query / output.
        self.kv_b_proj = nn.Linear(self.latent_dim, h * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(h * self.v_dim, d, bias=config.attention_output_bias)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        position_bias: torch.Tensor | None = None,
        cache=None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """h (B, T, d) -> queries [q_C, q_R] per head, latent c and rotary key k_R per token; the cache
        stores (c, k_R); `scoring_path` then scores absorbed against the latents or expanded (module docstring).

        vLLM's Transformers backend reads and rewrites this source: keep the module calls direct (it fuses
        `q_a_proj` with `kv_a_proj_with_mqa` and follows the `kv_a_proj_with_mqa -> kv_a_layernorm ->
        kv_b_proj` chain) and the one `self.expand_kv(latents, k_rot)` call, which it replaces by its own
        latent attention.
        """
        del position_bias  # config validation rules out ALiBi with MLA
        batch, seq = hidden_states.shape[:2]
        if self.config.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        latents, k_rot = self.kv_a_proj_with_mqa(hidden_states).split([self.latent_dim, self.rope_dim], dim=-1)
        # -1: the heads this rank holds (all of them, or its share under tensor parallelism)
        q_nope, q_rot = q.unflatten(-1, (-1, self.qk_dim)).transpose(1, 2).split([self.nope_dim, self.rope_dim], dim=-1)
        latents = self.kv_a_layernorm(latents).unsqueeze(1)  # (B, 1, T, d_c)
        k_rot = k_rot.unsqueeze(1)  # (B, 1, T, d_R): one rotary key shared by all heads
        if position_embeddings is not None:  # (`position_embedding_type="none"`: the decoupled key, unrotated)
            cos, sin = position_embeddings
            q_rot = apply_rotary(q_rot, cos, sin, self.interleaved)
            k_rot = apply_rotary(k_rot, cos, sin, self.interleaved)
        if cache is not None and not is_fx_proxy(cache):
            check_latent_cache(cache, self.layer_idx, self.latent_dim)
            latents, k_rot = cache.update(latents, k_rot, self.layer_idx)
            if latents.shape[-2] > seq and type(self.kv_b_proj) is not nn.Linear:
                check_expansion_of_cached_tokens(self.kv_b_proj)
            if self.scoring_path(seq, latents.shape[-2], attention_mask) == "absorbed":
                out, weights = self.absorbed_attention(q_nope, q_rot, latents, k_rot, attention_mask)
                return project(self.o_proj, out.reshape(batch, seq, -1)), weights

        queries = torch.cat((q_nope, q_rot), dim=-1)  # (B, H, T, d_qk)
        keys, values = self.expand_kv(latents, k_rot)
        # CPU SDPA with V narrower than q/k: zero-pad V to the q/k width (torch then takes its flash
        # kernel instead of the math path) and crop the output
        pad = self.config._attn_implementation == "sdpa" and self.v_dim < self.qk_dim and values.device.type == "cpu"
        if pad:
            values = nn.functional.pad(values, [0, self.qk_dim - self.v_dim])
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention)
        attention_interface = self.scores_through(attention_interface, kwargs)  # sinks
        out, weights = attention_interface(
            self, queries, keys, values, attention_mask, scaling=self.scaling, s_aux=self.sinks,
            **self.score_kwargs(kwargs),
        )
        if pad:
            out = out[..., : self.v_dim]
        return project(self.o_proj, out.reshape(batch, seq, -1)), weights

    def scoring_path(self, new_tokens: int, keys: int, attention_mask) -> str:
        """`"absorbed"` or `"expanded"` for a step of `new_tokens` queries against the `keys` keys the cache
        returned (a static cache: its every slot).

        Absorbed in inference for a step of at most `tuning().absorbed_max_new_tokens` new tokens with more keys
        than new tokens: a decode step, a short chunk, a short prefill into a static cache (module docstring).
        Longer steps (chunked prefill, a second turn, assisted decoding's check of many candidates) and a prefill
        into an empty dynamic cache expand, so the backend's fused kernel scores them without a
        (T_new x S) matrix. Whatever `decode_mode` says, the absorbed form needs a plain `kv_b_proj`
        (it reads the weight; a PEFT layer, hook, quantized or tensor-parallel weight must be called) and
        a tensor mask (it masks scores itself; flex's BlockMask is the backend's to apply).
        """
        absorbable = weight_is_readable(self.kv_b_proj) and (attention_mask is None or torch.is_tensor(attention_mask))
        if not absorbable or self.decode_mode == "expanded":
            return "expanded"
        if self.decode_mode == "absorbed":
            return "absorbed"
        decoding = new_tokens < keys and new_tokens <= tuning().absorbed_max_new_tokens and not self.training
        return "absorbed" if decoding else "expanded"

    def expand_kv(self, latents: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head keys and values for every cached token: latents (B, 1, S, d_c) and k_rot (B, 1, S, d_R)
        -> keys (B, H, S, d_qk), values (B, H, S, d_v).

        `kv_b_proj` gets a contiguous input: without a cache (or the latent norm) the latents are a strided
        slice of `kv_a_proj_with_mqa`'s output, which a wrapped layer may `view` (PEFT's activated LoRA does)."""
        kv = self.kv_b_proj(latents[:, 0].contiguous()).unflatten(-1, (-1, self.nope_dim + self.v_dim)).transpose(1, 2)
        k_nope, values = kv.split([self.nope_dim, self.v_dim], dim=-1)  # (B, H, S, d_n), (B, H, S, d_v)
        keys = torch.cat((k_nope, k_rot.expand(-1, k_nope.shape[1], -1, -1)), dim=-1)  # (B, H, S, d_qk)
        return keys, values

    def absorbed_attention(self, q_nope, q_rot, latents, k_rot, attention_mask):
        """Scores against the cached latents: W_UK folded into the query, W_UV applied after the sum.

        q_nope (B, H, T, d_n), q_rot (B, H, T, d_R), latents (B, 1, S, d_c), k_rot (B, 1, S, d_R)
        -> ((B, T, H, d_v), weights). The cost per step is one pass over the cache per block of new tokens,
        with no re-expansion. The mask is read as the model's backend means it (`eager_attention.explicit_mask`),
        so every backend scores the same keys here as on the expanded path.

        The eager backend (the reference) scores all T queries at once and returns the probabilities, as
        `eager_attention` does. Every other backend scores `tuning().absorbed_query_block` new tokens per pass
        and returns no weights, as its fused kernel would not: the explicit scores never exceed
        (B, H, block, S), whatever the step's length; a block's probabilities are freed before the next block
        is scored. Its peak memory is measured by `python -m benchmarks.thresholds --parts mla_query_block`.
        """
        batch, heads, q_len, _ = q_nope.shape
        kv_len = latents.shape[-2]
        weight = self.kv_b_proj.weight  # a plain tensor: `scoring_path` engages only then
        w_uk, w_uv = weight.view(heads, -1, self.latent_dim).split([self.nope_dim, self.v_dim], dim=1)
        q_latent = torch.einsum("bhtn,hnc->bhtc", q_nope, w_uk)  # (B, H, T, d_c)
        cache_latents, cache_rot = latents[:, 0], k_rot[:, 0]  # (B, S, d_c), (B, S, d_R)
        mask = explicit_mask(attention_mask, q_len, kv_len, self.sliding_window, self.config._attn_implementation)
        eager = self.config._attn_implementation == "eager"
        block = q_len if eager else tuning().absorbed_query_block
        outs, probs = [], None
        for start in range(0, q_len, block):
            rows = slice(start, min(start + block, q_len))
            block_mask = mask[..., rows, :] if mask is not None and mask.shape[-2] > 1 else mask
            probs = None  # the previous block's, freed before this block's scores exist
            probs = self._latent_probs(q_latent[:, :, rows], q_rot[:, :, rows], cache_latents, cache_rot, block_mask)
            out_latent = probs.flatten(1, 2) @ cache_latents  # (B, H·t, d_c)
            outs.append(out_latent.view(batch, heads, -1, self.latent_dim))
        out_latent = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # (B, H, T, d_c)
        out = torch.einsum("bhtc,hvc->bthv", out_latent, w_uv)  # (B, T, H, d_v)
        return out, probs if eager else None

    def _latent_probs(self, q_latent, q_rot, cache_latents, cache_rot, mask) -> torch.Tensor:
        """Probabilities (B, H, t, S) of t latent-space queries over the cached latents and rotary keys."""
        batch, heads, q_len, _ = q_latent.shape
        # Heads and query positions share one row axis, so each score is a plain (B, H·t, S) matmul
        # against the un-expanded cache (broadcasting a 1-head cache over H would copy it H times).
        # (the scale rides in the product's own alpha / beta, and the softmax upcasts inside: a decode step
        # is host-bound at small batches, where each kernel launch counts)
        scores = torch.baddbmm(
            q_rot.reshape(batch, heads * q_len, -1) @ cache_rot.transpose(1, 2),
            q_latent.reshape(batch, heads * q_len, -1),
            cache_latents.transpose(1, 2),
            beta=self.scaling,
            alpha=self.scaling,
        ).view(batch, heads, q_len, -1)  # (B, H, t, S)
        dropout = self.config.attention_dropout if self.training else 0.0
        return attention_probs(self, scores, mask, self.softcap, dropout=dropout, fused_upcast=True, sinks=self.sinks)


def check_latent_cache(cache, layer_idx: int, latent_dim: int) -> None:
    """Raise a `ValueError` for a cache whose layer holds per-head keys, which MLA cannot attend to.

    Such a cache holds per-head keys rather than latents: a prefix of per-head K/V, as
    PEFT's prefix tuning builds it (`PrefixTuningConfig`), or a static cache pre-allocated with per-head shapes (as
    ExecuTorch's recipe sizes it from the config), which MLA cannot attend to (its cache holds one latent
    per token, `kv_lora_rank` wide; the keys are made from it). Only another cache class than this package's
    latent layers is looked at (transformers' `DynamicCache` holds latents too once MLA has filled it)."""
    layers = getattr(cache, "layers", None)
    if not layers or layer_idx >= len(layers) or isinstance(layers[layer_idx], LatentLayerMixin):
        return
    keys = getattr(layers[layer_idx], "keys", None)
    if torch.is_tensor(keys) and keys.dim() == 4 and keys.numel() and (keys.shape[1], keys.shape[-1]) != (1, latent_dim):
        raise ValueError(
            f"MLA (`attention_type='mla'`) cannot attend to per-head keys and values (this cache's layer {layer_idx} "
            f"holds keys of shape {tuple(keys.shape)}; MLA caches one {latent_dim}-wide latent per token): PEFT's "
            "prefix tuning passes such a prefix (use prompt tuning (`PromptTuningConfig`), P-tuning or LoRA), and a "
            "cache pre-allocated from `num_key_value_heads` and `head_dim` (ExecuTorch's recipe) holds such keys "
            "before its first write (size its layers as a latent cache)."
        )


def check_expansion_of_cached_tokens(kv_b_proj: nn.Module) -> None:
    """Raise a `ValueError` for a `kv_b_proj` whose output depends on where a token sits in the call.

    PEFT's activated LoRA (aLoRA)
    adapts the call's last tokens from its invocation sequence on, which holds where each call's tokens are new
    (transformers' models project each token once and cache the result), but the latent cache re-expands every
    cached token through `kv_b_proj` at each step, so past the prompt the window would slide onto other tokens: a
    cached step would then answer otherwise than the uncached forward. (Read by class name: PEFT is not imported.)"""
    variants = getattr(kv_b_proj, "lora_variant", None)
    if isinstance(variants, dict) and any(type(v).__name__ == "ALoraLinearVariant" for v in variants.values()):
        raise ValueError(
            "Activated LoRA (`alora_invocation_tokens`) on MLA's `kv_b_proj` cannot run against a cache: MLA's "
            "latent cache re-expands every cached token through `kv_b_proj` at each step, where aLoRA adapts only "
            "the last tokens of a call. Target `kv_a_proj_with_mqa` instead (its output is what the cache holds), "
            "with `q_b_proj`/`q_proj` and `o_proj`, or run without a cache (`use_cache=False`)."
        )


class LatentKind(AttentionKind):
    """`attention_type="mla"`: DeepSeek's latent attention; the cache stores the latent and rotary key."""

    name = "mla"
    module = MultiHeadLatentAttention
    fields = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_latent_norm",
              "latent_norm_eps")
    reads = ()  # every head reads the latent: no `head_dim` or `num_key_value_heads`
    # "none": NoPE, the decoupled key kept but never rotated (Kimi Linear's full layers)
    positions: tuple[str, ...] = ("rope", "none")

    def validate(self, config) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(config, name) is None:
                raise ValueError(f"`attention_type={self.name!r}` needs `{name}`.")
            require_int(name, getattr(config, name), minimum=1)
        require_int("q_lora_rank", config.q_lora_rank, minimum=1, optional=True)
        require_bool("kv_latent_norm", config.kv_latent_norm)
        require_number("latent_norm_eps", config.latent_norm_eps, above=0, optional=True)
        if config.position_embedding_type not in self.positions:
            raise ValueError(
                f"`attention_type={self.name!r}` carries position only in its decoupled rotary key: it needs "
                f"`position_embedding_type` in {list(self.positions)}, got {config.position_embedding_type!r} (ALiBi "
                "and absolute positions cannot reach the absorbed latent scores)."
            )
        if config.qk_rope_head_dim % 2 and config.position_embedding_type == "rope":
            raise ValueError(f"`qk_rope_head_dim` must be even, got {config.qk_rope_head_dim}.")
        if isinstance(config.no_rope_layers, list) and 0 in config.no_rope_layers:
            raise ValueError(
                f"`no_rope_layers` marks NoPE layers, which `attention_type={self.name!r}` cannot have: its decoupled "
                f"rotary key carries all of its position, got {config.no_rope_layers!r}."
            )
        if config.partial_rotary_factor != 1.0:
            raise ValueError(
                f"`partial_rotary_factor` must be 1.0 with `attention_type={self.name!r}`: the rotated width is "
                f"`qk_rope_head_dim`, got `partial_rotary_factor`={config.partial_rotary_factor}."
            )

    def rope_head_dim(self, config, layer_type: str | None = None) -> int:
        return config.qk_rope_head_dim

    def default_head_dim(self, config) -> int | None:
        """d_c + d_R: MLA's heads have other widths (`qk_*_head_dim`, `v_head_dim`); `head_dim` is the one
        latent "head" each token caches, which is how vLLM sizes an MLA cache."""
        if config.kv_lora_rank is None or config.qk_rope_head_dim is None:
            return None  # `validate` names the missing field
        return config.kv_lora_rank + config.qk_rope_head_dim

    def backend_features(self, config) -> set[str]:
        needed = {"mla"}
        if config.attn_logit_softcapping is not None:
            needed.add("latent_softcap")
        if "sliding_attention" in config.layer_types:
            needed.add("latent_window")
        if config.head_dim != config.kv_lora_rank + config.qk_rope_head_dim:
            needed.add("latent_head_dim")
        if config.attention_sinks:
            needed.add("latent_sinks")
        return needed

    def cache_layer(self, config, layer_type: str, implementation: str, max_cache_len: int | None):
        return latent_layer(layer_type, implementation, config, max_cache_len)

    def parameters(self, config) -> int:
        """Query (direct or through its q_lora_rank bottleneck), the joint latent and rotary key,
        the per-head up-projection of the latent, the output."""
        d, h, bias = config.hidden_size, config.num_attention_heads, config.attention_bias
        qk = config.qk_nope_head_dim + config.qk_rope_head_dim
        if config.q_lora_rank:
            q = linear_parameters(d, config.q_lora_rank, bias) + norm_parameters(config, config.q_lora_rank)
            q += linear_parameters(config.q_lora_rank, h * qk, False)
        else:
            q = linear_parameters(d, h * qk, False)
        kv = linear_parameters(d, config.kv_lora_rank + config.qk_rope_head_dim, bias)
        kv += norm_parameters(config, config.kv_lora_rank) if config.kv_latent_norm else 0
        kv += linear_parameters(config.kv_lora_rank, h * (config.qk_nope_head_dim + config.v_head_dim), False)
        return q + kv + linear_parameters(h * config.v_head_dim, d, config.attention_output_bias) + sink_parameters(config)

    def bytes_per_token(self, config, element_bytes: int, quantization: str | None = None) -> int:
        """(d_c + d_R)·b: the latent and the shared rotary key."""
        if quantization is not None:
            raise ValueError(f"`quantization={quantization!r}` applies to per-head K/V, not to an MLA latent.")
        return (config.kv_lora_rank + config.qk_rope_head_dim) * element_bytes

    def tp_plan(self, config) -> dict[str, str]:
        """The tensor-parallel plan, transformers' DeepSeek-V2 one.

        The per-head projections (q, q_b, kv_b) column-parallel, o
        row-parallel, the joint latent projection by its own style; q_a and the latent norms replicated. With
        attention sinks, none: the per-head sinks are no module a style splits, so every rank holds the attention."""
        if config.attention_sinks:
            return {}
        plan = {"self_attn.q_proj": "colwise"} if config.q_lora_rank is None else {"self_attn.q_b_proj": "colwise"}
        plan.update({"self_attn.kv_a_proj_with_mqa": "mla_kv_a_proj", "self_attn.kv_b_proj": "colwise",
                     "self_attn.o_proj": "rowwise"})
        return plan


LATENT_ATTENTION = LatentKind()


def set_decode_mode(model: nn.Module, mode: str) -> None:
    """Set `decode_mode` on every MLA layer of `model` (`"auto"`, `"absorbed"` or `"expanded"`)."""
    if mode not in DECODE_MODES:
        raise ValueError(f"`decode_mode`={mode!r} is not one of {list(DECODE_MODES)}.")
    for module in model.modules():
        if isinstance(module, MultiHeadLatentAttention):
            module.decode_mode = mode


__all__ = ["LatentAttentionFields", "MultiHeadLatentAttention", "LATENT_ATTENTION", "mla_softmax_scale", "set_decode_mode", "DECODE_MODES",
           "ABSORBED_MAX_NEW_TOKENS", "ABSORBED_QUERY_BLOCK"]
