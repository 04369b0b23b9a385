"""DeepSeek-V4 against transformers' `DeepseekV4ForCausalLM`: a left-padded batch, decoding through each side's own
cache in steps that complete windows at different places, beam search, packed documents, the release's own file
names, and what transformers refuses (cropping the compressed caches: assisted decoding, prompt lookup; a static
cache; flash and flex kernels) refused by name. (Conversion both ways: test_conversion.py's `deepseek_v4` case.)"""

from __future__ import annotations

import json

import pytest
import torch
from conversion_cases import CASES, DSV4, perturbed
from family_parity import assert_gradients_match
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import modular_decoder  # noqa: F401
from modular_decoder import ModularDecoderConfig
from modular_decoder.cache import ModularDecoderCache
from modular_decoder.conversion import convert, export

pytestmark = pytest.mark.skipif("deepseek_v4" not in CASES, reason="this transformers has no DeepSeek-V4 class")

LONG = torch.tensor([[5, 17, 3, 42, 8, 61, 23, 11, 2, 90, 33, 7, 14]])
SHORT = torch.tensor([[9, 1, 64, 12, 40, 5, 77, 18]])


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(transformers' model, ours converted from its saved folder, the folders)."""
    root = tmp_path_factory.mktemp("dsv4")
    config = CASES["deepseek_v4"][1]()
    config.architectures = None
    torch.manual_seed(0)
    source = perturbed(AutoModelForCausalLM.from_config(config).eval())
    source.save_pretrained(root / "src")
    convert(root / "src", root / "md", progress=False)
    return source, AutoModelForCausalLM.from_pretrained(root / "md").eval(), root


def left_padded():
    pad = LONG.shape[1] - SHORT.shape[1]
    ids = torch.cat([LONG, torch.cat([torch.zeros(1, pad, dtype=torch.long), SHORT], dim=1)])
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    return ids, mask, pad


def test_gradients_equal_transformers_class(pair, tmp_path):
    """A loss's gradient on every parameter, the hyper-connections' (Sinkhorn with autograd), the compressors' and
    the hash-routed experts' included, is transformers'."""
    assert_gradients_match(*pair[:2], tmp_path)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_left_padded_batch_equals_transformers_on_each_row(pair, backend):
    """Each row of a left-padded batch computes what transformers' class computes for it alone. (transformers' own
    padded batch pools the padding into the compressed entries of the padded row: docs/using.md.)"""
    source, ours, _ = pair
    ours.config._attn_implementation = backend
    ids, mask, pad = left_padded()
    with torch.no_grad():
        batch = ours(ids, attention_mask=mask).logits
        alone_long, alone_short = source(LONG).logits, source(SHORT).logits
    torch.testing.assert_close(batch[0], alone_long[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(batch[1, pad:], alone_short[0], atol=1e-5, rtol=0)
    tokens = ours.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    expected = source.generate(SHORT, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(tokens[1, LONG.shape[1]:], expected[0, SHORT.shape[1]:])


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_cache_in_steps_equals_the_whole_forward_and_transformers(pair, backend):
    """Steps of 7, 1, 1, 2 and 2 tokens (windows of 2 and 4 completed inside a step, at its end, across two) through
    our cache give the uncached forward's logits and transformers' through its own cache."""
    source, ours, _ = pair
    ours.config._attn_implementation = backend
    ids = torch.cat([LONG, LONG.flip(1)])
    with torch.no_grad():
        whole = ours(ids).logits
        cache, theirs, steps = ModularDecoderCache(ours.config), None, []
        their_steps = []
        for start, stop in ((0, 7), (7, 8), (8, 9), (9, 11), (11, 13)):
            out = ours(ids[:, start:stop], cache=cache, use_cache=True)
            steps.append(out.logits)
            reference = source(ids[:, start:stop], past_key_values=theirs, use_cache=True)
            theirs = reference.past_key_values if hasattr(reference, "past_key_values") else reference.cache
            their_steps.append(reference.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.cat(steps, dim=1), torch.cat(their_steps, dim=1), atol=1e-5, rtol=0)
    assert cache.payload_bytes() > 0


def _their_steps(source, prompt, tokens):
    """transformers' logits for `prompt` (1, T) and then each of `tokens` (n,) one at a time through its own cache."""
    out = source(prompt, use_cache=True)
    logits, cache = [out.logits[0]], out.past_key_values if hasattr(out, "past_key_values") else out.cache
    for token in tokens:
        out = source(token.view(1, 1), past_key_values=cache, use_cache=True)
        cache = out.past_key_values if hasattr(out, "past_key_values") else out.cache
        logits.append(out.logits[0])
    return torch.cat(logits)


def _decode_steps(ours, ids, mask, tokens):
    """Our logits for a prefill of `ids` and then one step per column of `tokens`, through our cache."""
    cache, width = ModularDecoderCache(ours.config), ids.shape[1]
    full = torch.cat([mask, torch.ones_like(tokens)], dim=1)
    logits = [ours(ids, attention_mask=mask, cache=cache, use_cache=True).logits]
    for step in range(tokens.shape[1]):
        columns = width + step + 1
        logits.append(ours(tokens[:, step:step + 1], attention_mask=full[:, :columns], cache=cache,
                           use_cache=True).logits)
    return torch.cat(logits, dim=1), cache


@pytest.mark.parametrize(("backend", "top_k"), [("eager", 3), ("sdpa", 3), ("sdpa", 64)])
def test_decode_across_windows_of_a_left_padded_batch(pair, backend, top_k, monkeypatch):
    """Ten one-token steps of a left-padded batch (windows of 2 and 4 completing at other steps in each row, as
    their positions differ) give the uncached forward's logits and, per row, transformers' through its own cache;
    steps that complete no window pool nothing, and give what pooling at every step gives. With an indexer keeping
    more entries than there are (`top_k` 64), every visible entry is read without ranking, as ranking would keep."""
    from modular_decoder.compressed_attention import Compressor, WindowCompression

    source, ours, _ = pair
    ours.config._attn_implementation = backend
    for theirs, mine in zip(source.model.layers, ours.model.layers):
        if mine.self_attn.compressor is not None and mine.self_attn.compressor.indexer is not None:
            monkeypatch.setattr(theirs.self_attn.compressor.indexer, "index_topk", top_k)
            monkeypatch.setattr(mine.self_attn.compressor.indexer, "top_k", top_k)
    ids, mask, pad = left_padded()
    tokens = torch.randint(1, ours.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(3))
    pools = []
    monkeypatch.setattr(Compressor, "pool", lambda self, *a, _pool=Compressor.pool: pools.append(1) or _pool(self, *a))
    with torch.no_grad():
        whole = ours(torch.cat([ids, tokens], 1), attention_mask=torch.cat([mask, torch.ones_like(tokens)], 1)).logits
        pools.clear()
        stepped, cache = _decode_steps(ours, ids, mask, tokens)
        theirs = [_their_steps(source, prompt, row) for prompt, row in ((LONG, tokens[0]), (SHORT, tokens[1]))]
        # a window closes in a row at positions p with p + 1 divisible by the rate: 13.., and 8.. in the padded row
        steps = {rate: sum(any((p + 1) % rate == 0 for p in (13 + i, 8 + i)) for i in range(10)) for rate in (2, 4)}
        # pools per forward: 2 streams in each of the 2 CSA layers (rate 2), 1 in the HCA layer (rate 4)
        assert len(pools) == 2 * 2 + 1 + 2 * 2 * steps[2] + steps[4]  # the prefill, then the steps that close one
        monkeypatch.setattr(WindowCompression, "_completes_a_window", lambda self, real, positions: True)
        every_step, every_cache = _decode_steps(ours, ids, mask, tokens)
    torch.testing.assert_close(stepped[0], whole[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(stepped[1, pad:], whole[1, pad:], atol=1e-5, rtol=0)
    torch.testing.assert_close(stepped[0], theirs[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(stepped[1, pad:], theirs[1], atol=1e-5, rtol=0)
    torch.testing.assert_close(stepped, every_step, atol=0, rtol=0)
    for layer, every in zip(cache.layers, every_cache.layers):
        for name, tail in getattr(layer, "tails", {}).items():
            assert all(torch.equal(a, b) for a, b in zip(tail, every.tails[name]))
            assert torch.equal(layer.entries[name][:, :-1], every.entries[name][:, :-1])  # (the last: dropped ones)


def test_beam_search_equals_transformers(pair):
    """Beam search reorders the compressed caches' tails and entries as transformers' reorders its own."""
    source, ours, _ = pair
    kwargs = dict(max_new_tokens=8, num_beams=3, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(LONG, **kwargs), source.generate(LONG, **kwargs))


def test_packed_documents_see_only_their_own_entries(pair):
    """Two documents packed in one row (positions restarting at 0, no mask) compute what each computes alone: no
    window pools across the boundary, no query sees the other's entries."""
    _, ours, _ = pair
    packed = torch.cat([LONG, SHORT], dim=1)
    positions = torch.cat([torch.arange(LONG.shape[1]), torch.arange(SHORT.shape[1])]).unsqueeze(0)
    with torch.no_grad():
        together = ours(packed, position_ids=positions).logits
        first, second = ours(LONG).logits, ours(SHORT).logits
    torch.testing.assert_close(together[0, : LONG.shape[1]], first[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(together[0, LONG.shape[1]:], second[0], atol=1e-5, rtol=0)


def test_refused_by_name(pair):
    """What transformers' class cannot do is refused naming the argument: decoding that crops the cache, a static
    cache, flash and flex kernels, embeddings in place of the ids hash routing reads."""
    _, ours, root = pair
    with pytest.raises(ValueError, match="prompt_lookup_num_tokens.*compressed"):
        ours.generate(LONG, prompt_lookup_num_tokens=2, max_new_tokens=4)
    with pytest.raises(ValueError, match="assistant_model.*compressed"):
        ours.generate(LONG, assistant_model=ours, max_new_tokens=4)
    with pytest.raises(ValueError, match="no 'static' cache"):
        ours.generate(LONG, cache_implementation="static", max_new_tokens=4)
    cache = ModularDecoderCache(ours.config)
    ours(LONG, cache=cache, use_cache=True)
    with pytest.raises(ValueError, match="cannot be rolled back"):
        cache.crop(-1)
    with pytest.raises(ValueError, match="input_ids"):
        ours(inputs_embeds=ours.get_input_embeddings()(LONG))
    for backend in ("flash_attention_2", "flex_attention"):
        with pytest.raises(ValueError, match="shared_kv"):
            AutoModelForCausalLM.from_pretrained(root / "md", attn_implementation=backend)


def test_export_refuses_what_deepseek_v4_cannot_express(pair, tmp_path):
    _, ours, root = pair
    single = ModularDecoderConfig(**{**ours.config.to_dict(), "residual_stream": "single", "hc_mult": None,
                                     "hc_sinkhorn_iters": None, "hc_eps": None})
    AutoModelForCausalLM.from_config(single).save_pretrained(tmp_path / "single")
    with pytest.raises(ValueError, match="residual_stream"):
        export(tmp_path / "single", tmp_path / "out", family="deepseek_v4", progress=False)


def test_release_layout_converts_and_its_mtp_module_is_left_out(pair, tmp_path):
    """The release's own names (no `model.` prefix: `embed.weight`, `layers.N.attn.wq_a.weight`, `hc_head_fn`, ...)
    convert to the same model; its MTP module (`mtp.*`) is not converted, as transformers' class does not hold it,
    and the card says so."""
    source, ours, root = pair
    release = tmp_path / "release"
    release.mkdir()
    tensors = load_file(root / "src" / "model.safetensors")
    renamed = {}
    for name, tensor in tensors.items():
        for old, new in (("model.embed_tokens.", "embed."), ("model.layers.", "layers."), ("model.norm.", "norm."),
                         ("model.hc_head.hc_", "hc_head_")):
            if name.startswith(old):
                name = new + name[len(old):]
        renamed[name] = tensor.contiguous()
    renamed["mtp.0.e_proj.weight"] = torch.randn(DSV4["hidden_size"], DSV4["hidden_size"])
    save_file(renamed, release / "model.safetensors", metadata={"format": "pt"})
    (release / "config.json").write_text((root / "src" / "config.json").read_text())
    convert(release, tmp_path / "md", progress=False)
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "md").eval()
    with torch.no_grad():
        torch.testing.assert_close(converted(LONG).logits, ours(LONG).logits, atol=0, rtol=0)
    assert "multi-token-prediction module" in (tmp_path / "md" / "README.md").read_text()
    assert json.loads((tmp_path / "md" / "config.json").read_text())["num_mtp_layers"] == 0


def _train(model, collator, tmp_path, **arguments) -> list[float]:
    from transformers import Trainer, TrainingArguments

    dataset = [{"input_ids": [(s * 5 + i) % 90 + 1 for i in range(6 + s % 5)]} for s in range(12)]
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, learning_rate=1e-3,
                             use_cpu=True, report_to=[], logging_steps=1, save_strategy="no",
                             remove_unused_columns=False, **arguments)
    trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=collator)
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_trainer_padded_and_packed_beside_transformers(pair, tmp_path):
    """`Trainer` from the same weights and data: ours on right-padded batches, and on packed batches with gradient
    checkpointing, gives transformers' DeepSeek-V4 loss curve on right-padded batches (its padding comes after each
    row's tokens, so no real token's entry pools it; its packed batches would pool across documents)."""
    from decoding import right_padded
    from transformers import DataCollatorWithFlattening

    _, _, root = pair
    theirs = _train(AutoModelForCausalLM.from_pretrained(root / "src"), right_padded, tmp_path / "a")
    padded = _train(AutoModelForCausalLM.from_pretrained(root / "md"), right_padded, tmp_path / "b")
    packed = _train(AutoModelForCausalLM.from_pretrained(root / "md"), DataCollatorWithFlattening(return_position_ids=True),
                    tmp_path / "c", gradient_checkpointing=True)
    assert len(theirs) == 3
    torch.testing.assert_close(torch.tensor(padded), torch.tensor(theirs), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.tensor(packed), torch.tensor(theirs), rtol=1e-5, atol=1e-5)


def test_vllm_backend_refused_naming_what_it_cannot_serve(pair):
    """vLLM's Transformers backend cannot run shared key = value attention with compressed layers, hash routing or
    the clamped experts: refused at load naming them (transformers' class serves there neither)."""
    from modular_decoder.backend_features import check_backend

    _, ours, _ = pair
    with pytest.raises(ValueError, match="vLLM") as refusal:
        check_backend(ours.config, "vllm")
    for field in ("attention_type='shared_kv'", "num_hash_layers", "swiglu_limit"):
        assert field in str(refusal.value)
    assert "modular-decoder export FOLDER OUT --family deepseek_v4`" in str(refusal.value)  # vLLM's own class


@pytest.mark.parametrize("tiny", [False, True], ids=["published", "tiny"])
def test_preset_parameters_equal_transformers_class_on_meta(tiny):
    """The `deepseek_v4` preset exported to transformers' config and built by `DeepseekV4ForCausalLM` on the meta
    device has the contract's parameter count and ours (DeepSeek-V4-Flash without its MTP module: 284,325,869,015)."""
    from modular_decoder import ModularDecoderForCausalLM, parameter_count, preset_config
    from modular_decoder.conversion import get_family

    config = preset_config("deepseek_v4", tiny=tiny)
    with torch.device("meta"):
        theirs = AutoModelForCausalLM.from_config(get_family("deepseek_v4").from_contract(config))
        ours = ModularDecoderForCausalLM(config)
    count = parameter_count(config)["total"]
    assert sum(p.numel() for p in theirs.parameters()) == count == ours.num_parameters()
    assert tiny or count == 284_325_869_015
