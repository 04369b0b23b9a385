"""LFM2's gated short convolution: a linear-attention kind whose only state is a convolution window, chosen per layer
by `layer_types` (`"linear_attention"`) and `linear_attention_type="short_conv"` (`SHORT_CONV`, its registry entry).

    x ── in_proj ──┬─ B ─┐
                   ├─ x' ┴─ B ⊙ x' ── conv1d: depthwise causal, K taps, no activation ──┐
                   └─ C ──────────────────────────────────────────────────── C ⊙ ──┴─ out_proj ──>

Three gates from one projection (`in_proj`: rows [B; C; x'], transformers' order), the convolution over B ⊙ x' along
the sequence, gated again by C: y = out_proj(C ⊙ conv(B ⊙ x')). Its cache keeps the last K values of B ⊙ x' per
sequence (a `RecurrentLayer` with a window only), `linear_conv_kernel_dim`·d numbers whatever the context. With `conv_bias` the
projections and the taps carry biases.

Padding: a left-padded position's B ⊙ x' is zeroed before the convolution, so the row computes what it computes
alone (the convolution sees zeros before a sequence's first token). transformers' `Lfm2ShortConv` zeroes the hidden
state instead, which is the same only without biases (as every released LFM2 is: `conv_bias=False`); with biases
its padded positions leak bias products into the window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .delta_rule import kernels_for
from .kinds import LinearAttentionKind, require_bool, require_int
from .packed_documents import PackedDocuments
from .recurrent_cache import RecurrentLayer
from .recurrent_mixer import RecurrentMixer, identity

# `linear_conv_kernel_dim` where a short-convolution config leaves it unset (LFM2's `conv_L_cache`)
DEFAULT_KERNEL_SIZE = 3


@dataclass(kw_only=True)
class ShortConvFields:
    r"""The gated short convolution's options.

    Args:
        conv_bias (`bool`): Biases on the short-convolution layers' `in_proj`, `conv` and `out_proj` (LFM2's
            `conv_bias`). `linear_attention_type="short_conv"` only.
    """

    conv_bias: bool = False


class ShortConvolution(RecurrentMixer):
    """LFM2's gated short convolution (see the module docstring); `forward` returns `(output, None)`."""

    activation_name, activation = None, staticmethod(identity)  # no activation after the convolution

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        d, self.conv_kernel_size, bias = config.hidden_size, config.linear_conv_kernel_dim, config.conv_bias
        self.in_proj = nn.Linear(d, 3 * d, bias=bias)
        self.conv1d = nn.Conv1d(d, d, self.conv_kernel_size, groups=d, padding=self.conv_kernel_size - 1, bias=bias)
        self.out_proj = nn.Linear(d, d, bias=bias)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None, cache=None,
                documents: PackedDocuments | None = None, **kwargs) -> tuple[torch.Tensor, None]:
        """`attention_mask`: the 2-D padding mask of the new tokens (`linear_attention_mask`); `documents`: packed
        documents in the rows, each convolved from zeros."""
        b, c, x = self.in_proj(hidden_states).transpose(1, 2).chunk(3, dim=1)  # (B, d, T) each
        gated = b * x
        if attention_mask is not None:  # padding writes nothing into the window
            gated = gated * attention_mask[:, None, :].to(gated.dtype)
        out = c * self._convolve_any(gated, self._state(cache), kernels_for(hidden_states.device), documents)
        return self.out_proj(out.transpose(1, 2)), None


class ShortConvKind(LinearAttentionKind):
    """`linear_attention_type="short_conv"`: LFM2's gated short convolution."""

    name = "short_conv"
    module = ShortConvolution
    fields = ("linear_conv_kernel_dim", "conv_bias")

    def complete(self, config) -> None:
        if self.in_use(config) and config.linear_conv_kernel_dim is None:
            config.linear_conv_kernel_dim = DEFAULT_KERNEL_SIZE

    def validate(self, config) -> None:
        super().validate(config)
        if self.in_use(config):
            require_int("linear_conv_kernel_dim", config.linear_conv_kernel_dim, minimum=1)
            require_bool("conv_bias", config.conv_bias)

    def cache_layer(self, config, implementation: str, max_cache_len: int | None):
        """A conv window and no recurrent state per sequence (slot 0's window only)."""
        return RecurrentLayer()

    def parameters(self, config) -> int:
        """3·d² (in) + K·d (conv) + d² (out), and 3·d + d + d biases with `conv_bias`."""
        d = config.hidden_size
        return 4 * d * d + config.linear_conv_kernel_dim * d + (5 * d if config.conv_bias else 0)

    def state_bytes(self, config, element_bytes: int) -> int:
        """Per sequence: the window of the last K values of B ⊙ x', K·d·b."""
        return config.linear_conv_kernel_dim * config.hidden_size * element_bytes

    def describe(self, config) -> str:
        return "short-conv"

    def tp_plan(self, config) -> dict[str, str]:
        """The projections gather their outputs, so the gates and the convolution (replicated) see every channel,
        as the Gated DeltaNet plan does."""
        return {f"linear_attn.{name}": "colwise_gather_output" for name in ("in_proj", "out_proj")}


SHORT_CONV = ShortConvKind()


__all__ = ["ShortConvFields", "ShortConvolution", "SHORT_CONV"]
