"""Gated DeltaNet: the linear-attention layer of Qwen3-Next and Qwen3.5.

Chosen per layer by `layer_types` (`"linear_attention"`) and `linear_attention_type="gated_deltanet"`
(`GATED_DELTANET`, its registry entry).

    x ── in_proj_qkv ── causal conv (K taps) ── act ──┬─ q, k (H_k heads of d_k), v (H_v heads of d_v)
     ├── in_proj_b ── σ ──────────────────────────────┤ β (write strength, per value head)
     ├── in_proj_a ── -exp(A_log)·softplus(a + dt_bias) ┤ g (log-decay, per value head)
     │                                        gated delta rule (delta_rule.py) ── o
     └── in_proj_z ──────────────────── norm(o) · silu(z), per head ── out_proj ──>

The convolution applies `hidden_act` (SiLU in both families), as transformers' classes do. Each q/k head serves
H_v / H_k consecutive value heads. The output norm is an RMSNorm over each value head with a plain weight (it
does not follow `norm_unit_offset`: Qwen's block norms are zero-centred, this one is not), gated by SiLU(z).

Parameters keep transformers' names for Qwen3.5 (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`, `conv1d`,
`dt_bias`, `A_log`, `norm`, `out_proj`): one projection per quantity, so PEFT targets read plainly. Qwen3-Next's
fused `in_proj_qkvz` / `in_proj_ba` (interleaved per key head) are the same rows in another order; conversion moves
them (`conversion/families/qwen3_next.py`), bit for bit both ways.

A multi-token step (prefill, chunked prefill, a prompt continuing a cache) runs the chunked rule; a one-token step
against a cached state runs the recurrent update. While the cache records for a rollback (drafting), the tokens a
crop may remove (a verification's, a prompt's last few) run through the recurrent update one by one and their states
are kept (`recurrent_cache.run_recurrence`). Padded positions of a 2-D `attention_mask` are zeroed before the
projections, so the convolution sees zeros there as it does before a sequence's first token, and get β = 0 and
g = 0, so they neither write nor decay the state (transformers' classes zero the input only, which keeps the state
at zero only where the convolution's activation maps 0 to 0, as SiLU does): a left-padded row computes what it
computes alone, whatever `hidden_act`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from .delta_rule import kernels_for
from .kinds import LinearAttentionKind, require_int
from .packed_documents import PackedDocuments
from .recurrent_cache import RecurrentLayer, run_recurrence
from .recurrent_mixer import RecurrentMixer


class GatedRMSNorm(nn.Module):
    """RMSNorm over the last dim (plain weight, computed in fp32 and cast back), then · SiLU(gate) in fp32, as
    transformers' `Qwen3NextRMSNormGated`."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * x32.to(dtype)
        return (out * F.silu(gate.float())).to(dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class GatedDeltaNet(RecurrentMixer):
    """A Gated DeltaNet layer (see the module docstring); `forward` returns `(output, None)` like an attention
    layer (it has no attention weights)."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_k_heads, self.num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel_size = config.linear_conv_kernel_dim
        self.activation_name = config.hidden_act
        self.activation = ACT2FN[config.hidden_act]
        d = config.hidden_size
        self.in_proj_qkv = nn.Linear(d, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(d, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(d, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(d, self.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.conv_kernel_size, groups=self.conv_dim,
                                padding=self.conv_kernel_size - 1, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads).uniform_(0.01, 16).log_())
        self.norm = GatedRMSNorm(self.head_v_dim, eps=config.norm_eps)
        self.out_proj = nn.Linear(self.value_dim, d, bias=False)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, cache=None,
                documents: PackedDocuments | None = None, **kwargs) -> tuple[torch.Tensor, None]:
        """`documents`: packed documents in the rows (`packed_documents.packed_documents`), each computed from an
        empty state; the cache then keeps the state each row's last document leaves."""
        if attention_mask is not None:  # the 2-D padding mask of the new tokens (`linear_attention_mask`)
            hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
        batch, seq = hidden_states.shape[:2]
        layer = self._state(cache)
        kernels = kernels_for(hidden_states.device)
        mixed = self.in_proj_qkv(hidden_states).transpose(1, 2)  # (B, C, T)
        if documents is None:
            qkv = self._convolve(mixed, layer, kernels).transpose(1, 2)
        else:
            qkv = self._convolve_documents(mixed, layer, kernels, documents).transpose(1, 2)
        query, key, value = qkv.split((self.key_dim, self.key_dim, self.value_dim), dim=-1)
        query = query.reshape(batch, seq, -1, self.head_k_dim)  # (B, T, H_k, d_k)
        key = key.reshape(batch, seq, -1, self.head_k_dim)  # (B, T, H_k, d_k)
        value = value.reshape(batch, seq, -1, self.head_v_dim)  # (B, T, H_v, d_v)
        beta = self.in_proj_b(hidden_states).sigmoid()  # (B, T, H_v)
        # fp32: in half precision -exp(A_log) could overflow to -inf
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(hidden_states).float() + self.dt_bias)
        if attention_mask is not None:  # a padded position neither writes (β = 0) nor decays (g = 0) the state
            beta, g = beta * attention_mask[:, :, None], g * attention_mask[:, :, None]
        out = self._delta_rule((query, key, value, g, beta), layer, kernels, documents)  # (B, T, H_v, d_v)
        z = self.in_proj_z(hidden_states).reshape(batch, seq, -1, self.head_v_dim)
        out = self.norm(out, z).reshape(batch, seq, -1)  # (B, T, H_v·d_v)
        return self.out_proj(out), None

    def _delta_rule(self, inputs: tuple, layer, kernels, documents: PackedDocuments | None) -> torch.Tensor:
        """The gated delta rule over (query, key, value, g, beta): recurrent for a one-token step on a cached state,
        chunked otherwise (`recurrent_cache.run_recurrence`, which also records the states a crop may restore), or
        document by document; the cache keeps the new state."""
        if documents is None:  # (B, T, H_v, d_v); the state (B, H_v, d_k, d_v) and, while recording, per token
            return run_recurrence(layer, kernels.chunked, kernels.recurrent, inputs)
        # the rows end to end as one row of documents; each row's last document's state is its state
        batch, seq = inputs[0].shape[:2]
        flat = (x.reshape(1, batch * seq, *x.shape[2:]) for x in inputs)
        out, states = kernels.chunked_documents(*flat, documents)  # (1, B·T, H_v, d_v), (N, H_v, d_k, d_v)
        if layer is not None:
            layer.update_recurrent_state(states[documents.last])
        return out.reshape(batch, seq, *out.shape[2:])


class GatedDeltaNetKind(LinearAttentionKind):
    """`linear_attention_type="gated_deltanet"`: Qwen3-Next's / Qwen3.5's Gated DeltaNet."""

    name = "gated_deltanet"
    module = GatedDeltaNet
    fields = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
              "linear_conv_kernel_dim")

    def complete(self, config) -> None:
        """Defaults where a config with linear layers leaves them unset: H key and value heads of d_h, 4 taps."""
        if not self.in_use(config):
            return
        defaults = {"linear_num_key_heads": config.num_attention_heads,
                    "linear_num_value_heads": config.num_attention_heads,
                    "linear_key_head_dim": config.head_dim, "linear_value_head_dim": config.head_dim,
                    "linear_conv_kernel_dim": 4}
        for name, value in defaults.items():
            if getattr(config, name) is None:
                setattr(config, name, value)

    def validate(self, config) -> None:
        super().validate(config)
        if not self.in_use(config):
            return
        for name in self.fields:
            require_int(name, getattr(config, name), minimum=1)
        if config.linear_num_value_heads % config.linear_num_key_heads:
            raise ValueError(
                f"`linear_num_value_heads`={config.linear_num_value_heads} must be a multiple of "
                f"`linear_num_key_heads`={config.linear_num_key_heads} (each key head serves a group of value heads)."
            )

    def cache_layer(self, config, implementation: str, max_cache_len: int | None):
        """One fixed-size state per sequence, the same in every cache implementation (it never grows)."""
        return RecurrentLayer()

    def parameters(self, config) -> int:
        """d·(2·H_k·d_k + H_v·d_v) (q, k, v) + d·H_v·d_v (z) + 2·d·H_v (b, a) + K·(2·H_k·d_k + H_v·d_v) (conv)
        + 2·H_v (dt_bias, A_log) + d_v (norm) + H_v·d_v·d (out)."""
        d, hv, dv = config.hidden_size, config.linear_num_value_heads, config.linear_value_head_dim
        conv = 2 * config.linear_num_key_heads * config.linear_key_head_dim + hv * dv
        return d * conv + d * hv * dv + 2 * d * hv + config.linear_conv_kernel_dim * conv + 2 * hv + dv + hv * dv * d

    def state_bytes(self, config, element_bytes: int) -> int:
        """Per sequence: the conv window K·(2·H_k·d_k + H_v·d_v)·b plus the fp32 recurrent state 4·H_v·d_k·d_v."""
        conv = 2 * config.linear_num_key_heads * config.linear_key_head_dim
        conv += config.linear_num_value_heads * config.linear_value_head_dim
        recurrent = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
        return config.linear_conv_kernel_dim * conv * element_bytes + 4 * recurrent

    def describe(self, config) -> str:
        return "gdn"

    def tp_plan(self, config) -> dict[str, str]:
        """transformers' Qwen3.5 plan: the projections gather their outputs, so the convolution, the rule and the
        norm (replicated) see every head."""
        names = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
        return {f"linear_attn.{name}": "colwise_gather_output" for name in names}


GATED_DELTANET = GatedDeltaNetKind()


__all__ = ["GatedDeltaNet", "GatedRMSNorm", "GATED_DELTANET"]
