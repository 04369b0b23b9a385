"""The routed experts of a sparse layer: E gated MLPs stored as two 3-D parameters (transformers' v5 layout).

Each expert runs once on the tokens routed to it; transformers' experts kernels (`experts_implementation=`:
"grouped_mm", "batched_mm", ...) run on the same weights wherever this transformers has them.

    mlp.experts.gate_up_proj             (E, 2·f, d)   [gate; up] of every expert, concatenated
    mlp.experts.down_proj                (E, d, f)
    mlp.experts.gate_up_proj_bias        (E, 2·f)      `mlp_bias=True` only (gpt-oss), [gate; up] as above
    mlp.experts.down_proj_bias           (E, d)        `mlp_bias=True` only

With `moe_mlp_type="dense"` each expert is act(x W_up) W_down (Nemotron-H's relu² experts): `mlp.experts.up_proj`
(E, f, d) in place of `gate_up_proj` (and `up_proj_bias`), transformers' names for such experts. With
`moe_latent_size` the experts read and write that width instead of d (Nemotron-H's latent experts).

The gate is act(gate) ⊙ up with `hidden_act`, or with `swiglu_limit` a clamped SwiGLU (`clamped_swiglu`):
g = min(gate, limit), u = clamp(up, ±limit), (u + c) ⊙ g·σ(α·g), α = `swiglu_alpha`, c = `swiglu_up_offset`
(gpt-oss: α = 1.702, c = 1; DeepSeek-V4: α = 1, c = 0, i.e. SiLU(g) ⊙ u). (gpt-oss's checkpoints
interleave gate and up columns and store the products transposed; conversion rearranges them into this one
layout, so every family's experts share this module, its kernels' flags and its parallel plans.)

Part of the remote-code files: torch and transformers only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.activations import ACT2FN

from .compat import experts_kernels
from .split_products import linear


@dataclass(kw_only=True)
class ClampedSwiGLUFields:
    """Args:
        swiglu_up_offset (`float`, *optional*): c in the clamped SwiGLU (u + c) ⊙ g·σ(α·g) that `swiglu_limit` turns
            on: gpt-oss adds 1 to the clamped up projection, DeepSeek-V4 nothing (with `swiglu_alpha`=1 its experts
            compute SiLU(g) ⊙ u). Defaults to gpt-oss's 1.0 where `swiglu_limit` is set; unset otherwise.
            `mlp_type="moe"` only.
    """

    swiglu_up_offset: float | None = None


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, alpha: float, offset: float,
                   act_fn) -> torch.Tensor:
    """(u + c) ⊙ g·σ(α·g) on g = min(gate, limit), u = clamp(up, ±limit): gpt-oss's form term for term (α = 1.702,
    c = 1), DeepSeek-V4's as transformers computes it (α = 1, c = 0: `act_fn`(g) ⊙ u, `act_fn` SiLU)."""
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    glu = act_fn(gate) if alpha == 1.0 else gate * torch.sigmoid(gate * alpha)
    return (up + offset) * glu if offset else glu * up


class Experts(nn.Module):
    """E gated MLPs stored as two 3-D parameters (transformers' v5 layout).

    `forward(hidden_states (N, d), top_k_index (N, k), top_k_weights (N, k)) -> (N, d)`: the
    (token, slot) pairs are sorted by expert, so each expert's tokens form one contiguous run and
    each expert with tokens runs once, as two matrix products on its own slices of the weights; a
    decode step reads only the chosen experts. Ids outside [0, E) are skipped (transformers'
    expert-parallel code marks tokens of experts on other ranks that way).

    Where transformers has its experts kernels, the class is wrapped by its decorator (below):
    `config._experts_implementation` then picks "eager" (this forward) or one of its kernels on the
    same weights.
    """

    def __init__(self, config):
        super().__init__()
        self.num_experts = config.num_experts
        self.hidden_dim = config.moe_latent_size or config.hidden_size  # what the experts read and write
        self.intermediate_dim = config.moe_intermediate_size
        self.gated = config.moe_mlp_type == "gated"
        self.up_name = "gate_up_proj" if self.gated else "up_proj"
        up_width = (2 if self.gated else 1) * self.intermediate_dim
        self.register_parameter(self.up_name, nn.Parameter(torch.empty(self.num_experts, up_width, self.hidden_dim)))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, self.hidden_dim, self.intermediate_dim))
        biases = config.mlp_bias
        self.register_parameter(
            f"{self.up_name}_bias", nn.Parameter(torch.empty(self.num_experts, up_width)) if biases else None
        )
        self.register_parameter(
            "down_proj_bias", nn.Parameter(torch.empty(self.num_experts, self.hidden_dim)) if biases else None
        )
        self.act_fn = ACT2FN[config.hidden_act]
        self.limit, self.alpha, self.up_offset = config.swiglu_limit, config.swiglu_alpha, config.swiglu_up_offset

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        num_tokens, top_k = top_k_index.shape
        # `num_experts` is the local count under expert parallelism; other ids sort to the end
        local = self.num_experts
        expert_ids = top_k_index.reshape(-1)  # (N·k,)
        expert_ids = expert_ids.masked_fill((expert_ids < 0) | (expert_ids >= local), local)
        order = torch.argsort(expert_ids, stable=True)  # (N·k,) pairs grouped by expert
        counts = torch.bincount(expert_ids, minlength=local + 1)[:local].tolist()  # one host sync
        pairs = order[: sum(counts)]
        tokens = pairs // top_k
        grouped = hidden_states[tokens]  # (S, d)
        outputs, start = [], 0
        for expert, count in enumerate(counts):
            if count:
                outputs.append(self._expert(expert, grouped[start : start + count]))
                start += count
        out = hidden_states.new_zeros(num_tokens, self.hidden_dim)
        if not outputs:
            return out
        weighted = torch.cat(outputs) * top_k_weights.reshape(-1)[pairs].unsqueeze(-1)  # (S, d)
        # accumulate in the weights' precision (fp32 routing weights), cast once
        summed = torch.zeros(num_tokens, self.hidden_dim, dtype=weighted.dtype, device=weighted.device)
        return summed.index_add_(0, tokens, weighted).to(hidden_states.dtype)

    def _expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        # `linear`: a decode step's few rows split across the cores (plain fp32 CPU weights only)
        up = linear(x, getattr(self, self.up_name)[expert])  # (n, 2·f), or (n, f) ungated
        bias = getattr(self, f"{self.up_name}_bias")
        if bias is not None:
            up = up + bias[expert]
        out = linear(self._apply_gate(up) if self.gated else self.act_fn(up), self.down_proj[expert])  # (n, d)
        return out if self.down_proj_bias is None else out + self.down_proj_bias[expert]

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """(S, 2·f) [gate; up] -> (S, f): act(gate) ⊙ up, or the clamped SwiGLU with `swiglu_limit`
        (`clamped_swiglu`). transformers' experts kernels call this too."""
        # f from the tensor, not the config: tensor parallelism shards each half of gate_up_proj
        gate, up = gate_up.chunk(2, dim=-1)  # (S, f) each
        if self.limit is None:
            return self.act_fn(gate) * up
        return clamped_swiglu(gate, up, self.limit, self.alpha, self.up_offset, self.act_fn)


_EXPERTS_KERNELS = experts_kernels()
# The dtypes transformers' experts kernels take; another (a float64 model) runs this module's forward
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _kernel_applies(module: nn.Module, hidden_states: torch.Tensor) -> bool:
    """Whether transformers' kernel can take these tensors: its dtypes, and for `grouped_mm` widths
    whose rows are multiples of 16 bytes (torch's grouped product refuses other strides)."""
    if hidden_states.dtype not in KERNEL_DTYPES:
        return False
    if module.config._experts_implementation in (None, "grouped_mm"):
        size = hidden_states.element_size()
        return (module.hidden_dim * size) % 16 == 0 and (module.down_proj.shape[-1] * size) % 16 == 0
    return True


if _EXPERTS_KERNELS is not None:
    # transformers' kernels ("grouped_mm", "batched_mm", ...), `experts_implementation=` and its
    # expert-parallel dispatch work on this module; without the decorator its own forward is all there is
    _own_forward = Experts.forward
    Experts = _EXPERTS_KERNELS(Experts)
    _dispatching_forward = Experts.forward
    _decorated_init = Experts.__init__

    def _init(self, config, *args, **kwargs):
        _decorated_init(self, config, *args, **kwargs)
        # the decorator sets its class-wide flags: per config here
        self.has_bias, self.has_gate = self.down_proj_bias is not None, self.gated

    Experts.__init__ = _init

    def _forward(self, hidden_states, top_k_index, top_k_weights):
        run = _dispatching_forward if _kernel_applies(self, hidden_states) else _own_forward
        return run(self, hidden_states, top_k_index, top_k_weights)

    Experts.forward = _forward


def experts_kernels_available() -> bool:
    """Whether `Experts` dispatches on `config._experts_implementation` (transformers has the kernels)."""
    return _EXPERTS_KERNELS is not None


__all__ = ["KERNEL_DTYPES", "ClampedSwiGLUFields", "Experts", "clamped_swiglu", "experts_kernels_available"]
