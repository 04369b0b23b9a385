"""The checks every converted family's own test file runs against transformers' class: logits on our backends, a
left-padded batch, greedy tokens through each side's own cache."""

from __future__ import annotations

import torch
from test_gpt_oss_smollm3 import IDS, left_padded


def assert_logits_match(source, ours, backend: str, padded: bool = True) -> None:
    """Our logits on `backend` equal transformers' (eager), on `IDS` and, with `padded`, on the real tokens of a
    left-padded batch."""
    ours.set_attn_implementation(backend)
    with torch.no_grad():
        torch.testing.assert_close(ours(IDS).logits, source(IDS).logits, rtol=0, atol=1e-4)
        if not padded:
            return
        ids, mask = left_padded()
        got, want = ours(ids, attention_mask=mask).logits, source(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=1e-4)


def assert_greedy_tokens_match(source, ours, backend: str, cache: str, padded: bool = True) -> None:
    """Ten greedy tokens through each side's own cache (transformers' dynamic one; ours `cache`: "dynamic" or
    "static") are the same, for a left-padded batch (`padded`) or its first row alone."""
    ours.set_attn_implementation(backend)
    ids, mask = left_padded() if padded else (IDS[:1], torch.ones_like(IDS[:1]))
    kwargs = dict(attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = source.generate(ids, **kwargs)
        got = ours.generate(ids, cache_implementation=None if cache == "dynamic" else "static", **kwargs)
    assert torch.equal(got, want)


def held_bytes(cache) -> int:
    """Bytes of the keys and values a transformers cache holds (a shared layer's slot holds none)."""
    return sum(t.numel() * t.element_size() for layer in cache.layers
               for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if isinstance(t, torch.Tensor))


def assert_cache_holds_what_transformers_holds(source, ours) -> int:
    """After one prompt, our cache holds the bytes transformers' cache holds and `contract.cache_bytes` predicts
    (shared layers' slots empty on both sides); returns them."""
    from modular_decoder import ModularDecoderCache, cache_bytes
    from modular_decoder.compat import cache_of

    ids = IDS[:1]
    with torch.no_grad():
        theirs = cache_of(source(ids, use_cache=True))
        cache = ModularDecoderCache(ours.config)
        ours(ids, cache=cache, use_cache=True)
    assert cache.payload_bytes() == held_bytes(theirs) == cache_bytes(ours.config, ids.shape[1], 1, torch.float32)
    return cache.payload_bytes()
