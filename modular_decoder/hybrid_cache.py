"""The cache layers of layers that are not one mixer: a hybrid layer (attention and a linear-attention mixer side by
side, Falcon-H1's) keeps both its K/V and its state; a layer without a token mixer (a feed-forward-only layer of
`block_types`, Nemotron-H's MoE and MLP layers) keeps nothing.

`HybridLayer` holds the attention kind's layer (`attention`: dynamic, static or int8, as for any attention layer) and
the linear-attention kind's (`recurrent`, a `RecurrentLayer`): the attention reaches its K/V through `update` as
through any layer, the linear-attention mixer its state through `recurrent`, and everything generate asks of a layer
(beam reorder, batch repeat / select, reset, crop) reaches both. `EmptyLayer` is transformers' `DummyLayer` (5.25;
5.16 has none) for this family: it answers every such call and counts nothing.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from .compat import is_croppable
from .recurrent_cache import RecurrentLayer


class HybridLayer(CacheLayerMixin):
    """One hybrid layer's K/V (`attention`) and linear-attention state (`recurrent`)."""

    def __init__(self, attention: CacheLayerMixin, recurrent: RecurrentLayer):
        # no `CacheLayerMixin.__init__`: the keys and values are the attention layer's
        self.attention, self.recurrent = attention, recurrent

    @property
    def parts(self) -> tuple:
        return self.attention, self.recurrent

    @property
    def is_compileable(self) -> bool:
        return all(part.is_compileable for part in self.parts)

    @property
    def is_croppable(self) -> bool:
        return all(is_croppable(part) for part in self.parts)

    @property
    def is_sliding(self) -> bool:
        return getattr(self.attention, "is_sliding", False)

    @property
    def supports_early_init(self) -> bool:
        return self.attention.supports_early_init

    @property
    def is_initialized(self) -> bool:
        return self.attention.is_initialized

    @property
    def keys(self) -> torch.Tensor | None:
        return self.attention.keys

    @property
    def values(self) -> torch.Tensor | None:
        return self.attention.values

    def lazy_initialization(self, *args, **kwargs) -> None:
        self.attention.lazy_initialization(*args, **kwargs)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self.attention.update(key_states, value_states, *args, **kwargs)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.attention.get_mask_sizes(query_length)

    def get_seq_length(self):
        return self.attention.get_seq_length()

    def get_max_length(self) -> int:
        return self.attention.get_max_length()

    def reset(self) -> None:
        for part in self.parts:
            part.reset()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for part in self.parts:
            part.reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        for part in self.parts:
            part.batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        for part in self.parts:
            part.batch_select_indices(indices)

    def crop(self, tokens_to_remove: int) -> None:
        for part in self.parts:
            if part.is_initialized:  # (transformers 5.16's attention layers fail to crop before their first update)
                part.crop(tokens_to_remove)

    def activate_past_recording(self, *args, **kwargs) -> None:
        for part in self.parts:
            if hasattr(part, "activate_past_recording"):
                part.activate_past_recording(*args, **kwargs)

    def offload(self) -> None:
        for part in self.parts:
            part.offload()

    def prefetch(self) -> None:
        for part in self.parts:
            part.prefetch()


class EmptyLayer:
    """The cache layer of a layer without a token mixer: it stores nothing and answers every call generate makes."""

    supports_early_init = False
    is_compileable = True
    is_croppable = True
    is_sliding = False
    is_initialized = False
    keys = values = None

    def update(self, key_states, value_states, *args, **kwargs):
        raise ValueError("A layer without a token mixer (`block_types`) caches nothing.")

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, 0

    def lazy_initialization(self, *args, **kwargs) -> None: ...
    def reset(self) -> None: ...
    def reorder_cache(self, beam_idx) -> None: ...
    def batch_repeat_interleave(self, repeats: int) -> None: ...
    def batch_select_indices(self, indices) -> None: ...
    def crop(self, tokens_to_remove: int) -> None: ...
    def offload(self) -> None: ...
    def prefetch(self) -> None: ...


__all__ = ["EmptyLayer", "HybridLayer"]
