"""`GrowingLayer` (doubling pre-allocated storage) against transformers' `DynamicLayer` (torch.cat):
the same keys/values after every update and every cache operation generate() uses."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from modular_decoder.growing_cache import GrowingLayer


def _kv(batch: int, length: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 2, length, 4, generator=g), torch.randn(batch, 2, length, 3, generator=g)


def _same(ours: GrowingLayer, reference: DynamicLayer) -> None:
    assert torch.equal(ours.keys, reference.keys) and torch.equal(ours.values, reference.values)
    assert ours.get_seq_length() == reference.get_seq_length()
    assert ours.get_mask_sizes(1) == reference.get_mask_sizes(1)


def test_updates_across_capacity_and_every_operation_match_dynamic_layer():
    ours, reference = GrowingLayer(), DynamicLayer()
    seed = 0

    def step(length: int, batch: int):
        nonlocal seed
        seed += 1
        k, v = _kv(batch, length, seed)
        got, want = ours.update(k, v), reference.update(k, v)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        _same(ours, reference)

    step(5, 2)  # prefill
    for _ in range(70):  # past min_capacity (64): one reallocation
        step(1, 2)
    assert ours._key_store.shape[-2] == 128
    step(100, 2)  # a long chunk past the doubled capacity
    assert ours._key_store.shape[-2] == 256
    for layer in (ours, reference):
        layer.crop(-7)
    _same(ours, reference)
    step(1, 2)
    for layer in (ours, reference):
        layer.batch_repeat_interleave(3)
    step(1, 6)
    for layer in (ours, reference):
        layer.reorder_cache(torch.tensor([5, 4, 3, 2, 1, 0]))
    step(2, 6)
    for layer in (ours, reference):
        layer.batch_select_indices(torch.tensor([0, 2]))
    step(1, 2)
    for layer in (ours, reference):
        layer.reset()
    step(3, 1)
    step(1, 1)


def test_decode_writes_in_place_without_growing_the_views_by_copy():
    layer = GrowingLayer()
    k, v = _kv(1, 4, 0)
    layer.update(k, v)
    store = layer._key_store
    for i in range(10):
        layer.update(*_kv(1, 1, i + 1))
        assert layer._key_store is store and layer.keys.data_ptr() == store.data_ptr()
    assert layer.get_seq_length() == 14


def test_allocated_tensors_count_spare_capacity():
    layer = GrowingLayer()
    layer.update(*_kv(1, 3, 0))
    keys, values = layer.allocated_tensors()
    assert keys.shape[-2] == values.shape[-2] == GrowingLayer.min_capacity
    assert layer.keys.shape[-2] == 3


def test_tensors_that_require_grad_take_the_concatenating_path():
    ours, reference = GrowingLayer(), DynamicLayer()
    for seed in range(3):
        k, v = _kv(1, 2, seed)
        k.requires_grad_()
        got, want = ours.update(k, v), reference.update(k, v)
        assert torch.equal(got[0], want[0]) and got[0].requires_grad
    (ours.keys.sum()).backward()  # no in-place write broke the graph
