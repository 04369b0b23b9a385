"""int8 K/V cache layers: trade a bounded attention error for about half the bf16 cache bytes.

Granularity: symmetric absmax quantization with one scale per (sequence, K/V head, token), taken
over that head's d_h features, separately for keys and values:

    scale = max_i |x_i| / 127,   code_i = round(x_i / scale) ∈ [-127, 127],   x̂_i = code_i · scale

so every element is off by at most scale / 2 = max|x| / 254 of its own head-token row. Per-token
scales let a token be quantized once, when it arrives, and never again (no re-quantization as the
cache grows, unlike per-channel schemes), at the price of sharing one range across a row whose
channels may differ in magnitude (key outlier channels, as KIVI notes).

Storage: each row is its d_h int8 codes followed by the raw bytes of its scale (kept in the
states' dtype), one int8 vector of d_h + b. Codes and scale therefore move together through
every operation transformers' layer logic performs on the sequence and batch axes (append, the
sliding window, crop, beam reorder, batch repeat / select, reset), which these layers inherit
unchanged. Per token and layer: 2·H_kv·(d_h + b) bytes against 2·H_kv·d_h·2 for bf16, i.e.
(d_h + b) / (2·d_h): 51.6 % for d_h = 64 with bf16 scales, 53.1 % with fp32 scales.

Attention always sees the dequantized states, the new token's included, so a prompt gives the
same logits whether it is fed at once or token by token.
"""

from __future__ import annotations

import torch

from .compat import DynamicLayer, DynamicSlidingWindowLayer

QMAX = 127


def _scale_width(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def quantize_int8(states: torch.Tensor) -> torch.Tensor:
    """(B, H, T, D) float -> (B, H, T, D + b) int8: codes, then the bytes of the row's scale."""
    amax = states.detach().abs().amax(dim=-1, keepdim=True).float()  # (B, H, T, 1)
    tiny = torch.finfo(states.dtype).tiny  # an all-zero row keeps a representable, non-zero scale
    scale = (amax / QMAX).clamp(min=tiny).to(states.dtype)
    codes = torch.round(states.float() / scale.float()).clamp(-QMAX, QMAX).to(torch.int8)
    return torch.cat([codes, scale.view(torch.int8)], dim=-1)


def dequantize_int8(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, H, T, D + b) int8 -> (B, H, T, D) in `dtype`."""
    width = _scale_width(dtype)
    codes, scale_bytes = packed[..., :-width], packed[..., -width:]
    scale = scale_bytes.contiguous().view(dtype).float()  # (B, H, T, 1)
    return (codes.float() * scale).to(dtype)


class Int8LayerMixin:
    """Quantizes what `update` receives, stores it packed, returns the dequantized states."""

    compute_dtype: torch.dtype | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.compute_dtype is None:
            self.compute_dtype = key_states.dtype
        elif key_states.dtype != self.compute_dtype:
            raise ValueError(
                f"This int8 cache holds {self.compute_dtype} states; got {key_states.dtype}. Reset it first."
            )
        keys, values = super().update(quantize_int8(key_states), quantize_int8(value_states), *args, **kwargs)
        return dequantize_int8(keys, self.compute_dtype), dequantize_int8(values, self.compute_dtype)

    def reset(self) -> None:
        super().reset()
        self.compute_dtype = None


class Int8Layer(Int8LayerMixin, DynamicLayer):
    """Full attention: every token's int8 K/V."""


class Int8SlidingWindowLayer(Int8LayerMixin, DynamicSlidingWindowLayer):
    """Sliding attention: the int8 K/V of the last `sliding_window - 1` tokens."""


__all__ = ["Int8Layer", "Int8SlidingWindowLayer", "quantize_int8", "dequantize_int8"]
