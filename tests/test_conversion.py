"""Conversion parity: tiny random checkpoints of every family, made and saved by transformers' own
classes, convert into modular_decoder with the same logits and greedy tokens, and export back to
identical tensors."""

from __future__ import annotations

import pytest
import torch
from conversion_cases import CASES, perturbed, reference_generate, save_published, skip_without_class
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import modular_decoder  # noqa: F401  (registers the family with the Auto classes)
from modular_decoder.conversion import FAMILIES, convert, export

PROMPT = torch.tensor([[5, 17, 3, 42, 8, 61, 23, 11, 2, 90, 33, 7], [9, 1, 64, 12, 40, 5, 77, 18, 26, 3, 50, 14]])


def make_source(case: str, path):
    """A random source checkpoint; every parameter perturbed so that no norm is the identity and a
    swapped tensor could not go unnoticed, and so is every saved buffer (DeepSeek-V3's router
    correction bias, which starts at zero)."""
    skip_without_class(case)
    family, build = CASES[case]
    config = build()
    config.architectures = None
    torch.manual_seed(0)
    model = perturbed(AutoModelForCausalLM.from_config(config).eval())
    save_published(model, path)
    return family, model


def greedy(model, ids, generate=None):
    out = (generate or type(model).generate)(model, ids, max_new_tokens=20, min_new_tokens=20, do_sample=False,
                                             pad_token_id=0)
    return out[:, ids.shape[1]:]


@pytest.mark.parametrize("case", sorted(CASES))
def test_convert_matches_source_and_exports_back(case, tmp_path):
    family, source = make_source(case, tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "md", progress=False)
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "md").eval()
    assert ours.config.model_type == "modular_decoder"
    with torch.no_grad():
        expected, got = source(PROMPT).logits, ours(PROMPT).logits
    diff = (expected - got).abs().max().item()
    print(f"{case}: max logit diff {diff:.2e}")
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    assert torch.equal(greedy(ours, PROMPT[:1]), greedy(source, PROMPT[:1], reference_generate))

    export(tmp_path / "md", tmp_path / "back", family=family, progress=False)
    before, after = load_file(tmp_path / "src" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(after) == sorted(before)
    for name in before:
        assert torch.equal(after[name], before[name]), name


def test_every_family_has_a_case():
    assert {family for family, _ in CASES.values()} == set(FAMILIES)
