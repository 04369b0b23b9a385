"""LAUREL (Learned Augmented Residual Layer, arXiv 2411.07501; Gemma 3n): a low-rank side branch of the attention
sublayer, averaged with it.

With `laurel_rank` r > 0, the attention sublayer of a pre-norm or sandwich block joins the stream as

    x ─┬─ pre_attn_norm ─ n ─┬─ attn [─ post_attn_norm] ─┐
       │                     └─ n + post_norm(linear_right(linear_left(n))) ── (+) ── /√2 ─>
       └─────────────────────────────────────────────────(+)┘

that is (x + attn + laurel(n)) / √2, with `linear_left` d→r and `linear_right` r→d (Gemma 3n's `laurel` block names
them so). The block calls `join_attention` at that point (`blocks.py`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .norms import build_norm, norm_parameters


class Laurel(nn.Module):
    """n + post_norm(linear_right(linear_left(n))): the low-rank branch over the attention's normed input n."""

    def __init__(self, config):
        super().__init__()
        self.linear_left = nn.Linear(config.hidden_size, config.laurel_rank, bias=False)
        self.linear_right = nn.Linear(config.laurel_rank, config.hidden_size, bias=False)
        self.post_norm = build_norm(config)

    def forward(self, normed: torch.Tensor) -> torch.Tensor:
        return normed + self.post_norm(self.linear_right(self.linear_left(normed)))


def join_attention(block, x: torch.Tensor, branch: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
    """The attention sublayer's output `branch` joined to the stream `x`: the block's residual addition, averaged with
    the LAUREL branch of its normed input `normed` where the layer has one."""
    joined = block.residual(x, branch)
    if block.laurel is None:
        return joined
    return (joined + block.laurel(normed)) / math.sqrt(2)  # (Gemma 3n divides by √2)


def laurel_parameters(config) -> int:
    """One layer's LAUREL branch: 2·d·r and a norm over d (none without `laurel_rank`)."""
    if not config.laurel_rank:
        return 0
    return 2 * config.hidden_size * config.laurel_rank + norm_parameters(config, config.hidden_size)


__all__ = ["Laurel", "join_attention", "laurel_parameters"]
