"""A dynamic cache layer that grows by doubling pre-allocated storage instead of concatenating.

transformers' `DynamicLayer` runs `torch.cat` on every update, so a decode step copies the whole
cache and its time grows with the context. `GrowingLayer` writes the new tokens into spare
capacity (doubled when full: amortised O(1) copies per token) and exposes `keys` / `values` as
views of the filled part. Every transformers operation on those attributes (crop, beam reorder,
batch repeat / select, reset) therefore works unchanged; an operation that replaces them is
adopted into fresh storage at the next update.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer


class GrowingLayer(DynamicLayer):
    """`DynamicLayer` semantics with pre-allocated, doubling storage (see the module docstring)."""

    min_capacity = 64

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._key_store = self._value_store = None
        self._key_view = self._value_view = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad):
            # In-place writes into storage that autograd saved for backward would fail there
            self._key_store = None
            return super().update(key_states, value_states)
        if self._key_store is None or self.keys is not self._key_view or self.values is not self._value_view:
            self._adopt(key_states, value_states)
        length, new = self.keys.shape[-2], key_states.shape[-2]
        if length + new > self._key_store.shape[-2]:
            self._reallocate(length + new)
        self._key_store[..., length : length + new, :].copy_(key_states)
        self._value_store[..., length : length + new, :].copy_(value_states)
        self.keys = self._key_view = self._key_store[..., : length + new, :]
        self.values = self._value_view = self._value_store[..., : length + new, :]
        return self.keys, self.values

    def _adopt(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Storage for what `keys` / `values` hold now (empty at the start, or set from outside)."""
        if self.keys.numel() == 0:
            self.keys = key_states[..., :0, :]
            self.values = value_states[..., :0, :]
        self._key_store, self._value_store = self.keys, self.values
        self._reallocate(self.keys.shape[-2] + key_states.shape[-2])

    def _reallocate(self, needed: int) -> None:
        capacity = max(self.min_capacity, 1 << (needed - 1).bit_length())
        length = self.keys.shape[-2]
        stores = []
        for old in (self._key_store, self._value_store):
            store = old.new_empty((*old.shape[:-2], capacity, old.shape[-1]))
            store[..., :length, :].copy_(old[..., :length, :])
            stores.append(store)
        self._key_store, self._value_store = stores
        self.keys = self._key_view = self._key_store[..., :length, :]
        self.values = self._value_view = self._value_store[..., :length, :]

    def reset(self) -> None:
        self._key_store = self._value_store = self._key_view = self._value_view = None
        super().reset()

    def allocated_tensors(self) -> list:
        """The storage, spare capacity included (for `ModularDecoderCache.allocated_bytes`)."""
        if getattr(self, "_key_store", None) is None:
            return [self.keys, self.values]
        return [self._key_store, self._value_store]
