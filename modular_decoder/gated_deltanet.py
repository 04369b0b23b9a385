"""Gated DeltaNet: the linear-attention layer of Qwen3-Next, Qwen3.5 (and Qwen3.5-MoE) and OLMo hybrid.

Chosen per layer by `layer_types` (`"linear_attention"`) and `linear_attention_type="gated_deltanet"`
(`GATED_DELTANET`, its registry entry).

    x ── in_proj_qkv ── causal conv (K taps) ── act ──┬─ q, k (H_k heads of d_k), v (H_v heads of d_v)
     ├── in_proj_b ── σ (·2 with linear_allow_neg_eigval) ┤ β (write strength, per value head)
     ├── in_proj_a ── -exp(A_log)·softplus(a + dt_bias) ┤ g (log-decay, per value head)
     │                                        gated delta rule (delta_rule.py) ── o
     └── in_proj_z ──────────────────── norm(o) · silu(z), per head ── out_proj ──>

The convolution applies `hidden_act` (SiLU in every family), as transformers' classes do. Each q/k head serves
H_v / H_k consecutive value heads. The output norm is an RMSNorm over each value head with a plain weight (it
does not follow `norm_unit_offset`: Qwen's block norms are zero-centred, this one is not), gated by SiLU(z), with
epsilon `linear_norm_eps` (OLMo hybrid's is fla's 1e-5 beside block norms of 1e-6). With `linear_allow_neg_eigval`
β lies in (0, 2) (OLMo hybrid; "Unlocking State-Tracking in Linear RNNs Through Negative Eigenvalues",
arXiv 2411.12537): the transition I - β·k·kᵀ may then have a negative eigenvalue.

Parameters keep transformers' names for Qwen3.5 (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`, `conv1d`,
`dt_bias`, `A_log`, `norm`, `out_proj`): one projection per quantity, so PEFT targets read plainly. Qwen3-Next's
fused `in_proj_qkvz` / `in_proj_ba` (interleaved per key head) and OLMo hybrid's separate `q_proj` / `k_proj` /
`v_proj` (and its three convolutions) are the same rows in another order; conversion moves them
(`conversion/families/`), bit for bit both ways.

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

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from .delta_rule import kernels_for
from .kinds import LinearAttentionKind, require_bool, require_int, require_number
from .packed_documents import PackedDocuments
from .recurrent_cache import RecurrentLayer, upcast
from .recurrent_mixer import RecurrentMixer


@dataclass(kw_only=True)
class GatedDeltaNetFields:
    r"""The delta-rule layers' options (Gated DeltaNet and KDA).

    Args:
        linear_allow_neg_eigval (`bool`): β = 2·σ(b) instead of σ(b): the state transition I - β·k·kᵀ may have a
            negative eigenvalue (transformers' OLMo hybrid name; arXiv 2411.12537).
        linear_norm_eps (`float`, *optional*): Epsilon of the gated RMSNorm on each value head's output. Defaults to
            `norm_eps` (Qwen's; OLMo hybrid's is 1e-5, fla's default, beside block norms of 1e-6).
    """

    linear_allow_neg_eigval: bool = False
    linear_norm_eps: float | None = None


class GatedRMSNorm(nn.Module):
    """RMSNorm over the last dim (plain weight, computed in fp32 and cast back), then · act(gate) in fp32: SiLU as
    transformers' `Qwen3NextRMSNormGated`, sigmoid as its `KimiLinearRMSNormGated`."""

    def __init__(self, dim: int, eps: float = 1e-6, activation: str = "silu"):
        super().__init__()
        self.eps = eps
        self.activation = activation
        self.gate = F.silu if activation == "silu" else torch.sigmoid
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = upcast(x)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * x32.to(dtype)
        return (out * self.gate(upcast(gate))).to(dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, activation={self.activation}"


def output_norm_eps(config) -> float:
    return config.linear_norm_eps if config.linear_norm_eps is not None else config.norm_eps


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
        self.activation_name, self.activation = config.hidden_act, ACT2FN[config.hidden_act]
        self.beta_scale = 2.0 if config.linear_allow_neg_eigval else 1.0
        d = config.hidden_size
        self.in_proj_qkv = nn.Linear(d, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(d, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(d, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(d, self.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.conv_kernel_size, groups=self.conv_dim,
                                padding=self.conv_kernel_size - 1, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads).uniform_(0.01, 16).log_())
        self.norm = GatedRMSNorm(self.head_v_dim, eps=output_norm_eps(config))
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
        qkv = self._convolve_any(self.in_proj_qkv(hidden_states).transpose(1, 2), layer, kernels, documents)
        query, key, value = qkv.transpose(1, 2).split((self.key_dim, self.key_dim, self.value_dim), dim=-1)
        query = query.reshape(batch, seq, -1, self.head_k_dim)  # (B, T, H_k, d_k)
        key = key.reshape(batch, seq, -1, self.head_k_dim)  # (B, T, H_k, d_k)
        value = value.reshape(batch, seq, -1, self.head_v_dim)  # (B, T, H_v, d_v)
        beta = self.in_proj_b(hidden_states).sigmoid() * self.beta_scale  # (B, T, H_v)
        # fp32: in half precision -exp(A_log) could overflow to -inf
        g = -upcast(self.A_log).exp() * F.softplus(upcast(self.in_proj_a(hidden_states)) + self.dt_bias)
        if attention_mask is not None:  # a padded position neither writes (β = 0) nor decays (g = 0) the state
            beta, g = beta * attention_mask[:, :, None], g * attention_mask[:, :, None]
        out = self._delta_rule((query, key, value, g, beta), layer, kernels, documents)  # (B, T, H_v, d_v)
        z = self.in_proj_z(hidden_states).reshape(batch, seq, -1, self.head_v_dim)
        out = self.norm(out, z).reshape(batch, seq, -1)  # (B, T, H_v·d_v)
        return self.out_proj(out), None

    def init_scan_parameters(self, init) -> None:
        """As transformers' Qwen3-Next: dt_bias 1, A ~ U(0.01, 16)."""
        init.ones_(self.dt_bias)
        init.copy_(self.A_log, torch.empty_like(self.A_log).uniform_(0.01, 16).log_())


class GatedDeltaNetKind(LinearAttentionKind):
    """`linear_attention_type="gated_deltanet"`: the Gated DeltaNet of Qwen3-Next, Qwen3.5 and OLMo hybrid."""

    name = "gated_deltanet"
    module = GatedDeltaNet
    sizes = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
             "linear_conv_kernel_dim")
    fields = (*sizes, "linear_allow_neg_eigval", "linear_norm_eps")

    def complete(self, config) -> None:
        """Defaults where a config with linear layers leaves them unset: H key and value heads of d_h, 4 taps."""
        if not self.in_use(config):
            return
        defaults = {"linear_num_key_heads": config.num_attention_heads,
                    "linear_num_value_heads": config.num_attention_heads,
                    "linear_key_head_dim": config.head_dim, "linear_value_head_dim": config.head_dim,
                    "linear_conv_kernel_dim": 4}
        for name, value in defaults.items():  # (`linear_norm_eps` stays None: `norm_eps`)
            if getattr(config, name) is None:
                setattr(config, name, value)

    def validate(self, config) -> None:
        super().validate(config)
        if not self.in_use(config):
            return
        for name in self.sizes:
            require_int(name, getattr(config, name), minimum=1)
        require_bool("linear_allow_neg_eigval", config.linear_allow_neg_eigval)
        require_number("linear_norm_eps", config.linear_norm_eps, above=0, optional=True)
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


__all__ = ["GatedDeltaNet", "GatedDeltaNetFields", "GatedDeltaNetKind", "GatedRMSNorm", "GATED_DELTANET",
           "output_norm_eps"]
