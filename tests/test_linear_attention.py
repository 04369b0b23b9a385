"""Linear-attention layers beside full attention, against transformers' own classes with the same weights (through
the converter): Gated DeltaNet (`Qwen3NextForCausalLM`, `Qwen3_5ForCausalLM`, `OlmoHybridForCausalLM`) and every
other kind of the registry through a family that has it (`FAMILIES`). The kernels against transformers' reference
kernels, logits and every generate() path through each side's own cache (drafting: test_hybrid_drafting.py), the
cache's state and its arithmetic, the refusals, and the GPU kernel dispatch (with stand-ins: fla and causal-conv1d
need CUDA, which the test machines lack). tests/test_mixers.py has what is particular to KDA and the short
convolution, test_mamba2.py Mamba-2's kernels and rules."""

from __future__ import annotations

import pytest
import torch
from conversion_cases import CASES, perturbed, save_published, skip_without_class
from kernel_stand_ins import TensorShapes, clear_kernel_caches, fake_fla, use_causal_conv1d
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_next import modeling_qwen3_next as reference

from modular_decoder import ModularDecoderCache, ModularDecoderConfig, ModularDecoderForCausalLM, preset_config
from modular_decoder import compat, delta_rule, kda_rule
from modular_decoder.contract import cache_bytes, cache_bytes_per_token, parameter_count, state_bytes_per_sequence
from modular_decoder.conversion import convert
from modular_decoder.hybrid_cache import HybridLayer
from modular_decoder.recurrent_cache import RecurrentLayer

# The hybrids of every linear-attention kind (their own kernels and rules: test_mamba2.py for Mamba-2's,
# test_mixers.py for KDA's); those whose kernels are fla's and causal-conv1d's (`delta_rule.build_kernels`)
DELTA_RULE_FAMILIES = ["qwen3_next", "qwen3_5_text", "olmo_hybrid", "kimi_linear", "lfm2"]
FAMILIES = DELTA_RULE_FAMILIES + ["bamba", "granitemoehybrid", "nemotron_h", "falcon_h1"]
# the fla kernels each kind calls (besides causal-conv1d's)
FLA_CALLS = {"gated_deltanet": {"chunked_gated_delta_rule", "recurrent_gated_delta_rule"},
             "kda": {"chunked_kda", "recurrent_gated_delta_rule"}, "short_conv": set()}
IDS = torch.tensor([[5, 17, 3, 42, 8, 61, 23, 11, 2, 90, 33, 7], [9, 1, 64, 12, 40, 5, 77, 18, 26, 3, 50, 14]])
PADDED = IDS.clone()
PADDED[1, :5] = 0
MASK = torch.ones_like(IDS)
MASK[1, :5] = 0
GREEDY = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    """(transformers' model, ours converted from its checkpoint), both fp32 and eval."""
    return converted_pair(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=DELTA_RULE_FAMILIES)
def delta_rule_pair(request, tmp_path_factory):
    return converted_pair(request.param, tmp_path_factory)


def converted_pair(case: str, tmp_path_factory):
    """(transformers' model of conversion case `case`, every weight perturbed, ours converted from its checkpoint),
    both fp32 and eval; skipped where this transformers has no class for it."""
    skip_without_class(case)
    family, build = CASES[case]
    config = build()
    config.architectures = None
    torch.manual_seed(0)
    source = perturbed(AutoModelForCausalLM.from_config(config).eval())
    path = tmp_path_factory.mktemp(case)
    save_published(source, path / "src")
    convert(path / "src", path / "ours", progress=False)
    return source, ModularDecoderForCausalLM.from_pretrained(path / "ours").eval()


def _cache_of(output):
    return getattr(output, compat.CACHE_NAME)


def _states(cache) -> list:
    """The cache's linear-attention states: its linear layers', and a hybrid layer's (`recurrent`)."""
    return [layer.recurrent if isinstance(layer, HybridLayer) else layer for layer in cache.layers
            if isinstance(layer, (RecurrentLayer, HybridLayer))]


def _key_layers(cache) -> list:
    """The cache's layers that hold keys (attention layers, hybrid layers)."""
    return [layer for layer in cache.layers if getattr(layer, "keys", None) is not None]


# --- the kernels --------------------------------------------------------------------------------


def _rule_inputs(length: int, seed: int = 0, beta_scale: float = 1.0):
    torch.manual_seed(seed)
    batch, key_heads, value_heads, d_k, d_v = 2, 2, 4, 16, 8
    return dict(query=torch.randn(batch, length, key_heads, d_k), key=torch.randn(batch, length, key_heads, d_k),
                value=torch.randn(batch, length, value_heads, d_v), g=-torch.rand(batch, length, value_heads) * 2,
                beta=torch.rand(batch, length, value_heads) * beta_scale), torch.randn(batch, value_heads, d_k, d_v)


@pytest.mark.parametrize("length", [1, 5, 64, 130])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("beta_scale", [1.0, 2.0])
def test_kernels_equal_transformers_reference_kernels(length, with_state, beta_scale):
    """Both rules equal transformers' `torch_chunk_gated_delta_rule` / `torch_recurrent_gated_delta_rule` (grouped
    value heads, a chunk boundary crossed or not, from a zero or a given state, β in (0, 1) or, with negative
    eigenvalues allowed as OLMo hybrid's, in (0, 2)), and each other."""
    inputs, state = _rule_inputs(length, beta_scale=beta_scale)
    state = state if with_state else None
    ours_chunked = delta_rule.chunked_gated_delta_rule(**inputs, initial_state=state)
    ours_recurrent = delta_rule.recurrent_gated_delta_rule(**inputs, initial_state=state)
    kwargs = dict(initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    theirs_chunked = reference.torch_chunk_gated_delta_rule(*inputs.values(), **kwargs)
    theirs_recurrent = reference.torch_recurrent_gated_delta_rule(*inputs.values(), **kwargs)
    assert_rules_agree(ours_chunked, ours_recurrent, theirs_chunked, theirs_recurrent)


def assert_rules_agree(ours_chunked, ours_recurrent, theirs_chunked, theirs_recurrent) -> None:
    """Ours chunked = transformers' chunked, ours recurrent = transformers' recurrent, and ours chunked = ours
    recurrent: outputs and final states (each rule returns both)."""
    for ours, theirs in ((ours_chunked, theirs_chunked), (ours_recurrent, theirs_recurrent),
                         (ours_chunked, ours_recurrent)):
        torch.testing.assert_close(ours[0], theirs[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours[1], theirs[1], rtol=1e-5, atol=1e-5)


def test_chunked_rule_holds_no_sequence_by_sequence_tensor():
    """O(T·C) per head: over 1,024 tokens no intermediate has two dimensions as long as the sequence (no query x
    key matrix), only (chunk x chunk) blocks."""
    inputs, _ = _rule_inputs(1024)
    with TensorShapes() as mode:
        delta_rule.chunked_gated_delta_rule(**inputs)
    assert not [shape for shape in mode.shapes if sum(dim >= 1024 for dim in shape) >= 2]
    assert max(max(shape[-2:], default=0) for shape in mode.shapes if len(shape) >= 2) >= delta_rule.CHUNK_SIZE


# --- against transformers' classes ----------------------------------------------------------------


def test_logits_and_greedy_tokens_match_transformers(pair):
    source, ours = pair
    with torch.no_grad():
        torch.testing.assert_close(ours(IDS).logits, source(IDS).logits, rtol=0, atol=1e-5)
    assert torch.equal(ours.generate(IDS, **GREEDY), source.generate(IDS, **GREEDY))


def test_left_padded_batch_matches_transformers_and_each_row_alone(pair):
    source, ours = pair
    together = ours.generate(PADDED, attention_mask=MASK, **GREEDY)
    assert torch.equal(together, source.generate(PADDED, attention_mask=MASK, **GREEDY))
    alone = ours.generate(IDS[1:, 5:], **GREEDY)
    assert torch.equal(together[1, 5:], alone[0])


def test_beam_search_and_sampling_match_transformers(pair):
    source, ours = pair
    beams = dict(GREEDY, num_beams=3)
    assert torch.equal(ours.generate(PADDED, attention_mask=MASK, **beams),
                       source.generate(PADDED, attention_mask=MASK, **beams))
    sampled = []
    for model in (ours, source):
        torch.manual_seed(7)
        sampled.append(model.generate(PADDED, attention_mask=MASK, do_sample=True, top_k=20, max_new_tokens=10,
                                      pad_token_id=0))
    assert torch.equal(*sampled)


def test_a_second_generate_continues_the_cache(pair):
    """generate, append a user turn, generate again on the returned cache: the tokens of one generate over the
    whole text, on our side and on transformers'."""
    source, ours = pair
    first = ours.generate(IDS[:1], max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    turn = torch.cat([first.sequences, torch.tensor([[7, 8, 9]])], dim=1)
    continued = ours.generate(turn, cache=_cache_of(first), max_new_tokens=6, do_sample=False)
    assert torch.equal(continued, ours.generate(turn, max_new_tokens=6, do_sample=False))
    assert torch.equal(continued, source.generate(turn, max_new_tokens=6, do_sample=False))


def test_prompt_in_chunks_through_the_cache_equals_transformers_forward(pair):
    """Chunked prefill: a prompt fed as 5 + 4 + 1 + 2 tokens against the cache gives the logits of transformers'
    one-pass forward (and of ours without a cache)."""
    source, ours = pair
    with torch.no_grad():
        expected = source(IDS, use_cache=False).logits
        torch.testing.assert_close(ours(IDS, use_cache=False).logits, expected, rtol=0, atol=1e-5)
        cache, start, pieces = ModularDecoderCache(ours.config), 0, []
        for size in (5, 4, 1, 2):
            pieces.append(ours(IDS[:, start:start + size], cache=cache).logits)
            start += size
    torch.testing.assert_close(torch.cat(pieces, dim=1), expected, rtol=0, atol=1e-5)


def test_eager_and_sdpa_agree_on_the_full_layers(pair):
    _, ours = pair
    with torch.no_grad():
        sdpa = ours(PADDED, attention_mask=MASK).logits
        ours.set_attn_implementation("eager")
        eager = ours(PADDED, attention_mask=MASK).logits
        ours.set_attn_implementation("sdpa")
    torch.testing.assert_close(eager[:, 5:], sdpa[:, 5:], rtol=0, atol=1e-5)


def test_static_and_int8_caches_give_the_dynamic_tokens(pair):
    _, ours = pair
    dynamic = ours.generate(PADDED, attention_mask=MASK, **GREEDY)
    assert torch.equal(ours.generate(PADDED, attention_mask=MASK, cache_implementation="static", **GREEDY), dynamic)
    if "int8" not in ours.config.attention_kind.cache_implementations:  # MLA's latent (Kimi Linear's full layers)
        return
    quantized = ours.generate(PADDED, attention_mask=MASK, cache_implementation="quantized", **GREEDY)
    assert quantized.shape == dynamic.shape  # int8 K/V on the full layers; the states stay in the model's dtype


# --- the cache ------------------------------------------------------------------------------------


def test_cache_holds_a_constant_state_per_sequence_as_the_contract_says(pair):
    _, ours = pair
    config = ours.config
    with torch.no_grad():
        out = ours(IDS[:, :4], use_cache=True)
        cache = _cache_of(out)
        first = cache.payload_bytes()
        assert first == cache_bytes(config, 4, batch_size=2, dtype=torch.float32)
        ours(IDS[:, 4:], cache=cache)
    assert sum(layer.payload_bytes() for layer in _states(cache)) == 2 * state_bytes_per_sequence(config, torch.float32)
    grown = cache.payload_bytes() - first  # only the full layers grew, by their K/V of 8 tokens
    assert grown == 2 * 8 * cache_bytes_per_token(config, torch.float32)
    per_layer = (2 * config.num_key_value_heads * config.head_dim if config.attention_type == "standard"
                 else config.kv_lora_rank + config.qk_rope_head_dim)  # K/V, or MLA's latent and decoupled key
    assert cache_bytes_per_token(config, torch.float32) == config.attention_layer_count * per_layer * 4
    assert cache.get_seq_length() == IDS.shape[1]


def test_reorder_select_repeat_and_reset_follow_the_batch(pair):
    _, ours = pair
    with torch.no_grad():
        cache = _cache_of(ours(IDS, use_cache=True))
    layer = _states(cache)[0]

    def states():  # the conv window, and the recurrent state where the kind has one (LFM2's has none)
        return [t for t in (layer.conv_state, layer.recurrent_state) if t is not None]

    before = [t.clone() for t in states()]
    assert before and (layer.recurrent_state is not None or ours.config.linear_attention_type == "short_conv")
    cache.reorder_cache(torch.tensor([1, 0]))
    assert all(torch.equal(now, then.flip(0)) for now, then in zip(states(), before, strict=True))
    cache.batch_repeat_interleave(2)
    assert all(torch.equal(now, then.flip(0).repeat_interleave(2, dim=0)) for now, then in zip(states(), before))
    cache.batch_select_indices(torch.tensor([0, 3]))
    assert all(torch.equal(now, then.flip(0)) for now, then in zip(states(), before, strict=True))
    cache.reset()
    assert layer.conv_state is None and layer.recurrent_state is None and layer.get_seq_length() == 0


# --- the contract ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, field", [
    (dict(linear_num_key_heads=2), "linear_num_key_heads"),  # no linear layer reads it
    (dict(layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2, linear_num_value_heads=3),
     "linear_num_value_heads"),
    (dict(layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=0), "linear_conv_kernel_dim"),
    (dict(layer_types=["linear_attention", "full_attention"], linear_attention_type="mamba"), "linear_attention_type"),
    (dict(layer_types=["linear_attention"] * 2), "position_embedding_type"),  # rope with no attention layer
    (dict(attention_type="mla", kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
          attn_output_gate=True), "attn_output_gate"),
])
def test_bad_settings_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"`{field}`"):
        ModularDecoderConfig(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, **kwargs)


def test_presets_follow_their_checkpoints():
    """Qwen3-Next-80B-A3B: about 80B parameters (the MTP module aside); the state per sequence is constant."""
    config = preset_config("qwen3_next")
    assert config.layer_types[:4] == ["linear_attention"] * 3 + ["full_attention"]
    assert 79e9 < parameter_count(config)["total"] < 81e9
    assert cache_bytes_per_token(config, torch.bfloat16) == 12 * 2 * 2 * 256 * 2  # 12 full layers of 2 K/V heads
    assert state_bytes_per_sequence(config, torch.bfloat16) == 36 * (4 * (2 * 16 * 128 + 32 * 128) * 2
                                                                     + 4 * 32 * 128 * 128)
    tiny = preset_config("qwen3_5", tiny=True)
    assert tiny.layer_types == ["linear_attention", "full_attention"] and tiny.linear_num_value_heads == 6


# --- the GPU kernels' dispatch, with stand-ins ----------------------------------------------------


def _use_stand_ins(monkeypatch, calls: list) -> None:
    """fla (Gated DeltaNet's and KDA's kernels) and causal-conv1d reported available and this device counted as
    theirs, as stand-ins that compute what the libraries document and record their calls in `calls`."""
    monkeypatch.setattr(compat, "flash_linear_attention_kernels", lambda: (
        fake_fla(delta_rule.chunked_gated_delta_rule, calls), fake_fla(delta_rule.recurrent_gated_delta_rule, calls)))
    monkeypatch.setattr(compat, "fla_kda_kernels", lambda: (
        fake_fla(kda_rule.chunked_kda, calls), fake_fla(delta_rule.recurrent_gated_delta_rule, calls)))
    monkeypatch.setattr(delta_rule, "_FLA_DEVICES", ("cpu",))
    use_causal_conv1d(monkeypatch, calls)


def test_gpu_kernels_are_dispatched_where_available(delta_rule_pair, monkeypatch):
    """With fla and causal-conv1d reported available (stand-ins that compute what the libraries document) and
    this device counted as theirs, the layers call them (the chunked kernel for prefill, the fused recurrent one
    and the in-place conv update for decode, those of the layer's kind) and the tokens stay those of the PyTorch
    path. While the cache records for prompt lookup, the window is not updated in place (a crop may need it) and the
    tokens stay greedy's."""
    _, ours = delta_rule_pair
    expected = ours.generate(PADDED, attention_mask=MASK, **GREEDY)
    grounded = torch.cat([IDS[:1], IDS[:1, :6]], dim=1)  # prompt lookup finds drafts in it
    greedy = ours.generate(grounded, **GREEDY)
    fla = FLA_CALLS[ours.config.linear_attention_type]
    calls = []
    _use_stand_ins(monkeypatch, calls)
    try:
        assert delta_rule.kernels_for(torch.device("cpu")).name == "fla+causal-conv1d"
        assert torch.equal(ours.generate(PADDED, attention_mask=MASK, **GREEDY), expected)
        assert fla | {"conv", "conv_update"} <= set(calls)
        calls.clear()
        assert torch.equal(ours.generate(grounded, prompt_lookup_num_tokens=3, **GREEDY), greedy)
    finally:
        monkeypatch.undo()
        clear_kernel_caches()
    assert fla | {"conv"} <= set(calls)
    assert "conv_update" not in calls
    assert delta_rule.kernels_for(torch.device("cpu")) == delta_rule.TORCH_KERNELS


def test_gpu_kernels_take_packed_documents_by_cu_seqlens(delta_rule_pair, monkeypatch):
    """Packed documents on the GPU path: fla's chunked kernel gets `cu_seqlens` (batch 1), causal-conv1d's
    kernel the row with zeros between documents; each document's logits stay those it has alone."""
    _, ours = delta_rule_pair
    documents = [IDS[0, :7].tolist(), IDS[1, :3].tolist(), IDS[1, 3:].tolist()]
    ids = torch.tensor([sum(documents, [])])
    positions = torch.tensor([sum((list(range(len(d))) for d in documents), [])])
    with torch.no_grad():
        alone = [ours(torch.tensor([d])).logits[0] for d in documents]
    calls = []
    _use_stand_ins(monkeypatch, calls)
    try:
        with torch.no_grad():
            packed = ours(input_ids=ids, position_ids=positions).logits[0]
    finally:
        monkeypatch.undo()
        clear_kernel_caches()
    assert {"cu_seqlens" for _ in FLA_CALLS[ours.config.linear_attention_type]} | {"conv"} <= set(calls)
    assert "conv_update" not in calls
    torch.testing.assert_close(packed, torch.cat(alone), rtol=1e-5, atol=1e-5)


def test_without_an_accelerator_transformers_reports_no_gpu_kernels():
    """What this machine has: transformers' own availability checks say no, so the PyTorch path runs."""
    assert compat.flash_linear_attention_kernels() is None and compat.causal_conv1d_kernels() is None
    assert compat.fla_kda_kernels() is None
    assert delta_rule.kernels_for(torch.device("cpu")).name == kda_rule.kda_kernels_for(torch.device("cpu")).name
    assert delta_rule.kernels_for(torch.device("cpu")).name == "torch"


def test_a_checkpoint_with_a_part_of_an_mtp_module_is_refused_by_name(tmp_path):
    """Released Qwen3-Next / Qwen3.5 checkpoints ship a multi-token-prediction module (`mtp.*`), which converts
    (tests/test_mtp_qwen3_next.py); a file holding a part of one (`mtp.fc` without its layer) is refused naming the
    tensor, nothing written."""
    from safetensors.torch import load_file, save_file

    config = CASES["qwen3_5_text"][1]()
    config.architectures = None
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "src")
    weights = load_file(tmp_path / "src" / "model.safetensors")
    save_file({**weights, "mtp.fc.weight": torch.zeros(4, 4)}, str(tmp_path / "src" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"Unexpected tensors .*'mtp\.fc\.weight'"):
        convert(tmp_path / "src", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_reshape_refuses_hybrids_by_name():
    from modular_decoder.tools.reshape.pipeline import check_options

    with pytest.raises(ValueError, match="'linear_attention' layers"):
        check_options(preset_config("qwen3_5", tiny=True), kv_heads=1)


def test_a_cache_that_cannot_hold_the_state_is_refused_by_name():
    from transformers import DynamicCache

    model = ModularDecoderForCausalLM(preset_config("qwen3_5", tiny=True)).eval()
    for cache in (DynamicCache(), DynamicCache(config=model.config)):
        with pytest.raises(ValueError, match="`cache` is a DynamicCache .*ModularDecoderCache"):
            model(IDS[:1, :4], cache=cache)
