"""Every generate() strategy with the family's own cache, against a reference path."""

from __future__ import annotations

import pytest
import torch

from decoding import PRESETS, SLIDING_PRESETS, greedy_no_cache, prompt, tiny_model

NEW = 12  # past the tiny presets' window of 8, so sliding layers wrap


@pytest.mark.parametrize("name", PRESETS)
def test_static_cache_generate_equals_no_cache_loop(name):
    # Regression: generate() hands a compileable cache a dict of per-layer-type masks, which the
    # model used to treat as a 2-D mask and fail on.
    model = tiny_model(name)
    ids = prompt()
    out = model.generate(ids, max_new_tokens=NEW, do_sample=False, cache_implementation="static")
    assert torch.equal(out, greedy_no_cache(model, ids, NEW))


@pytest.mark.parametrize("name", SLIDING_PRESETS)
def test_assisted_decoding_with_a_sliding_draft_past_its_window(name):
    # Regression: the draft model's cache was built without past recording, so cropping it once
    # its sliding layers had wrapped raised.
    model, draft = tiny_model(name), tiny_model(name, seed=1, num_hidden_layers=1)
    ids = prompt()
    out = model.generate(ids, max_new_tokens=NEW, do_sample=False, assistant_model=draft)
    assert torch.equal(out, greedy_no_cache(model, ids, NEW))
