"""Cache layers for multi-head latent attention: they store the latent, not per-head K/V.

Per token and layer an MLA cache holds the normalized joint KV latent `c_kv` (width d_c =
`kv_lora_rank`) and the shared rotary key (width d_R = `qk_rope_head_dim`): (d_c + d_R)·b bytes,
against 2·H·d_h·b for a K/V layer. Both ride as one-"head" 4-D tensors, (B, 1, T, d_c) and
(B, 1, T, d_R), the layout `models/deepseek_v3` uses, so transformers' dynamic, static and
sliding-window layer logic (masks, beam reorder, crop, batch repeat / select, reset) applies
unchanged. The subclasses only name the payload (`latents`, `rope_keys`), check the layout, and
let `ModularDecoderCache.payload_bytes()` find it through `payload_tensors`.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicSlidingWindowLayer, StaticLayer, StaticSlidingWindowLayer

from .growing_cache import GrowingLayer


class LatentLayerMixin:
    """`update(latents, rope_keys)` stores (B, 1, T, d_c) latents and (B, 1, T, d_R) rotary keys.

    `keys` holds the latents and `values` the rotary keys (the slots transformers' layer logic
    manages); `latents` / `rope_keys` are the readable names for the same tensors.
    """

    payload_tensors = ("latents", "rope_keys")

    @property
    def latents(self) -> torch.Tensor | None:
        return self.keys

    @property
    def rope_keys(self) -> torch.Tensor | None:
        return self.values

    def update(self, latents: torch.Tensor, rope_keys: torch.Tensor, *args, **kwargs):
        if latents.dim() != 4 or latents.shape[1] != 1 or rope_keys.dim() != 4 or rope_keys.shape[1] != 1:
            raise ValueError(
                "A latent cache layer stores (batch, 1, tokens, width) tensors; got latents "
                f"{tuple(latents.shape)} and rotary keys {tuple(rope_keys.shape)}."
            )
        return super().update(latents, rope_keys, *args, **kwargs)


class DynamicLatentLayer(LatentLayerMixin, GrowingLayer):
    """Grows with every token (the default) into pre-allocated storage with 1/64 of its length spare
    (`growing_cache.py`): no copy of the whole latent cache per decode step."""


class DynamicSlidingLatentLayer(LatentLayerMixin, DynamicSlidingWindowLayer):
    """Keeps the latents of the last `sliding_window - 1` tokens."""


class StaticLatentLayer(LatentLayerMixin, StaticLayer):
    """Pre-allocated for `max_cache_len` tokens (compileable)."""


class StaticSlidingLatentLayer(LatentLayerMixin, StaticSlidingWindowLayer):
    """A pre-allocated ring of `sliding_window` latents."""


def latent_layer(layer_type: str, implementation: str, config, max_cache_len: int | None = None):
    """The latent layer for a layer of `layer_type` in a `"dynamic"` or `"static"` cache."""
    sliding = layer_type == "sliding_attention"
    if implementation == "dynamic":
        return DynamicSlidingLatentLayer(sliding_window=config.sliding_window) if sliding else DynamicLatentLayer()
    if sliding:
        return StaticSlidingLatentLayer(max_cache_len=max_cache_len, sliding_window=config.sliding_window)
    return StaticLatentLayer(max_cache_len=max_cache_len)


__all__ = [
    "LatentLayerMixin",
    "DynamicLatentLayer",
    "DynamicSlidingLatentLayer",
    "StaticLatentLayer",
    "StaticSlidingLatentLayer",
    "latent_layer",
]
