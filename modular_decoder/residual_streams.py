"""How a layer's output joins the residual stream (`residual_stream`).

    single             one stream: x_{l+1} = layer(x_l), the sublayers' residual additions as the block draws them
                       (every family until Gemma 3n and DeepSeek-V4)
    hyper_connections  `hc_mult` streams mixed around each sublayer by learned, Sinkhorn-normalised matrices
                       (DeepSeek-V4's manifold-constrained hyper-connections: `hyper_connections.py`)

An entry owns the model's part (`model_module`: the stream(s) made from the embedded input, and collapsed back to
one before the final norm), each layer's part (`layer_modules`) and the join itself (`join`: run the block's
sublayers, `DecoderBlock.sublayers`, or its two branches, and merge their output into the stream).

`ResidualStreamFields` holds the field, `registries.RESIDUAL_STREAMS` the entries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .kinds import Kind


@dataclass(kw_only=True)
class ResidualStreamFields:
    """Args:
        residual_stream (`str`): How each layer's output joins the residual stream: `"single"` (one stream) or
            `"hyper_connections"` (`hc_mult` streams mixed around each sublayer, DeepSeek-V4).
    """

    residual_stream: str = "single"


class ResidualStreamKind(Kind):
    """A value of `residual_stream`: the model's and each layer's parts, and the join."""

    def model_module(self, config) -> nn.Module:
        """The model's part: called with the embedded input (B, T, d) it returns the stream(s) layer 0 takes, and
        with `leaving=True` the last layer's output as one (B, T, d) stream for the final norm."""
        raise NotImplementedError

    def layer_modules(self, config, layer_idx: int) -> dict[str, nn.Module]:
        """The modules a layer holds for this entry, by attribute name."""
        return {}

    def join(self, block, x, **kwargs) -> torch.Tensor:
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


class SingleStream(ResidualStreamKind):
    """One stream: x ─ sublayers ─>"""

    name = "single"

    def model_module(self, config) -> nn.Module:
        return OneStream()

    def join(self, block, x, **kwargs) -> torch.Tensor:
        return block.sublayers(x, **kwargs)


SINGLE_STREAM = SingleStream()


def attach_layer_modules(block: nn.Module, config, layer_idx: int, stream: ResidualStreamKind) -> None:
    """Give `block` what its layer holds for the stream entry."""
    block.stream = stream
    for name, module in stream.layer_modules(config, layer_idx).items():
        setattr(block, name, module)


__all__ = ["SINGLE_STREAM", "OneStream", "ResidualStreamFields", "ResidualStreamKind", "attach_layer_modules"]
