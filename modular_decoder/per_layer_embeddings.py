"""Per-layer embeddings (Gemma 3n, Gemma 4): a small embedding per layer, added inside the layer.

Each token looks up one row of `embed` (`vocab_size_per_layer_input` x L·p, p = `hidden_size_per_layer_input`), scaled
by sqrt(p), and the embedded input x_0 (after `embedding_multiplier`) is projected to L·p, scaled by d^-1/2 and
RMS-normed per layer; their sum times 2^-1/2 is layer l's input e_l (p wide). Inside layer l, after its sublayers,
a branch reads the layer's output h:

    h ─ input_gate (d→p) ─ act ─ (·) e_l ─ output_proj (p→d) ─ post_norm ─> b      (act: `hidden_act`)

and the residual stream's entry adds b where it belongs (one stream: h + b; AltUp: to the streams it does not
compute, `residual_streams.py`). Ids outside [0, `vocab_size_per_layer_input`) look up row 0, as Gemma 3n does.
The lookup needs token ids: a forward given `inputs_embeds` alone is refused (Gemma 4 recovers the ids by comparing
the embeddings with every row of the table; Gemma 3n leaves the lookup out).

`PER_LAYER_EMBEDDINGS` is the mechanism's entry (`registries.FEATURES`); its fields live in `PerLayerEmbeddingFields`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from .kinds import Feature, require_int, require_unset_unless
from .mlp import activation
from .norms import build_norm, norm_parameters


@dataclass(kw_only=True)
class PerLayerEmbeddingFields:
    """Args:
        hidden_size_per_layer_input (`int`): Width p of each layer's embedding (transformers' Gemma 3n / Gemma 4
            field). 0: none.
        vocab_size_per_layer_input (`int`, *optional*): Rows of the per-layer embedding table (transformers' field);
            ids past it look up row 0. Defaults to `vocab_size` where p > 0.
    """

    hidden_size_per_layer_input: int = 0
    vocab_size_per_layer_input: int | None = None


class PerLayerEmbeddings(nn.Module):
    """The model's part: every layer's input e_l, (B, T, L, p), from the ids and the embedded input."""

    def __init__(self, config):
        super().__init__()
        self.layers, self.width = config.num_hidden_layers, config.hidden_size_per_layer_input
        self.rows = config.vocab_size_per_layer_input
        self.embed = nn.Embedding(self.rows, self.layers * self.width, config.pad_token_id)
        self.projection = nn.Linear(config.hidden_size, self.layers * self.width, bias=False)
        self.norm = build_norm(config, self.width)
        self.embed_scale = math.sqrt(self.width)
        self.projection_scale = config.hidden_size ** -0.5

    def forward(self, input_ids: torch.Tensor | None, embedded: torch.Tensor) -> torch.Tensor:
        if input_ids is None:
            raise ValueError("Per-layer embeddings (`hidden_size_per_layer_input`) look tokens up by id: pass "
                             "`input_ids` (`inputs_embeds` alone cannot give them).")
        ids = torch.where((input_ids >= 0) & (input_ids < self.rows), input_ids, 0)
        table = self.embed(ids)
        table = table * torch.tensor(self.embed_scale).to(table.dtype)  # (Gemma's embedding scale: an fp32 tensor, cast)
        projected = self.projection(embedded) * self.projection_scale
        projected = self.norm(projected.unflatten(-1, (self.layers, self.width)))  # (B, T, L, p)
        return (projected + table.unflatten(-1, (self.layers, self.width))) * 2.0 ** -0.5


class PerLayerInputBranch(nn.Module):
    """A layer's part: b = post_norm(output_proj(act(input_gate(h)) · e_l)) (see the module docstring)."""

    def __init__(self, config):
        super().__init__()
        d, p = config.hidden_size, config.hidden_size_per_layer_input
        self.input_gate = nn.Linear(d, p, bias=False)
        self.act_fn = activation(config.hidden_act)
        self.output_proj = nn.Linear(p, d, bias=False)
        self.post_norm = build_norm(config)

    def forward(self, hidden: torch.Tensor, layer_input: torch.Tensor) -> torch.Tensor:
        return self.post_norm(self.output_proj(self.act_fn(self.input_gate(hidden)) * layer_input))


class PerLayerEmbeddingsFeature(Feature):
    """`hidden_size_per_layer_input` > 0: the model's `per_layer_embeddings`, every block's `per_layer_input`."""

    name = "per_layer_embeddings"
    fields = ("hidden_size_per_layer_input", "vocab_size_per_layer_input")
    switch = "hidden_size_per_layer_input"

    def in_use(self, config) -> bool:
        return bool(config.hidden_size_per_layer_input)

    def complete(self, config) -> None:
        if self.in_use(config) and config.vocab_size_per_layer_input is None:
            config.vocab_size_per_layer_input = config.vocab_size

    def validate(self, config) -> None:
        require_int("hidden_size_per_layer_input", config.hidden_size_per_layer_input, minimum=0)
        require_unset_unless(config, self.in_use(config), ("vocab_size_per_layer_input",),
                             "with `hidden_size_per_layer_input` > 0")
        if self.in_use(config):
            require_int("vocab_size_per_layer_input", config.vocab_size_per_layer_input, minimum=1)
            if config.num_mtp_layers:
                raise ValueError("`hidden_size_per_layer_input` with `num_mtp_layers`: the MTP modules take no "
                                 "per-layer embeddings; use one or the other.")

    def parameters(self, config) -> tuple[int, int]:
        """(the model's part: table, projection, norm; one layer's branch: gate, projection, norm)."""
        if not self.in_use(config):
            return 0, 0
        d, p, layers = config.hidden_size, config.hidden_size_per_layer_input, config.num_hidden_layers
        model = config.vocab_size_per_layer_input * layers * p + d * layers * p + norm_parameters(config, p)
        return model, 2 * d * p + norm_parameters(config, d)


PER_LAYER_EMBEDDINGS = PerLayerEmbeddingsFeature()

__all__ = ["PER_LAYER_EMBEDDINGS", "PerLayerEmbeddingFields", "PerLayerEmbeddings", "PerLayerInputBranch"]
