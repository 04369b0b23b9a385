"""A 2-D `attention_mask` beside a static cache, in direct `forward` calls, means what it means in transformers'
models: column j is cache slot j (the first token), covering at least the cached and new tokens and at most the
cache's length (zeros after the tokens, as generate's masks are padded to the cache inside the mask builders).
Each call then gives the logits of the same calls with a dynamic cache and of one forward without a cache, on a
left-padded batch; a mask that does not reach the new tokens is refused as the dynamic path refuses it."""

from __future__ import annotations

import pytest
import torch
from decoding import converted_twin, prompt, tiny_model
from transformers import DynamicCache, StaticCache

from modular_decoder.cache import ModularDecoderCache

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_CACHE = 16
STEPS = [(0, 5), (5, 7), (7, 8)]  # (cached, cached + new) of a prefill, a chunk of two and one decode step


def _batch(vocab: int):
    ids = prompt(2, 8, vocab=vocab)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :3] = 0  # the second row is left-padded
    return ids, mask


def _caches(model):
    config = model.config
    return {
        "ours-static": lambda: ModularDecoderCache(config, "static", max_cache_len=MAX_CACHE),
        "transformers-static": lambda: StaticCache(config=config, max_cache_len=MAX_CACHE),
        "dynamic": lambda: DynamicCache(config=config),
    }


@pytest.mark.parametrize("preset", ["llama", "gpt2", "gemma2", "deepseek_v3"])
@pytest.mark.parametrize("cache_kind", ["ours-static", "transformers-static", "dynamic"])
@pytest.mark.parametrize("padded", [False, True], ids=["exact", "padded-to-cache"])
def test_steps_equal_the_uncached_forward(preset, cache_kind, padded):
    model = tiny_model(preset)
    if padded and cache_kind == "dynamic":
        pytest.skip("a dynamic cache has no length to pad to")
    ids, mask = _batch(model.config.vocab_size)
    with torch.no_grad():
        reference = model(ids, attention_mask=mask, use_cache=False).logits
        cache = _caches(model)[cache_kind]()
        for past, end in STEPS:
            step_mask = mask[:, :end]
            if padded:
                step_mask = torch.nn.functional.pad(step_mask, (0, MAX_CACHE - end))
            logits = model(ids[:, past:end], attention_mask=step_mask, cache=cache).logits
            real = mask[:, past:end].bool()
            torch.testing.assert_close(logits[real], reference[:, past:end][real], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache_kind", ["ours-static", "transformers-static", "dynamic"])
def test_a_mask_that_misses_the_cached_tokens_is_refused(cache_kind):
    model = tiny_model("llama")
    ids, mask = _batch(model.config.vocab_size)
    cache = _caches(model)[cache_kind]()
    with torch.no_grad():
        model(ids[:, :5], attention_mask=mask[:, :5], cache=cache)
        with pytest.raises(ValueError, match=r"`attention_mask` has length 2 but must cover the 5 cached and 2 new"):
            model(ids[:, 5:7], attention_mask=mask[:, 5:7], cache=cache)


@pytest.mark.parametrize("cache_kind", ["ours-static", "transformers-static"])
def test_a_mask_longer_than_the_cache_is_refused(cache_kind):
    model = tiny_model("llama")
    ids, mask = _batch(model.config.vocab_size)
    cache = _caches(model)[cache_kind]()
    with pytest.raises(ValueError, match=rf"`attention_mask` has length {MAX_CACHE + 1}.*{MAX_CACHE}"):
        model(ids[:, :5], attention_mask=torch.nn.functional.pad(mask[:, :5], (0, MAX_CACHE - 4)), cache=cache)


def test_router_losses_count_the_new_tokens_of_a_padded_mask():
    """The router losses weigh the new tokens' columns of the mask: a static cache's padded mask gives the losses
    of the same step with a dynamic cache."""
    model = tiny_model("mixtral", router_z_loss_coef=0.01)
    ids, mask = _batch(model.config.vocab_size)
    outputs = {}
    with torch.no_grad():
        for kind, padded in (("ours-static", True), ("dynamic", False)):
            cache = _caches(model)[kind]()
            model(ids[:, :5], attention_mask=mask[:, :5], cache=cache)
            step_mask = torch.nn.functional.pad(mask[:, :7], (0, MAX_CACHE - 7)) if padded else mask[:, :7]
            outputs[kind] = model(ids[:, 5:7], attention_mask=step_mask, cache=cache, output_router_logits=True)
    for name in ("aux_loss", "z_loss"):
        torch.testing.assert_close(getattr(outputs["ours-static"], name), getattr(outputs["dynamic"], name))


def test_a_static_cache_whose_layers_all_slide_takes_a_mask_longer_than_the_window(tmp_path):
    """Mistral's layout (every layer slides, window 8) over a static cache of 64: a 12-token prompt with its 2-D
    mask, then a step, give the logits of the uncached forward and of transformers' `MistralForCausalLM` with
    `StaticCache(max_cache_len=64)` on the same weights (the window bounds the ring, not the mask)."""
    mistral, ours = converted_twin("Mistral", tmp_path, sliding_window=8, max_position_embeddings=128)
    assert set(ours.config.layer_types) == {"sliding_attention"}
    ids = prompt(2, 13, vocab=128)
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[1, :3] = 0  # the second row is left-padded
    with torch.no_grad():
        reference = ours(ids, attention_mask=mask, use_cache=False).logits
        caches = {"ours": ModularDecoderCache(ours.config, "static", max_cache_len=64),
                  "mistral": StaticCache(config=mistral.config, max_cache_len=64)}
        for name, model in (("ours", ours), ("mistral", mistral)):
            cache = caches[name]
            logits = torch.cat([model(ids[:, :12], attention_mask=mask[:, :12], cache=cache).logits,
                                model(ids[:, 12:], attention_mask=mask, cache=cache).logits], dim=1)
            real = mask.bool()
            torch.testing.assert_close(logits[real], reference[real], rtol=1e-5, atol=1e-5, msg=name)
