"""Multi-head latent attention (MLA, DeepSeek-V2 https://arxiv.org/abs/2405.04434).

Each position's hidden vector h is projected to a joint KV latent c = Norm(h W_DKV) of width d_c
(`kv_lora_rank`) and a shared rotary key k_R = RoPE(h W_KR) of width d_R (`qk_rope_head_dim`);
the cache stores only (c, k_R) (see `latent_cache.py`). Per head, content keys k_C = c W_UK and
values v = c W_UV (both inside `kv_b_proj`) are derived from the latent. Queries are projected
directly (`q_proj`) or through their own bottleneck (`q_a_proj` -> `q_a_layernorm` -> `q_b_proj`
when `q_lora_rank` is set); each head's query is [q_C (`qk_nope_head_dim`), q_R (d_R)].

Two ways to compute the same scores:

* expanded (prefill, training): k = [c W_UK, k_R], v = c W_UV for every cached token, then the
  attention interface (eager / sdpa / flash) as for any attention;
* absorbed (decode): q_C·k_Cᵀ = (q_C W_UKᵀ)·cᵀ, so the query is moved into latent space once and
  scored directly against the cached latents; the weighted sum of latents is mapped through W_UV
  afterwards. No per-head key or value is ever built for the cached tokens.

Module names follow DeepSeek's (`q_a_proj`, `kv_a_proj_with_mqa`, `kv_b_proj`, `o_proj`, ...), so
checkpoints convert by a near-identity map and PEFT targets read naturally.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .attention import eager_attention
from .layout import project
from .norms import build_norm
from .positions import apply_rotary

# "auto": absorbed when the queries are fewer than the keys they attend to (decoding against a
# cache), expanded otherwise; the other two force one path (tests, benchmarks).
DECODE_MODES = ("auto", "absorbed", "expanded")


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


class MultiHeadLatentAttention(nn.Module):
    """MLA with a latent cache; `decode_mode` (one of `DECODE_MODES`) picks absorbed or expanded scores."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.layer_type = config.layer_types[layer_idx]
        self.num_heads = config.num_attention_heads
        self.num_key_value_groups = 1  # keys are expanded per head on the expanded path
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.latent_dim = config.v_head_dim, config.kv_lora_rank
        self.qk_dim = self.nope_dim + self.rope_dim
        self.scaling = mla_softmax_scale(config, self.layer_type)
        self.softcap = config.attn_logit_softcapping
        self.sliding_window = config.sliding_window if self.layer_type == "sliding_attention" else None
        self.is_causal = True
        self.interleaved = config.rope_interleaved
        self.decode_mode = "auto"
        d, h, bias = config.hidden_size, self.num_heads, config.attention_bias
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(d, h * self.qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, config.q_lora_rank, bias=bias)
            self.q_a_layernorm = build_norm(config, config.q_lora_rank)
            self.q_b_proj = nn.Linear(config.q_lora_rank, h * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.latent_dim + self.rope_dim, bias=bias)
        self.kv_a_layernorm = build_norm(config, self.latent_dim)
        # No bias here: it is what makes W_UK / W_UV absorbable into the query / output.
        self.kv_b_proj = nn.Linear(self.latent_dim, h * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(h * self.v_dim, d, bias=config.attention_output_bias)

    def queries(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """(B, T, d) -> (B, H, T, d_qk)."""
        if self.config.q_lora_rank is None:
            q = project(self.q_proj, hidden_states)
        else:
            q = project(self.q_b_proj, self.q_a_layernorm(project(self.q_a_proj, hidden_states)))
        return q.unflatten(-1, (self.num_heads, self.qk_dim)).transpose(1, 2)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        position_bias: torch.Tensor | None = None,
        cache=None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        del position_bias  # config validation rules out ALiBi with MLA
        batch, seq = hidden_states.shape[:2]
        q_nope, q_rot = self.queries(hidden_states).split([self.nope_dim, self.rope_dim], dim=-1)
        latents, k_rot = project(self.kv_a_proj_with_mqa, hidden_states).split([self.latent_dim, self.rope_dim], dim=-1)
        latents = self.kv_a_layernorm(latents).unsqueeze(1)  # (B, 1, T, d_c)
        k_rot = k_rot.unsqueeze(1)  # (B, 1, T, d_R): one rotary key shared by all heads
        cos, sin = position_embeddings
        q_rot = apply_rotary(q_rot, cos, sin, self.interleaved)
        k_rot = apply_rotary(k_rot, cos, sin, self.interleaved)
        if cache is not None:
            latents, k_rot = cache.update(latents, k_rot, self.layer_idx)
        # The absorbed path masks scores itself, so it takes tensor masks only (flex's BlockMask
        # goes through the backend on the expanded path).
        if self._absorb(seq, latents.shape[-2]) and (attention_mask is None or torch.is_tensor(attention_mask)):
            out, weights = self.absorbed_attention(q_nope, q_rot, latents, k_rot, attention_mask)
        else:
            out, weights = self.expanded_attention(q_nope, q_rot, latents, k_rot, attention_mask, **kwargs)
        return project(self.o_proj, out.reshape(batch, seq, -1)), weights

    def _absorb(self, q_len: int, kv_len: int) -> bool:
        if self.decode_mode == "auto":
            return q_len < kv_len and not self.training
        return self.decode_mode == "absorbed"

    def expanded_attention(self, q_nope, q_rot, latents, k_rot, attention_mask, **kwargs):
        """Per-head keys and values for every cached token, then the configured attention backend."""
        batch, _, kv_len, _ = latents.shape
        kv = self.kv_b_proj(latents[:, 0]).unflatten(-1, (self.num_heads, -1)).transpose(1, 2)  # (B, H, S, d_n+d_v)
        k_nope, values = kv.split([self.nope_dim, self.v_dim], dim=-1)
        keys = torch.cat((k_nope, k_rot.expand(-1, self.num_heads, -1, -1)), dim=-1)  # (B, H, S, d_qk)
        queries = torch.cat((q_nope, q_rot), dim=-1)  # (B, H, T, d_qk)
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention
        )
        extra = {"softcap": self.softcap} if self.softcap is not None else {}
        # torch's CPU SDPA runs its flash kernel only when V is as wide as q/k, else the math path
        # (3x slower at 512 tokens, measured): pad V with zeros and crop the output instead.
        width = queries.shape[-1]
        pad = self.config._attn_implementation == "sdpa" and values.device.type == "cpu" and self.v_dim < width
        if pad:
            values = nn.functional.pad(values, [0, width - self.v_dim])
        out, weights = attention_interface(
            self,
            queries,
            keys,
            values,
            attention_mask,
            dropout=self.config.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            sliding_window=self.sliding_window,
            **extra,
            **kwargs,
        )
        return (out[..., : self.v_dim] if pad else out), weights

    def absorbed_attention(self, q_nope, q_rot, latents, k_rot, attention_mask):
        """Scores against the cached latents: W_UK folded into the query, W_UV applied after the sum.

        q_nope (B, H, T, d_n), q_rot (B, H, T, d_R), latents (B, 1, S, d_c), k_rot (B, 1, S, d_R)
        -> (B, T, H, d_v). The cost per step is one pass over the cache, with no re-expansion.
        """
        batch, heads, q_len, _ = q_nope.shape
        kv_len = latents.shape[-2]
        w_uk, w_uv = self.kv_b_proj.weight.view(heads, -1, self.latent_dim).split([self.nope_dim, self.v_dim], dim=1)
        q_latent = torch.einsum("bhtn,hnc->bhtc", q_nope, w_uk)  # (B, H, T, d_c)
        # Heads and query positions share one row axis, so each score is a plain (B, H·T, S) matmul
        # against the un-expanded cache (broadcasting a 1-head cache over H would copy it H times).
        cache_latents, cache_rot = latents[:, 0], k_rot[:, 0]  # (B, S, d_c), (B, S, d_R)
        scores = torch.baddbmm(
            q_rot.reshape(batch, heads * q_len, -1) @ cache_rot.transpose(1, 2),
            q_latent.reshape(batch, heads * q_len, -1),
            cache_latents.transpose(1, 2),
        ).view(batch, heads, q_len, kv_len) * self.scaling  # (B, H, T, S)
        if self.softcap is not None:
            scores = self.softcap * torch.tanh(scores / self.softcap)
        scores = _mask_scores(scores, attention_mask, self.sliding_window)
        probs = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(q_nope.dtype)
        probs = nn.functional.dropout(probs, p=self.config.attention_dropout, training=self.training)
        out_latent = probs.view(batch, heads * q_len, kv_len) @ cache_latents  # (B, H·T, d_c)
        out = torch.einsum("bhtc,hvc->bthv", out_latent.view(batch, heads, q_len, -1), w_uv)  # (B, T, H, d_v)
        return out, probs


def _mask_scores(scores: torch.Tensor, attention_mask: torch.Tensor | None, sliding_window: int | None = None):
    """Apply a boolean (keep) or additive 4-D mask, or the 2-D padding mask the flash backends get.

    `None` means what it means to sdpa, for which transformers skips building masks: one query
    sees every key; several are causal aligned at the first key (torch's `is_causal`), which is
    also right for a prefill into an empty static cache. A 2-D (B, S) padding mask carries no
    causal structure, so it is combined with the flash kernels' own rule: causal aligned at the
    bottom-right corner, and the window on sliding layers.
    """
    q_len, kv_len = scores.shape[-2:]
    if attention_mask is None:
        if q_len == 1:
            return scores
        keep = torch.ones(q_len, kv_len, dtype=torch.bool, device=scores.device).tril()
        return scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
    if attention_mask.dim() == 2:
        query = torch.arange(q_len, device=scores.device)[:, None] + (kv_len - q_len)
        key = torch.arange(kv_len, device=scores.device)[None, :]
        keep = key <= query
        if sliding_window is not None:
            keep = keep & (key > query - sliding_window)
        keep = keep[None, None] & attention_mask[:, None, None, -kv_len:].bool()  # (B, 1, T, S)
        return scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
    attention_mask = attention_mask[..., :kv_len]
    if attention_mask.dtype == torch.bool:
        return scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
    return scores + attention_mask


def set_decode_mode(model: nn.Module, mode: str) -> None:
    """Set `decode_mode` on every MLA layer of `model` (`"auto"`, `"absorbed"` or `"expanded"`)."""
    if mode not in DECODE_MODES:
        raise ValueError(f"`decode_mode`={mode!r} is not one of {list(DECODE_MODES)}.")
    for module in model.modules():
        if isinstance(module, MultiHeadLatentAttention):
            module.decode_mode = mode


__all__ = ["MultiHeadLatentAttention", "mla_softmax_scale", "set_decode_mode", "DECODE_MODES"]
