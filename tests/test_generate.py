"""Every generate() strategy with the family's own cache, against a reference path."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

from decoding import PRESETS, greedy_no_cache, prompt, tiny_model
from modular_decoder import ModularDecoderCache, ModularDecoderForCausalLM
from modular_decoder.eager_attention import eager_attention

NEW = 8  # with 6-token prompts, past the tiny presets' window of 8: sliding layers wrap


# --- every strategy, every cache kind -------------------------------------------------------

KINDS = ["dynamic", "static", "int8"]


def _fake_int8(x: torch.Tensor) -> torch.Tensor:
    """Written apart from int8_cache.py: absmax/127 per (batch, head, token) row, rounded."""
    scale = (x.abs().amax(-1, keepdim=True) / 127).clamp(min=torch.finfo(x.dtype).tiny)
    return torch.round(x / scale).clamp(-127, 127) * scale


def _int8_reference_attention(module, query, key, value, attention_mask, **kwargs):
    return eager_attention(module, query, _fake_int8(key), _fake_int8(value), attention_mask, **kwargs)


AttentionInterface.register("int8_reference", _int8_reference_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register("int8_reference", eager_mask)


def _kwargs(kind: str) -> dict:
    """generate() arguments selecting each cache kind through the public path."""
    if kind == "static":
        return {"cache_implementation": "static"}
    if kind == "int8":
        return {"cache_implementation": "quantized", "cache_config": {"backend": "int8"}}
    return {}


def _reference(model, kind: str):
    """The no-cache reference for `kind`: the same weights; for int8, attention on int8-rounded K/V."""
    if kind != "int8":
        return model
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("int8_reference")
    return reference


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", PRESETS)
def test_greedy_equals_no_cache_loop(name, kind):
    # Also the regression test for generate() with a static cache, which hands the model a dict of
    # per-layer-type masks the model used to treat as a 2-D mask.
    model = tiny_model(name)
    ids = prompt(2)
    out = model.generate(ids, max_new_tokens=NEW, do_sample=False, **_kwargs(kind))
    assert torch.equal(out, greedy_no_cache(_reference(model, kind), ids, NEW))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["bloom", "gemma2"])
def test_beam_search_equals_no_cache_beam_search(name, kind):
    model = tiny_model(name)
    ids = prompt(2)
    out = model.generate(ids, max_new_tokens=8, num_beams=3, do_sample=False, **_kwargs(kind))
    expected = _reference(model, kind).generate(ids, max_new_tokens=8, num_beams=3, do_sample=False, use_cache=False)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["gpt2", "gemma2"])
def test_assisted_and_prompt_lookup_decoding_equal_greedy(name, kind):
    # Greedy speculative decoding is lossless: it must give the greedy no-cache tokens. With gemma2
    # the draft's sliding layers wrap: the regression test for a draft cache built without past
    # recording, which raised on the first crop past the window.
    model = tiny_model(name)
    draft = tiny_model(name, seed=1, num_hidden_layers=1, hidden_size=32)
    ids = prompt(1)
    expected = greedy_no_cache(_reference(model, kind), ids, NEW)
    if kind == "static" and "sliding_attention" in model.config.layer_types:
        # A static ring past its window cannot be rolled back, and generate() says so.
        with pytest.raises(ValueError, match="cropped"):
            model.generate(ids, max_new_tokens=NEW, do_sample=False, assistant_model=draft, **_kwargs(kind))
        return
    assisted = model.generate(ids, max_new_tokens=NEW, do_sample=False, assistant_model=draft, **_kwargs(kind))
    assert torch.equal(assisted, expected)
    lookup = model.generate(ids, max_new_tokens=NEW, do_sample=False, prompt_lookup_num_tokens=3, **_kwargs(kind))
    assert torch.equal(lookup, expected)


@pytest.mark.parametrize("name", ["gemma2"])
def test_sampling_is_reproducible_and_equal_between_cache_kinds(name):
    model = tiny_model(name)
    ids = prompt(2)
    runs = {}
    for kind in ("none", "dynamic", "static", "int8", "int8-again"):
        torch.manual_seed(123)
        extra = {"use_cache": False} if kind == "none" else _kwargs(kind.removesuffix("-again"))
        runs[kind] = model.generate(ids, max_new_tokens=NEW, do_sample=True, top_k=0, num_return_sequences=3, **extra)
    assert runs["dynamic"].shape == (6, ids.shape[1] + NEW)
    assert torch.equal(runs["dynamic"], runs["none"])
    assert torch.equal(runs["static"], runs["none"])
    assert torch.equal(runs["int8"], runs["int8-again"])
    assert not torch.equal(runs["dynamic"][0::3], runs["dynamic"][1::3])  # the copies did sample apart


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", PRESETS)
def test_left_padded_batch_gives_each_row_its_own_tokens(name, kind):
    model = tiny_model(name)
    long, short = prompt(1, 7, seed=2), prompt(1, 3, seed=4)
    pad = torch.zeros(1, 4, dtype=torch.long)
    batch = torch.cat([long, torch.cat([pad, short], dim=1)])
    mask = torch.cat([torch.ones(1, 7), torch.cat([torch.zeros(1, 4), torch.ones(1, 3)], dim=1)]).long()
    out = model.generate(batch, attention_mask=mask, max_new_tokens=NEW, do_sample=False, **_kwargs(kind))
    for row, alone in ((0, long), (1, short)):
        single = model.generate(alone, max_new_tokens=NEW, do_sample=False, **_kwargs(kind))
        assert torch.equal(out[row, -NEW:], single[0, -NEW:]), row


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["gemma2"])
def test_a_user_cache_is_used_and_returned(name, kind):
    model = tiny_model(name)
    ids = prompt(2)
    cache = ModularDecoderCache(model.config, kind, max_cache_len=32 if kind == "static" else None)
    out = model.generate(ids, max_new_tokens=NEW, do_sample=False, cache=cache, return_dict_in_generate=True)
    assert out.cache is cache
    assert torch.equal(out.sequences, model.generate(ids, max_new_tokens=NEW, do_sample=False, **_kwargs(kind)))
    assert cache.get_seq_length() == ids.shape[1] + NEW - 1  # the last token is never fed back


def test_int8_is_the_default_quantized_backend_and_others_go_to_transformers():
    model = tiny_model("llama")
    kwargs, config = {}, model.generation_config
    config = copy.deepcopy(config)
    config.cache_implementation = "quantized"
    model._prepare_cache_for_generation(config, kwargs, None, 1, 20)
    assert isinstance(kwargs["cache"], ModularDecoderCache) and kwargs["cache"].implementation == "int8"
    config.cache_config = {"backend": "quanto"}
    with pytest.raises(ImportError):  # transformers' QuantizedCache, which needs optimum-quanto
        model._prepare_cache_for_generation(config, {}, None, 1, 20)


# --- against transformers' own classes, through the conversion path --------------------------


def _hf_tiny(family: str):
    import transformers

    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False, pad_token_id=0)
    if family == "llama":
        config = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    elif family == "mistral":
        config = transformers.MistralConfig(**common, sliding_window=8)
        cls = transformers.MistralForCausalLM
    else:
        config = transformers.Gemma2Config(**{**common, "tie_word_embeddings": True}, head_dim=16, sliding_window=8,
                                           query_pre_attn_scalar=16)
        cls = transformers.Gemma2ForCausalLM
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():  # larger weights than the 0.02 init, so tokens are not near-ties
        for param in model.parameters():
            param.add_(torch.randn_like(param) * (0.3 if param.dim() == 1 else 0.15))
    return model


def _converted(hf_model, family: str, tmp_path) -> ModularDecoderForCausalLM:
    from modular_decoder import conversion

    hf_model.save_pretrained(tmp_path / "src")
    conversion.convert(tmp_path / "src", tmp_path / "ours", progress=False)
    ours = ModularDecoderForCausalLM.from_pretrained(tmp_path / "ours", attn_implementation="eager").eval()
    ours.generation_config.pad_token_id = 0
    return ours


@pytest.mark.parametrize(
    "family, kind", [("llama", "dynamic"), ("llama", "static"), ("mistral", "dynamic"), ("gemma2", "dynamic"),
                     ("gemma2", "static")]
)
def test_beam_and_assisted_decoding_match_transformers(family, kind, tmp_path):
    hf = _hf_tiny(family)
    hf.generation_config.pad_token_id = 0
    ours = _converted(hf, family, tmp_path)
    ids = prompt(1, 6)
    expected = hf.generate(ids, max_new_tokens=NEW, num_beams=3, do_sample=False)
    assert torch.equal(ours.generate(ids, max_new_tokens=NEW, num_beams=3, do_sample=False, **_kwargs(kind)), expected)
    greedy = hf.generate(ids, max_new_tokens=NEW, do_sample=False)
    if kind == "static" and family != "llama":
        return  # a static ring past its window is not croppable (see above)
    draft = tiny_model("llama", seed=1, num_hidden_layers=1, hidden_size=32)
    assisted = ours.generate(ids, max_new_tokens=NEW, do_sample=False, assistant_model=draft, **_kwargs(kind))
    assert torch.equal(assisted, greedy)
    assert torch.equal(ours.generate(ids, max_new_tokens=NEW, do_sample=False, **_kwargs(kind)), greedy)


# --- the caches are transformers' types -------------------------------------------------------


def _llama_twin():
    """transformers' Llama and our llama preset with the same shape (weights need not match here)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    ours = tiny_model("llama")
    c = ours.config
    llama = LlamaForCausalLM(LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, max_position_embeddings=c.max_position_embeddings,
    )).eval()
    return ours, llama


def _generated_cache(model, ids, **kwargs):
    out = model.generate(ids, do_sample=False, return_dict_in_generate=True, **kwargs)
    return out.cache


def test_default_and_static_caches_are_transformers_types_as_for_llama():
    from transformers.cache_utils import DynamicCache, StaticCache

    ours, llama = _llama_twin()
    ids = prompt()
    with torch.no_grad():
        for model in (llama, ours):
            assert isinstance(_generated_cache(model, ids, max_new_tokens=3), DynamicCache)
            assert isinstance(_generated_cache(model, ids, max_new_tokens=3, cache_implementation="static"), StaticCache)
    assert isinstance(ModularDecoderCache(ours.config), DynamicCache)
    assert isinstance(ModularDecoderCache(ours.config, "static", max_cache_len=8), StaticCache)


def test_a_shorter_later_static_generate_keeps_the_larger_cache_length_as_llama():
    ours, llama = _llama_twin()
    ids = prompt()
    lengths = {}
    with torch.no_grad():
        for name, model in (("llama", llama), ("ours", ours)):
            first = _generated_cache(model, ids, max_new_tokens=12, cache_implementation="static")
            second = _generated_cache(model, ids, max_new_tokens=3, cache_implementation="static")
            lengths[name] = [c.layers[0].max_cache_len for c in (first, second)]
    assert lengths["ours"] == lengths["llama"]
    assert lengths["ours"][0] == lengths["ours"][1] > ids.shape[1] + 3  # the second call needed less
