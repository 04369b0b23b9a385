"""Chunked attention (Llama 4's local layers): the sequence is cut into chunks of `attention_chunk_size` tokens and
a query attends, causally, only to the keys of its own chunk.

A layer is chunked where `layer_types` says `"chunked_attention"` (transformers' value). Its mask is transformers'
`create_chunked_causal_mask` (chunks start at each row's first real token, so a left-padded row chunks as it would
alone); its cache is a sliding layer whose window is the chunk size (a query's chunk starts at most
`attention_chunk_size - 1` tokens back), as transformers caches Llama 4. Flash kernels take a window, not chunks, so
they are refused, as transformers refuses them for Llama 4.

`CHUNKED_ATTENTION_FEATURE` is the mechanism's entry (`registries.FEATURES`); its field lives in
`ChunkedAttentionFields`, a base of the config.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers.masking_utils import create_chunked_causal_mask

from .kinds import Feature, require_int, require_unset_unless

CHUNKED_ATTENTION = "chunked_attention"  # the `layer_types` value (transformers' own)
# The shortest chunk whose cache layer keeps what the next query needs (a sliding layer holds `window - 1` tokens)
MIN_CHUNK_SIZE = 2


@dataclass(kw_only=True)
class ChunkedAttentionFields:
    """Args:
        attention_chunk_size (`int`, *optional*): Tokens per chunk of the `"chunked_attention"` layers of
            `layer_types` (transformers' Llama 4 field): a query attends only to the keys of its own chunk, causally.
            Required where some layer is chunked, unset otherwise.
    """

    attention_chunk_size: int | None = None


def layer_window(config, layer_type: str) -> int | None:
    """How far back the keys of a layer of `layer_type` can reach, as a window its cache keeps: `sliding_window`
    for a sliding layer, `attention_chunk_size` for a chunked one, `None` (every key) otherwise."""
    if layer_type == "sliding_attention":
        return config.sliding_window
    if layer_type == CHUNKED_ATTENTION:
        return config.attention_chunk_size
    return None


class ChunkedAttention(Feature):
    """The `"chunked_attention"` layers of `layer_types` and their `attention_chunk_size`."""

    name = "chunked_attention"
    fields = ("attention_chunk_size",)
    mask_builder = staticmethod(create_chunked_causal_mask)

    def in_use(self, config) -> bool:
        return isinstance(config.layer_types, list) and CHUNKED_ATTENTION in config.layer_types

    def validate(self, config) -> None:
        used = self.in_use(config)
        require_unset_unless(config, used, self.fields, "to the 'chunked_attention' layers of `layer_types`")
        if used:
            if config.attention_chunk_size is None:
                raise ValueError("`layer_types` has 'chunked_attention' layers but `attention_chunk_size` is None.")
            require_int("attention_chunk_size", config.attention_chunk_size, minimum=MIN_CHUNK_SIZE)
            if "sliding_attention" in config.layer_types:
                # transformers' mask builders size both masks by the first layer whose cache slides
                raise ValueError("`layer_types` mixes 'sliding_attention' and 'chunked_attention' layers, whose "
                                 "masks transformers sizes by one cache layer: use one or the other.")


CHUNKED_ATTENTION_FEATURE = ChunkedAttention()

__all__ = ["CHUNKED_ATTENTION", "CHUNKED_ATTENTION_FEATURE", "ChunkedAttentionFields", "layer_window"]
