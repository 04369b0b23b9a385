"""What is particular to the recurrent mixers of LFM2, Qwen3.5-MoE, OLMo hybrid and Kimi Linear, against
transformers' own classes with the same weights (through the converter): left padding (and where transformers' class
is not exact), packed documents, the presets' sizes against transformers' classes, the refusals, and each kind on
other layouts. tests/test_linear_attention.py runs every generate() path, the cache and the kernel dispatch on a
case of each kind."""

from __future__ import annotations

import logging

import pytest
import torch
from conversion_cases import CASES, perturbed, save_published, skip_without_class
from kernel_stand_ins import TensorShapes
from test_linear_attention import assert_rules_agree
from transformers import AutoModelForCausalLM

from modular_decoder import ModularDecoderCache, ModularDecoderConfig, ModularDecoderForCausalLM, preset_config
from modular_decoder.contract import cache_bytes_per_token, parameter_count, state_bytes_per_sequence
from modular_decoder.conversion import convert, export, get_family

# conversion case -> the preset of its family
MIXER_CASES = {"lfm2": "lfm2", "lfm2-bias": "lfm2", "qwen3_5_moe_text": "qwen3_5_moe", "olmo_hybrid": "olmo_hybrid",
               "olmo_hybrid-rope": "olmo_hybrid", "kimi_linear": "kimi_linear", "kimi_linear-q-lora": "kimi_linear"}
# the variants beside the cases tests/test_linear_attention.py runs every path on (`FAMILIES` there)
PAIR_CASES = ["lfm2-bias", "qwen3_5_moe_text", "olmo_hybrid-rope", "kimi_linear-q-lora"]
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


@pytest.fixture(scope="module", params=PAIR_CASES)
def pair(request, tmp_path_factory):
    """(case, transformers' model, ours converted from its checkpoint), both fp32 and eval."""
    skip_without_class(request.param)
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

    case = next(case for case, name in MIXER_CASES.items() if name == preset)
    skip_without_class(case)
    config, family = preset_config(preset), CASES[case][0]
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


def test_kimi_linear_preset_is_the_released_48b_a3b():
    config = preset_config("kimi_linear")
    counts = parameter_count(config)
    assert 48e9 < counts["total"] < 50e9 and 3e9 < counts["active"] < 4e9
    assert [i + 1 for i, t in enumerate(config.layer_types) if t == "full_attention"] == [4, 8, 12, 16, 20, 24, 27]
    assert cache_bytes_per_token(config, torch.bfloat16) == 7 * (512 + 64) * 2  # 7 latent layers
    assert state_bytes_per_sequence(config, torch.bfloat16) == 20 * (4 * 3 * 32 * 128 * 2 + 4 * 32 * 128 * 128)


def test_lfm2_preset_is_the_released_1_2b():
    config = preset_config("lfm2")
    assert [i for i, t in enumerate(config.layer_types) if t == "full_attention"] == [2, 5, 8, 10, 12, 14]
    assert 1.16e9 < parameter_count(config)["total"] < 1.18e9
    assert state_bytes_per_sequence(config, torch.bfloat16) == 10 * 3 * 2048 * 2  # 10 windows of 3 x d
    assert cache_bytes_per_token(config, torch.bfloat16) == 6 * 2 * 8 * 64 * 2


# --- the contract ---------------------------------------------------------------------------------

HYBRID = dict(layer_types=["linear_attention", "full_attention"])
KDA = dict(HYBRID, linear_attention_type="kda")


@pytest.mark.parametrize("kwargs, field", [
    (dict(conv_bias=True), "conv_bias"),  # no short-convolution layer reads it
    (dict(HYBRID, conv_bias=True), "conv_bias"),  # a Gated DeltaNet layer does not either
    (dict(HYBRID, linear_attention_type="short_conv", linear_num_key_heads=2), "linear_num_key_heads"),
    (dict(HYBRID, linear_attention_type="short_conv", linear_conv_kernel_dim=0), "linear_conv_kernel_dim"),
    (dict(HYBRID, linear_attention_type="short_conv", conv_bias="yes"), "conv_bias"),
    (dict(KDA, linear_num_key_heads=2, linear_num_value_heads=4), "linear_num_value_heads"),  # one per key head
    (dict(KDA, conv_bias=True), "conv_bias"),
    (dict(attention_type="dsa", kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, q_lora_rank=8,
          index_n_heads=2, index_head_dim=8, index_topk=2, position_embedding_type="none"),
     "position_embedding_type"),  # the indexer rotates: NoPE latent attention is MLA's only
    (dict(latent_norm_eps=1e-6), "latent_norm_eps"),  # no latent attention
])
def test_bad_settings_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"`{field}`"):
        ModularDecoderConfig(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, **kwargs)


def _steps_give_the_no_cache_logits(config) -> None:
    """A random model of `config`: three tokens then one at a time through its cache give the no-cache logits."""
    torch.manual_seed(0)
    model = ModularDecoderForCausalLM(config).eval()
    with torch.no_grad():
        expected = model(IDS % 64, use_cache=False).logits
        cache = ModularDecoderCache(model.config)
        steps = [model(IDS[:, :3] % 64, cache=cache).logits]
        steps += [model(IDS[:, t:t + 1] % 64, cache=cache).logits for t in range(3, IDS.shape[1])]
    torch.testing.assert_close(torch.cat(steps, dim=1), expected, rtol=1e-5, atol=1e-5)


def test_a_short_convolution_combines_with_a_llama_layout():
    """The short convolution is an axis: on a Llama layout with NoPE-free full layers, MLA, or a sandwich block, a
    prompt through the cache step by step gives the no-cache logits."""
    base = dict(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                layer_types=["linear_attention", "full_attention", "linear_attention"],
                linear_attention_type="short_conv", conv_bias=True)
    for extra in (dict(), dict(norm_position="sandwich", num_key_value_heads=1),
                  dict(attention_type="mla", kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)):
        _steps_give_the_no_cache_logits(ModularDecoderConfig(**base, **extra))


@pytest.mark.parametrize("tied", [True, False])
def test_an_untied_lfm2_export_warns_that_vllm_ties_its_head(tied, tmp_path, caplog):
    """transformers' Lfm2ForCausalLM reads the untied head as written (the export's logits are ours); vLLM's class
    ties it, so `export` says so, and says nothing for a tied model."""
    config = preset_config("lfm2", tiny=True, vocab_size=64, hidden_size=32, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                           tie_word_embeddings=tied)
    torch.manual_seed(0)
    ours = perturbed(ModularDecoderForCausalLM(config))
    ours.save_pretrained(tmp_path / "md")
    with caplog.at_level(logging.WARNING, logger="modular_decoder.conversion.api"):
        export(tmp_path / "md", tmp_path / "lfm2", "lfm2", progress=False)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "lfm2").eval()
    ids = torch.tensor([[3, 14, 15, 9, 2, 6]])
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids).logits, atol=1e-5, rtol=0)
    assert theirs.config.tie_word_embeddings == tied
    assert ("always ties its head to the embedding" in caplog.text) != tied


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


# --- Kimi Delta Attention's rule ------------------------------------------------------------------


def _kda_inputs(length: int, with_state: bool):
    torch.manual_seed(length)
    batch, heads, d_k, d_v = 2, 3, 16, 8
    inputs = dict(query=torch.randn(batch, length, heads, d_k), key=torch.randn(batch, length, heads, d_k),
                  value=torch.randn(batch, length, heads, d_v), g=-torch.rand(batch, length, heads, d_k) * 2,
                  beta=torch.rand(batch, length, heads) * 2)
    return inputs, torch.randn(batch, heads, d_k, d_v) if with_state else None


@pytest.mark.parametrize("length", [1, 5, 64, 130])
@pytest.mark.parametrize("with_state", [False, True])
def test_kda_rules_equal_transformers_reference_kernels(length, with_state):
    """The chunked and the recurrent KDA rule equal transformers' `chunk_kimi_delta_attention` /
    `recurrent_kimi_delta_attention` (a decay per key channel, β up to 2, a chunk boundary crossed or not, from a zero
    or a given state) and each other."""
    skip_without_class("kimi_linear")
    from transformers.models.kimi_linear import modeling_kimi_linear as reference

    from modular_decoder import delta_rule, kda_rule

    inputs, state = _kda_inputs(length, with_state)
    kwargs = dict(initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ours_chunked = kda_rule.chunked_kda(**inputs, initial_state=state)
    ours_recurrent = delta_rule.recurrent_gated_delta_rule(**inputs, initial_state=state)
    theirs_chunked = reference.chunk_kimi_delta_attention(*inputs.values(), **kwargs)
    theirs_recurrent = reference.recurrent_kimi_delta_attention(*inputs.values(), **kwargs)
    assert_rules_agree(ours_chunked, ours_recurrent, theirs_chunked, theirs_recurrent)


def test_chunked_kda_holds_no_sequence_by_sequence_tensor():
    """O(T·C·d_k) per head: over 1,024 tokens no intermediate has two dimensions as long as the sequence."""
    from modular_decoder import kda_rule

    inputs, _ = _kda_inputs(1024, False)
    with TensorShapes() as mode:
        kda_rule.chunked_kda(**inputs)
    shapes = mode.shapes
    assert not [shape for shape in shapes if sum(dim >= 1024 for dim in shape) >= 2]


def test_kda_and_nope_latent_attention_combine_with_other_layouts():
    """KDA and NoPE latent attention are axes: KDA beside standard attention with RoPE on a sandwich block, and
    NoPE MLA beside Gated DeltaNet; a prompt through the cache step by step gives the no-cache logits."""
    base = dict(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                layer_types=["linear_attention", "full_attention", "linear_attention"], linear_num_key_heads=2,
                linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=16)
    for extra in (dict(linear_attention_type="kda", norm_position="sandwich", num_key_value_heads=2,
                       linear_allow_neg_eigval=True),
                  dict(attention_type="mla", kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                       position_embedding_type="none", latent_norm_eps=1e-6)):
        _steps_give_the_no_cache_logits(ModularDecoderConfig(**base, **extra))


def test_kimi_linear_imports_and_refuses_by_name_where_transformers_has_no_class(monkeypatch):
    """On a release without `KimiLinearConfig` (5.16) the family module imports, and exporting names the release."""
    import types

    from modular_decoder.conversion.families import kimi_linear

    monkeypatch.setattr(kimi_linear, "transformers", types.SimpleNamespace(__version__="5.16.1"))
    with pytest.raises(ValueError, match="has no Kimi Linear"):
        kimi_linear.from_contract(preset_config("kimi_linear", tiny=True))
