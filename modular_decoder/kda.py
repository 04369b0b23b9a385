"""Kimi Delta Attention (KDA): Kimi Linear's linear-attention layer, chosen per layer by `layer_types`
(`"linear_attention"`) and `linear_attention_type="kda"` (`KDA`, its registry entry).

    x ─┬ q_proj, k_proj, v_proj ── one causal conv over the three (K taps) ── SiLU ── q, k (H x d_k), v (H x d_v)
       ├ f_a_proj ── f_b_proj ── -exp(A_log)·softplus(· + dt_bias) ──────── g: a log-decay per key channel
       ├ b_proj ── σ (·2 with linear_allow_neg_eigval) ──────────────────── β, per head
       │                                         KDA rule (kda_rule.py) ── o
       └ g_a_proj ── g_b_proj ─────────────── o_norm(o) · σ(gate), per head ── o_proj ──>

Gated DeltaNet with a decay for each key channel, from a low-rank gate (`f_a_proj` to d_v, `f_b_proj` to H·d_k),
and an output gated by a sigmoid (Gated DeltaNet's is SiLU). The three short convolutions of q, k and v are one
depthwise convolution over their concatenated channels, as transformers' `KimiLinearDeltaAttention` holds them (the
released files keep them apart: conversion stacks them), so the cache keeps one window of 2·H·d_k + H·d_v channels.
The low-rank width is d_v (fla's `KimiDeltaAttention`; Kimi Linear's heads have d_k = d_v). Its heads are the
fields Gated DeltaNet reads (`linear_num_key_heads` = `linear_num_value_heads` = H, `linear_key_head_dim`,
`linear_value_head_dim`), with its options `linear_allow_neg_eigval` and `linear_norm_eps` (gated_deltanet.py).

Padded positions of a 2-D `attention_mask` are zeroed before the projections and get β = 0 and g = 0, so they
neither write nor decay the state (transformers' class zeroes the input only: its padded positions still decay the
state, which a left-padded row has not yet written, so left padding is exact there as here).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from .gated_deltanet import GatedDeltaNetKind, GatedRMSNorm, output_norm_eps
from .kda_rule import kda_kernels_for
from .packed_documents import PackedDocuments
from .recurrent_cache import RecurrentLayer, upcast
from .recurrent_mixer import RecurrentMixer

# fla's initialisation of the decay (transformers' Kimi Linear follows it): A ~ U(1, 16), dt ~ logU(1e-3, 1e-1)
A_RANGE, DT_RANGE, DT_FLOOR = (1.0, 16.0), (1e-3, 1e-1), 1e-4


class KimiDeltaAttention(RecurrentMixer):
    """A KDA layer (see the module docstring); `forward` returns `(output, None)` like an attention layer."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_dim, self.value_dim = self.num_heads * self.head_k_dim, self.num_heads * self.head_v_dim
        self.activation_name, self.activation = config.hidden_act, ACT2FN[config.hidden_act]
        self.beta_scale = 2.0 if config.linear_allow_neg_eigval else 1.0
        d, kernel_size, conv_dim = config.hidden_size, config.linear_conv_kernel_dim, 2 * self.key_dim + self.value_dim
        self.conv_kernel_size = kernel_size
        self.q_proj = nn.Linear(d, self.key_dim, bias=False)
        self.k_proj = nn.Linear(d, self.key_dim, bias=False)
        self.v_proj = nn.Linear(d, self.value_dim, bias=False)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, kernel_size, groups=conv_dim, padding=kernel_size - 1, bias=False)
        self.f_a_proj = nn.Linear(d, self.head_v_dim, bias=False)
        self.f_b_proj = nn.Linear(self.head_v_dim, self.key_dim, bias=False)
        self.A_log = nn.Parameter(torch.empty(self.num_heads).uniform_(*A_RANGE).log_())
        self.dt_bias = nn.Parameter(torch.zeros(self.key_dim))
        self.b_proj = nn.Linear(d, self.num_heads, bias=False)
        self.g_a_proj = nn.Linear(d, self.head_v_dim, bias=False)
        self.g_b_proj = nn.Linear(self.head_v_dim, self.value_dim, bias=False)
        self.o_norm = GatedRMSNorm(self.head_v_dim, eps=output_norm_eps(config), activation="sigmoid")
        self.o_proj = nn.Linear(self.value_dim, d, bias=False)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, cache=None,
                documents: PackedDocuments | None = None, **kwargs) -> tuple[torch.Tensor, None]:
        """`attention_mask`: the 2-D padding mask of the new tokens; `documents`: packed documents in the rows, each
        computed from an empty state (the cache then keeps each row's last document's)."""
        if attention_mask is not None:
            hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
        batch, seq = hidden_states.shape[:2]
        layer, kernels = self._state(cache), kda_kernels_for(hidden_states.device)
        mixed = torch.cat([self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)], dim=-1)
        qkv = self._convolve_any(mixed.transpose(1, 2), layer, kernels, documents).transpose(1, 2)
        query, key, value = qkv.split((self.key_dim, self.key_dim, self.value_dim), dim=-1)
        query, key = (x.reshape(batch, seq, -1, self.head_k_dim) for x in (query, key))  # (B, T, H, d_k)
        value = value.reshape(batch, seq, -1, self.head_v_dim)  # (B, T, H, d_v)
        gate = upcast(self.f_b_proj(self.f_a_proj(hidden_states))) + upcast(self.dt_bias)
        # fp32: the decay of each key channel, -exp(A_log)·softplus(f + dt_bias)
        g = -upcast(self.A_log).exp()[:, None] * F.softplus(gate.reshape(batch, seq, -1, self.head_k_dim))
        beta = self.b_proj(hidden_states).sigmoid() * self.beta_scale  # (B, T, H)
        if attention_mask is not None:  # a padded position neither writes (β = 0) nor decays (g = 0) the state
            beta, g = beta * attention_mask[:, :, None], g * attention_mask[:, :, None, None]
        out = self._delta_rule((query, key, value, g, beta), layer, kernels, documents)  # (B, T, H, d_v)
        output_gate = self.g_b_proj(self.g_a_proj(hidden_states)).reshape(batch, seq, -1, self.head_v_dim)
        return self.o_proj(self.o_norm(out, output_gate).reshape(batch, seq, -1)), None

    def init_scan_parameters(self, init) -> None:
        """fla's (and transformers' Kimi Linear's): A ~ U(1, 16); dt_bias the inverse softplus of dt, dt log-uniform
        in [1e-3, 1e-1] and at least 1e-4."""
        init.copy_(self.A_log, torch.empty_like(self.A_log).uniform_(*A_RANGE).log_())
        low, high = (math.log(x) for x in DT_RANGE)
        dt = torch.empty_like(self.dt_bias).uniform_(low, high).exp().clamp_min(DT_FLOOR)
        init.copy_(self.dt_bias, dt + torch.log(-torch.expm1(-dt)))


class KdaKind(GatedDeltaNetKind):
    """`linear_attention_type="kda"`: Kimi Linear's Kimi Delta Attention (Gated DeltaNet's fields and options, one
    value head per key head)."""

    name = "kda"
    module = KimiDeltaAttention

    def validate(self, config) -> None:
        super().validate(config)
        if self.in_use(config) and config.linear_num_value_heads != config.linear_num_key_heads:
            raise ValueError(
                f"`linear_num_value_heads`={config.linear_num_value_heads} must equal `linear_num_key_heads`="
                f"{config.linear_num_key_heads} with `linear_attention_type='kda'` (a decay per key channel of each "
                "head: one value head per key head)."
            )

    def cache_layer(self, config, implementation: str, max_cache_len: int | None):
        """One window over the three convolutions' channels and one fp32 state per sequence."""
        return RecurrentLayer()

    def parameters(self, config) -> int:
        """d·(2·H·d_k + H·d_v) (q, k, v) + K·(2·H·d_k + H·d_v) (conv) + d·d_v + d_v·H·d_k (f) + H + H·d_k (A_log,
        dt_bias) + d·H (b) + d·d_v + d_v·H·d_v (g) + d_v (o_norm) + H·d_v·d (o)."""
        d, h = config.hidden_size, config.linear_num_value_heads
        d_k, d_v = config.linear_key_head_dim, config.linear_value_head_dim
        conv = 2 * h * d_k + h * d_v
        return (d * conv + config.linear_conv_kernel_dim * conv + d * d_v + d_v * h * d_k + h + h * d_k + d * h
                + d * d_v + d_v * h * d_v + d_v + h * d_v * d)

    def describe(self, config) -> str:
        return "kda"

    def tp_plan(self, config) -> dict[str, str]:
        """As Gated DeltaNet's: the projections gather their outputs, so the convolution, the rule and the norm
        (replicated) see every head."""
        names = ("q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj", "b_proj", "g_a_proj", "g_b_proj", "o_proj")
        return {f"linear_attn.{name}": "colwise_gather_output" for name in names}


KDA = KdaKind()


__all__ = ["KimiDeltaAttention", "KDA"]
