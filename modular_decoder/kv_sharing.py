"""Keys and values shared across layers (Gemma 3n, Gemma 4's `num_kv_shared_layers`): the last
`num_kv_shared_layers` layers compute no keys or values of their own; each attends to those of the last earlier layer
of its type (sliding or full) before them, its source.

    layer:     0 S   1 S   2 F   3 S   4 F  |  5 S   6 F        (num_kv_shared_layers = 2)
    reads:                 (own)            |  K/V of 3, of 4

A source hands its keys and values, as its cache returned them in this forward (every cached token plus the new
ones; a sliding layer's window), to its readers through a per-forward dict (`shared_kv`, one of the layer inputs
the model gives every block); so a reader sees exactly its source's keys and values, with or without a cache.
A reader holds no `k_proj`, `v_proj` or key norm, and its slot in the cache holds nothing (`SharedKVLayer`):
`contract.cache_bytes` counts the sources only. What counts the tokens a reader sees (`get_seq_length`, the mask
sizes) is its source's layer.

A drafter that reads the model's keys and values (transformers' Gemma 4 assistant, `kv_assistant.py`) gets, per
attention type, those of the last layer of that type computing its own (`drafter_kv_layers`), handed over the same way.

`KVSharingFields` holds the field; the standard attention kind owns its rules (`attention.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers.cache_utils import CacheLayerMixin

from .kinds import HYBRID, LINEAR_ATTENTION, require_int


@dataclass(kw_only=True)
class KVSharingFields:
    """Args:
        num_kv_shared_layers (`int`): The last this many layers read the keys and values of the last earlier layer of
            their type instead of computing their own (transformers' Gemma 3n / Gemma 4 field): no `k_proj`, `v_proj`
            or key norm, nothing cached. 0: none. Standard attention only; every type of a sharing layer needs an
            earlier layer of that type to read from.
    """

    num_kv_shared_layers: int = 0


def _attending_types(config) -> list[str | None]:
    """Per layer, its attention type, or `None` in a feed-forward-only layer (`block_types` "mlp")."""
    blocks = config.block_types or ["mixer_mlp"] * config.num_hidden_layers
    return [None if block == "mlp" else layer_type for layer_type, block in zip(config.layer_types, blocks)]


def kv_sources(config) -> list[int | None]:
    """Per layer, the earlier layer whose keys and values it reads, or `None` where it computes its own (or has no
    attention)."""
    layers = config.num_hidden_layers
    first_shared = layers - config.num_kv_shared_layers
    types = _attending_types(config)
    before = types[:first_shared]
    sources = [None] * layers
    for index in range(first_shared, layers):
        if types[index] is not None:
            sources[index] = len(before) - 1 - before[::-1].index(types[index])
    return sources


# the layer types whose keys and values a drafter reads (transformers' Gemma attention types)
DRAFTER_KV_TYPES = ("sliding_attention", "full_attention")


def drafter_kv_layers(config) -> dict[str, int]:
    """Per attention type a drafter reads (`DRAFTER_KV_TYPES`), the layer whose keys and values it gets: the last
    standard-attention layer of that type computing its own (transformers' Gemma 4 "store" layers: the sharing
    layers' sources, else each type's last layer)."""
    if config.attention_type != "standard":
        return {}
    types = _attending_types(config)[: config.num_hidden_layers - config.num_kv_shared_layers]
    return {layer_type: len(types) - 1 - types[::-1].index(layer_type)
            for layer_type in DRAFTER_KV_TYPES if layer_type in types}


def validate_kv_sharing(config) -> None:
    """`num_kv_shared_layers` in [0, L), each sharing layer's type found among the attending layers before the first
    one; no linear-attention or hybrid layer among them."""
    require_int("num_kv_shared_layers", config.num_kv_shared_layers, minimum=0,
                maximum=config.num_hidden_layers - 1)
    if config.num_kv_shared_layers and config.num_mtp_layers:
        raise ValueError("`num_kv_shared_layers` with `num_mtp_layers`: an MTP module's block is built from the last "
                         "layer's kinds, which here reads another layer's keys and values; use one or the other.")
    first_shared = config.num_hidden_layers - config.num_kv_shared_layers
    types = _attending_types(config)
    if reached := {LINEAR_ATTENTION, HYBRID} & set(types[first_shared:]):
        raise ValueError(f"`num_kv_shared_layers`={config.num_kv_shared_layers} reaches a {sorted(reached)} layer, "
                         "whose recurrent state is no keys and values to share.")
    missing = sorted(set(types[first_shared:]) - set(types[:first_shared]) - {None})
    if missing:
        raise ValueError(f"`num_kv_shared_layers`={config.num_kv_shared_layers}: the sharing layers of type {missing} "
                         "have no earlier layer of that type to read keys and values from.")


class SharedKVLayer(CacheLayerMixin):
    """The cache slot of a layer that reads another layer's keys and values: it holds nothing (as transformers'
    `DummyLayer` from 5.24); every operation `generate` asks of a layer leaves it empty."""

    is_compileable = True
    is_croppable = True
    is_sliding = False
    supports_early_init = False

    def __init__(self, source: int):
        super().__init__()
        self.source = source
        self.is_initialized = True  # nothing to allocate

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        raise RuntimeError(f"A layer that reads layer {self.source}'s keys and values caches none of its own.")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        raise RuntimeError("The mask sizes of a layer sharing keys and values are its source's (the cache asks it).")

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return -1

    def offload(self) -> None: ...
    def prefetch(self) -> None: ...
    def reset(self) -> None: ...
    def crop(self, max_length: int) -> None: ...
    def reorder_cache(self, beam_idx) -> None: ...
    def batch_repeat_interleave(self, repeats: int) -> None: ...
    def batch_select_indices(self, indices) -> None: ...


__all__ = ["DRAFTER_KV_TYPES", "KVSharingFields", "SharedKVLayer", "drafter_kv_layers", "kv_sources",
           "validate_kv_sharing"]
