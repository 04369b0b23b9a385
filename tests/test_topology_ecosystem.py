"""Llama 4, Gemma 4 and Gemma 3n presets and adapters beside transformers' own classes: each preset (published and
tiny) exported to its family's config and built by transformers' class on the meta device has the contract's
parameter count and ours; a LoRA adapter made on transformers' class loads onto the converted model with its logits
(converted where Llama 4 names the modules otherwise), trains a step there with gradient checkpointing, and loads back
onto transformers' class with ours; an adapter the family's map cannot rename is refused naming the module."""

from __future__ import annotations

import json

import pytest
import torch
from conversion_cases import CASES, converted_pair, lora_round_trip, preset_parameter_counts

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


# case -> the family whose map renames the adapter (Llama 4's dense MLPs and shared expert are transformers'
# `feed_forward` and `feed_forward.shared_expert`, ours `mlp` and `mlp.shared_experts`), or None: named alike
LORA_CASES = {"llama4_text": "llama4_text", "gemma4_text": None, "gemma3n_text": None}
IDS = torch.tensor([[5, 17, 3, 42, 8, 61, 23, 11, 2, 80, 33, 7]])


@pytest.mark.parametrize("case", sorted(LORA_CASES))
def test_lora_adapter_moves_between_transformers_class_and_ours(case, tmp_path):
    """An adapter on every attention and MLP projection (a reader of shared keys and values has no k / v projection
    on either side; Llama 4's shared experts too), made on transformers' class, gives ours its logits (through
    `convert_adapter` where the family names them otherwise); one SGD step on ours with gradient checkpointing
    changes them, and the trained adapter (through `export_adapter`) gives transformers' class ours."""
    _, _, path = converted_pair(case, tmp_path)

    def checkpointed(model):
        model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    ours, before = lora_round_trip(path, ATTENTION + MLP, IDS, tmp_path, before_step=checkpointed,
                                   family=LORA_CASES[case])
    with torch.no_grad():
        assert (ours(IDS).logits - before).abs().max() > 1e-3


@pytest.mark.parametrize("case, targets, refused", [
    ("llama4_text", {"target_modules": ["router"]}, "model.layers.1.feed_forward.router (a TopKRouter in ours)"),
    ("llama4_text", {"target_modules": ["q_proj"], "target_parameters": ["experts.down_proj"]},
     "`target_parameters`"),
    ("phi3", {"target_modules": ["qkv_proj", "o_proj"]}, "model.layers.0.self_attn.qkv_proj"),
], ids=["a-router-ours-holds-as-a-parameter", "experts-parameters", "a-projection-the-map-splits"])
def test_an_adapter_the_map_cannot_rename_is_refused_naming_it(case, targets, refused, tmp_path, capsys):
    """An adapter on a module that is a linear layer on transformers' side only (Llama 4's router), on parameters
    (experts), or on a projection the map splits (Phi-3's fused qkv) is refused in one line naming it, never
    converted without it; the modules it can rename are not written either."""
    import transformers as tf
    from peft import LoraConfig, get_peft_model
    from test_cli_errors import user_error

    config = CASES[case][1]()
    config.save_pretrained(tmp_path / "theirs")
    get_peft_model(tf.AutoModelForCausalLM.from_config(config), LoraConfig(r=2, **targets)).save_pretrained(
        tmp_path / "adapter")
    adapter_config = tmp_path / "adapter" / "adapter_config.json"  # the base named by the adapter itself
    adapter_config.write_text(json.dumps({**json.loads(adapter_config.read_text()),
                                          "base_model_name_or_path": str(tmp_path / "theirs")}))
    assert refused in user_error(capsys, ["convert", str(tmp_path / "adapter"), str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()
