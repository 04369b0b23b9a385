"""A dynamic cache layer that grows into pre-allocated storage instead of concatenating.

transformers' `DynamicLayer` runs `torch.cat` on every update, so a decode step copies the whole
cache and its time grows with the context. `GrowingLayer` writes the new tokens into spare
capacity and exposes `keys` / `values` as views of the filled part. When full, it moves to
storage with `1/spare_divisor` of its length spare (at least `min_spare` tokens): amortised
`spare_divisor` token copies per step instead of the whole context, and at most that fraction of
memory more than `DynamicLayer` holds (doubling would hold up to twice as much).

Every transformers operation on `keys` / `values` (crop, beam reorder, batch repeat / select,
offload, reset) works unchanged. An assignment that is not a prefix view of the storage (a
repeated or reordered batch, a tensor from elsewhere) releases the storage at once, so the old
and the new never stay in memory together; the new tensors move into fresh storage at the next
update, one at a time, as `DynamicLayer`'s concatenation holds them.
"""

from __future__ import annotations

import torch

from .compat import DynamicLayer


def is_prefix_view(tensor, store) -> bool:
    """Whether `tensor` is `store[..., :n, :]` for some n (what `update` and `crop` leave).

    While compiling, the data pointers are not compared (dynamo cannot trace that): inside a compiled step
    only `update` assigns, always a prefix view; a batch repeat, select or reorder runs outside the graph."""
    return (
        isinstance(tensor, torch.Tensor) and store is not None
        and (torch.compiler.is_compiling() or tensor.data_ptr() == store.data_ptr()
             or tensor.numel() == 0)  # an empty view's data_ptr is 0
        and tensor.shape[:-2] == store.shape[:-2] and tensor.shape[-1] == store.shape[-1]
        and tensor.stride() == store.stride() and tensor.dtype == store.dtype
    )


class GrowingLayer(DynamicLayer):
    """`DynamicLayer` semantics with pre-allocated storage (see the module docstring)."""

    spare_divisor = 64
    min_spare = 16
    _keys = _values = _key_store = _value_store = None

    @classmethod
    def capacity_for(cls, needed: int) -> int:
        """Tokens of storage reserved when `needed` tokens no longer fit."""
        return needed + max(cls.min_spare, needed // cls.spare_divisor)

    @property
    def keys(self):
        return self._keys

    @keys.setter
    def keys(self, tensor):
        if not is_prefix_view(tensor, self._key_store):
            self._key_store = None  # replaced: let the old storage go now
        self._keys = tensor

    @property
    def values(self):
        return self._values

    @values.setter
    def values(self, tensor):
        if not is_prefix_view(tensor, self._value_store):
            self._value_store = None
        self._values = tensor

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad):
            # In-place writes into storage that autograd saved for backward would fail there; the
            # concatenation's result is not a view of the storage: the storage is released (here, not by
            # the setter's pointer test, which a compiled step skips).
            self._key_store = self._value_store = None
            return super().update(key_states, value_states)
        # (written for host time: a decode step runs this once per layer, and on a GPU the host is the limit)
        new = key_states.shape[-2]
        length = self._keys.shape[-2] if self._keys.dim() == 4 else 0  # 1-D and empty until the first tokens
        end = length + new
        key_store, value_store = self._key_store, self._value_store
        if key_store is None or value_store is None or min(key_store.shape[-2], value_store.shape[-2]) < end:
            self._reserve(length, self.capacity_for(end), key_states, value_states)
            key_store, value_store = self._key_store, self._value_store
        key_store.narrow(-2, length, new).copy_(key_states)
        value_store.narrow(-2, length, new).copy_(value_states)
        # prefix views of the storage: set past the setters' test, which they pass by construction
        self._keys, self._values = key_store.narrow(-2, 0, end), value_store.narrow(-2, 0, end)
        return self._keys, self._values

    def _reserve(self, length: int, capacity: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Move the first `length` tokens into fresh storage of `capacity` tokens, keys then values,
        each released before the next is allocated (the peak: one tensor held twice, as in `torch.cat`)."""
        for name, states in (("key", key_states), ("value", value_states)):
            held = getattr(self, f"{name}s")
            source = held if length else states
            store = torch.empty((*states.shape[:-2], capacity, states.shape[-1]), dtype=source.dtype,
                                device=states.device)
            if length:
                store[..., :length, :].copy_(held[..., :length, :])
            del held, source
            setattr(self, f"_{name}_store", store)
            setattr(self, f"{name}s", store[..., :length, :])  # a prefix view: the old tensor goes

    def allocated_tensors(self) -> list:
        """The storage, spare capacity included (for `ModularDecoderCache.allocated_bytes`)."""
        return [self._key_store if self._key_store is not None else self.keys,
                self._value_store if self._value_store is not None else self.values]
