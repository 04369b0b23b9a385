"""Mamba-2: the state-space mixer of Bamba, Granite 4.0-H, Nemotron-H and Falcon-H1, chosen per layer by
`layer_types` (`"linear_attention"`) and `linear_attention_type="mamba2"` (`MAMBA2`, its registry entry).

    x ── in_proj ─┬─ z ────────────────────────────────────────────────────┐
                  ├─ x B C ── causal conv (K taps, `mamba_hidden_act`) ─┬─ x (H heads of P), B, C (G groups of N)
                  └─ dt ── softplus(dt + dt_bias), clamped ─────────────┤ A = -exp(A_log) per head
                                              selective scan (mamba2_scan.py) ── y = C·S + D·x
                                              norm(y · silu(z)), per group ── out_proj ──>

Each group's B and C serve H / G consecutive heads; the gated RMSNorm normalises each group's H·P / G channels
(`mamba_norm_before_gate` puts the norm before the gate instead, as Falcon-H1 may; `mamba_rms_norm=False` leaves
y · silu(z) unnormalised). Parameters keep the names of transformers' mixers (`in_proj`, `conv1d`, `dt_bias`, `A_log`,
`D`, `norm`, `out_proj`; the module sits at `linear_attn`, where transformers' classes say `mamba` or `mixer`).

A multi-token step runs the chunked scan, a one-token step against a cached state the recurrent update. The step
size is clamped to `time_step_limit` in both (mamba_ssm's and transformers' decode steps do not clamp, their
prefill does: with a limit set, the cached path then differs from the uncached forward; here it does not).
Padded positions of a 2-D `attention_mask` get zeros into the convolution (what a lone sequence's convolution sees
before its first token, whatever biases the projection has) and dt = 0, so they neither write nor decay the state:
a left-padded row computes what it computes alone.

Falcon-H1's μP multipliers are explicit: `ssm_in_multiplier` scales the mixer's input, `ssm_multipliers` the five
parts of `in_proj`'s output (z, x, B, C, dt), `ssm_out_multiplier` its output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from .kinds import LinearAttentionKind, require_bool, require_choice, require_int, require_number
from .mamba2_scan import CHUNK_SIZE, kernels_for
from .packed_documents import PackedDocuments
from .recurrent_cache import RecurrentLayer, run_recurrence, upcast
from .recurrent_mixer import RecurrentMixer

# The parts of `in_proj`'s output `ssm_multipliers` scales, in order
PROJECTION_PARTS = ("z", "x", "B", "C", "dt")


@dataclass(kw_only=True)
class Mamba2Fields:
    r"""The fields of `linear_attention_type="mamba2"` (transformers' names, from its Bamba, Granite 4.0-H and
    Falcon-H1 configs). They apply only where some layer is a linear-attention layer; elsewhere they keep their
    defaults.

    Args:
        mamba_n_heads (`int`, *optional*): Heads H of the scan. Defaults to 2·d / 64 (Mamba-2's 64-wide heads at
            `expand` 2).
        mamba_d_head (`int`, *optional*): Head width P; the mixer's inner width is H·P (transformers' `mamba_expand`
            · d, or Falcon-H1's `mamba_d_ssm`). Defaults to 2·d / H.
        mamba_n_groups (`int`): Groups G of B and C, each shared by H / G consecutive heads; the gated norm
            normalises each group's H·P / G channels. Must divide H.
        mamba_d_state (`int`): State width N per channel (B and C are N wide per group).
        mamba_d_conv (`int`): Taps K of the causal convolution over x, B and C.
        mamba_chunk_size (`int`): Tokens per chunk of the chunked scan (what it computes does not depend on it,
            within rounding).
        mamba_conv_bias (`bool`): A bias on the convolution.
        mamba_proj_bias (`bool`): Biases on `in_proj` and `out_proj`.
        time_step_limit (`list[float]`, *optional*): [min, max] the step size dt is clamped to after the softplus,
            in prefill and decode alike. `None`: (0, ∞), no clamp.
        mamba_hidden_act (`str`): The activation after the convolution (transformers' `ACT2FN` key; Nemotron-H's
            field; Bamba, Granite and Falcon-H1 use their `hidden_act`).
        mamba_rms_norm (`bool`): A gated RMSNorm before `out_proj` (its weight `norm.weight`); `False`:
            y · silu(z) goes to `out_proj` unnormalised (Falcon-H1's `mamba_rms_norm`).
        mamba_norm_before_gate (`bool`): norm(y) · silu(z) instead of norm(y · silu(z)) (Falcon-H1's field; the
            others gate first). Only with `mamba_rms_norm`.
        ssm_in_multiplier (`float`): The mixer's input is multiplied by this (Falcon-H1's μP).
        ssm_multipliers (`list[float]`, *optional*): Five factors for the parts of `in_proj`'s output: z, x, B, C
            and dt (Falcon-H1's μP). `None`: all 1.
        ssm_out_multiplier (`float`): The mixer's output is multiplied by this (Falcon-H1's μP).
    """

    mamba_n_heads: int | None = None
    mamba_d_head: int | None = None
    mamba_n_groups: int = 1
    mamba_d_state: int = 128
    mamba_d_conv: int = 4
    mamba_chunk_size: int = CHUNK_SIZE
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    time_step_limit: list[float] | None = None
    mamba_hidden_act: str = "silu"
    mamba_rms_norm: bool = True
    mamba_norm_before_gate: bool = False
    ssm_in_multiplier: float = 1.0
    ssm_multipliers: list[float] | None = None
    ssm_out_multiplier: float = 1.0


MAMBA2_FIELDS = tuple(Mamba2Fields.__dataclass_fields__)


class GroupedGatedRMSNorm(nn.Module):
    """RMSNorm over each of `groups` equal parts of the last dim, gated by SiLU(gate), in fp32 and cast back to the
    gate's dtype: norm(x · silu(z)) · w, or with `norm_before_gate` norm(x) · w · silu(z) (mamba_ssm's
    `RMSNormGated`, transformers' `BambaRMSNormGated` / `FalconH1RMSNormGated`)."""

    def __init__(self, dim: int, groups: int, eps: float = 1e-6, norm_before_gate: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.groups, self.eps, self.norm_before_gate = groups, eps, norm_before_gate

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        gate32 = F.silu(upcast(gate))
        x32 = upcast(x) if self.norm_before_gate else upcast(x) * gate32
        grouped = x32.unflatten(-1, (self.groups, -1))
        x32 = (grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        out = upcast(self.weight) * x32
        return (out * gate32 if self.norm_before_gate else out).to(gate.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, groups={self.groups}, eps={self.eps}"


class Mamba2(RecurrentMixer):
    """A Mamba-2 layer (see the module docstring); `forward` returns `(output, None)` like an attention layer."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.head_dim = config.mamba_n_heads, config.mamba_d_head
        self.n_groups, self.state_size = config.mamba_n_groups, config.mamba_d_state
        self.inner = self.num_heads * self.head_dim
        self.conv_dim = self.inner + 2 * self.n_groups * self.state_size
        self.conv_kernel_size = config.mamba_d_conv
        self.chunk_size = config.mamba_chunk_size
        self.activation_name = config.mamba_hidden_act
        self.activation = ACT2FN[config.mamba_hidden_act]
        self.time_step_limit = tuple(config.time_step_limit or (0.0, math.inf))
        self.in_multiplier, self.out_multiplier = config.ssm_in_multiplier, config.ssm_out_multiplier
        self.part_multipliers = tuple(config.ssm_multipliers or (1.0,) * len(PROJECTION_PARTS))
        d, heads = config.hidden_size, self.num_heads
        self.in_proj = nn.Linear(d, self.inner + self.conv_dim + heads, bias=config.mamba_proj_bias)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.conv_kernel_size, groups=self.conv_dim,
                                padding=self.conv_kernel_size - 1, bias=config.mamba_conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(heads))
        self.A_log = nn.Parameter(torch.empty(heads))
        self.D = nn.Parameter(torch.empty(heads))
        self.norm = (GroupedGatedRMSNorm(self.inner, self.n_groups, config.norm_eps, config.mamba_norm_before_gate)
                     if config.mamba_rms_norm else None)
        self.out_proj = nn.Linear(self.inner, d, bias=config.mamba_proj_bias)
        self.init_scan_parameters()

    @torch.no_grad()
    def init_scan_parameters(self, init=None) -> None:
        """Mamba-2's own initialisation (mamba_ssm's `Mamba2`): A ~ U(1, 16), D = 1, and dt_bias the inverse
        softplus of a step log-uniform in [0.001, 0.1] (at least 1e-4). `init`: `transformers.initialization`, whose
        helpers leave tensors loaded from a checkpoint alone; plain tensor writes without it."""
        if self.A_log.is_meta:
            return
        steps = torch.exp(torch.rand(self.num_heads) * (math.log(0.1) - math.log(0.001)) + math.log(0.001))
        steps = steps.clamp(min=1e-4)
        values = {"A_log": torch.empty(self.num_heads).uniform_(1, 16).log(), "D": torch.ones(self.num_heads),
                  "dt_bias": steps + torch.log(-torch.expm1(-steps))}
        for name, value in values.items():
            param = getattr(self, name)
            (init.copy_ if init is not None else torch.Tensor.copy_)(param, value.to(param.dtype))

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, cache=None,
                documents: PackedDocuments | None = None, **kwargs) -> tuple[torch.Tensor, None]:
        """`attention_mask`: the 2-D padding mask of the new tokens (`linear_attention_mask`). `documents`: packed
        documents in the rows (`packed_documents.packed_documents`), each computed from an empty state; the cache
        then keeps the state each row's last document leaves."""
        batch, seq, _ = hidden_states.shape
        dtype = hidden_states.dtype
        layer = self._state(cache)
        kernels = kernels_for(hidden_states.device)
        if self.in_multiplier != 1.0:
            hidden_states = hidden_states * self.in_multiplier
        z, xbc, dt = self._projections(hidden_states)
        if attention_mask is not None:  # padding: zeros into the convolution, as before a lone sequence's start
            xbc = xbc * attention_mask[:, :, None].to(xbc.dtype)
        xbc = xbc.transpose(1, 2)  # (B, C, T)
        if documents is None:
            xbc = self._convolve(xbc, layer, kernels)
        else:
            xbc = self._convolve_documents(xbc, layer, kernels, documents)
        x, B, C = xbc.transpose(1, 2).split((self.inner, self.n_groups * self.state_size,
                                             self.n_groups * self.state_size), dim=-1)
        dt = F.softplus(upcast(dt) + upcast(self.dt_bias)).clamp(*self.time_step_limit)  # (B, T, H)
        if attention_mask is not None:  # a padded position neither decays nor writes the state
            dt = dt * attention_mask[:, :, None]
        inputs = (x.reshape(batch, seq, self.num_heads, self.head_dim), dt,
                  B.reshape(batch, seq, self.n_groups, self.state_size),
                  C.reshape(batch, seq, self.n_groups, self.state_size))
        y = self._scan(inputs, layer, kernels, documents).reshape(batch, seq, self.inner)  # fp32
        y = self.norm(y, z) if self.norm is not None else (y * F.silu(upcast(z))).to(dtype)
        out = self.out_proj(y.to(dtype))
        return (out * self.out_multiplier if self.out_multiplier != 1.0 else out), None

    def _projections(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`in_proj` split into z (B, T, H·P), the convolution's input x B C (B, T, H·P + 2·G·N) and dt (B, T, H),
        each part scaled by its `ssm_multipliers` factor."""
        projected = self.in_proj(hidden_states)
        if any(m != 1.0 for m in self.part_multipliers):
            widths = (self.inner, self.inner, self.n_groups * self.state_size, self.n_groups * self.state_size,
                      self.num_heads)
            parts = projected.split(widths, dim=-1)
            projected = torch.cat([p * m if m != 1.0 else p for p, m in zip(parts, self.part_multipliers)], dim=-1)
        return projected.split((self.inner, self.conv_dim, self.num_heads), dim=-1)

    def _scan(self, inputs: tuple, layer, kernels, documents: PackedDocuments | None) -> torch.Tensor:
        """The scan over (x, dt, B, C): recurrent for a one-token step on a cached state, chunked otherwise
        (`recurrent_cache.run_recurrence`, which also records the states a crop may restore), or document by document;
        the cache keeps the new state. Returns y (B, T, H, P) in fp32."""
        A = -torch.exp(upcast(self.A_log))
        if documents is None:
            def chunked(x, dt, B, C, state):
                return kernels.chunked(x, dt, A, B, C, self.D, state, chunk_size=self.chunk_size)

            def recurrent(x, dt, B, C, state):
                return kernels.recurrent(x, dt, A, B, C, self.D, state)

            return run_recurrence(layer, chunked, recurrent, inputs)
        # the rows end to end as one row of documents; each row's last document's state is its state
        batch, seq = inputs[0].shape[:2]
        x, dt, B, C = (t.reshape(1, batch * seq, *t.shape[2:]) for t in inputs)
        y, states = kernels.chunked_documents(x, dt, A, B, C, self.D, documents, chunk_size=self.chunk_size)
        if layer is not None:
            layer.update_recurrent_state(states[documents.last])
        return y.reshape(batch, seq, *y.shape[2:])


class Mamba2Kind(LinearAttentionKind):
    """`linear_attention_type="mamba2"`: Mamba-2's selective state-space mixer."""

    name = "mamba2"
    module = Mamba2
    fields = MAMBA2_FIELDS

    def complete(self, config) -> None:
        """Defaults where a config with linear layers leaves the sizes unset: heads of 64 at twice the width."""
        if not self.in_use(config) or not isinstance(config.hidden_size, int):
            return
        if config.mamba_n_heads is None:
            config.mamba_n_heads = max(1, 2 * config.hidden_size // 64)
        if config.mamba_d_head is None and isinstance(config.mamba_n_heads, int) and config.mamba_n_heads > 0:
            config.mamba_d_head = max(1, 2 * config.hidden_size // config.mamba_n_heads)
        for name in ("time_step_limit", "ssm_multipliers"):
            if isinstance(getattr(config, name), tuple):
                setattr(config, name, list(getattr(config, name)))

    def validate(self, config) -> None:
        super().validate(config)
        if not self.in_use(config):
            return
        for name in ("mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_d_conv",
                     "mamba_chunk_size"):
            require_int(name, getattr(config, name), minimum=1)
        if config.mamba_n_heads % config.mamba_n_groups:
            raise ValueError(f"`mamba_n_groups`={config.mamba_n_groups} must divide `mamba_n_heads`="
                             f"{config.mamba_n_heads} (each group of B and C serves a run of heads).")
        for name in ("mamba_conv_bias", "mamba_proj_bias", "mamba_rms_norm", "mamba_norm_before_gate"):
            require_bool(name, getattr(config, name))
        if config.mamba_norm_before_gate and not config.mamba_rms_norm:
            raise ValueError("`mamba_norm_before_gate` places the gated norm, and `mamba_rms_norm` is False (there is "
                             "none): leave it False.")
        require_choice("mamba_hidden_act", config.mamba_hidden_act, ACT2FN)
        self._validate_limit(config.time_step_limit)
        for name in ("ssm_in_multiplier", "ssm_out_multiplier"):
            require_number(name, getattr(config, name), above=0)
        factors = config.ssm_multipliers
        if factors is not None:
            if not isinstance(factors, list) or len(factors) != len(PROJECTION_PARTS):
                raise ValueError(f"`ssm_multipliers` must list {len(PROJECTION_PARTS)} factors (for "
                                 f"{', '.join(PROJECTION_PARTS)}), got {factors!r}.")
            for factor in factors:
                require_number("ssm_multipliers[...]", factor, above=0)

    @staticmethod
    def _validate_limit(limit) -> None:
        if limit is None:
            return
        if not isinstance(limit, list) or len(limit) != 2:
            raise ValueError(f"`time_step_limit` must be [min, max] (or None: no clamp), got {limit!r}.")
        low, high = limit
        require_number("time_step_limit[0]", low, at_least=0)
        if not (isinstance(high, (int, float)) and not isinstance(high, bool) and high > low):
            raise ValueError(f"`time_step_limit` must be [min, max] with max > min, got {limit!r}.")

    def cache_layer(self, config, implementation: str, max_cache_len: int | None):
        """One fixed-size state per sequence, the same in every cache implementation (it never grows)."""
        return RecurrentLayer()

    def parameters(self, config) -> int:
        """d·(2·H·P + 2·G·N + H) (in_proj) + K·(H·P + 2·G·N) (conv) + 3·H (dt_bias, A_log, D) + H·P (norm) +
        H·P·d (out_proj), with the biases the config asks for."""
        d, heads, inner = config.hidden_size, config.mamba_n_heads, config.mamba_n_heads * config.mamba_d_head
        conv = inner + 2 * config.mamba_n_groups * config.mamba_d_state
        projected = inner + conv + heads
        total = d * projected + config.mamba_d_conv * conv + 3 * heads + inner * d
        if config.mamba_proj_bias:
            total += projected + d
        if config.mamba_conv_bias:
            total += conv
        return total + (inner if config.mamba_rms_norm else 0)

    def state_bytes(self, config, element_bytes: int) -> int:
        """Per sequence: the conv window K·(H·P + 2·G·N)·b plus the fp32 state 4·H·P·N."""
        inner = config.mamba_n_heads * config.mamba_d_head
        conv = inner + 2 * config.mamba_n_groups * config.mamba_d_state
        return config.mamba_d_conv * conv * element_bytes + 4 * inner * config.mamba_d_state

    def tp_plan(self, config) -> dict[str, str]:
        """The projections gather their outputs, so the convolution, the scan and the norm (replicated) see every
        head (as the plan of transformers' Qwen3.5 does for Gated DeltaNet; its Mamba-2 classes plan none)."""
        return {f"linear_attn.{name}": "colwise_gather_output" for name in ("in_proj", "out_proj")}


MAMBA2 = Mamba2Kind()


__all__ = ["MAMBA2", "MAMBA2_FIELDS", "GroupedGatedRMSNorm", "Mamba2", "Mamba2Fields"]
