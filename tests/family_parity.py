"""The checks every converted family's own test file runs against transformers' class: logits on our backends, a
left-padded batch, greedy tokens through each side's own cache, the gradients of a loss."""

from __future__ import annotations

import copy
from pathlib import Path

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


def assert_gradients_match(source, ours, folder: Path) -> None:
    """One loss's gradient on every parameter equals transformers' to fp32 rounding: ours written as a copy's weights
    and exported to the family's names (each tensor moved, split or reshaped, never rescaled), against transformers'
    class on the same batch, both in training mode (Gemma 3n's AltUp clamps its coefficients there). Stronger than
    equal `Trainer` losses: Adam's first steps move each weight by about its learning rate whatever the gradient's
    scale, so a gradient off by a factor would not show in them."""
    from modular_decoder.conversion import export

    try:
        for model in (source, ours):
            model.train()
            model.zero_grad(set_to_none=True)
            model(IDS, labels=IDS).loss.backward()
        holder = copy.deepcopy(ours)
        gradients = {name: param.grad for name, param in ours.named_parameters()}
        with torch.no_grad():
            for name, param in holder.named_parameters():
                param.copy_(torch.zeros_like(param) if gradients[name] is None else gradients[name])
        holder.save_pretrained(folder / "gradients")
        export(folder / "gradients", folder / "exported", source.config.model_type, progress=False)
        # (loaded by transformers' class: the names it holds in memory, which its files may spell otherwise)
        exported = dict(type(source).from_pretrained(folder / "exported").named_parameters())
        wanted = {name: torch.zeros_like(p) if p.grad is None else p.grad for name, p in source.named_parameters()}
        largest = max(want.abs().max().item() for want in wanted.values())
        for name, want in wanted.items():
            # fp32 rounding through the layers: measured at most 5e-6 of a tensor's largest gradient, and near 1e-9
            # where the gradient is zero in exact arithmetic (a key bias under softmax), hence the model-wide floor
            torch.testing.assert_close(exported[name].detach(), want, rtol=0,
                                       atol=max(1e-4 * want.abs().max().item(), 1e-6 * largest),
                                       msg=lambda text, name=name: f"{name}: {text}")
    finally:
        for model in (source, ours):
            model.zero_grad(set_to_none=True)
            model.eval()
