"""Standard multi-head attention: MHA, GQA and MQA are one integer (`num_key_value_heads`).

The score computation goes through transformers' attention interface, so `attn_implementation`
picks the backend; `eager_attention` below is the readable reference every backend is tested
against.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .backends import attention_function
from .layout import fused_projection, project
from .norms import build_norm
from .positions import apply_rotary


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, H_kv, T, D) -> (B, H_kv·n_rep, T, D), each K/V head serving n_rep query heads."""
    if n_rep == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, t, d).reshape(b, h * n_rep, t, d)


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
    """The reference: scores = softcap(q·kᵀ·scale) + bias + mask, softmax in fp32.

    query (B, H, T_q, D_qk), key (B, H_kv, T_k, D_qk), value (B, H_kv, T_k, D_v) -> (B, T_q, H, D_v).
    The order (scale, soft-cap, bias, mask) is Gemma 2's and FlexAttention's.
    """
    n_rep = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, n_rep), repeat_kv(value, n_rep)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling  # (B, H, T_q, T_k)
    # Without autograd the steps below reuse the scores tensor (same arithmetic, no new
    # B x H x T_q x T_k tensor per step); autograd needs each intermediate kept.
    fresh = not scores.requires_grad
    if softcap is not None:
        scores = scores.div_(softcap).tanh_().mul_(softcap) if fresh else softcap * torch.tanh(scores / softcap)
    if position_bias is not None:
        scores = scores.add_(position_bias) if fresh else scores + position_bias
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            fill = torch.finfo(scores.dtype).min
            scores = scores.masked_fill_(~attention_mask, fill) if fresh else scores.masked_fill(~attention_mask, fill)
        else:
            mask = attention_mask[:, :, :, : key.shape[-2]]
            scores = scores.add_(mask) if fresh else scores + mask
    probs = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = nn.functional.dropout(probs, p=dropout, training=module.training)
    out = torch.matmul(probs, value)  # (B, H, T_q, D_v)
    return out.transpose(1, 2).contiguous(), probs


class QKNorm(nn.Module):
    """Norms q and k, per head (`"head"`: over d_h, Qwen 3 / Gemma 3) or over the whole projection
    (`"full"`: over H·d_h, OLMo 2). Applied before the heads are split into (B, H, T, D)."""

    def __init__(self, config, per_head: bool):
        super().__init__()
        q_dim = config.head_dim if per_head else config.num_attention_heads * config.head_dim
        k_dim = config.head_dim if per_head else config.num_key_value_heads * config.head_dim
        self.per_head = per_head
        self.q_norm = build_norm(config, q_dim)
        self.k_norm = build_norm(config, k_dim)

    def forward(self, q: torch.Tensor, k: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.per_head:
            q = self.q_norm(q.unflatten(-1, (-1, head_dim))).flatten(-2)
            k = self.k_norm(k.unflatten(-1, (-1, head_dim))).flatten(-2)
            return q, k
        return self.q_norm(q), self.k_norm(k)


class StandardAttention(nn.Module):
    """q/k/v/o projections, optional QK-norm, RoPE or ALiBi, a cache, and a pluggable score backend."""

    # One matrix product for q, k and v once `layout.decode_layout` has fused their weights
    FUSED_PROJECTIONS = {"qkv": ("q_proj", "k_proj", "v_proj")}

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.layer_type = config.layer_types[layer_idx]
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.scaling = (config.query_pre_attn_scalar or config.head_dim) ** -0.5
        self.softcap = config.attn_logit_softcapping
        self.sliding_window = config.sliding_window if self.layer_type == "sliding_attention" else None
        self.is_causal = True
        self.interleaved = config.rope_interleaved
        d, hd = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(d, self.num_heads * hd, bias=config.attention_bias)
        self.k_proj = nn.Linear(d, self.num_key_value_heads * hd, bias=config.attention_bias)
        self.v_proj = nn.Linear(d, self.num_key_value_heads * hd, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * hd, d, bias=config.attention_output_bias)
        self.qk_norm = QKNorm(config, per_head=config.qk_norm == "head") if config.qk_norm != "none" else None

    def _project_qkv(self, hidden_states: torch.Tensor, position_embeddings) -> tuple[torch.Tensor, ...]:
        """q (B, H, T, D), k and v (B, H_kv, T, D), normed and rotated as configured."""
        batch, seq = hidden_states.shape[:2]
        fused = fused_projection(self, "qkv")
        if fused is not None and self.qk_norm is None:
            # q and k lie side by side in the fused output: view them as one tensor of heads and
            # rotate it in one pass (half the small ops of a decode step's RoPE)
            q_width, k_width, _ = fused.sizes
            qkv = fused.product(hidden_states)
            qk = qkv[..., : q_width + k_width].view(batch, seq, -1, self.head_dim).transpose(1, 2)
            v = qkv[..., q_width + k_width :].view(batch, seq, -1, self.head_dim).transpose(1, 2)
            if position_embeddings is not None:
                qk = apply_rotary(qk, *position_embeddings, self.interleaved)
            q, k = qk.split([self.num_heads, self.num_key_value_heads], dim=1)
            return q, k, v
        if fused is not None:
            q, k, v = fused(hidden_states)
        else:
            q, k, v = (project(layer, hidden_states) for layer in (self.q_proj, self.k_proj, self.v_proj))
        if self.qk_norm is not None:
            q, k = self.qk_norm(q, k, self.head_dim)
        q = q.view(batch, seq, -1, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = k.view(batch, seq, -1, self.head_dim).transpose(1, 2)  # (B, H_kv, T, D)
        v = v.view(batch, seq, -1, self.head_dim).transpose(1, 2)  # (B, H_kv, T, D)
        if position_embeddings is not None:
            cos, sin = position_embeddings
            q, k = apply_rotary(q, cos, sin, self.interleaved), apply_rotary(k, cos, sin, self.interleaved)
        return q, k, v

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        position_bias: torch.Tensor | None = None,
        cache=None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        batch, seq = hidden_states.shape[:2]
        q, k, v = self._project_qkv(hidden_states, position_embeddings)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)

        # ALiBi reaches flex / flash as `alibi_slopes` (see backends.py), the others as `position_bias`
        attention_interface: Callable = attention_function(
            self.config._attn_implementation, eager_attention, alibi_slopes="alibi_slopes" in kwargs
        )
        extra = {}
        if self.softcap is not None:
            extra["softcap"] = self.softcap
        if position_bias is not None:
            extra["position_bias"] = position_bias
        out, weights = attention_interface(
            self,
            q,
            k,
            v,
            attention_mask,
            dropout=self.config.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            sliding_window=self.sliding_window,
            **extra,
            **kwargs,
        )
        out = out.reshape(batch, seq, -1).contiguous()
        return project(self.o_proj, out), weights
