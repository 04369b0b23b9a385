"""Multi-head latent attention: cached decoding vs the full forward for every position scaling,
absorbed vs expanded scores, the latent cache's bytes, generate() strategies, and parity with
transformers' DeepSeek-V2 / V3 through the conversion package."""


import pytest
import torch
from decoding import steps_against_full
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

from modular_decoder import ModularDecoderConfig, ModularDecoderForCausalLM, parameter_count
from modular_decoder.cache import ModularDecoderCache
from modular_decoder.contract import cache_bytes, cache_bytes_per_token
from modular_decoder.conversion import convert, export, get_family
from modular_decoder.latent_cache import LatentLayerMixin
from modular_decoder.eager_attention import attention_probs
from modular_decoder.mla import (ABSORBED_MAX_NEW_TOKENS, ABSORBED_QUERY_BLOCK, MultiHeadLatentAttention, mla_softmax_scale,
                                 set_decode_mode)

SEQ = 20
MLA = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
           max_position_embeddings=64, attention_type="mla", kv_lora_rank=16, qk_nope_head_dim=8,
           qk_rope_head_dim=4, v_head_dim=6)
# DeepSeek-V2/V3 configure YaRN like this (scaled down): mscale on cos/sin, mscale_all_dim on all scores.
DEEPSEEK_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
                 "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16},
    "yarn_deepseek": DEEPSEEK_YARN,
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    # longrope switches factor tables at `original_max_position_embeddings` per call, which no cache
    # can follow (transformers' own models neither); keep the test inside the short range.
    "longrope": {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.1],
                 "long_factor": [2.0, 2.1], "original_max_position_embeddings": 32},
}


def _config(**overrides) -> ModularDecoderConfig:
    return ModularDecoderConfig(**{**MLA, **overrides})


def _scramble(model: nn.Module) -> nn.Module:
    """Weights large enough that attention is far from uniform and norms are not the identity, so a
    wrong scale, rotary layout or mask moves the logits well past the tolerances."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
            elif param.dim() == 2:
                param.copy_(torch.randn_like(param) * (0.3 if "embed" in name else param.shape[1] ** -0.5))
            else:
                param.copy_(0.1 * torch.randn_like(param))
    return model.eval()


def _model(config, backend="eager") -> ModularDecoderForCausalLM:
    torch.manual_seed(0)
    return _scramble(ModularDecoderForCausalLM._from_config(config, attn_implementation=backend))


@torch.no_grad()
def _incremental_logits(model, ids, prefill: int = 5):
    out = model(ids[:, :prefill], use_cache=True)
    steps, cache = [out.logits], out.cache
    for t in range(prefill, ids.shape[1]):
        out = model(ids[:, t : t + 1], cache=cache, use_cache=True)
        steps.append(out.logits)
    return torch.cat(steps, dim=1), cache


CASES = [(rope, q, "auto") for rope in ROPES for q in (None, 12)] + [
    ("default", 12, "expanded"), ("yarn_deepseek", None, "expanded")]


@pytest.mark.parametrize("rope, q_lora_rank, mode", CASES, ids=[f"{r}-q{q}-{m}" for r, q, m in CASES])
def test_cached_decoding_matches_full_forward(rope, q_lora_rank, mode):
    config = _config(rope_parameters=dict(ROPES[rope]), q_lora_rank=q_lora_rank,
                     rope_interleaved=rope == "yarn_deepseek")
    model = _model(config)
    ids = torch.randint(0, config.vocab_size, (2, SEQ))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
    set_decode_mode(model, mode)  # "auto" decodes absorbed against the latent cache
    steps, cache = _incremental_logits(model, ids)
    torch.testing.assert_close(steps, full, rtol=0, atol=1e-5)
    assert all(isinstance(layer, LatentLayerMixin) for layer in cache.layers)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(norm_position="post"),
        dict(parallel_block=True, parallel_norms="separate", mlp_type="dense", hidden_act="gelu"),
        dict(norm_position="sandwich", attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
        dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
        dict(norm_type="layernorm", attention_bias=True, q_lora_rank=12, query_pre_attn_scalar=10.0),
    ],
    ids=["post_norm", "parallel", "softcaps", "sliding", "layernorm_bias"],
)
@pytest.mark.parametrize("implementation", ["dynamic", "static"])
def test_mla_composes_with_the_contract(overrides, implementation):
    model = _model(_config(**overrides))
    ids = torch.randint(0, model.config.vocab_size, (2, SEQ))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        cache = ModularDecoderCache(model.config, implementation, max_cache_len=SEQ + 4)
        out = model(ids[:, :5], cache=cache)
        steps = [out.logits]
        for t in range(5, SEQ):
            steps.append(model(ids[:, t : t + 1], cache=cache).logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("q_lora_rank", [None, 12])
def test_absorbed_equals_expanded(backend, q_lora_rank):
    """Whole sequences (left-padded batch included) scored both ways give the same logits."""
    model = _model(_config(q_lora_rank=q_lora_rank, rope_parameters=dict(DEEPSEEK_YARN)), backend)
    ids = torch.randint(0, model.config.vocab_size, (2, SEQ))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    results = {}
    for mode in ("expanded", "absorbed"):
        set_decode_mode(model, mode)
        with torch.no_grad():
            results[mode] = (model(ids).logits, model(ids, attention_mask=mask).logits)
    for a, b in zip(results["expanded"], results["absorbed"]):
        torch.testing.assert_close(a[:, 4:], b[:, 4:], rtol=0, atol=1e-5)
        torch.testing.assert_close(a[0], b[0], rtol=0, atol=1e-5)
    # the paths are not trivially the same code: forcing a wrong scale on one is visible
    layer = model.model.layers[0].self_attn
    layer.scaling *= 1.5
    with torch.no_grad():
        assert not torch.allclose(model(ids).logits, results["absorbed"][0], atol=1e-3)


def test_absorbed_decode_reads_latents_only(monkeypatch):
    """The absorbed step never runs kv_b_proj (no per-head K/V for the cached tokens). Recorded by patching
    `nn.Linear.forward` on the class: a hook on the layer would itself move decoding to the expanded path
    (`tests/test_decode_adapters.py`)."""
    model = _model(_config())
    kv_b = {id(block.self_attn.kv_b_proj) for block in model.model.layers}
    calls, forward = [], torch.nn.Linear.forward
    monkeypatch.setattr(torch.nn.Linear, "forward", lambda self, x: calls.append(id(self)) or forward(self, x))
    ids = torch.randint(0, model.config.vocab_size, (1, 8))
    with torch.no_grad():
        cache = model(ids[:, :7]).cache
        assert kv_b <= set(calls)  # the prefill expands: the recording sees kv_b_proj when it runs
        calls.clear()
        model(ids[:, 7:], cache=cache)
    assert not kv_b & set(calls)


def test_latent_cache_bytes_match_the_formula():
    # DeepSeek-V2's ratios: d_c = 4·d_h, d_R = d_h / 2 -> 4.5·d_h elements per token and layer
    d_h = 16
    config = _config(hidden_size=64, head_dim=d_h, kv_lora_rank=4 * d_h, qk_rope_head_dim=d_h // 2,
                     qk_nope_head_dim=d_h, v_head_dim=d_h)
    L = config.num_hidden_layers
    assert cache_bytes_per_token(config, torch.float32) == L * 4.5 * d_h * 4
    assert cache_bytes_per_token(config, torch.bfloat16) == L * (config.kv_lora_rank + config.qk_rope_head_dim) * 2
    model = _model(config)
    batch, tokens = 3, 11
    ids = torch.randint(0, config.vocab_size, (batch, tokens))
    for implementation in ("dynamic", "static"):
        cache = ModularDecoderCache(config, implementation, max_cache_len=32)
        with torch.no_grad():
            model(ids, cache=cache)
        expected = batch * tokens * cache_bytes_per_token(config, torch.float32)
        assert cache.payload_bytes() == expected == cache_bytes(config, tokens, batch, torch.float32)
        for layer in cache.layers:
            assert layer.latents.shape[-1] == config.kv_lora_rank and layer.rope_keys.shape[-1] == d_h // 2


@pytest.mark.parametrize("q_lora_rank", [None, 12])
@pytest.mark.parametrize("norm_type", ["rmsnorm", "layernorm"])
def test_parameter_count_matches_formula(q_lora_rank, norm_type):
    config = _config(q_lora_rank=q_lora_rank, norm_type=norm_type, attention_bias=True,
                     attention_output_bias=False)
    assert ModularDecoderForCausalLM(config).num_parameters() == parameter_count(config)["total"]


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(position_embedding_type="alibi"), "position_embedding_type"),
        (dict(position_embedding_type="learned"), "position_embedding_type"),
        (dict(position_embedding_type="sinusoidal"), "position_embedding_type"),
        (dict(qk_norm="head"), "qk_norm"),
        (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
        (dict(qk_rope_head_dim=5), "qk_rope_head_dim"),
        (dict(kv_lora_rank=None), "kv_lora_rank"),
        (dict(q_lora_rank=0), "q_lora_rank"),
    ],
)
def test_bad_combinations_raise(overrides, field):
    with pytest.raises(ValueError, match=field):
        _config(**overrides)


def test_decode_mode_is_validated():
    with pytest.raises(ValueError, match="decode_mode"):
        set_decode_mode(_model(_config()), "fast")


# --- DeepSeek-V2 / V3 parity through the conversion package ------------------------------------

DEEPSEEK = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, max_position_embeddings=64,
                # every layer dense here (the experts: MOE below)
                first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
REFERENCES = {
    "v2": lambda **kw: DeepseekV2ForCausalLM(DeepseekV2Config(**DEEPSEEK, **kw)),
    "v3": lambda **kw: DeepseekV3ForCausalLM(DeepseekV3Config(**DEEPSEEK, n_group=1, topk_group=1, **kw)),
    "v3_halves": lambda **kw: DeepseekV3ForCausalLM(
        DeepseekV3Config(**DEEPSEEK, n_group=1, topk_group=1, rope_interleave=False, **kw)),
}


# V2 and V3 with and without the query bottleneck and YaRN; V3's halves layout once with both.
PARITY = [(ref, q, yarn) for ref in ("v2", "v3") for q in (None, 12) for yarn in (False, True)] + [("v3_halves", 12, True)]


@pytest.mark.parametrize("reference, q_lora_rank, yarn", PARITY,
                         ids=[f"{r}-q{q}-{'yarn' if y else 'rope'}" for r, q, y in PARITY])
def test_parity_with_deepseek(reference, q_lora_rank, yarn, tmp_path):
    torch.manual_seed(0)
    rope = dict(DEEPSEEK_YARN) if yarn else None
    ref = _scramble(REFERENCES[reference](q_lora_rank=q_lora_rank, rope_parameters=rope))
    ref.save_pretrained(tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "ours", progress=False)
    ours = ModularDecoderForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    assert ours.config.attention_type == "mla" and ours.config.rope_interleaved == (reference != "v3_halves")

    ids = torch.randint(0, 97, (2, 40))  # past `original_max_position_embeddings`: YaRN's range matters
    with torch.no_grad():
        expected, got = ref(ids).logits, ours(ids).logits
    assert expected.abs().max() > 1.0  # not a near-zero model where any error would hide
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
    prompt = ids[:, :6]
    kwargs = dict(max_new_tokens=24, do_sample=False, attention_mask=torch.ones_like(prompt))
    with torch.no_grad():
        assert torch.equal(ours.generate(prompt, **kwargs), ref.generate(prompt, **kwargs))


def test_softmax_scale_matches_deepseek():
    for rope in (None, DEEPSEEK_YARN, dict(DEEPSEEK_YARN, mscale=0.707, mscale_all_dim=0.707)):
        ref_config = DeepseekV3Config(**DEEPSEEK, n_group=1, topk_group=1, rope_parameters=rope and dict(rope))
        ours = ModularDecoderConfig(**get_family("deepseek_v3").to_contract(ref_config))
        expected = DeepseekV3ForCausalLM(ref_config).model.layers[0].self_attn.scaling
        assert mla_softmax_scale(ours) == pytest.approx(expected, rel=1e-12)


def test_beam_search_and_assisted_decoding_match_deepseek(tmp_path):
    """Beam reorder / batch repeat (beams) and crop (prompt lookup) on the latent cache."""
    torch.manual_seed(0)
    ref = _scramble(REFERENCES["v3"](q_lora_rank=12, rope_parameters=dict(DEEPSEEK_YARN)))
    ref.save_pretrained(tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "ours", progress=False)
    ours = ModularDecoderForCausalLM.from_pretrained(tmp_path / "ours").eval()
    prompt = torch.randint(0, 97, (2, 6))
    prompt = torch.cat([prompt, prompt[:, :4]], dim=1)  # repeated n-grams give prompt lookup candidates
    mask = torch.ones_like(prompt)
    with torch.no_grad():
        beams = dict(max_new_tokens=12, num_beams=3, num_return_sequences=2, do_sample=False, attention_mask=mask)
        assert torch.equal(ours.generate(prompt, **beams), ref.generate(prompt, **beams))
        greedy = dict(max_new_tokens=16, do_sample=False, attention_mask=mask[:1])
        expected = ref.generate(prompt[:1], **greedy)
        assert torch.equal(ours.generate(prompt[:1], prompt_lookup_num_tokens=3, **greedy), expected)
        assert torch.equal(ours.generate(prompt[:1], cache_implementation="static", **greedy), expected)


@pytest.mark.parametrize("reference", ["v2", "v3"])
def test_export_round_trip(reference, tmp_path):
    torch.manual_seed(0)
    ref = _scramble(REFERENCES[reference](q_lora_rank=12, rope_parameters=dict(DEEPSEEK_YARN)))
    ref.save_pretrained(tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "ours", progress=False)
    export(tmp_path / "ours", tmp_path / "back", family=f"deepseek_{reference}", progress=False)
    back = type(ref).from_pretrained(tmp_path / "back", dtype=torch.float32).eval()
    ids = torch.randint(0, 97, (1, 24))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ref(ids).logits, rtol=0, atol=0)


# DeepSeek with its mixture of experts: a dense first layer, then routed + shared experts.
MOE = dict(num_hidden_layers=3, first_k_dense_replace=1, moe_intermediate_size=12)
MOE_FIELDS = {
    "v2": dict(n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2, routed_scaling_factor=1.5),
    "v2_grouped": dict(n_routed_experts=16, num_experts_per_tok=3, n_shared_experts=1,
                       topk_method="group_limited_greedy", n_group=4, topk_group=2),
    "v3": dict(n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1, n_group=4, topk_group=2,
               routed_scaling_factor=2.5),
}


def _moe_deepseek(reference: str, **kwargs):
    """transformers' DeepSeek-V2 / V3 with the experts of `MOE_FIELDS[reference]`."""
    v3 = reference == "v3"
    config = (DeepseekV3Config if v3 else DeepseekV2Config)(**{**DEEPSEEK, **MOE, **MOE_FIELDS[reference]}, **kwargs)
    return (DeepseekV3ForCausalLM if v3 else DeepseekV2ForCausalLM)(config)


def _moe_reference(reference: str, q_lora_rank, tmp_path):
    """A scrambled DeepSeek MoE model (correction bias included), saved and converted."""
    torch.manual_seed(0)
    ref = _scramble(_moe_deepseek(reference, q_lora_rank=q_lora_rank, rope_parameters=dict(DEEPSEEK_YARN)))
    with torch.no_grad():
        for name, buffer in ref.named_buffers():
            if "e_score_correction_bias" in name:
                buffer.normal_(0.0, 0.1)
    ref.save_pretrained(tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "ours", progress=False)
    ours = ModularDecoderForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    return ref, ours


MOE_PARITY = [("v2", None), ("v2_grouped", 12), ("v3", 12), ("v3", None)]


@pytest.mark.parametrize("reference, q_lora_rank", MOE_PARITY, ids=[f"{r}-q{q}" for r, q in MOE_PARITY])
def test_parity_with_deepseek_mixture_of_experts(reference, q_lora_rank, tmp_path):
    ref, ours = _moe_reference(reference, q_lora_rank, tmp_path)
    assert ours.config.mlp_layer_types == ["dense", "sparse", "sparse"]
    assert ours.config.router_type == ("sigmoid_topk" if reference == "v3" else "softmax_topk")
    ids = torch.randint(0, 97, (2, 40))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # a left-padded row
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    for implementation in ("eager", "grouped_mm"):  # ours (and theirs) with each experts kernel
        ref.set_experts_implementation(implementation)
        ours.set_experts_implementation(implementation)
        with torch.no_grad():
            expected, got = ref(ids).logits, ours(ids).logits
            padded = ref(ids, attention_mask=mask, position_ids=positions).logits
            ours_padded = ours(ids, attention_mask=mask, position_ids=positions).logits
        assert expected.abs().max() > 1.0
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
        torch.testing.assert_close(ours_padded[0], padded[0], rtol=0, atol=1e-4)
        torch.testing.assert_close(ours_padded[1, 7:], padded[1, 7:], rtol=0, atol=1e-4)
    prompt = ids[:, :6]
    with torch.no_grad():
        for kwargs in (dict(max_new_tokens=16, do_sample=False), dict(max_new_tokens=8, num_beams=3, do_sample=False)):
            kwargs["attention_mask"] = torch.ones_like(prompt)
            assert torch.equal(ours.generate(prompt, **kwargs), ref.generate(prompt, **kwargs))


@pytest.mark.parametrize("reference", ["v2_grouped", "v3"])
def test_mixture_of_experts_export_loads_in_the_source_class(reference, tmp_path):
    ref, _ = _moe_reference(reference, 12, tmp_path)
    export(tmp_path / "ours", tmp_path / "back", family=f"deepseek_{reference[:2]}", progress=False)
    back = type(ref).from_pretrained(tmp_path / "back", dtype=torch.float32).eval()
    ids = torch.randint(0, 97, (1, 24))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ref(ids).logits, rtol=0, atol=0)
    gate = "model.layers.1.mlp.gate"
    torch.testing.assert_close(back.get_buffer(f"{gate}.e_score_correction_bias") if reference == "v3" else
                               back.get_parameter(f"{gate}.weight"),
                               ref.get_buffer(f"{gate}.e_score_correction_bias") if reference == "v3" else
                               ref.get_parameter(f"{gate}.weight"), rtol=0, atol=0)


@pytest.mark.parametrize("overrides", [dict(norm_position="post"), dict(norm_position="sandwich"),
                                       dict(parallel_block=True, parallel_norms="separate")],
                         ids=["post_norm", "sandwich", "parallel"])
@pytest.mark.parametrize("implementation", ["dynamic", "static"])
def test_mla_with_mixture_of_experts_composes_with_the_contract(overrides, implementation):
    config = _config(num_hidden_layers=3, mlp_type="moe", mlp_layer_types=["dense", "sparse", "sparse"],
                     num_experts=8, num_experts_per_tok=2, moe_intermediate_size=12, n_shared_experts=1,
                     router_type="sigmoid_topk", n_group=4, topk_group=2, routed_scaling_factor=2.5, **overrides)
    model = _model(config)
    ids = torch.randint(0, model.config.vocab_size, (2, SEQ))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        cache = ModularDecoderCache(model.config, implementation, max_cache_len=SEQ + 4)
        steps = [model(ids[:, :5], cache=cache).logits]
        for t in range(5, SEQ):
            steps.append(model(ids[:, t : t + 1], cache=cache).logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)


def test_output_attentions_from_both_paths():
    model = _model(_config())
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    weights = {}
    for mode in ("expanded", "absorbed"):
        set_decode_mode(model, mode)
        with torch.no_grad():
            weights[mode] = model(ids, output_attentions=True).attentions
    assert len(weights["absorbed"]) == model.config.num_hidden_layers
    for a, b in zip(weights["expanded"], weights["absorbed"]):
        assert a.shape == (2, 4, 8, 8)
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        torch.testing.assert_close(a.sum(-1), torch.ones(2, 4, 8), rtol=0, atol=1e-5)


# --- multi-token steps against a cache: absorbed for a few new tokens, expanded beyond -----------

# A prefill, a long step (chunked prefill, a second turn), an absorbed step of several query blocks (the last
# one partial), a few-token step, a decode step, a long step
MULTI_TOKEN_CHUNKS = [ABSORBED_MAX_NEW_TOKENS // 2, ABSORBED_MAX_NEW_TOKENS + 5, 2 * ABSORBED_QUERY_BLOCK + 3, 3, 1,
                      ABSORBED_MAX_NEW_TOKENS + 1]


@pytest.mark.parametrize("window", [None, 24], ids=["full", "sliding"])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora_kv_b"])
@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_multi_token_steps_against_a_cache_match_the_full_forward(backend, lora, padded, window, monkeypatch):
    """Steps of every length against a growing cache give the no-cache forward's logits; a plain
    `kv_b_proj` takes both paths on the way, a LoRA on it only the expanded one (which calls it). With a
    window, the first layer slides (shorter than the long steps, longer than a query block)."""
    length = sum(MULTI_TOKEN_CHUNKS)
    layers = {} if window is None else dict(sliding_window=window, layer_types=["sliding_attention", "full_attention"])
    model = _model(_config(max_position_embeddings=length, q_lora_rank=12, rope_parameters=dict(DEEPSEEK_YARN),
                           **layers), backend)
    if lora:
        model = get_peft_model(model, LoraConfig(target_modules=["kv_b_proj"], init_lora_weights=False)).eval()
    paths = []
    scoring_path = MultiHeadLatentAttention.scoring_path
    monkeypatch.setattr(MultiHeadLatentAttention, "scoring_path",
                        lambda self, *args: paths.append(scoring_path(self, *args)) or paths[-1])
    ids = torch.randint(0, model.config.vocab_size, (2, length), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :3] = 0
    cached, full = steps_against_full(model, ids, mask, MULTI_TOKEN_CHUNKS)
    torch.testing.assert_close(cached[0], full[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(cached[1, 3:], full[1, 3:], rtol=0, atol=1e-5)
    assert set(paths) == ({"expanded"} if lora else {"absorbed", "expanded"})


def test_long_steps_against_a_cache_build_no_score_matrix(monkeypatch):
    """Only a step of at most `ABSORBED_MAX_NEW_TOKENS` new tokens scores explicitly (absorbed), and then
    `ABSORBED_QUERY_BLOCK` new tokens per pass; a longer step against the same cache goes to the backend's
    fused kernel. Recorded where MLA builds scores."""
    import modular_decoder.mla as mla

    shapes = []
    monkeypatch.setattr(mla, "attention_probs", lambda module, scores, *a, _f=mla.attention_probs, **k:
                        shapes.append(tuple(scores.shape)) or _f(module, scores, *a, **k))
    model = _model(_config(max_position_embeddings=4 * ABSORBED_MAX_NEW_TOKENS), "sdpa")
    ids = torch.randint(0, model.config.vocab_size, (1, 4 * ABSORBED_MAX_NEW_TOKENS))
    with torch.no_grad():
        for new_tokens in (3, ABSORBED_MAX_NEW_TOKENS - 1, ABSORBED_MAX_NEW_TOKENS + 1, 2 * ABSORBED_MAX_NEW_TOKENS):
            cache = model(ids[:, :ABSORBED_MAX_NEW_TOKENS]).cache
            shapes.clear()
            model(ids[:, ABSORBED_MAX_NEW_TOKENS : ABSORBED_MAX_NEW_TOKENS + new_tokens], cache=cache)
            keys = ABSORBED_MAX_NEW_TOKENS + new_tokens
            blocks = [min(ABSORBED_QUERY_BLOCK, new_tokens - start) for start in range(0, new_tokens, ABSORBED_QUERY_BLOCK)]
            expected = [(1, 4, rows, keys) for rows in blocks] * model.config.num_hidden_layers
            assert shapes == (expected if new_tokens <= ABSORBED_MAX_NEW_TOKENS else [])


def test_eager_absorbed_step_scores_every_new_token_at_once_and_returns_the_weights():
    """The eager reference keeps one score matrix per step, and its weights equal the expanded path's."""
    model = _model(_config(max_position_embeddings=64))
    ids = torch.randint(0, model.config.vocab_size, (2, 3 * ABSORBED_QUERY_BLOCK))
    weights = {}
    with torch.no_grad():
        for mode in ("expanded", "absorbed"):
            set_decode_mode(model, mode)
            cache = model(ids[:, :ABSORBED_QUERY_BLOCK]).cache
            weights[mode] = model(ids[:, ABSORBED_QUERY_BLOCK:], cache=cache, output_attentions=True).attentions
    for a, b in zip(weights["expanded"], weights["absorbed"]):
        assert b.shape == (2, 4, 2 * ABSORBED_QUERY_BLOCK, 3 * ABSORBED_QUERY_BLOCK)
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_absorbed_step_returns_weights_on_eager_only():
    """Eager (the reference) returns the absorbed step's probabilities; every other backend returns none, as its
    fused kernel would not (and as the query blocks it scores in would not add up to one matrix)."""
    recorded = {}
    ids = torch.randint(0, MLA["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(5))
    for backend in ("eager", "sdpa"):
        model = _model(_config(), backend)
        set_decode_mode(model, "absorbed")
        handle = model.model.layers[0].self_attn.register_forward_hook(
            lambda module, args, out, backend=backend: recorded.__setitem__(backend, out[1]))
        with torch.no_grad():
            model(ids[:, 9:], cache=model(ids[:, :9]).cache)
        handle.remove()
    assert recorded["eager"].shape == (2, 4, 3, 12)
    assert recorded["sdpa"] is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_fused_upcast_softmax_equals_the_explicit_one(dtype):
    """The absorbed path's softmax (`attention_probs(fused_upcast=True)`: in the scores' dtype, which torch
    accumulates in fp32) against the softmax written out in float64 and rounded to `dtype` (exp of the shifted
    scores over their sum): within two roundings of `dtype`, with boolean and additive masks and a query that sees
    no key. In half precision it also equals the
    explicit fp32 softmax cast back, bit for bit (in fp32 and fp64 both branches are one call, so only the
    written-out reference can tell them from a wrong softmax)."""
    torch.manual_seed(0)
    module = nn.Module().eval()
    scores = (torch.randn(2, 4, 3, 300) * 8).to(dtype)
    keep = torch.rand(2, 1, 3, 300) > 0.3
    keep[0, 0, 1] = False  # a query with no key to see
    additive = torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min / 2)
    for mask in (keep, additive):
        fused = attention_probs(module, scores.clone(), mask, fused_upcast=True)
        assert fused.dtype == dtype and not fused.isnan().any()
        # the mask applied as `attention_probs` applies it, in `dtype`; then the softmax written out in float64
        if mask.dtype == torch.bool:
            masked = scores.masked_fill(~mask, torch.finfo(dtype).min).double()
        else:
            masked = (scores + mask).double()
        shifted = (masked - masked.amax(-1, keepdim=True)).exp()
        reference = (shifted / shifted.sum(-1, keepdim=True)).to(dtype)
        torch.testing.assert_close(fused, reference, rtol=0, atol=2 * torch.finfo(dtype).eps)
        if dtype in (torch.float16, torch.bfloat16):
            assert torch.equal(fused, attention_probs(module, scores.clone(), mask))


def test_the_absorbed_step_holds_two_score_blocks_at_its_peak():
    """Per pass the absorbed scoring holds one block's scores and probabilities: 2 blocks of (B, H, block, S)
    fp32 values at its peak, plus tensors the size of the new tokens. Measured by `benchmarks.measure.TensorBytes`
    (the bytes of the tensors the call allocates, alive at once). The previous block's probabilities stayed alive
    while the next block was scored: 3.1 to 3.4 blocks at 16 to 64 new tokens."""
    from benchmarks.measure import TensorBytes

    config = _config(max_position_embeddings=4096, kv_lora_rank=64, qk_nope_head_dim=16, v_head_dim=16)
    layer = _model(config, "sdpa").model.layers[0].self_attn
    context, heads = 2048, config.num_attention_heads
    latents, k_rot = torch.randn(1, 1, context, 64), torch.randn(1, 1, context, config.qk_rope_head_dim)
    for new_tokens in (ABSORBED_QUERY_BLOCK * 2, ABSORBED_QUERY_BLOCK * 8):
        q_nope, q_rot = torch.randn(1, heads, new_tokens, 16), torch.randn(1, heads, new_tokens, 4)
        with torch.no_grad(), TensorBytes() as probe:
            layer.absorbed_attention(q_nope, q_rot, latents, k_rot, None)
        block = heads * ABSORBED_QUERY_BLOCK * context * 4
        # besides the scores: the (T, S) causal mask, the queries and outputs in latent space (d_c wide)
        per_step = new_tokens * context + 3 * heads * new_tokens * 64 * 4
        assert 2 * block <= probe.peak_bytes <= 2 * block + per_step, (new_tokens, probe.peak_bytes / block)


def test_a_short_prefill_into_a_static_cache_runs_absorbed_and_into_a_dynamic_one_expanded(monkeypatch):
    """`scoring_path` compares the new tokens with the keys the cache returns: a static cache returns its every
    slot, which both forms compute over, so a short prefill into it runs absorbed (faster there: `python -m
    benchmarks mla_crossover`, its static_prefill rows); a dynamic cache returns only the new tokens, expanded
    (the two forms cost the same). Both give the uncached forward's logits."""
    model = _model(_config())
    paths = []
    scoring_path = MultiHeadLatentAttention.scoring_path
    monkeypatch.setattr(MultiHeadLatentAttention, "scoring_path",
                        lambda self, *args: paths.append(scoring_path(self, *args)) or paths[-1])
    ids = torch.randint(0, MLA["vocab_size"], (1, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        reference = model(ids, use_cache=False).logits
        for cache, path in ((ModularDecoderCache(model.config, "static", max_cache_len=32), "absorbed"),
                            (ModularDecoderCache(model.config), "expanded")):
            paths.clear()
            torch.testing.assert_close(model(ids, cache=cache).logits, reference, rtol=0, atol=1e-5)
            assert paths == [path] * MLA["num_hidden_layers"]


def test_scoring_path_rule():
    layer = _model(_config()).model.layers[0].self_attn
    few, many = ABSORBED_MAX_NEW_TOKENS, ABSORBED_MAX_NEW_TOKENS + 1
    assert layer.scoring_path(1, 100, None) == layer.scoring_path(few, 100, None) == "absorbed"
    assert layer.scoring_path(many, 1000, None) == "expanded"  # chunked prefill, a second turn
    assert layer.scoring_path(3, 3, None) == "expanded"  # a prefill without cached tokens
    layer.train()
    assert layer.scoring_path(1, 100, None) == "expanded"
    layer.eval()
    layer.decode_mode = "absorbed"
    assert layer.scoring_path(many, 1000, None) == "absorbed"  # forced (tests, benchmarks)
    layer.kv_b_proj.register_forward_pre_hook(lambda *_: None)
    assert layer.scoring_path(1, 100, None) == "expanded"  # a hooked kv_b_proj is always called
