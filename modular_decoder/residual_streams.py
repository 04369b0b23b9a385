"""How a layer's output joins the residual stream (`residual_stream`), and what a layer adds to it beside its
sublayers.

    single             one stream: x_{l+1} = layer(x_l), the sublayers' residual additions as the block draws them
                       (every family until Gemma 3n and DeepSeek-V4)
    altup              n streams, each layer computing one between a predict and a correct step (Gemma 3n;
                       `altup.py`)
    hyper_connections  n streams mixed around each sublayer's branch by learned, Sinkhorn-normalised matrices
                       (DeepSeek-V4's manifold-constrained hyper-connections; `hyper_connections.py`): the join runs
                       a serial block's two branches (`blocks.SerialBlock`) rather than its whole diagram

An entry owns the model's part (`model_module`: the stream(s) made from the embedded input, and collapsed back to
one before the final norm), each layer's part (`layer_modules`) and the join itself (`join`: run the block's
sublayers, `DecoderBlock.sublayers`, or its two branches, and merge their output into the stream). What the
entries that run the whole diagram (single, altup) join the same way, each after the sublayers and in this order:

- a per-layer embedding's branch (`per_layer_embeddings.py`, `hidden_size_per_layer_input`): added to the stream;
- `layer_scalar` (Gemma 4): the layer's output times a scalar the checkpoint holds (`layer_scalar`, a saved
  buffer per layer, 1 when fresh; transformers' name), as Gemma 4 scales it.

Inside the diagram, the attention sublayer's output may join with a LAUREL branch beside it (`laurel_rank`,
`laurel.py`), which those entries allow. Hyper-connections refuse the three by name (their streams mix around each
branch, where none of them has a place).

`ResidualStreamFields` holds the fields, `registries.RESIDUAL_STREAMS` the entries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .kinds import Kind, require_bool, require_int
from .laurel import Laurel
from .per_layer_embeddings import PER_LAYER_EMBEDDINGS, PerLayerInputBranch


@dataclass(kw_only=True)
class ResidualStreamFields:
    """Args:
        residual_stream (`str`): How each layer's output joins the residual stream: `"single"` (one stream),
            `"altup"` (AltUp's `altup_num_inputs` streams, one computed per layer: Gemma 3n) or `"hyper_connections"`
            (`hc_mult` streams mixed around each sublayer: DeepSeek-V4).
        layer_scalar (`bool`): Each layer's output, the whole stream, times a scalar of its own (`layer_scalar`, a
            buffer saved with the weights and not trained, 1 when fresh: Gemma 4).
        laurel_rank (`int`): Width r of LAUREL's low-rank branch beside each layer's attention (Gemma 3n's field): the
            attention sublayer joins as (x + attn + n + post_norm(right(left(n)))) / √2, n its normed input. Blocks with
            a pre-attention norm (`norm_position` pre or sandwich, serial). 0: none.
    """

    residual_stream: str = "single"
    layer_scalar: bool = False
    laurel_rank: int = 0


class ResidualStreamKind(Kind):
    """A value of `residual_stream`: the model's and each layer's parts, and the join."""

    position_dim = 1  # the positions' dim in the stream(s) the layers pass on ((B, T, d); (B, T, n, d))

    def validate(self, config) -> None:
        require_bool("layer_scalar", config.layer_scalar)
        require_int("laurel_rank", config.laurel_rank, minimum=0)
        if config.laurel_rank and (config.parallel_block or config.norm_position not in ("pre", "sandwich")):
            raise ValueError("`laurel_rank` adds a branch of the attention's normed input: it needs a serial block with "
                             f"a pre-attention norm (`norm_position` 'pre' or 'sandwich'), got `norm_position`="
                             f"{config.norm_position!r}{' with `parallel_block`' if config.parallel_block else ''}.")

    def model_module(self, config) -> nn.Module:
        """The model's part: called with the embedded input (B, T, d) it returns the stream(s) layer 0 takes, and
        with `leaving=True` the last layer's output as one (B, T, d) stream for the final norm."""
        raise NotImplementedError

    def layer_modules(self, config, layer_idx: int) -> dict[str, nn.Module]:
        """The modules a layer holds for this entry, by attribute name."""
        return {}

    def join(self, block, x, per_layer_input=None, **kwargs) -> torch.Tensor:
        """The layer: `block.sublayers` run on the stream(s) `x`, their output merged into the stream."""
        raise NotImplementedError

    def layer_parameters(self, config) -> int:
        """Parameters one layer holds for this entry."""
        return 0

    def model_parameters(self, config) -> int:
        """Parameters the model's part holds."""
        return 0

    def fp32_modules(self, config) -> tuple[str, ...]:
        """Name patterns of its modules that stay fp32 whatever dtype the model loads in."""
        return ()


class OneStream(nn.Module):
    """The single stream's model part: the embedded input is the stream, the last layer's output leaves as it is."""

    def forward(self, hidden: torch.Tensor, leaving: bool = False) -> torch.Tensor:
        return hidden


def scaled_layer_output(block, hidden: torch.Tensor) -> torch.Tensor:
    """`hidden` times the layer's `layer_scalar` where it has one (`layer_scalar`)."""
    return hidden if block.layer_scalar is None else hidden * block.layer_scalar


class SingleStream(ResidualStreamKind):
    """One stream: x ─ sublayers ─ h ─(+ per-layer branch(h))─ · layer_scalar ─>"""

    name = "single"

    def model_module(self, config) -> nn.Module:
        return OneStream()

    def join(self, block, x, per_layer_input=None, **kwargs) -> torch.Tensor:
        hidden = block.sublayers(x, **kwargs)
        if block.per_layer_input is not None:
            hidden = hidden + block.per_layer_input(hidden, per_layer_input)
        return scaled_layer_output(block, hidden)


SINGLE_STREAM = SingleStream()


def attach_layer_modules(block: nn.Module, config, layer_idx: int, stream: ResidualStreamKind, mixes: bool) -> None:
    """Give `block` what its layer adds beside its sublayers: the stream entry's modules, the per-layer embedding's
    branch (`per_layer_input`, or `None`), the LAUREL branch beside its token mixer (`laurel`; `None` without one, or
    in a layer that `mixes` no tokens) and the `layer_scalar` buffer (or `None`)."""
    block.stream = stream
    for name, module in stream.layer_modules(config, layer_idx).items():
        setattr(block, name, module)
    block.per_layer_input = PerLayerInputBranch(config) if PER_LAYER_EMBEDDINGS.in_use(config) else None
    block.laurel = Laurel(config) if config.laurel_rank and mixes else None
    block.register_buffer("layer_scalar", torch.ones(1) if config.layer_scalar else None)


__all__ = ["SINGLE_STREAM", "ResidualStreamFields", "ResidualStreamKind", "attach_layer_modules",
           "scaled_layer_output"]
