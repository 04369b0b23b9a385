"""What the recurrent token mixers (Gated DeltaNet, KDA, LFM2's short convolution, Mamba-2) share: their entry in the
family's cache, their short causal convolution over a prompt, a decode step, a cached window or packed documents, and
a delta rule's recurrence through the cache.

A mixer subclasses `RecurrentMixer` and sets `layer_idx`, `conv1d` (a depthwise `nn.Conv1d` padded by K - 1),
`conv_kernel_size` (K), `activation_name` and `activation` (applied after the convolution; `None` and the identity for
none, as LFM2's). The convolution runs through causal-conv1d's kernels where they run (`kernels.conv`,
`kernels.conv_update`) and the module is plain; otherwise the module is called, so hooks and adapters on it run.
The model's `_init_weights` calls `init_scan_parameters(init)` for the mixer's own parameters (A_log, dt_bias, ...).
"""

from __future__ import annotations

import torch
from torch import nn

from .delta_rule import causal_conv1d, causal_conv1d_last
from .hybrid_cache import HybridLayer
from .packed_documents import PackedDocuments, convolve_documents, last_document_only
from .recurrent_cache import RecurrentLayer, run_recurrence
from .split_products import weight_is_readable

# The activations causal-conv1d's kernels apply (None: none; any other runs through the module)
FUSED_ACTIVATIONS = (None, "silu", "swish")


class RecurrentMixer(nn.Module):
    """Base of a token mixer that keeps a recurrent state and a convolution window in the cache."""

    layer_idx: int
    conv1d: nn.Conv1d
    conv_kernel_size: int
    activation_name: str | None

    def _state(self, cache) -> RecurrentLayer | None:
        """This layer's entry of `cache` (the family's `ModularDecoderCache`), or a `ValueError` naming the cache
        where another kind was passed: a K/V cache has no place for a recurrent state."""
        if cache is None:
            return None
        layers = getattr(cache, "layers", None)
        layer = layers[self.layer_idx] if isinstance(layers, list) and self.layer_idx < len(layers) else None
        layer = layer.recurrent if isinstance(layer, HybridLayer) else layer  # a hybrid layer's state
        if not isinstance(layer, RecurrentLayer):
            raise ValueError(
                f"`cache` is a {type(cache).__name__} whose layer {self.layer_idx} cannot hold this "
                "'linear_attention' layer's state: pass `modular_decoder.ModularDecoderCache(config)` (generate "
                "builds one by itself)."
            )
        return layer

    def _convolve(self, x: torch.Tensor, layer, kernels) -> torch.Tensor:
        """The short causal convolution of x (B, C, T), continuing the cached window when there is one.

        A decode step on causal-conv1d updates the window in place (not while the cache records: a crop may need the
        window before it); everything else prepends the cached window (`RecurrentLayer.update_conv_state`) and
        convolves, through causal-conv1d's kernel where it runs and the module is plain, else by calling the module;
        a one-token step on a cached window of a plain module computes its one output from the weight
        (`causal_conv1d_last`)."""
        fused = self._fused_conv(kernels)
        seq = x.shape[-1]
        if fused and layer is not None and layer.conv_state is not None and seq == 1 and not layer.record_past:
            layer.count_step()
            return kernels.conv_update(x, layer.conv_state, self.conv1d.weight.squeeze(1), self.conv1d.bias,
                                       self.activation_name)
        if layer is not None:
            x = layer.update_conv_state(x, conv_kernel_size=self.conv_kernel_size)
        if (not fused and seq == 1 and x.shape[-1] >= self.conv_kernel_size
                and weight_is_readable(self.conv1d, nn.Conv1d)):
            return self.activation(causal_conv1d_last(x, self.conv1d.weight, self.conv1d.bias))
        return self._convolution(x, kernels, fused)[..., -seq:]

    def _convolve_documents(self, x: torch.Tensor, layer, kernels, documents: PackedDocuments) -> torch.Tensor:
        """The short causal convolution of x (B, C, T) over packed documents, each from zeros
        (`packed_documents.convolve_documents`); the cache keeps each row's last document's window."""
        if layer is not None:
            layer.update_conv_state(last_document_only(x, documents), conv_kernel_size=self.conv_kernel_size)
        fused = self._fused_conv(kernels)
        return convolve_documents(x, documents, self.conv_kernel_size,
                                  lambda row: self._convolution(row, kernels, fused))

    def _convolve_any(self, x: torch.Tensor, layer, kernels, documents: PackedDocuments | None) -> torch.Tensor:
        """`_convolve`, or `_convolve_documents` where the rows hold packed documents."""
        if documents is None:
            return self._convolve(x, layer, kernels)
        return self._convolve_documents(x, layer, kernels, documents)

    def _fused_conv(self, kernels) -> bool:
        """Whether causal-conv1d's kernels compute the convolution: where they run, for its activations, on a plain
        module (otherwise the module is called, so hooks and adapters on it run)."""
        return (kernels.conv is not None and self.activation_name in FUSED_ACTIVATIONS
                and weight_is_readable(self.conv1d, nn.Conv1d))

    def _convolution(self, x: torch.Tensor, kernels, fused: bool) -> torch.Tensor:
        """activation(causal convolution of x (B, C, L)), zero-padded on the left, no cache."""
        if fused:
            return kernels.conv(x, self.conv1d.weight.squeeze(1), self.conv1d.bias, activation=self.activation_name)
        return causal_conv1d(x, self.conv1d, self.activation)

    def _delta_rule(self, inputs: tuple, layer, kernels, documents: PackedDocuments | None) -> torch.Tensor:
        """A delta rule (Gated DeltaNet's, KDA's) over (query, key, value, g, beta): recurrent for a one-token step on
        a cached state, chunked otherwise (`recurrent_cache.run_recurrence`, which also records the states a crop may
        restore), or document by document; the cache keeps the new state."""
        if documents is None:  # (B, T, H_v, d_v); the state (B, H_v, d_k, d_v) and, while recording, per token
            return run_recurrence(layer, kernels.chunked, kernels.recurrent, inputs)
        # the rows end to end as one row of documents; each row's last document's state is its state
        batch, seq = inputs[0].shape[:2]
        flat = (x.reshape(1, batch * seq, *x.shape[2:]) for x in inputs)
        out, states = kernels.chunked_documents(*flat, documents)  # (1, B·T, H_v, d_v), (N, H_v, d_k, d_v)
        if layer is not None:
            layer.update_recurrent_state(states[documents.last])
        return out.reshape(batch, seq, *out.shape[2:])

    def init_scan_parameters(self, init) -> None:
        """Initialise this module's own parameters (not its submodules'), with transformers' `initialization`
        helpers (`init`). Nothing by default."""


def identity(x: torch.Tensor) -> torch.Tensor:
    return x


__all__ = ["FUSED_ACTIVATIONS", "RecurrentMixer", "identity"]
