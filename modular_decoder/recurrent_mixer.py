"""What every linear-attention layer shares: its entry of the cache, and its short causal convolution continued
across forwards through the cache's window.

Each kind of `registries.LINEAR_ATTENTIONS` that convolves (Gated DeltaNet and KDA over their queries, keys and
values, LFM2's gated short convolution over B ⊙ x) computes act(conv(x)) over the new inputs x (B, C, T) with the
last K inputs before them: the window its cache layer keeps (`recurrent_cache.RecurrentLayer.update_conv_state`),
zeros before a sequence's first token, as a lone sequence's convolution pads. A decode step on causal-conv1d
updates the window in place (`causal_conv1d_update`); everything else prepends the window and convolves, through
causal-conv1d's kernel where it runs and the module is plain, else by calling the module (so hooks and adapters on it
run). Packed documents each start from zeros (`packed_documents.convolve_documents`).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from transformers.activations import ACT2FN

from .packed_documents import PackedDocuments, convolve_documents, last_document_only
from .recurrent_cache import RecurrentLayer
from .split_products import weight_is_readable

# The activations causal-conv1d's kernels apply themselves (None: none)
FUSED_ACTIVATIONS = (None, "silu", "swish")


class RecurrentMixer(nn.Module):
    """Base of a linear-attention layer: `layer_idx`, its cache entry (`cache_layer`) and its convolution
    (`convolve`). A subclass sets `conv_name` (the attribute holding its `nn.Conv1d`) and `conv_activation` (an
    `ACT2FN` key, or None)."""

    conv_name = "conv1d"
    conv_activation: str | None = None

    def __init__(self, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx

    def cache_layer(self, cache) -> RecurrentLayer | None:
        """This layer's entry of `cache` (the family's `ModularDecoderCache`), or a `ValueError` naming the cache
        where another kind was passed: a K/V cache has no place for a recurrent state."""
        if cache is None:
            return None
        layers = getattr(cache, "layers", None)
        layer = layers[self.layer_idx] if isinstance(layers, list) and self.layer_idx < len(layers) else None
        if not isinstance(layer, RecurrentLayer):
            raise ValueError(
                f"`cache` is a {type(cache).__name__} whose layer {self.layer_idx} cannot hold this "
                "'linear_attention' layer's state: pass `modular_decoder.ModularDecoderCache(config)` (generate "
                "builds one by itself)."
            )
        return layer

    def convolve(self, x: torch.Tensor, layer: RecurrentLayer | None, kernels,
                 documents: PackedDocuments | None = None) -> torch.Tensor:
        """act(causal conv) of the new inputs x (B, C, T), continuing `layer`'s window (module docstring)."""
        conv = getattr(self, self.conv_name)
        kernel_size = conv.kernel_size[0]
        fused = self._fused_conv(conv, kernels)
        if documents is not None:  # the cache keeps each row's last document's window
            if layer is not None:
                layer.update_conv_state(last_document_only(x, documents), conv_kernel_size=kernel_size)
            return convolve_documents(x, documents, kernel_size, lambda row: self._convolution(row, conv, kernels, fused))
        seq = x.shape[-1]
        if fused and layer is not None and layer.conv_state is not None and seq == 1:
            layer.count_step()
            return kernels.conv_update(x, layer.conv_state, conv.weight.squeeze(1), conv.bias, self.conv_activation)
        if layer is not None:
            x = layer.update_conv_state(x, conv_kernel_size=kernel_size)
        return self._convolution(x, conv, kernels, fused)[..., -seq:]

    def run_rule(self, inputs: tuple, layer: RecurrentLayer | None, kernels,
                 documents: PackedDocuments | None) -> torch.Tensor:
        """The layer's recurrence over `inputs` ((B, T, ...) tensors, queries first): `kernels.recurrent` for a
        one-token step on a cached state, `kernels.chunked` otherwise, or `kernels.chunked_documents` document by
        document (the rows end to end as one row; each row's last document's state is its state); the cache keeps
        the new state."""
        batch, seq = inputs[0].shape[:2]
        if documents is None:
            state = layer.recurrent_state if layer is not None else None
            rule = kernels.recurrent if state is not None and seq == 1 else kernels.chunked
            out, state = rule(*inputs, state)  # (B, T, H_v, d_v), (B, H_v, d_k, d_v)
        else:
            flat = (x.reshape(1, batch * seq, *x.shape[2:]) for x in inputs)
            out, states = kernels.chunked_documents(*flat, documents)  # (1, B·T, H_v, d_v), (N, H_v, d_k, d_v)
            out, state = out.reshape(batch, seq, *out.shape[2:]), states[documents.last]
        if layer is not None:
            layer.update_recurrent_state(state)
        return out

    def _fused_conv(self, conv: nn.Conv1d, kernels) -> bool:
        """Whether causal-conv1d's kernels compute the convolution: where they run, for their activations, on a
        plain module (otherwise the module is called, so hooks and adapters on it run)."""
        return (kernels.conv is not None and self.conv_activation in FUSED_ACTIVATIONS
                and weight_is_readable(conv, nn.Conv1d))

    def _convolution(self, x: torch.Tensor, conv: nn.Conv1d, kernels, fused: bool) -> torch.Tensor:
        """act(causal convolution of x (B, C, L)), zero-padded on the left, no cache."""
        if fused:
            return kernels.conv(x, conv.weight.squeeze(1), conv.bias, activation=self.conv_activation)
        return causal_conv1d(x, conv, activation_function(self.conv_activation))

    def init_parameters(self, init, std: float) -> None:
        """Initialise this module's own parameters (not its submodules'), with transformers' `initialization`
        helpers (`init`); the model's `_init_weights` calls it. Nothing by default."""


def activation_function(name: str | None) -> Callable:
    return ACT2FN[name] if name is not None else _identity


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def causal_conv1d(x: torch.Tensor, conv: nn.Conv1d, activation: Callable) -> torch.Tensor:
    """activation(depthwise causal conv) of x (B, C, T) through the module `conv` (padding K - 1 on both sides:
    the first T outputs are the causal ones), so hooks and adapters on it run."""
    return activation(conv(x)[..., : x.shape[-1]])


__all__ = ["RecurrentMixer", "activation_function", "causal_conv1d"]
