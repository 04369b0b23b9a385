"""The family's cache: byte accounting against the contract and the seed's Figure 8.4, the int8
layer's error bound, cache operations generate() relies on, and a compiled static decode."""

from __future__ import annotations

import pytest
import torch
from transformers import CompileConfig

from decoding import greedy_no_cache, prompt, tiny_model
from modular_decoder import (ModularDecoderCache, ModularDecoderConfig, cache_bytes, cache_bytes_per_token,
                             compiled_decoding)
from modular_decoder.contract import breakeven_context
from modular_decoder.int8_cache import dequantize_int8, quantize_int8

KINDS = ["dynamic", "static", "int8"]
MAX_CACHE = 24


def _cache(model, kind: str) -> ModularDecoderCache:
    return ModularDecoderCache(model.config, kind, max_cache_len=MAX_CACHE if kind == "static" else None)


@torch.no_grad()
def _fill(model, cache, batch: int, length: int) -> None:
    """Prefill 3 tokens (or fewer), then decode one at a time up to `length`."""
    ids = prompt(batch, length)
    first = min(3, length)
    model(ids[:, :first], cache=cache)
    for t in range(first, length):
        model(ids[:, t : t + 1], cache=cache)


# --- Figure 8.4 -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kv_heads, kib, crossover, gib_128k",
    [(32, 512, "26,703", "62.50"), (8, 128, "106,812", "15.62"), (1, 16, "854,492", "1.95")],
    ids=["MHA", "GQA-8", "MQA"],
)
def test_cache_bytes_per_token_reproduces_figure_8_4(kv_heads, kib, crossover, gib_128k):
    # The seed's stated assumptions: 32 layers, 128-wide heads, 2-byte elements, batch 1, and
    # 7e9 two-byte weights; the strings are what its runnable cell prints.
    config = ModularDecoderConfig(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32,
                                  num_key_value_heads=kv_heads, vocab_size=32000)
    assert config.head_dim == 128
    per_token = cache_bytes_per_token(config, torch.bfloat16)
    assert per_token == kib * 1024
    assert per_token == 2 * 32 * kv_heads * 128 * 2
    assert f"{breakeven_context(config, 7_000_000_000 * 2, torch.bfloat16):,.0f}" == crossover
    assert f"{cache_bytes(config, 128_000, 1, torch.bfloat16) / 2**30:.2f}" == gib_128k


# --- payload and allocation -----------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2"])
def test_payload_bytes_match_the_contract(name, kind):
    # Lengths straddle the tiny presets' window of 8; batches 1 and 3.
    model = tiny_model(name)
    quantization = "int8" if kind == "int8" else None
    for batch in (1, 3):
        cache = _cache(model, kind)
        ids = prompt(batch, 13)
        with torch.no_grad():
            model(ids[:, :3], cache=cache)
            for length in range(4, 14):
                model(ids[:, length - 1 : length], cache=cache)
                expected = cache_bytes(model.config, length, batch, torch.float32, quantization)
                assert cache.payload_bytes() == expected, (batch, length)


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_allocated_bytes_of_a_static_cache_are_its_whole_length(name):
    model = tiny_model(name)
    config, batch = model.config, 2
    cache = _cache(model, "static")
    _fill(model, cache, batch, 5)
    row = 2 * batch * config.num_key_value_heads * config.head_dim * 4  # K and V, fp32
    slots = [MAX_CACHE if t == "full_attention" else min(config.sliding_window, MAX_CACHE) for t in config.layer_types]
    assert cache.allocated_bytes() == row * sum(slots)
    assert cache.payload_bytes() == cache_bytes(config, 5, batch, torch.float32) < cache.allocated_bytes()
    dynamic = _cache(model, "dynamic")
    _fill(model, dynamic, batch, 5)
    # Full layers reserve storage with a bounded spare (growing_cache.py, `capacity_for`: the 3-token
    # prefill's storage holds the 2 decoded tokens too); the dynamic sliding layers hold exactly their payload.
    from modular_decoder.growing_cache import GrowingLayer

    held = [GrowingLayer.capacity_for(3) if t == "full_attention" else min(5, config.sliding_window - 1)
            for t in config.layer_types]
    assert dynamic.allocated_bytes() == row * sum(held)


@pytest.mark.parametrize("model_dtype, scale_bytes", [(torch.bfloat16, 2), (torch.float32, 4)])
def test_int8_payload_is_at_most_55_percent_of_bf16(model_dtype, scale_bytes):
    # d_h = 64 (SmolLM2's head width): (64 + b) / 128 of the bf16 bytes.
    model = tiny_model("llama", hidden_size=256).to(model_dtype)
    assert model.config.head_dim == 64
    int8 = _cache(model, "int8")
    _fill(model, int8, 2, 10)
    bf16_bytes = cache_bytes(model.config, 10, 2, torch.bfloat16)
    assert int8.payload_bytes() == cache_bytes(model.config, 10, 2, model_dtype, "int8")
    assert int8.payload_bytes() / bf16_bytes == pytest.approx((64 + scale_bytes) / 128)
    assert int8.payload_bytes() <= 0.55 * bf16_bytes
    stored = int8.layers[0].keys
    assert stored.dtype == torch.int8 and stored.shape[-1] == 64 + scale_bytes


# --- the int8 layer -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_round_trip_error_is_bounded_per_token_and_head(dtype):
    x = torch.randn(2, 3, 5, 16) * torch.logspace(-3, 2, 5)[None, None, :, None]  # rows of very different ranges
    x[0, 0, 0] = 0.0  # an all-zero row
    x = x.to(dtype)
    packed = quantize_int8(x)
    assert packed.dtype == torch.int8 and packed.shape == (2, 3, 5, 16 + x.element_size())
    back = dequantize_int8(packed, dtype)
    assert back.dtype == dtype
    amax = x.float().abs().amax(-1, keepdim=True)
    # |x - x̂| <= scale / 2 = amax / 254, plus the rounding of the result (and, in bf16, of the scale)
    eps = torch.finfo(dtype).eps
    bound = amax / 254 * (1 + 2 * eps) + amax * eps
    assert ((back.float() - x.float()).abs() <= bound).all()
    assert torch.equal(back[0, 0, 0], torch.zeros(16, dtype=dtype))
    assert not torch.equal(back, x)  # it does quantize


@torch.no_grad()
def test_int8_decode_matches_int8_prefill_and_stays_near_full_precision():
    # Each token is quantized once, independently, so feeding a sequence at once or token by token
    # must agree to float rounding; against the unquantized model the logits move by the int8
    # rounding (<= 1/254 of each K/V row's range), measured here at under 1 % of the logit range.
    model = tiny_model("llama")
    ids = prompt(2, 12)
    full = model(ids, use_cache=False).logits
    at_once = model(ids, cache=_cache(model, "int8")).logits
    cache = _cache(model, "int8")
    steps = [model(ids[:, :4], cache=cache).logits]
    steps += [model(ids[:, t : t + 1], cache=cache).logits for t in range(4, 12)]
    torch.testing.assert_close(torch.cat(steps, dim=1), at_once, rtol=0, atol=1e-5)
    err = (at_once - full).abs().max().item()
    assert 0 < err < 0.01 * full.abs().max().item()


def test_int8_cache_refuses_mla_and_mixed_dtypes():
    config = tiny_model("llama").config
    mla = ModularDecoderConfig(**{**config.to_dict(), "attention_type": "mla", "kv_lora_rank": 16,
                                  "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8})
    with pytest.raises(ValueError, match="mla"):
        ModularDecoderCache(mla, "int8")
    cache = ModularDecoderCache(config, "int8")
    k = torch.randn(1, 4, 2, 16)
    cache.update(k, k, 0)
    with pytest.raises(ValueError, match="float32"):
        cache.update(k.bfloat16(), k.bfloat16(), 0)


def test_unknown_implementation_names_the_choices():
    with pytest.raises(ValueError, match="int8"):
        ModularDecoderCache(tiny_model("llama").config, "int4")


# --- cache operations -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["llama", "gemma2"])
@torch.no_grad()
def test_reset_gives_an_empty_cache_that_decodes_as_new(name, kind):
    model = tiny_model(name)
    ids = prompt(1, 6)
    cache = _cache(model, kind)
    first = model.generate(ids, max_new_tokens=10, do_sample=False, cache=cache)
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.payload_bytes() == 0
    again = model.generate(ids, max_new_tokens=10, do_sample=False, cache=cache)
    assert torch.equal(first, again)


@pytest.mark.parametrize("kind", ["dynamic", "int8"])
@pytest.mark.parametrize("name", ["llama", "mistral"])
@torch.no_grad()
def test_batch_repeat_and_select_continue_like_the_source_rows(name, kind):
    # Past mistral's window of 8, so the sliding layers hold a wrapped window when repeated.
    model = tiny_model(name)
    ids = prompt(2, 10)
    nxt = prompt(2, 1, seed=3)
    reference = _cache(model, kind)
    model(ids, cache=reference)
    expected = model(nxt, cache=reference).logits  # (2, 1, V)

    repeated = _cache(model, kind)
    model(ids, cache=repeated)
    repeated.batch_repeat_interleave(3)
    logits = model(nxt.repeat_interleave(3, dim=0), cache=repeated).logits
    torch.testing.assert_close(logits, expected.repeat_interleave(3, dim=0), rtol=0, atol=1e-5)

    selected = _cache(model, kind)
    model(ids, cache=selected)
    selected.batch_select_indices(torch.tensor([1]))
    torch.testing.assert_close(model(nxt[1:], cache=selected).logits, expected[1:], rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["llama", "mistral"])
@torch.no_grad()
def test_reorder_and_crop(name, kind):
    # Beam reorder swaps rows; crop(-n) followed by re-feeding the same tokens restores the logits.
    model = tiny_model(name)
    ids = prompt(2, 6)
    tail = prompt(2, 3, seed=5)
    cache = _cache(model, kind)
    cache.activate_past_recording()  # what assisted decoding does, so sliding layers can roll back
    model(ids, cache=cache)
    before = model(tail, cache=cache).logits
    if kind == "static" and name == "mistral":
        # A static ring past its window cannot give evicted tokens back: transformers' rule, and
        # assisted decoding refuses such a cache.
        assert not cache.is_croppable
        cache = _cache(model, kind)
        model(ids, cache=cache)
    else:
        assert cache.is_croppable  # int8 rows crop like any K/V row (codes and scale travel together)
        cache.crop(-3)
        assert cache.get_seq_length() == 6
        torch.testing.assert_close(model(tail, cache=cache).logits, before, rtol=0, atol=1e-5)
        cache.crop(-3)
    cache.reorder_cache(torch.tensor([1, 0]))
    torch.testing.assert_close(model(tail.flip(0), cache=cache).logits, before.flip(0), rtol=0, atol=1e-5)


# --- torch.compile --------------------------------------------------------------------------


def _compile_config(backend: str, dynamic) -> CompileConfig:
    return compiled_decoding(mode="default", backend=backend, dynamic=dynamic)["compile_config"]


def test_compiled_static_decode_equals_dynamic_cache():
    torch._dynamo.reset()
    model = tiny_model("llama")
    ids = prompt(2, 6)
    dynamic = model.generate(ids, max_new_tokens=10, do_sample=False)
    compiled = model.generate(ids, max_new_tokens=10, do_sample=False, cache_implementation="static",
                              compile_config=_compile_config("inductor", dynamic=False))
    assert hasattr(model, "_compiled_call")  # generate() did take the compiled path
    assert torch.equal(compiled, dynamic)
    assert torch.equal(dynamic, greedy_no_cache(model, ids, 10))


@pytest.mark.slow
def test_compiled_static_sliding_decode_equals_dynamic_cache():
    # The static sliding ring keeps a Python int position, so dynamo recompiles until the ring is
    # full; `dynamic=None` lets it go symbolic. Traced only (backend "eager") to keep this short.
    torch._dynamo.reset()
    model = tiny_model("gemma2")
    ids = prompt(1, 9)  # already past the window of 8
    dynamic = model.generate(ids, max_new_tokens=5, do_sample=False)
    compiled = model.generate(ids, max_new_tokens=5, do_sample=False, cache_implementation="static",
                              compile_config=_compile_config("eager", dynamic=None))
    assert hasattr(model, "_compiled_call")
    assert torch.equal(compiled, dynamic)
