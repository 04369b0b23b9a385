"""The base class of every attention kind's module, and the one attention call each kind makes.

It holds what the attention backends read from a layer (its config and index, the score scale, the soft-cap and
window of its layer type, causality, the RoPE pair layout, the attention sinks) and the call's keyword arguments.
"""

from __future__ import annotations

import torch
from torch import nn

from .alibi_kernels import ALIBI_SLOPE_FUNCTIONS
from .backend_features import canonical_backend
from .sinks import sink_function


class AttentionLayer(nn.Module):
    """What every attention kind's module carries for the backends: its config and layer, the score
    scale, soft-cap and window of its layer type, causality and the RoPE pair layout.

    A kind's `forward` makes exactly one call through transformers' attention interface, written out
    in its own source as `attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(...)` and
    `attention_interface(self, q, k, v, mask, scaling=self.scaling, s_aux=self.sinks, **self.score_kwargs(kwargs))`:
    `attn_implementation` picks the backend (`scores_through` swaps in this family's function where a
    backend takes ALiBi slopes or sinks only through it), and vLLM's Transformers modeling backend finds each
    layer's attention by reading that call (with `scaling=self.<attr>`, `s_aux=self.<attr>` and `layer_idx`).

    `sinks` (H,): the attention sinks with `attention_sinks` (`sinks.py`), else `None`."""

    def __init__(self, config, layer_idx: int, scaling: float):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.layer_type = config.layer_types[layer_idx]
        self.scaling = scaling
        self.softcap = config.attn_logit_softcapping
        self.sliding_window = config.sliding_window if self.layer_type == "sliding_attention" else None
        self.is_causal = True
        self.interleaved = config.rope_interleaved
        sinks = nn.Parameter(torch.empty(config.num_attention_heads)) if config.attention_sinks else None
        self.register_parameter("sinks", sinks)

    def scores_through(self, interface, kwargs: dict):
        """The attention function this layer calls.

        `interface` (the backend `attn_implementation` names), or this family's own where a backend takes ALiBi
        slopes (flex, flash-attn 2) or sinks (sdpa, flex, flash) only through it."""
        slopes, sinks = "alibi_slopes" in kwargs, self.sinks is not None
        if not (slopes or sinks):  # (the common case: no backend name to read)
            return interface
        backend = canonical_backend(self.config._attn_implementation)
        if slopes or backend == "flex_attention":  # flex / flash-attn 2 take ALiBi as slopes (flex takes the sinks too)
            return ALIBI_SLOPE_FUNCTIONS[backend]
        return sink_function(backend, interface)

    def score_kwargs(self, kwargs: dict) -> dict:
        """What a backend takes beside q, k, v, the mask and `scaling`: the dropout while training, this
        layer's window and soft-cap, and the model's keyword arguments (position_ids, ALiBi, ...)."""
        kwargs = dict(kwargs, dropout=self.config.attention_dropout if self.training else 0.0,
                      sliding_window=self.sliding_window)
        if self.softcap is not None:
            kwargs["softcap"] = self.softcap
        return kwargs
