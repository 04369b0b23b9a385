"""Llama 4, Gemma 4 and Gemma 3n presets and adapters beside transformers' own classes: each preset (published and
tiny) exported to its family's config and built by transformers' class on the meta device has the contract's
parameter count and ours; a LoRA adapter made on transformers' class loads onto the converted model with its logits,
trains a step there with gradient checkpointing, and loads back onto transformers' class with ours."""

from __future__ import annotations

import pytest
import torch
from conversion_cases import converted_pair, lora_round_trip, preset_parameter_counts

pytestmark = pytest.mark.usefixtures("one_thread")

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


@pytest.mark.parametrize("tiny", [False, True], ids=["published", "tiny"])
@pytest.mark.parametrize("name, family, total", [("llama4", "llama4_text", 107_769_861_120),
                                                 ("gemma4", "gemma4_text", 4_628_569_344),
                                                 ("gemma3n", "gemma3n_text", 4_435_182_688)])
def test_presets_have_the_parameters_of_their_family_class(name, family, total, tiny):
    """Llama-4-Scout's text model, gemma-4-E2B's and gemma-3n-E2B's (and their tiny forms): transformers' class on
    meta, the contract's formula and ours agree; the published ones have their releases' text totals."""
    theirs, count, ours = preset_parameter_counts(name, family, tiny)
    assert theirs == count == ours
    assert tiny or count == total


# case -> the modules named alike on both sides (Llama 4's dense MLPs are transformers' `feed_forward`, ours `mlp`)
LORA_CASES = {"llama4_text": ATTENTION, "gemma4_text": ATTENTION + MLP, "gemma3n_text": ATTENTION + MLP}


@pytest.mark.parametrize("case", sorted(LORA_CASES))
def test_lora_adapter_moves_between_transformers_class_and_ours(case, tmp_path):
    """An adapter on the modules named alike (a reader of shared keys and values has no k / v projection on either
    side), made on transformers' class, gives ours its logits; one SGD step on ours with gradient checkpointing
    changes them, and the trained adapter gives transformers' class ours."""
    _, _, path = converted_pair(case, tmp_path)
    ids = torch.tensor([[5, 17, 3, 42, 8, 61, 23, 11, 2, 80, 33, 7]])

    def checkpointed(model):
        model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    ours, before = lora_round_trip(path, LORA_CASES[case], ids, tmp_path, before_step=checkpointed)
    with torch.no_grad():
        assert (ours(ids).logits - before).abs().max() > 1e-3
