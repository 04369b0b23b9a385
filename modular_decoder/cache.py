"""The family's own `Cache`: each layer stored in the form its attention needs, with its cost.

Implementations (`IMPLEMENTATIONS`), each mapping `config.layer_types` to layers, which the
config's attention kind builds (`AttentionKind.cache_layer`):

- `"dynamic"`: full K/V that grows into pre-allocated storage with 1/64 of its length spare, at
  least 16 tokens (`growing_cache.py`: no copy of the whole cache per step), and
  for sliding layers the last `sliding_window - 1` tokens (as Mistral and Gemma local layers need);
- `"static"`: K/V pre-allocated for `max_cache_len` tokens (a ring of `sliding_window` slots for
  sliding layers), for `torch.compile`;
- `"int8"`: dynamic, with K/V stored as int8 plus one scale per token and head (`int8_cache.py`
  states the granularity and the error bound);
- with `attention_type="mla"`, `"dynamic"` / `"static"` store the latent (`latent_cache.py`);
- a `"linear_attention"` layer stores its fixed-size state per sequence in every implementation
  (`recurrent_cache.py`: the short convolution's window and the recurrent state, transformers'
  `LinearAttentionLayer`). While the cache records its past (`activate_past_recording`, which assisted
  decoding calls) it also keeps the states of the last drafted tokens, so `crop` rolls it back; a crop past
  what it recorded is refused with a `ValueError` before any layer changes.

They reuse transformers' layer classes, so every `generate()` strategy (beam reorder, crop for
assisted decoding, batch repeat / select, reset) works unchanged.

`payload_bytes()` counts the stored bytes of the tokens the next step can attend to;
`allocated_bytes()` counts every byte reserved (a static cache reserves its whole length up front).
`contract.cache_bytes` predicts the payload from the config alone.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, StaticCache, StaticLayer

from .blocks import mixing_layer_types
from .chunked_attention import layer_window
from .hybrid_cache import EmptyLayer, HybridLayer
from .kinds import LINEAR_ATTENTION
from .kv_sharing import SharedKVLayer, kv_sources
from .recurrent_cache import RecurrentLayer

IMPLEMENTATIONS = ("dynamic", "static", "int8")


def _tensor_bytes(tensor) -> int:
    if not isinstance(tensor, torch.Tensor):
        return 0
    return tensor.numel() * tensor.element_size()


class ModularDecoderCache(Cache):
    """A cache whose layers follow `config.layer_types` (and, with MLA, store latents).

    `ModularDecoderCache(config, implementation)` builds the class of that implementation, each a
    transformers cache type, so code that branches on the type treats it as it treats Llama's:
    `"dynamic"` -> `DynamicModularDecoderCache` (a `DynamicCache`), `"static"` ->
    `StaticModularDecoderCache` (a `StaticCache`), `"int8"` -> `Int8ModularDecoderCache`.

    Args:
        config: the model's `ModularDecoderConfig`.
        implementation: `"dynamic"` (grows as tokens come), `"static"` (pre-allocated, compileable)
            or `"int8"` (dynamic, int8 K/V with a scale per token and head).
        max_cache_len: capacity of a static cache.
    """

    implementation = "dynamic"

    def __new__(cls, config=None, implementation: str = "dynamic", *args, **kwargs):
        if cls is ModularDecoderCache:
            if implementation not in IMPLEMENTATIONS:
                raise ValueError(f"`implementation`={implementation!r} is not one of {list(IMPLEMENTATIONS)}.")
            cls = CACHE_CLASSES[implementation]
        return super().__new__(cls)

    def __init__(self, config, implementation: str | None = None, max_cache_len: int | None = None, **kwargs):
        implementation = implementation or self.implementation
        if implementation != self.implementation:
            raise ValueError(f"{type(self).__name__} is the {self.implementation!r} cache, not {implementation!r}.")
        kind = config.attention_kind
        if implementation not in kind.cache_implementations:
            raise ValueError(
                f"`attention_type={kind.name!r}` has no {implementation!r} cache (it stores "
                f"{list(kind.cache_implementations)}); the int8 cache quantizes per-head K/V."
            )
        if implementation == "static" and max_cache_len is None:
            raise ValueError("A static cache needs `max_cache_len`.")
        if implementation == "static" and config.position_embedding_type == "alibi" and config.sliding_window:
            # A static sliding layer is a ring: slot order is not position order, so the ALiBi
            # distances computed from slot indices would be wrong.
            raise ValueError("ALiBi with a static sliding-window cache is not supported; use the dynamic cache.")
        self.config = config
        self.kv_sources = kv_sources(config)  # a layer that reads another's keys and values holds nothing
        layers = [SharedKVLayer(source) if source is not None else self._layer(config, types, implementation,
                                                                                 max_cache_len)
                  for types, source in zip(mixing_layer_types(config), self.kv_sources)]
        Cache.__init__(self, layers=layers, **kwargs)  # the layers are ours, not the ones DynamicCache / StaticCache pick

    @staticmethod
    def _layer(config, mixer_types: tuple[str, ...], implementation: str, max_cache_len: int | None):
        """The cache layer of a layer whose mixers have `mixer_types`: each kind's own, both in a hybrid layer, none
        without a mixer."""
        parts = [config.linear_attention_kind.cache_layer(config, implementation, max_cache_len)
                 if layer_type == LINEAR_ATTENTION
                 else config.attention_kind.cache_layer(config, layer_type, implementation, max_cache_len)
                 for layer_type in mixer_types]
        if not parts:
            return EmptyLayer()
        return parts[0] if len(parts) == 1 else HybridLayer(*parts)

    def crop(self, tokens_to_remove: int) -> None:
        """transformers' `crop` (a negative count of tokens to remove); where a linear-attention layer cannot
        restore the state before them, or compressed entries cannot be unpooled, a `ValueError` before any layer
        changes."""
        if (error := self.config.attention_kind.rollback_error(self.config)) is not None:
            raise ValueError(error)
        for layer in self.layers:
            for part in _parts(layer):  # (a hybrid layer's state too)
                if isinstance(part, RecurrentLayer):
                    part.check_crop(tokens_to_remove)
        super().crop(tokens_to_remove)

    def activate_past_recording(self, recurrent_states_to_keep: int | None = None, **kwargs) -> None:
        """Keep what `crop` needs to undo the next forwards (assisted decoding calls it before drafting):
        linear-attention layers record the states of up to `recurrent_states_to_keep` tokens (the tokens drafted
        per step), sliding layers every entry until the crop. The same on every transformers release (5.16 passes
        no count; the drafting paths of `ModularDecoderForCausalLM.generate` then give it). Refused where compressed
        entries cannot be rolled back."""
        if (error := self.config.attention_kind.rollback_error(self.config)) is not None:
            raise ValueError(error)
        for layer in (part for whole in self.layers for part in _parts(whole)):
            if isinstance(layer, RecurrentLayer):
                layer.activate_past_recording(recurrent_states_to_keep)
            elif hasattr(layer, "activate_past_recording"):
                layer.activate_past_recording()

    def held_batch_size(self) -> int | None:
        """The batch size of what the layers hold (read off shapes: no device work), or None for an empty cache.
        A static layer, allocated for its batch up front, is not asked."""
        for layer in (part for whole in self.layers for part in _parts(whole)):
            if isinstance(layer, RecurrentLayer):
                held = layer.held_batch_size()
            elif isinstance(layer, StaticLayer) or not getattr(layer, "is_initialized", False):
                continue
            else:
                held = next((t.shape[0] for t in _layer_tensors(layer) if isinstance(t, torch.Tensor) and t.numel()),
                            None)
            if held is not None:
                return held
        return None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens cached, as transformers counts them.

        Asked of a linear-attention layer (which holds a state, not
        tokens), the first attention layer answers, and a cache of linear layers only counts what they have seen."""
        return self.layers[self._attention_layer(layer_idx, prefer_full=False)].get_seq_length()

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        """The (kv_length, kv_offset) of the masks of layer `layer_idx`'s type.

        Asked of a linear-attention layer
        (transformers' mask builders look for the first non-sliding layer), those of the first full-attention
        layer. The releases differ in what they answer there (5.16 refuses any index but 0), so this one answers."""
        index = self._attention_layer(layer_idx, prefer_full=True)
        if not _attends(self.layers[index]):
            return query_length, 0
        return self.layers[index].get_mask_sizes(query_length)

    def _attention_layer(self, layer_idx: int, prefer_full: bool) -> int:
        """`layer_idx` (where it reads another layer's keys and values, that layer), or where it holds no K/V (a
        linear-attention layer, a layer without a mixer), the first full-attention layer (with `prefer_full`), else
        the first attention layer, else the first linear-attention layer (which counts the tokens it has seen)."""
        if self.kv_sources[layer_idx] is not None:
            return self.kv_sources[layer_idx]
        if _attends(self.layers[layer_idx]):
            return layer_idx
        attending = [i for i, layer in enumerate(self.layers) if _attends(layer)]
        full = [i for i in attending if not getattr(self.layers[i], "is_sliding", False)]
        recurrent = [i for i, layer in enumerate(self.layers) if isinstance(layer, RecurrentLayer)]
        return next(iter((full if prefer_full else []) + attending + recurrent), layer_idx)

    def payload_bytes(self) -> int:
        """Bytes stored for the tokens the next step can attend to (what `contract.cache_bytes` predicts).

        Dynamic layers hold exactly those. A static layer counts its filled slots; a static sliding
        ring counts `sliding_window - 1` of its `sliding_window` slots, since the oldest is overwritten
        by the next token before any query reads it.
        """
        return sum(self._payload(part, layer_window(self.config, layer_type))
                   for layer, types in zip(self.layers, mixing_layer_types(self.config))
                   for part, layer_type in zip(_parts(layer), types))

    def _payload(self, layer, window: int | None) -> int:
        if not getattr(layer, "is_initialized", False):
            return 0
        if hasattr(layer, "payload_bytes"):  # a recurrent state, compressed entries: the layer counts its own
            return layer.payload_bytes()
        tensors = _layer_tensors(layer)
        if not isinstance(layer, StaticLayer):
            return sum(_tensor_bytes(t) for t in tensors)
        slots = layer.keys.shape[-2]
        held = min(int(layer.get_seq_length()), slots)
        if getattr(layer, "is_sliding", False):  # (sliding or chunked: its window)
            held = min(held, window - 1)
        return held * (sum(_tensor_bytes(t) for t in tensors) // max(slots, 1))

    def allocated_bytes(self) -> int:
        """Bytes reserved by the cache tensors, used or not."""
        return sum(
            layer.payload_bytes() if isinstance(layer, RecurrentLayer) else
            sum(_tensor_bytes(t) for t in (layer.allocated_tensors() if hasattr(layer, "allocated_tensors")
                                           else _layer_tensors(layer)))
            for whole in self.layers for layer in _parts(whole)
            if getattr(layer, "is_initialized", False)
        )


def _attends(layer) -> bool:
    """Whether a cache layer holds K/V (an attention layer's or a hybrid layer's), not only a state or nothing (a
    layer reading another's keys and values holds none)."""
    return not isinstance(layer, (RecurrentLayer, EmptyLayer, SharedKVLayer))


def _parts(layer) -> tuple:
    """The layers a cache layer is made of: a hybrid layer's two, else itself."""
    return layer.parts if isinstance(layer, HybridLayer) else (layer,)


def _layer_tensors(layer) -> list:
    return [getattr(layer, name, None) for name in getattr(layer, "payload_tensors", ("keys", "values"))]


class DynamicModularDecoderCache(ModularDecoderCache, DynamicCache):
    """The default: grows with the tokens (full layers into storage with 1/64 spare, sliding layers
    keep their window, MLA layers their latents)."""


class StaticModularDecoderCache(ModularDecoderCache, StaticCache):
    """Pre-allocated for `max_cache_len` tokens (compileable, exportable)."""

    implementation = "static"


class Int8ModularDecoderCache(ModularDecoderCache):
    """Dynamic, with K/V stored as int8 and one scale per token and head (`int8_cache.py`)."""

    implementation = "int8"


CACHE_CLASSES: dict[str, type[ModularDecoderCache]] = {
    "dynamic": DynamicModularDecoderCache,
    "static": StaticModularDecoderCache,
    "int8": Int8ModularDecoderCache,
}
