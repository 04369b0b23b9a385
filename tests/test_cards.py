"""model_cards/: every committed card is what the code renders now, parses as a Hub card, and its
numbers agree with the contract functions and with a model actually built from the config."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard

from modular_decoder import (PRESETS, ModularDecoderForCausalLM, cache_bytes, cache_bytes_per_token, parameter_count,
                             preset_config)
from modular_decoder.tools.cards import CARD_TEMPLATE, preset_card, render_model_card, variant_tags

CARDS = Path(__file__).resolve().parent.parent / "model_cards"


def _row(text: str, label: str) -> int:
    match = re.search(rf"^\| {re.escape(label)} \| ([\d,]+) \|$", text, re.MULTILINE)
    assert match, f"no row {label!r}"
    return int(match.group(1).replace(",", ""))


def test_template_is_committed():
    assert (CARDS / "TEMPLATE.md").read_text() == CARD_TEMPLATE.template


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_card(name):
    committed = (CARDS / f"{name}.md").read_text()
    assert committed == preset_card(name), "stale card: run `python -m modular_decoder.tools.cards model_cards`"

    card = ModelCard(committed)
    meta = card.data.to_dict()
    assert meta["library_name"] == "transformers"
    assert meta["pipeline_tag"] == "text-generation"
    assert meta["license"] == "apache-2.0"
    config = preset_config(name)
    assert set(variant_tags(config)) <= set(meta["tags"])

    with torch.device("meta"):  # the real module tree, without allocating the weights
        model = ModularDecoderForCausalLM(config)
    assert _row(card.text, "total") == model.num_parameters()
    assert _row(card.text, "active per token") == parameter_count(config)["active"]
    if config.mlp_type == "moe":  # routed experts: a token uses fewer parameters than the model holds
        assert _row(card.text, "active per token") < _row(card.text, "total")
        assert "target_parameters" in card.text
    assert _row(card.text, "per token (all layers)") == cache_bytes_per_token(config)
    for k in (4, 32, 128):
        assert _row(card.text, f"at {k}k context") == cache_bytes(config, k * 1024)
    fields = ("hidden_size", "norm_position", "position_embedding_type")
    if config.attention_type == "standard":  # MLA heads read the latent: no K/V heads in its table
        fields += ("num_key_value_heads",)
    for field in fields:
        assert f"| `{field}` | `{getattr(config, field)!r}` |" in card.text


def test_tags_name_the_variant_choices():
    tags = variant_tags(preset_config("gemma2"))
    assert {"norm-position-sandwich", "mlp-gated", "activation-gelu-pytorch-tanh", "attention-gqa",
            "sliding-window", "logit-softcapping"} <= set(tags)
    assert "attention-mqa" in variant_tags(preset_config("falcon"))
    assert "parallel-block" in variant_tags(preset_config("falcon"))
    assert "attention-mha" in variant_tags(preset_config("gpt2"))
    assert {"mlp-moe", "mixture-of-experts", "router-sigmoid-topk", "attention-mla"} <= set(
        variant_tags(preset_config("deepseek_v3")))
    assert {"attention-sinks", "sliding-window", "router-topk-softmax", "clamped-swiglu"} <= set(
        variant_tags(preset_config("gpt_oss")))
    assert "nope-layers" in variant_tags(preset_config("smollm3"))
    assert {"residual-stream-altup", "laurel", "activation-sparsity", "kv-sharing", "per-layer-embeddings"} <= set(
        variant_tags(preset_config("gemma3n")))
    assert {"per-layer-attention-shapes", "kv-sharing", "per-layer-embeddings", "layer-scalars",
            "sliding-window"} <= set(variant_tags(preset_config("gemma4")))
    assert {"chunked-attention", "nope-layers", "nope-temperature-tuning", "qk-norm-weightless", "router-topk-sigmoid",
            "router-weight-on-input"} <= set(variant_tags(preset_config("llama4")))
    assert "query-temperature" in variant_tags(preset_config("ministral3"))
    assert not {"attention-sinks", "nope-layers", "clamped-swiglu"} & set(variant_tags(preset_config("llama")))


@pytest.mark.parametrize("name, fields", [
    ("gpt_oss", ("attention_sinks", "router_type", "router_bias", "mlp_bias", "swiglu_limit", "swiglu_alpha")),
    ("gemma3n", ("residual_stream", "altup_num_inputs", "altup_active_idx", "altup_coef_clip", "altup_correct_scale",
                 "laurel_rank", "activation_sparsity_pattern", "num_kv_shared_layers", "value_norm")),
    ("gemma4", ("global_head_dim", "num_kv_shared_layers", "value_norm", "hidden_size_per_layer_input",
                "vocab_size_per_layer_input", "layer_scalar", "layer_intermediate_sizes")),
    ("llama4", ("attention_chunk_size", "attn_temperature_tuning", "floor_scale", "attn_scale",
                "attn_temperature_offset", "attn_temperature_layers", "qk_norm", "router_type",
                "apply_router_weight_on_input", "rope_interleaved")),
])
def test_cards_name_the_new_fields(name, fields):
    card = preset_card(name)
    for field in fields:
        assert f"| `{field}` | `{getattr(preset_config(name), field)!r}` |" in card, field


def test_card_shows_the_nope_layers_as_a_pattern():
    assert "| `no_rope_layers` | `" + "RRRN" * 9 + "` (R: 1, N: 0) |" in preset_card("smollm3")


def test_converted_card_names_base_model():
    text = render_model_card(preset_config("smollm2", tiny=True), base_model="HuggingFaceTB/SmolLM2-135M-Instruct",
                             repo_id="me/smollm2-md")
    card = ModelCard(text)
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert 'from_pretrained("me/smollm2-md", trust_remote_code=True)' in card.text
    assert "base_model" not in ModelCard(render_model_card(preset_config("gpt2", tiny=True))).data.to_dict()
