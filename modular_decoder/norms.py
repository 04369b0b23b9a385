"""Normalization layers, chosen by `config.norm_type` through `NORMS`."""

from __future__ import annotations

import torch
from torch import nn

from .split_products import is_fx_proxy


def rms_unweighted(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, without a weight: the statistics in fp32, the result in x's dtype (DeepSeek-V4's
    unweighted norms, as transformers' `DeepseekV4UnweightedRMSNorm` computes them)."""
    if not is_fx_proxy(x) and x.dtype is torch.float32:  # the same math in one call (bit-equal in fp32)
        return nn.functional.rms_norm(x, x.shape[-1:], None, eps)
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class RMSNorm(nn.Module):
    """y = x / rms(x) · w, computed in fp32 (as Llama and Gemma do) and cast back.

    With `unit_offset` the scale is `1 + w` and `w` starts at zero (Gemma's parameterisation).
    """

    reads: tuple[str, ...] = ()  # config fields only some norms read: RMSNorm has no bias

    def __init__(self, dim: int, eps: float = 1e-6, bias: bool = False, unit_offset: bool = False):
        super().__init__()
        del bias  # RMSNorm has none; the argument keeps one constructor signature for the registry
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if not is_fx_proxy(x) and x.dtype == weight.dtype == torch.float32:
            # Same math in one call (bit-equal in fp32, the scale 1 + w included): a decode step runs two norms per
            # layer. (A tracer's proxy takes the formula below, which vLLM's fx matcher recognises as an RMSNorm.)
            return nn.functional.rms_norm(x, weight.shape, 1.0 + weight if self.unit_offset else weight, self.eps)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            # Gemma multiplies in fp32 before the cast (see transformers' Gemma3RMSNorm)
            return (x32 * (1.0 + self.weight.float())).to(dtype)
        return self.weight * x32.to(dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, unit_offset={self.unit_offset}"

    @staticmethod
    def parameter_count(config, width: int) -> int:
        return width


class LayerNorm(nn.LayerNorm):
    """torch's LayerNorm with an optional bias and the optional `1 + w` scale."""

    reads: tuple[str, ...] = ("norm_bias",)

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True, unit_offset: bool = False):
        super().__init__(dim, eps=eps, bias=bias)
        self.unit_offset = unit_offset
        if unit_offset:
            nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = 1.0 + self.weight if self.unit_offset else self.weight
        return nn.functional.layer_norm(x, self.normalized_shape, weight, self.bias, self.eps)

    @staticmethod
    def parameter_count(config, width: int) -> int:
        return width * (2 if config.norm_bias else 1)


# `norm_type` -> norm class (its allowed values)
NORMS: dict[str, type[nn.Module]] = {"rmsnorm": RMSNorm, "layernorm": LayerNorm}


def norm_parameters(config, width: int) -> int:
    """Parameters of one norm of the configured type over `width` features."""
    return NORMS[config.norm_type].parameter_count(config, width)


def build_norm(config, dim: int | None = None, eps: float | None = None) -> nn.Module:
    """The norm the config asks for, over `dim` features (default: the hidden size), with epsilon `eps` (default:
    `norm_eps`)."""
    return NORMS[config.norm_type](dim or config.hidden_size, eps=config.norm_eps if eps is None else eps,
                                   bias=config.norm_bias, unit_offset=config.norm_unit_offset)
