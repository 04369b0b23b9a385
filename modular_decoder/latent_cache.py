"""Cache layers for multi-head latent attention: they store the latent, not per-head K/V.

Per token and layer an MLA cache holds the normalized joint KV latent `c_kv` (width d_c =
`kv_lora_rank`) and the shared rotary key (width d_R = `qk_rope_head_dim`): (d_c + d_R)·b bytes,
against 2·H·d_h·b for a K/V layer. Both ride as one-"head" 4-D tensors, (B, 1, T, d_c) and
(B, 1, T, d_R), the layout `models/deepseek_v3` uses, so transformers' dynamic, static and
sliding-window layer logic (masks, beam reorder, crop, batch repeat / select, reset) applies
unchanged. The subclasses only name the payload (`latents`, `rope_keys`), check the layout, and
let `ModularDecoderCache.payload_bytes()` find it through `payload_tensors`.

DeepSeek Sparse Attention (`attention_type="dsa"`) caches one more tensor per layer: the lightning
indexer's keys, (B, T, D_I), in transformers' own indexed layers (`DynamicIndexedLayer`,
`StaticIndexedLayer`, what transformers' `DeepseekV32` caches), beside the latent and rotary key.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicIndexedLayer, StaticIndexedLayer, StaticLayer, StaticSlidingWindowLayer

from .chunked_attention import layer_window
from .compat import DynamicSlidingWindowLayer
from .growing_cache import GrowingLayer, is_prefix_view


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


class DynamicIndexedLatentLayer(LatentLayerMixin, GrowingLayer, DynamicIndexedLayer):
    """A dynamic latent layer that also holds the DSA indexer's keys, (B, T, D_I).

    `update_indexer` grows them into storage with spare room, as `GrowingLayer` grows the latents (no copy of
    the whole indexer cache per decode step); every other operation is `DynamicIndexedLayer`'s, on a view of
    that storage. `reset` drops them, as it drops the latents, whichever transformers release runs.
    """

    payload_tensors = ("latents", "rope_keys", "indexer_keys")
    _indexer_keys = _indexer_store = None

    @property
    def indexer_keys(self):
        return self._indexer_keys

    @indexer_keys.setter
    def indexer_keys(self, tensor):
        if not is_prefix_view(tensor, self._indexer_store):
            self._indexer_store = None  # replaced (reordered, repeated, moved): let the old storage go now
        self._indexer_keys = tensor

    def update_indexer(self, indexer_key_states: torch.Tensor) -> torch.Tensor:
        """Append (B, T, D_I) indexer keys; returns every cached one, (B, S, D_I)."""
        if not self.is_indexer_initialized:
            self.lazy_initialization_indexer(indexer_key_states)
        held, new = self._indexer_keys, indexer_key_states.shape[1]
        length = held.shape[1] if held.dim() == 3 else 0  # 1-D and empty until the first keys
        end = length + new
        store = self._indexer_store
        if store is None or store.shape[1] < end:
            source = held if length else indexer_key_states
            store = source.new_empty((source.shape[0], self.capacity_for(end), source.shape[-1]))
            if length:
                store.narrow(1, 0, length).copy_(held)
            del held, source
            self._indexer_store = store
        store.narrow(1, length, new).copy_(indexer_key_states)
        self._indexer_keys = store.narrow(1, 0, end)  # a prefix view of the storage
        return self._indexer_keys

    def reset(self) -> None:
        super().reset()
        self.indexer_keys = None
        self.is_indexer_initialized = False

    def allocated_tensors(self) -> list:
        return super().allocated_tensors() + [self._indexer_store if self._indexer_store is not None
                                              else self._indexer_keys]


class StaticIndexedLatentLayer(LatentLayerMixin, StaticIndexedLayer):
    """Latents, rotary keys and the DSA indexer's keys pre-allocated for `max_cache_len` tokens (compileable)."""

    payload_tensors = ("latents", "rope_keys", "indexer_keys")


def indexed_latent_layer(implementation: str, max_cache_len: int | None = None):
    """The layer of a DSA model in a `"dynamic"` or `"static"` cache (DSA has no sliding layers)."""
    return DynamicIndexedLatentLayer() if implementation == "dynamic" else StaticIndexedLatentLayer(max_cache_len)


def latent_layer(layer_type: str, implementation: str, config, max_cache_len: int | None = None):
    """The latent layer for a layer of `layer_type` in a `"dynamic"` or `"static"` cache."""
    window = layer_window(config, layer_type)  # sliding and chunked layers keep a window
    if implementation == "dynamic":
        return DynamicSlidingLatentLayer(sliding_window=window) if window else DynamicLatentLayer()
    if window:
        return StaticSlidingLatentLayer(max_cache_len=max_cache_len, sliding_window=window)
    return StaticLatentLayer(max_cache_len=max_cache_len)


__all__ = [
    "LatentLayerMixin",
    "DynamicLatentLayer",
    "DynamicSlidingLatentLayer",
    "StaticLatentLayer",
    "StaticSlidingLatentLayer",
    "DynamicIndexedLatentLayer",
    "StaticIndexedLatentLayer",
    "latent_layer",
    "indexed_latent_layer",
]
