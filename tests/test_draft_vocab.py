"""Drafting over a frequency-ranked part of the vocabulary (`mtp_draft_vocab_size`, `mtp.draft_vocab`): the field's
rules, the ranking saved with the model and left out on export, the gathered-rows path against calling the head
(hooked, LoRA-adapted, scaled and soft-capped heads), and `generate(use_mtp=True)` giving plain decoding's tokens with
drafts that lie in the subset."""

from __future__ import annotations

import pytest
import torch

from modular_decoder import ModularDecoderConfig, ModularDecoderForCausalLM, preset_config
from modular_decoder.draft_vocab import draft_logits, set_draft_vocab
from modular_decoder.mtp_generation import MtpCandidateGenerator

pytestmark = pytest.mark.usefixtures("one_thread")
V = 64


def tiny(**overrides) -> ModularDecoderConfig:
    fields = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=48, max_position_embeddings=64, num_mtp_layers=1)
    return ModularDecoderConfig(**{**fields, **overrides})


def model_of(config, subset=None, seed: int = 0) -> ModularDecoderForCausalLM:
    torch.manual_seed(seed)
    model = ModularDecoderForCausalLM(config).eval()
    if subset is not None:
        set_draft_vocab(model, subset)
    return model


def ranked(count: int, seed: int = 1, vocab_size: int = V) -> torch.LongTensor:
    return torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))[:count]


def test_field_rules_and_the_buffer():
    assert tiny().mtp_draft_vocab_size == 0 and model_of(tiny()).mtp.draft_vocab is None
    assert not any("draft" in name for name in model_of(tiny()).state_dict())
    for bad, match in ((-1, "mtp_draft_vocab_size"), (V + 1, "mtp_draft_vocab_size.*vocab_size"), (1.5, "mtp_draft")):
        with pytest.raises(ValueError, match=match):
            tiny(mtp_draft_vocab_size=bad)
    with pytest.raises(ValueError, match="mtp_draft_vocab_size.*num_mtp_layers"):
        tiny(num_mtp_layers=0, mtp_draft_vocab_size=8)
    model = model_of(tiny(mtp_draft_vocab_size=8))
    assert torch.equal(model.mtp.draft_vocab, torch.arange(8))  # before a ranking is set: the first ids
    assert "mtp.draft_vocab" not in dict(model.named_parameters())  # a buffer: optimizers and PEFT never see it
    assert model.to(torch.bfloat16).mtp.draft_vocab.dtype == torch.int64


def test_set_draft_vocab_refuses_bad_ids_naming_them():
    model = model_of(tiny())
    for bad in ([], [[1, 2]], [1.0, 2.0], [3, V], [-1], [2, 2]):
        with pytest.raises(ValueError, match="draft_vocab"):
            set_draft_vocab(model, bad)
    with pytest.raises(ValueError, match="draft_vocab.*num_mtp_layers"):
        set_draft_vocab(model_of(tiny(num_mtp_layers=0)), [1, 2])
    set_draft_vocab(model, [5, 3])
    assert model.config.mtp_draft_vocab_size == 2
    set_draft_vocab(model, None)
    assert model.config.mtp_draft_vocab_size == 0 and model.mtp.draft_vocab is None


def test_saved_and_loaded_with_the_model(tmp_path):
    model = model_of(tiny(), ranked(20))
    model.save_pretrained(tmp_path)
    loaded = ModularDecoderForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.mtp_draft_vocab_size == 20 and torch.equal(loaded.mtp.draft_vocab, ranked(20))


def _module_path(model, hidden):
    """The subset's logits by calling the head whole (the reference the gathered rows must equal)."""
    ids = model.mtp.draft_vocab
    full = torch.full((hidden.shape[0], V), float("-inf"))
    full[:, ids] = model._logits(hidden[:, None])[:, -1][:, ids]
    return full


@pytest.mark.parametrize("fields", [{}, {"tie_word_embeddings": False, "lm_head_bias": True},
                                    {"logits_scaling": 2.5, "final_logit_softcapping": 3.0}],
                         ids=["tied", "untied-bias", "scaled-capped"])
def test_gathered_rows_equal_calling_the_head(fields):
    model = model_of(tiny(**fields), ranked(16))
    hidden = torch.randn(2, 32)
    with torch.no_grad():
        fast = draft_logits(model, hidden)
        assert model.mtp._draft_rows[1].shape == (16, 32)  # the gathered rows, not the whole head
        torch.testing.assert_close(fast, _module_path(model, hidden), rtol=1e-6, atol=1e-6)
        assert torch.equal(fast.argmax(-1), _module_path(model, hidden).argmax(-1))
        assert torch.isinf(fast[:, [i for i in range(V) if i not in ranked(16)]]).all()
        model.lm_head.weight.mul_(-1)  # written in place: the gathered rows are made again
        torch.testing.assert_close(draft_logits(model, hidden), _module_path(model, hidden), rtol=1e-6, atol=1e-6)
        set_draft_vocab(model, ranked(8, seed=2))  # another ranking: again
        torch.testing.assert_close(draft_logits(model, hidden), _module_path(model, hidden), rtol=1e-6, atol=1e-6)


def test_a_hooked_or_adapted_head_is_called():
    from peft import LoraConfig, get_peft_model

    model = model_of(tiny(tie_word_embeddings=False), ranked(16))
    hidden = torch.randn(1, 32)
    calls = []
    handle = model.lm_head.register_forward_hook(lambda module, args, out: calls.append(1) or out * 2)
    with torch.no_grad():
        hooked = draft_logits(model, hidden)
    handle.remove()
    assert calls and torch.equal(hooked, _module_path(model, hidden) * 2)
    adapted = get_peft_model(model, LoraConfig(r=4, target_modules=["lm_head"], init_lora_weights=False))
    base = adapted.get_base_model()
    with torch.no_grad():
        lora = draft_logits(base, hidden)
        reference = _module_path(base, hidden)  # through the LoRA layer
        without = draft_logits(model_of(tiny(tie_word_embeddings=False), ranked(16)), hidden)
    assert torch.equal(lora, reference) and not torch.allclose(lora, without)


def _outside(subset, logits) -> torch.Tensor:
    outside = torch.ones(logits.shape[-1], dtype=torch.bool)
    outside[subset] = False
    return outside


class Drafts:
    """Every step's drafted ids and draft logits."""

    def __init__(self, monkeypatch):
        self.steps = []
        original = MtpCandidateGenerator.get_candidates

        def recorded(generator, input_ids, *args, **kwargs):
            ids, logits = original(generator, input_ids, *args, **kwargs)
            if logits is not None:
                self.steps.append((ids[:, input_ids.shape[1]:].clone(), logits.clone()))
            return ids, logits

        monkeypatch.setattr(MtpCandidateGenerator, "get_candidates", recorded)

    def in_subset(self, subset) -> bool:
        return bool(self.steps) and all(torch.isin(ids, subset).all() and torch.isinf(logits[..., _outside(subset, logits)]).all()
                                        for ids, logits in self.steps)


@pytest.mark.parametrize("case", ["dynamic", "two-modules", "three-drafts-one-module", "int8", "mla"])
def test_greedy_tokens_are_plain_decodings_and_drafts_lie_in_the_subset(case, monkeypatch):
    config = tiny(num_mtp_layers=2 if case == "two-modules" else 1, eos_token_id=None)
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    if case == "three-drafts-one-module":
        kwargs.update(mtp_draft_tokens=3)  # the last module drafting again on its own drafts
    if case == "int8":
        kwargs.update(cache_implementation="quantized", cache_config={"backend": "int8"})
    if case == "mla":
        config = preset_config("deepseek_v3", tiny=True, num_mtp_layers=1, eos_token_id=None)
    subset = ranked(24, vocab_size=config.vocab_size)
    model = model_of(config, subset)
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    drafts = Drafts(monkeypatch)
    drafting = {"use_mtp": True, "mtp_draft_tokens": kwargs.pop("mtp_draft_tokens", None)}
    drafted = model.generate(prompt, attention_mask=torch.ones_like(prompt), **drafting, **kwargs)
    assert torch.equal(drafted, model.generate(prompt, attention_mask=torch.ones_like(prompt), **kwargs))
    assert drafts.in_subset(subset)


def test_a_subset_of_every_id_drafts_as_the_whole_vocabulary(monkeypatch):
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    # the same steps draft in both calls (the adaptive schedule would follow this machine's timings)
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(prompt),
                  num_assistant_tokens_schedule="constant")
    drafts = Drafts(monkeypatch)
    model_of(tiny(eos_token_id=None)).generate(prompt, use_mtp=True, **kwargs)
    whole = list(drafts.steps)
    drafts.steps.clear()
    model_of(tiny(eos_token_id=None), ranked(V)).generate(prompt, use_mtp=True, **kwargs)
    assert whole and len(whole) == len(drafts.steps)
    for (ids, logits), (other_ids, other_logits) in zip(whole, drafts.steps, strict=True):
        assert torch.equal(ids, other_ids)
        torch.testing.assert_close(logits, other_logits, rtol=1e-6, atol=1e-6)


def test_sampling_draws_from_the_subset_and_falls_back_where_processors_leave_none_of_it(monkeypatch):
    subset = ranked(24)
    model = model_of(tiny(eos_token_id=None), subset)
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    kwargs = dict(max_new_tokens=10, do_sample=True, top_k=0, pad_token_id=0, attention_mask=torch.ones_like(prompt))
    drafts = Drafts(monkeypatch)
    torch.manual_seed(0)
    out = model.generate(prompt, use_mtp=True, **kwargs)
    assert out.shape == (1, 15) and drafts.in_subset(subset)
    drafts.steps.clear()  # every id of the subset suppressed: the whole head drafts
    out = model.generate(prompt, use_mtp=True, suppress_tokens=subset.tolist(), **kwargs)
    assert not torch.isin(out[:, 5:], subset).any()
    assert drafts.steps and not any(torch.isin(ids, subset).any() for ids, _ in drafts.steps)


def test_export_leaves_the_ranking_out(tmp_path):
    from mtp_cases import save_deepseek_v3_with_mtp

    from modular_decoder.conversion import convert, export

    src = save_deepseek_v3_with_mtp(tmp_path / "src")
    convert(src, tmp_path / "ours", progress=False)
    model = ModularDecoderForCausalLM.from_pretrained(tmp_path / "ours")
    set_draft_vocab(model, ranked(16))
    model.save_pretrained(tmp_path / "ranked")
    export(tmp_path / "ranked", tmp_path / "back", family="deepseek_v3", progress=False)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "back" / "model.safetensors"), "pt") as files:
        assert not any("draft" in name for name in files.keys())
