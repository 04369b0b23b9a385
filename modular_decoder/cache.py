"""The family's own `Cache`: each layer stored in the form its attention needs, with its cost.

Layer kinds (`LAYER_KINDS`): full K/V, sliding-window K/V (keeps the last `sliding_window - 1`
positions, as Mistral and Gemma local layers need), and static pre-allocated K/V for
`torch.compile`. They reuse transformers' layer classes, so every `generate()` strategy (beam
reorder, crop for assisted decoding, batch repeat / select, reset) works unchanged.

`payload_bytes()` measures what is stored; `allocated_bytes()` what is reserved (a static cache
reserves its whole length up front). `contract.cache_bytes_per_token` gives the formula.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import (
    Cache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    StaticLayer,
    StaticSlidingWindowLayer,
)

from .latent_cache import latent_layer


def _tensor_bytes(tensor) -> int:
    if not isinstance(tensor, torch.Tensor):
        return 0
    return tensor.numel() * tensor.element_size()


def _dynamic_layer(config, layer_type: str, max_cache_len: int | None):
    if config.attention_type == "mla":
        return latent_layer(layer_type, "dynamic", config)
    if layer_type == "sliding_attention":
        return DynamicSlidingWindowLayer(sliding_window=config.sliding_window)
    return DynamicLayer()


def _static_layer(config, layer_type: str, max_cache_len: int | None):
    if max_cache_len is None:
        raise ValueError("A static cache needs `max_cache_len`.")
    if config.attention_type == "mla":
        return latent_layer(layer_type, "static", config, max_cache_len)
    if layer_type == "sliding_attention":
        return StaticSlidingWindowLayer(max_cache_len=max_cache_len, sliding_window=config.sliding_window)
    return StaticLayer(max_cache_len=max_cache_len)


# Cache layouts: name -> factory(config, layer_type, max_cache_len) -> layer
LAYER_KINDS = {"dynamic": _dynamic_layer, "static": _static_layer}


class ModularDecoderCache(Cache):
    """A cache whose layers follow `config.layer_types` (and, with MLA, store latents).

    Args:
        config: the model's `ModularDecoderConfig`.
        implementation: `"dynamic"` (grows as tokens come) or `"static"` (pre-allocated, compileable).
        max_cache_len: capacity of a static cache.
    """

    def __init__(self, config, implementation: str = "dynamic", max_cache_len: int | None = None, **kwargs):
        if implementation not in LAYER_KINDS:
            raise ValueError(f"`implementation`={implementation!r} is not one of {sorted(LAYER_KINDS)}.")
        if implementation == "static" and config.position_embedding_type == "alibi" and config.sliding_window:
            # A static sliding layer is a ring: slot order is not position order, so the ALiBi
            # distances computed from slot indices would be wrong.
            raise ValueError("ALiBi with a static sliding-window cache is not supported; use the dynamic cache.")
        self.config = config
        self.implementation = implementation
        self.max_cache_len = max_cache_len
        factory = LAYER_KINDS[implementation]
        layers = [factory(config, layer_type, max_cache_len) for layer_type in config.layer_types]
        super().__init__(layers=layers, **kwargs)

    def payload_bytes(self) -> int:
        """Bytes of cached state that hold tokens seen so far (what the formula predicts)."""
        total = 0
        for layer in self.layers:
            if not getattr(layer, "is_initialized", False):
                continue
            if isinstance(layer, StaticLayer):
                stored = min(int(layer.get_seq_length()), layer.keys.shape[-2])
                per_slot = (_tensor_bytes(layer.keys) + _tensor_bytes(layer.values)) // max(layer.keys.shape[-2], 1)
                total += stored * per_slot
            else:
                total += sum(_tensor_bytes(t) for t in _layer_tensors(layer))
        return total

    def allocated_bytes(self) -> int:
        """Bytes reserved by the cache tensors, used or not."""
        return sum(
            sum(_tensor_bytes(t) for t in _layer_tensors(layer))
            for layer in self.layers
            if getattr(layer, "is_initialized", False)
        )


def _layer_tensors(layer) -> list:
    return [getattr(layer, name, None) for name in getattr(layer, "payload_tensors", ("keys", "values"))]
