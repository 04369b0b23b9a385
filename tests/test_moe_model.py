"""The mixture-of-experts kind through the whole model: parameter counts against the families' own
classes, router logits and router losses against transformers' MoE families, every block placement
and both attention kinds with cached decoding, generate strategies, half-precision routers,
experts kernels, and parallelism plans that name real modules on every preset and every variant."""

from __future__ import annotations

import re

import pytest
import torch
from conversion_cases import CASES, MOE_CASES, perturbed
from decoding import greedy_no_cache, prompt, tiny_model
from variants import CHOICES, build, variant_id
from transformers import AutoModelForCausalLM
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from modular_decoder import PRESETS, ModularDecoderConfig, ModularDecoderForCausalLM, parameter_count, preset_config
from modular_decoder.cache import ModularDecoderCache
from modular_decoder.conversion import convert, get_family
from modular_decoder.tools.validate import batch_invariant_experts

pytestmark = pytest.mark.usefixtures("one_thread")

# ---------------------------------------------------------------------------------------------- arithmetic

# preset -> (transformers family, published total). The totals are those of the family's class on the
# meta device (Mixtral-8x7B, Qwen3-30B-A3B, DeepSeek-V3 without its multi-token-prediction layer).
FAMILY_OF = {"mixtral": "mixtral", "qwen3_moe": "qwen3_moe", "olmoe": "olmoe", "deepseek_v2_lite": "deepseek_v2",
             "deepseek_v3": "deepseek_v3", "gpt_oss": "gpt_oss", "llama4": "llama4_text"}
# dense presets whose families' classes count their parameters as ours do (per-layer shapes, shared keys and values,
# per-layer embeddings)
DENSE_FAMILY_OF = {"gemma4": "gemma4_text", "gemma3n": "gemma3n_text"}
PUBLISHED_TOTALS = {"mixtral": 46_702_792_704, "qwen3_moe": 30_532_122_624, "deepseek_v3": 671_026_404_352}
# the rounded "active" figures their model cards publish
PUBLISHED_ACTIVE = {"mixtral": 12.9e9, "qwen3_moe": 3.3e9, "deepseek_v3": 37e9}


@pytest.mark.parametrize("name", list(PUBLISHED_TOTALS))
def test_published_totals_and_active_parameters(name):
    config = preset_config(name)
    counts = parameter_count(config)
    assert counts["total"] == PUBLISHED_TOTALS[name]
    # active: the total less the routed experts a token is not sent to, in every sparse layer
    expert = 3 * config.hidden_size * config.moe_intermediate_size
    unchosen = config.mlp_layer_types.count("sparse") * (config.num_experts - config.num_experts_per_tok) * expert
    assert counts["active"] == counts["total"] - unchosen
    assert abs(counts["active"] - PUBLISHED_ACTIVE[name]) < 0.05 * PUBLISHED_ACTIVE[name]


@pytest.mark.parametrize("name", list(FAMILY_OF) + list(DENSE_FAMILY_OF))
def test_total_equals_the_family_class_on_meta(name):
    """The preset exported to its family's config (the conversion's `from_contract`) and built by
    transformers' own class has exactly the contract's parameter count."""
    config = preset_config(name)
    their_config = get_family({**FAMILY_OF, **DENSE_FAMILY_OF}[name]).from_contract(config)
    with torch.device("meta"):
        theirs = AutoModelForCausalLM.from_config(their_config)
        ours = ModularDecoderForCausalLM(config)
    assert sum(p.numel() for p in theirs.parameters()) == parameter_count(config)["total"] == ours.num_parameters()


# ---------------------------------------------------------------------------------------------- router losses


def _source_and_ours(case: str, tmp_path):
    """transformers' model of a conversion case (weights perturbed, correction bias included) and ours."""
    family, build = CASES[case]
    config = build()
    config.architectures = None
    torch.manual_seed(0)
    source = perturbed(AutoModelForCausalLM.from_config(config).eval())
    source.save_pretrained(tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "ours", progress=False)
    return source, AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()


def _padded_batch(right: bool = False):
    ids = torch.tensor([[5, 17, 3, 42, 8, 61, 23, 11, 2, 90, 33, 7], [9, 1, 64, 12, 40, 5, 77, 18, 26, 3, 50, 14]])
    mask = torch.ones_like(ids)
    mask[1, slice(-5, None) if right else slice(None, 5)] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # both sides count real tokens only
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, positions, labels


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
@pytest.mark.parametrize("case", MOE_CASES)
def test_router_logits_and_losses_match_the_family(case, implementation, tmp_path):
    """Same weights, a left-padded batch with labels: logits, every sparse layer's router logits,
    `aux_loss` and the loss (CE + router_aux_loss_coef · aux) equal transformers' class. DeepSeek-V4's batch is
    right-padded: transformers' class pools its compressed windows by column, padding included (docs/using.md)."""
    source, ours = _source_and_ours(case, tmp_path)
    if source._can_set_experts_implementation():  # (Llama 4's experts run every token through every expert)
        source.set_experts_implementation(implementation)
    ours.set_experts_implementation(implementation)
    ids, mask, positions, labels = _padded_batch(right=ours.config.attention_type == "shared_kv")
    kwargs = dict(attention_mask=mask, position_ids=positions, labels=labels, output_router_logits=True)
    with torch.no_grad():
        theirs, got = source(ids, **kwargs), ours(ids, **kwargs)
    real = mask.bool()
    torch.testing.assert_close(got.logits[real], theirs.logits[real], rtol=0, atol=1e-4)
    # the layers routed by token id (`num_hash_layers`, DeepSeek-V4's first ones) record no logits, as transformers'
    hashed = getattr(ours.config, "num_hash_layers", 0) or 0
    assert len(got.router_logits) == ours.config.mlp_layer_types.count("sparse") - hashed
    assert len(got.router_logits) == len(theirs.router_logits)
    rows = real.reshape(-1)
    for a, b in zip(got.router_logits, theirs.router_logits):
        torch.testing.assert_close(a[rows], b[rows], rtol=0, atol=1e-5)
    router_loss = 0.0
    if theirs.aux_loss is not None and ours.config.router_type in ("sigmoid_topk", "sqrtsoftplus_topk"):
        # transformers' MiniMax-M2 and DeepSeek-V4 add Switch's loss over the softmax of their routers' logits; ours
        # is the sigmoid / √softplus router's own (DeepSeek-V3's sequence-wise one, tested in
        # test_router_training.py): the language model's part of the loss is the same
        theirs_lm = theirs.loss - source.config.router_aux_loss_coef * theirs.aux_loss
        torch.testing.assert_close(got.loss - ours.config.router_aux_loss_coef * got.aux_loss, theirs_lm,
                                   rtol=1e-5, atol=1e-5)
        return
    if theirs.aux_loss is not None:
        torch.testing.assert_close(got.aux_loss, theirs.aux_loss, rtol=1e-5, atol=1e-6)
    elif ours.config.router_type == "sigmoid_topk":
        # transformers trains DeepSeek-V3 with no balance loss; ours adds its sequence-wise one (its formula is
        # tested in test_router_training.py), weighted by the paper's α
        assert ours.config.router_aux_loss_coef == 0.0001
        router_loss = ours.config.router_aux_loss_coef * got.aux_loss
    elif ours.config.router_type == "topk_sigmoid":
        # transformers' Llama 4 adds no balance loss; ours adds Switch's over the router logits, weighted by its
        # config's `router_aux_loss_coef` (0.001), as the other top-k routers do
        assert ours.config.router_aux_loss_coef == 0.001
        router_loss = ours.config.router_aux_loss_coef * got.aux_loss
    else:  # DeepSeek-V2: transformers adds none, and neither do we (its own loss is of another form)
        assert ours.config.router_aux_loss_coef == 0.0
    torch.testing.assert_close(got.loss, theirs.loss + router_loss, rtol=1e-5, atol=1e-5)


def test_z_loss_is_added_with_its_coefficient(tmp_path):
    _, ours = _source_and_ours("qwen2_moe", tmp_path)
    ours.config.router_z_loss_coef = 0.01
    ids, mask, positions, labels = _padded_batch()
    with torch.no_grad():
        plain = ours(ids, attention_mask=mask, position_ids=positions, labels=labels)
        out = ours(ids, attention_mask=mask, position_ids=positions, labels=labels, output_router_logits=True)
    assert plain.aux_loss is None and plain.z_loss is None and plain.router_logits is None
    # ST-MoE eq. 5 in float64 over the real tokens of every sparse layer
    rows = torch.cat([logits.double()[mask.reshape(-1).bool()] for logits in out.router_logits])
    z = (torch.logsumexp(rows, dim=-1) ** 2).mean()
    torch.testing.assert_close(out.z_loss.double(), z, rtol=1e-6, atol=0)
    aux = load_balancing_loss_func(out.router_logits, ours.config.num_experts, ours.config.num_experts_per_tok, mask)
    expected = plain.loss + ours.config.router_aux_loss_coef * aux + 0.01 * out.z_loss
    torch.testing.assert_close(out.loss, expected, rtol=1e-6, atol=1e-7)


def test_router_losses_train_the_router():
    model = tiny_model("mixtral", output_router_logits=True, router_z_loss_coef=0.001).train()
    ids = prompt(2, 12)
    out = model(ids, labels=ids)
    out.loss.backward()
    gate = model.model.layers[0].mlp.gate.weight
    assert gate.grad is not None and gate.grad.abs().sum() > 0
    assert out.aux_loss.requires_grad and out.z_loss.requires_grad


def test_router_logits_of_a_model_without_routers_are_none_recorded():
    """The class declares router logits recordable (transformers' `test_capture_outputs_decorator` then asks for
    them): a dense model records none and computes as without the flag, as transformers' Llama does. The config
    field still refuses the setting, which nothing would read."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = tiny_model("llama")
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=model.config.vocab_size, hidden_size=32, intermediate_size=40,
                                         num_hidden_layers=2, num_attention_heads=4)).eval()
    ids = prompt()
    with torch.no_grad():
        for reference in (model, llama):
            plain = reference(ids, labels=ids)
            asked = reference(ids, labels=ids, output_router_logits=True)
            torch.testing.assert_close(asked.logits, plain.logits, rtol=0, atol=0)
            torch.testing.assert_close(asked.loss, plain.loss, rtol=0, atol=0)
            assert not getattr(asked, "router_logits", None) and getattr(asked, "aux_loss", None) is None
    with pytest.raises(ValueError, match="output_router_logits.*only applies to `mlp_type='moe'`"):
        preset_config("llama", tiny=True, output_router_logits=True)


# ---------------------------------------------------------------------------------------------- composition

SEQ = 14
ROUTERS = {
    # Qwen2-MoE-like: a dense layer, softmax top-k, one gated shared expert
    "softmax_shared_gate": dict(mlp_layer_types=["sparse", "dense", "sparse"], num_experts=6, num_experts_per_tok=2,
                                moe_intermediate_size=12, n_shared_experts=1, shared_expert_intermediate_size=20,
                                shared_expert_gate=True, norm_topk_prob=False),
    # DeepSeek-V3-like: sigmoid scores, correction bias, 4 groups of 2, best 2 groups, scaled
    "sigmoid_grouped": dict(mlp_layer_types=["dense", "sparse", "sparse"], num_experts=8, num_experts_per_tok=2,
                            moe_intermediate_size=12, n_shared_experts=2, router_type="sigmoid_topk", n_group=4,
                            topk_group=2, routed_scaling_factor=2.5),
}
PLACEMENTS = {
    "pre": dict(norm_position="pre"),
    "post": dict(norm_position="post"),
    "sandwich": dict(norm_position="sandwich"),
    "output": dict(norm_position="output"),
    "parallel_shared": dict(parallel_block=True, parallel_norms="shared"),
    "parallel_separate": dict(parallel_block=True, parallel_norms="separate"),
}
ATTENTION = {
    "gqa": dict(num_key_value_heads=2),
    "mla": dict(attention_type="mla", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8),
}


def _moe_model(router: str, placement: str, attention: str, backend: str = "eager") -> ModularDecoderForCausalLM:
    config = ModularDecoderConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        max_position_embeddings=64, mlp_type="moe", **ROUTERS[router], **PLACEMENTS[placement], **ATTENTION[attention],
    )
    torch.manual_seed(0)
    model = ModularDecoderForCausalLM._from_config(config, attn_implementation=backend)
    with torch.no_grad():  # routers far from uniform, norms and correction biases not at their init
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.3)
            elif name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5)
        for name, buffer in model.named_buffers():
            if "correction_bias" in name:
                buffer.normal_(0.0, 0.1)
    return model.eval()


COMBINATIONS = [(r, p, a) for r in ROUTERS for p in PLACEMENTS for a in ATTENTION]


@pytest.mark.parametrize("router, placement, attention", COMBINATIONS, ids=["-".join(c) for c in COMBINATIONS])
def test_every_placement_and_attention_kind(router, placement, attention):
    """Cached decoding (dynamic and static) equals the full forward; eager equals SDPA on a padded
    batch; changing later tokens leaves earlier logits exactly unchanged."""
    model = _moe_model(router, placement, attention)
    ids = torch.randint(0, 97, (2, SEQ))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        for implementation in ("dynamic", "static"):
            cache = ModularDecoderCache(model.config, implementation, max_cache_len=SEQ + 2)
            steps = [model(ids[:, :4], cache=cache).logits]
            steps += [model(ids[:, t : t + 1], cache=cache).logits for t in range(4, SEQ)]
            torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)

        mask = torch.ones_like(ids)
        mask[1, :4] = 0
        sdpa = _moe_model(router, placement, attention, backend="sdpa")
        a, b = model(ids, attention_mask=mask).logits, sdpa(ids, attention_mask=mask).logits
        torch.testing.assert_close(a[0], b[0], rtol=0, atol=1e-5)
        torch.testing.assert_close(a[1, 4:], b[1, 4:], rtol=0, atol=1e-5)

        changed = ids.clone()
        changed[:, SEQ // 2 :] = (changed[:, SEQ // 2 :] + 1) % 97
        with batch_invariant_experts(model):  # see its docstring: exact per-token arithmetic
            before, after = model(ids).logits, model(changed).logits
        torch.testing.assert_close(before[:, : SEQ // 2], after[:, : SEQ // 2], rtol=0, atol=0)
        assert not torch.allclose(before[:, SEQ // 2 :], after[:, SEQ // 2 :])


@pytest.mark.parametrize("router", list(ROUTERS))
def test_experts_kernels_agree(router):
    """Our grouped forward ("eager") and transformers' kernels on the same weights."""
    model = _moe_model(router, "pre", "gqa")
    ids = torch.randint(0, 97, (2, SEQ))
    with torch.no_grad():
        reference = model(ids).logits
        for implementation in ("grouped_mm", "batched_mm", "eager"):
            model.set_experts_implementation(implementation)
            torch.testing.assert_close(model(ids).logits, reference, rtol=0, atol=1e-5)


def test_experts_implementation_is_chosen_at_load(tmp_path):
    model = tiny_model("deepseek_v3")
    assert model.config._experts_implementation == "grouped_mm"  # transformers' own default
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="eager")
    assert loaded.config._experts_implementation == "eager"
    with pytest.raises(ValueError, match="experts_implementation"):
        AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="nonsense")


# ---------------------------------------------------------------------------------------------- generate

GENERATE_PRESETS = ["mixtral", "deepseek_v3"]  # standard attention and MLA, softmax and sigmoid routers


def _moe_tiny(name: str, **overrides):
    model = tiny_model(name, **overrides)
    with torch.no_grad():  # routers away from uniform so that the routing matters to the tokens
        for param_name, param in model.named_parameters():
            if param_name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5)
    return model


@pytest.mark.parametrize("kind", ["dynamic", "static"])
@pytest.mark.parametrize("name", GENERATE_PRESETS)
def test_greedy_beam_and_prompt_lookup_equal_the_no_cache_references(name, kind):
    model = _moe_tiny(name)
    extra = {"cache_implementation": "static"} if kind == "static" else {}
    ids = prompt(2)
    greedy = model.generate(ids, max_new_tokens=8, do_sample=False, **extra)
    assert torch.equal(greedy, greedy_no_cache(model, ids, 8))
    beams = model.generate(ids, max_new_tokens=6, num_beams=3, do_sample=False, **extra)
    assert torch.equal(beams, model.generate(ids, max_new_tokens=6, num_beams=3, do_sample=False, use_cache=False))
    if kind == "static":
        # transformers sizes a static cache max_length - 1, which a last verification step of prompt
        # lookup can overrun (its LlamaForCausalLM raises the same IndexError): dynamic cache only
        return
    one = torch.cat([prompt(1), prompt(1)[:, :3]], dim=1)  # repeated n-grams give lookup candidates
    lookup = model.generate(one, max_new_tokens=8, do_sample=False, prompt_lookup_num_tokens=3)
    assert torch.equal(lookup, greedy_no_cache(model, one, 8))


@pytest.mark.parametrize("name", GENERATE_PRESETS)
def test_sampling_and_left_padding(name):
    model = _moe_tiny(name)
    ids = prompt(2)
    runs = {}
    for kind in ("none", "dynamic", "static"):
        torch.manual_seed(7)
        extra = {"use_cache": False} if kind == "none" else {"cache_implementation": kind}
        runs[kind] = model.generate(ids, max_new_tokens=6, do_sample=True, top_k=0, **extra)
    assert torch.equal(runs["dynamic"], runs["none"]) and torch.equal(runs["static"], runs["none"])
    long, short = prompt(1, 7, seed=2), prompt(1, 3, seed=4)
    batch = torch.cat([long, torch.cat([torch.zeros(1, 4, dtype=torch.long), short], dim=1)])
    mask = torch.cat([torch.ones(1, 7), torch.cat([torch.zeros(1, 4), torch.ones(1, 3)], dim=1)]).long()
    out = model.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False)
    for row, alone in ((0, long), (1, short)):
        assert torch.equal(out[row, -6:], model.generate(alone, max_new_tokens=6, do_sample=False)[0, -6:])


# ---------------------------------------------------------------------------------------------- dtype


def test_sigmoid_routers_stay_fp32_in_half_precision(tmp_path):
    """As DeepSeek-V3 keeps them: its bias-corrected choice compares scores that bf16 logits would blur."""
    tiny_model("deepseek_v3").save_pretrained(tmp_path / "v3")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "v3", dtype=torch.bfloat16)
    sparse = model.model.layers[1].mlp
    assert sparse.gate.weight.dtype == sparse.gate.e_score_correction_bias.dtype == torch.float32
    assert sparse.experts.gate_up_proj.dtype == model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model(prompt()).logits.dtype == torch.bfloat16
    tiny_model("mixtral").save_pretrained(tmp_path / "mixtral")  # softmax routers route in the model's dtype
    mixtral = AutoModelForCausalLM.from_pretrained(tmp_path / "mixtral", dtype=torch.bfloat16)
    assert mixtral.model.layers[0].mlp.gate.weight.dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------- parallelism plans


def _matches(key: str, names: set[str]) -> bool:
    """transformers matches plan keys to module / parameter names with layer numbers as `*`."""
    return any(re.sub(r"\d+", "*", name) == key for name in names)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_plan_key_names_a_module_of_the_model(name):
    _check_plans(preset_config(name, tiny=True))


@pytest.mark.parametrize("choice", CHOICES, ids=variant_id)
def test_every_plan_key_names_a_module_of_every_variant(choice):
    """The variant matrix: every value of every axis (dense MLPs without a gate, post-norm without a final norm,
    full QK-norm, MLA with and without a query bottleneck, experts with shared experts and gates, ...)."""
    _check_plans(build(choice))


def _check_plans(config):
    from transformers.integrations.tensor_parallel import ALL_PARALLEL_STYLES

    with torch.device("meta"):
        model = ModularDecoderForCausalLM(config)
    names = {n for n, _ in model.named_modules()} | {n for n, _ in model.named_parameters()}
    plans = {"tp": model.tp_plan, "ep": model.ep_plan, "pp": model.pp_plan, "fsdp": model.fsdp_plan}
    for plan_name, plan in plans.items():
        unmatched = [key for key in plan if not _matches(key, names)]
        assert not unmatched, f"{plan_name} plan keys naming nothing: {unmatched}"
    for style in {**model.tp_plan, **model.ep_plan}.values():
        assert style in ALL_PARALLEL_STYLES
    assert bool(model.ep_plan) == (config.mlp_type == "moe")
    assert model.tp_plan and model.pp_plan and model.fsdp_plan


# ---------------------------------------------------------------------------------------------- compile


def test_fullgraph_compiled_static_decode_with_the_default_experts_kernel():
    """`_can_compile_fullgraph` holds for MoE with transformers' default kernel ("grouped_mm": no
    data-dependent shapes); our grouped "eager" forward reads per-expert counts on the host and
    would break the graph. Traced with dynamo's "eager" backend to keep the test short."""
    from modular_decoder import compiled_decoding

    torch._dynamo.reset()
    model = _moe_tiny("mixtral")
    assert model.config._experts_implementation == "grouped_mm"
    ids = prompt(2, 6)
    expected = model.generate(ids, max_new_tokens=6, do_sample=False)
    compiled = model.generate(ids, max_new_tokens=6, do_sample=False,
                              **compiled_decoding(mode="default", backend="eager"))
    assert hasattr(model, "_compiled_call")
    assert torch.equal(compiled, expected)


@pytest.mark.parametrize("overrides", [dict(), dict(hidden_size=8, moe_intermediate_size=3)],
                         ids=["float64", "widths-grouped_mm-refuses"])
def test_experts_outside_the_kernels_reach_run_the_module_forward(overrides):
    """transformers' grouped_mm takes fp32/bf16/fp16 with 16-byte rows only (its Mixtral fails on a
    float64 model or odd widths); ours runs its own grouped forward there, with the same result as
    the per-token products."""
    config = preset_config("mixtral", tiny=True, **({"head_dim": 4} if overrides else {}), **overrides)
    torch.manual_seed(0)
    model = ModularDecoderForCausalLM(config).eval()
    if not overrides:
        model = model.double()
    ids = torch.randint(0, config.vocab_size, (2, 5))
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    with torch.no_grad():
        out = model(ids, attention_mask=mask).logits
        model.set_experts_implementation("batched_mm")
        reference = model(ids, attention_mask=mask).logits
    assert torch.isfinite(out[mask.bool()]).all()
    torch.testing.assert_close(out[mask.bool()], reference[mask.bool()])
