"""The base class of every attention kind's module: what the attention backends read from a layer
(its config and index, the score scale, the soft-cap and window of its layer type, causality, the
RoPE pair layout) and the keyword arguments of the one attention call each kind makes.
"""

from __future__ import annotations

from torch import nn


class AttentionLayer(nn.Module):
    """What every attention kind's module carries for the backends: its config and layer, the score
    scale, soft-cap and window of its layer type, causality and the RoPE pair layout.

    A kind's `forward` makes exactly one call through transformers' attention interface, written out
    in its own source as `attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(...)` and
    `attention_interface(self, q, k, v, mask, scaling=self.scaling, **self.score_kwargs(kwargs))`:
    `attn_implementation` picks the backend, and vLLM's Transformers modeling backend finds each
    layer's attention by reading that call (with `scaling=self.<attr>` and `layer_idx`)."""

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

    def score_kwargs(self, kwargs: dict) -> dict:
        """What a backend takes beside q, k, v, the mask and `scaling`: the dropout while training, this
        layer's window and soft-cap, and the model's keyword arguments (position_ids, ALiBi, ...)."""
        kwargs = dict(kwargs, dropout=self.config.attention_dropout if self.training else 0.0,
                      sliding_window=self.sliding_window)
        if self.softcap is not None:
            kwargs["softcap"] = self.softcap
        return kwargs
