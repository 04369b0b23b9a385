"""A forward that keeps only the last k positions' logits runs the layers that cache nothing on those k positions.

The layers that read earlier layers' keys and values (`num_kv_shared_layers`, `kv_sharing.py`) are the last ones and
write nothing to the cache: once the stream reaches the first of them, no later computation of another position
depends on a position whose logits are dropped. So in a forward with an integer `logits_to_keep` = k (what `generate`
passes: 1 for a prefill), from that layer on the stream, the masks' query rows, the rotary tables, the positions,
the token ids and the per-layer inputs are cut to the last k positions, as transformers' Gemma 4 does
(`_maybe_slice_kv_shared_inputs`); the kept positions' logits are those of the whole forward.

It stays off where a caller reads every position (hidden states, attentions or router logits recorded), where the
backend cannot take a cut mask (flash and flex: transformers' condition), where ALiBi's bias is built for every
query, and where a `None` mask stands for SDPA's causal flag, which aligns at the first key, for more than one kept
query or beside a static cache.
"""

from __future__ import annotations

import torch

from .backend_features import canonical_backend
from .compat import attn_implementation
from .kv_sharing import kv_sources

RECORDED = ("output_hidden_states", "output_attentions", "output_router_logits")
CUT_MASK_BACKENDS = frozenset({"eager", "sdpa"})


def kept_positions_from(model, logits_to_keep, seq: int, masks: dict, cache, kwargs: dict) -> int | None:
    """The layer from which a forward of `seq` positions runs on the last `logits_to_keep` only, or `None` where
    it runs on all (module docstring)."""
    sources = kv_sources(model.config)
    first = next((index for index, source in enumerate(sources) if source is not None), None)
    if first is None or not isinstance(logits_to_keep, int) or not 0 < logits_to_keep < seq:
        return None
    if any(kwargs.get(flag) or getattr(model.config, flag, False) for flag in RECORDED):
        return None
    if canonical_backend(attn_implementation(model.config)) not in CUT_MASK_BACKENDS or model.alibi is not None:
        return None
    causal_flag = any(mask is None for mask in masks.values())
    if causal_flag and (logits_to_keep > 1 or getattr(cache, "is_compileable", False)):
        return None
    return first


def last_positions(tensor: torch.Tensor | None, keep: int, dim: int = 1) -> torch.Tensor | None:
    """The last `keep` entries of `tensor` along `dim` (`None` stays `None`)."""
    return None if tensor is None else tensor.narrow(dim, tensor.shape[dim] - keep, keep)


def keep_last(keep: int, stream_dim: int, hidden, masks: dict, rotary: list, position_ids, input_ids,
              layer_inputs: list[dict]) -> tuple:
    """Everything the remaining layers take, cut to the last `keep` positions: the stream(s) `hidden` (positions
    along `stream_dim`), each mask's query rows, each layer's rotary (cos, sin), the positions, the token ids and
    each per-layer input ((B, T, d); the shared keys and values stay whole: they are every position's)."""
    masks = {layer_type: last_positions(mask, keep, dim=-2) for layer_type, mask in masks.items()}
    rotary = [None if table is None else tuple(last_positions(part, keep, dim=-2) for part in table)  # (B, 1, T, r)
              for table in rotary]
    layer_inputs = [{name: last_positions(value, keep) if name == "per_layer_input" else value
                     for name, value in inputs.items()} for inputs in layer_inputs]
    return (last_positions(hidden, keep, stream_dim), masks, rotary, last_positions(position_ids, keep),
            last_positions(input_ids, keep), layer_inputs)


__all__ = ["kept_positions_from", "keep_last", "last_positions"]
