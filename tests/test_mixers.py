"""What is particular to the recurrent mixers of LFM2, Qwen3.5-MoE, OLMo hybrid and Kimi Linear, against
transformers' own classes with the same weights (through the converter): left padding (and where transformers' class
is not exact), packed documents, the presets' sizes against transformers' classes, the refusals, and each kind on
other layouts. tests/test_linear_attention.py runs every generate() path, the cache and the kernel dispatch on a
case of each kind."""

from __future__ import annotations

import pytest
import torch
from conversion_cases import CASES, perturbed, save_published
from transformers import AutoModelForCausalLM

from modular_decoder import ModularDecoderCache, ModularDecoderConfig, ModularDecoderForCausalLM, preset_config
from modular_decoder.contract import cache_bytes_per_token, parameter_count, state_bytes_per_sequence
from modular_decoder.conversion import convert, export, get_family

# conversion case -> the preset of its family
MIXER_CASES = {"lfm2": "lfm2", "lfm2-bias": "lfm2", "qwen3_5_moe_text": "qwen3_5_moe", "olmo_hybrid": "olmo_hybrid",
               "olmo_hybrid-rope": "olmo_hybrid"}
IDS = torch.tensor([[5, 17, 3, 42, 8, 61, 23, 11, 2, 90, 33, 7], [9, 1, 64, 12, 40, 5, 77, 18, 26, 3, 50, 14]])
PADDED = IDS.clone()
PADDED[1, :5] = 0
MASK = torch.ones_like(IDS)
MASK[1, :5] = 0
GREEDY = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
# transformers' class is not exact under left padding with biases on the short convolution (short_conv.py)
PADDING_INEXACT_IN_TRANSFORMERS = {"lfm2-bias"}
# Documents of 70 (crossing a 64-token chunk), 3, 6 and 1 tokens (shorter than the conv window)
DOCUMENTS = [[(7 * i + 3) % 90 + 1 for i in range(70)], [7, 14, 28], [11, 22, 33, 44, 55, 66], [5]]


@pytest.fixture(scope="module", params=sorted(MIXER_CASES))
def pair(request, tmp_path_factory):
    """(case, transformers' model, ours converted from its checkpoint), both fp32 and eval."""
    config = CASES[request.param][1]()
    config.architectures = None
    torch.manual_seed(0)
    source = perturbed(AutoModelForCausalLM.from_config(config).eval())
    path = tmp_path_factory.mktemp(request.param)
    save_published(source, path / "src")
    convert(path / "src", path / "ours", progress=False)
    return request.param, source, ModularDecoderForCausalLM.from_pretrained(path / "ours").eval()


def test_left_padded_batch_matches_each_row_alone_and_transformers(pair):
    case, source, ours = pair
    together = ours.generate(PADDED, attention_mask=MASK, **GREEDY)
    alone = ours.generate(IDS[1:, 5:], **GREEDY)
    assert torch.equal(together[1, 5:], alone[0])
    with torch.no_grad():
        logits = ours(PADDED, attention_mask=MASK).logits
        torch.testing.assert_close(logits[1, 5:], ours(IDS[1:, 5:]).logits[0], rtol=0, atol=1e-5)
    if case not in PADDING_INEXACT_IN_TRANSFORMERS:
        assert torch.equal(together, source.generate(PADDED, attention_mask=MASK, **GREEDY))


def test_packed_documents_equal_each_document_alone_in_transformers_class(pair):
    """One row of packed documents (`position_ids` restarting, no mask): each document's logits equal transformers'
    class on that document alone (its own class carries the state across documents)."""
    _, source, ours = pair
    ids = torch.tensor([sum(DOCUMENTS, [])])
    positions = torch.tensor([sum((list(range(len(d))) for d in DOCUMENTS), [])])
    with torch.no_grad():
        packed = ours(input_ids=ids, position_ids=positions).logits[0]
        start = 0
        for document in DOCUMENTS:
            alone = source(torch.tensor([document])).logits[0]
            torch.testing.assert_close(packed[start:start + len(document)], alone, rtol=1e-5, atol=1e-5)
            start += len(document)


# --- the presets ----------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", sorted(set(MIXER_CASES.values())))
def test_presets_have_the_parameters_of_transformers_class(preset):
    """The full preset, built on the meta device, has the parameters of transformers' class built from its export's
    config; the tiny preset keeps the kinds."""
    from transformers import AutoModelForCausalLM as Auto

    config = preset_config(preset)
    family = next(family for case, (family, _) in CASES.items() if MIXER_CASES.get(case) == preset)
    with torch.device("meta"):
        ours = ModularDecoderForCausalLM(config)
        theirs = Auto.from_config(get_family(family).from_contract(config))
    assert ours.num_parameters() == theirs.num_parameters() == parameter_count(config)["total"]
    tiny = preset_config(preset, tiny=True)
    assert tiny.linear_attention_type == config.linear_attention_type
    assert set(tiny.layer_types) == set(config.layer_types)


def test_qwen3_5_moe_preset_is_the_released_35b_a3b():
    config = preset_config("qwen3_5_moe")
    counts = parameter_count(config)
    assert 34e9 < counts["total"] < 36e9 and 2.5e9 < counts["active"] < 3.5e9
    assert config.layer_types[:4] == ["linear_attention"] * 3 + ["full_attention"]


def test_lfm2_preset_is_the_released_1_2b():
    config = preset_config("lfm2")
    assert [i for i, t in enumerate(config.layer_types) if t == "full_attention"] == [2, 5, 8, 10, 12, 14]
    assert 1.16e9 < parameter_count(config)["total"] < 1.18e9
    assert state_bytes_per_sequence(config, torch.bfloat16) == 10 * 3 * 2048 * 2  # 10 windows of 3 x d
    assert cache_bytes_per_token(config, torch.bfloat16) == 6 * 2 * 8 * 64 * 2


# --- the contract ---------------------------------------------------------------------------------

HYBRID = dict(layer_types=["linear_attention", "full_attention"])


@pytest.mark.parametrize("kwargs, field", [
    (dict(conv_bias=True), "conv_bias"),  # no short-convolution layer reads it
    (dict(HYBRID, conv_bias=True), "conv_bias"),  # a Gated DeltaNet layer does not either
    (dict(HYBRID, linear_attention_type="short_conv", linear_num_key_heads=2), "linear_num_key_heads"),
    (dict(HYBRID, linear_attention_type="short_conv", linear_conv_kernel_dim=0), "linear_conv_kernel_dim"),
    (dict(HYBRID, linear_attention_type="short_conv", conv_bias="yes"), "conv_bias"),
])
def test_bad_settings_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"`{field}`"):
        ModularDecoderConfig(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, **kwargs)


def test_a_short_convolution_combines_with_a_llama_layout():
    """The short convolution is an axis: on a Llama layout with NoPE-free full layers, MLA, or a sandwich block, a
    prompt through the cache step by step gives the no-cache logits."""
    base = dict(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                layer_types=["linear_attention", "full_attention", "linear_attention"],
                linear_attention_type="short_conv", conv_bias=True)
    for extra in (dict(), dict(norm_position="sandwich", num_key_value_heads=1),
                  dict(attention_type="mla", kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)):
        torch.manual_seed(0)
        model = ModularDecoderForCausalLM(ModularDecoderConfig(**base, **extra)).eval()
        with torch.no_grad():
            expected = model(IDS % 64, use_cache=False).logits
            cache = ModularDecoderCache(model.config)
            steps = [model(IDS[:, :3] % 64, cache=cache).logits]
            steps += [model(IDS[:, t:t + 1] % 64, cache=cache).logits for t in range(3, IDS.shape[1])]
        torch.testing.assert_close(torch.cat(steps, dim=1), expected, rtol=1e-5, atol=1e-5)


def test_olmo_hybrid_folders_of_either_layout_convert_and_export_to_the_released_one(tmp_path):
    """A folder saved by transformers' own `save_pretrained` (its three convolutions cut in equal thirds, an attention
    layer's first norm named as a linear layer's) converts with the logits of transformers' class, and export writes
    the released layout (convolutions of H_k·d_k, H_k·d_k, H_v·d_v rows), which transformers' class loads back."""
    from safetensors.torch import load_file

    config = CASES["olmo_hybrid"][1]()
    config.architectures = None
    torch.manual_seed(0)
    source = perturbed(AutoModelForCausalLM.from_config(config)).eval()
    source.save_pretrained(tmp_path / "theirs")
    convert(tmp_path / "theirs", tmp_path / "ours", progress=False)
    ours = ModularDecoderForCausalLM.from_pretrained(tmp_path / "ours").eval()
    export(tmp_path / "ours", tmp_path / "back", family="olmo_hybrid", progress=False)
    files = load_file(tmp_path / "back" / "model.safetensors")
    key, value = 2 * 8, 2 * 16
    assert [files[f"model.layers.0.linear_attn.{x}_conv1d.weight"].shape[0] for x in "qkv"] == [key, key, value]
    assert "model.layers.2.post_attention_layernorm.weight" in files  # the attention layer's, by its own name
    assert "model.layers.0.feedforward_layer_norm.weight" in files  # a linear layer's
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        expected = source(IDS).logits
        torch.testing.assert_close(ours(IDS).logits, expected, rtol=0, atol=1e-5)
        torch.testing.assert_close(back(IDS).logits, expected, rtol=0, atol=0)


@pytest.mark.parametrize("kwargs", [
    dict(linear_attention_norm_position="pre"),  # no linear layer
    dict(HYBRID, linear_attention_norm_position="middle"),
    dict(HYBRID, linear_attention_norm_position="pre", parallel_block=True),
    dict(HYBRID, linear_allow_neg_eigval=1),
    dict(HYBRID, linear_norm_eps=0.0),
    dict(linear_norm_eps=1e-5),  # no linear layer
])
def test_bad_gated_deltanet_and_block_settings_are_refused_naming_the_field(kwargs):
    field = next(name for name in kwargs if name.startswith("linear_") and name != "linear_attention_type"
                 and name != "layer_types")
    with pytest.raises(ValueError, match=f"`{field}`"):
        ModularDecoderConfig(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, **kwargs)
