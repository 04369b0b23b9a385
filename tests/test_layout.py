"""`layout`: the decode layout (fused q/k/v and gate/up, wide weights column-major) and the
multi-core matrix-vector product must compute what the standard layout computes, on every preset,
and step aside whenever the fused buffer is no longer what the parameters hold."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from decoding import prompt, tiny_model
from modular_decoder.layout import FusedProjection, decode_layout, has_decode_layout, linear, standard_layout
from modular_decoder.tools.presets import PRESETS

MLA = dict(attention_type="mla", q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
           v_head_dim=6)
VARIANTS = {name: (name, {}) for name in PRESETS} | {"mla": ("llama", MLA)}


@contextlib.contextmanager
def threads(count: int):
    """The split product only runs with several threads; the suite's workers use one each."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def counting(target, name: str):
    calls = []
    original = getattr(target, name)

    def spy(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    setattr(target, name, spy)
    try:
        yield calls
    finally:
        setattr(target, name, original)


@pytest.mark.parametrize("parts", [2, 3])
@pytest.mark.parametrize("rows", [1, 3, 16, 17])
@pytest.mark.parametrize("column_major", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_equals_f_linear(parts, rows, column_major, with_bias):
    for out_features, in_features in [(96, 48), (48, 96), (50, 47)]:  # the last splits neither way
        weight = torch.randn(out_features, in_features)
        if column_major:
            weight = weight.t().contiguous().t()
        bias = torch.randn(out_features) if with_bias else None
        x = torch.randn(1, rows, in_features)
        with threads(parts), counting(torch, "bmm") as bmm_calls:
            y = linear(x, weight, bias)
        torch.testing.assert_close(y, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
        assert y.shape == (1, rows, out_features)
        splits = (in_features if column_major else out_features) % parts == 0
        assert len(bmm_calls) == (1 if splits and rows <= 16 else 0)


def test_linear_falls_back_with_one_thread_and_under_autograd_keeps_gradients():
    weight = torch.randn(64, 32, requires_grad=True)
    x = torch.randn(1, 1, 32, requires_grad=True)
    with threads(1), counting(torch, "bmm") as bmm_calls:
        linear(x, weight)
    assert not bmm_calls
    with threads(2):
        linear(x, weight).square().sum().backward()
    expected_x, expected_w = torch.autograd.grad(F.linear(x, weight).square().sum(), (x, weight))
    torch.testing.assert_close(x.grad, expected_x)
    torch.testing.assert_close(weight.grad, expected_w)


def test_layout_keeps_names_values_shapes_and_ties():
    model = tiny_model("smollm2")  # tied head: vocab 128 > hidden
    before = {k: v.clone() for k, v in model.state_dict().items()}
    moved = decode_layout(model)
    assert moved > 0 and has_decode_layout(model)
    after = model.state_dict()
    assert list(after) == list(before)
    for name, value in before.items():
        assert torch.equal(after[name], value), name
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    storages = {p.untyped_storage().data_ptr() for p in (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)}
    assert len(storages) == 1  # one buffer
    assert mlp.gate_proj.weight.untyped_storage().data_ptr() == mlp.up_proj.weight.untyped_storage().data_ptr()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.stride() == (1, model.config.vocab_size)
    assert decode_layout(model) == 0  # idempotent
    assert standard_layout(model) > 0 and all(p.is_contiguous() for p in model.parameters())
    assert not has_decode_layout(model)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


def _pair(name: str):
    base, overrides = VARIANTS[name]
    standard = tiny_model(base, **overrides)
    laid_out = tiny_model(base, **overrides)
    decode_layout(laid_out)
    return standard, laid_out


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_variant_decodes_the_same_in_either_layout(name):
    """Cached decoding step by step (the split products run: 2 threads), and greedy generation."""
    standard, laid_out = _pair(name)
    ids = prompt(2, 5)
    with torch.no_grad(), threads(2), counting(FusedProjection, "product") as fused_calls:
        expected = standard.generate(ids, max_new_tokens=8, do_sample=False)
        assert not fused_calls  # the standard model has no fused groups
        got = laid_out.generate(ids, max_new_tokens=8, do_sample=False)
        assert torch.equal(got, expected)
        assert fused_calls  # q/k/v or gate/up of every variant took the fused path
        cache_a = cache_b = None
        for step in range(expected.shape[1]):
            piece = expected[:, : step + 1] if step == 0 else expected[:, step : step + 1]
            out_a = standard(piece, cache=cache_a, use_cache=True)
            out_b = laid_out(piece, cache=cache_b, use_cache=True)
            cache_a, cache_b = out_a.cache, out_b.cache
            torch.testing.assert_close(out_b.logits, out_a.logits, rtol=1e-5, atol=1e-5)


def test_fused_path_steps_aside_for_hooks_gradients_dtype_moves_and_new_weights():
    standard, laid_out = _pair("llama")
    ids = prompt(1, 6)
    attn = laid_out.model.layers[0].self_attn

    # a forward hook on a member sees its call
    seen = []
    handle = attn.q_proj.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    with torch.no_grad(), counting(FusedProjection, "product") as fused_calls:
        laid_out(ids)
    handle.remove()
    assert seen == [(1, 6, attn.q_proj.out_features)]
    assert len(fused_calls) == 2 * laid_out.config.num_hidden_layers - 1  # all but the hooked group

    # training: gradients reach the member weights, equal to the standard layout's
    laid_out.train(), standard.train()
    for model in (standard, laid_out):
        model(ids, labels=ids).loss.backward()
    for (name, a), (_, b) in zip(standard.named_parameters(), laid_out.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=name)
    laid_out.eval(), standard.eval()

    # weights loaded in place (the fused buffer is what the parameters hold) are used
    fresh = tiny_model("llama", seed=5).state_dict()
    standard.load_state_dict(fresh)
    laid_out.load_state_dict(fresh)
    with torch.no_grad(), counting(FusedProjection, "product") as fused_calls:
        torch.testing.assert_close(laid_out(ids).logits, standard(ids).logits, rtol=1e-5, atol=1e-5)
    assert fused_calls

    # a dtype move replaces the parameters: the stale buffer must not be used
    standard.double(), laid_out.double()
    with torch.no_grad(), counting(FusedProjection, "product") as fused_calls:
        torch.testing.assert_close(laid_out(ids).logits, standard(ids).logits)
    assert not fused_calls


def test_peft_lora_wraps_a_fused_member():
    peft = pytest.importorskip("peft")
    standard, laid_out = _pair("llama")
    ids = prompt(1, 6)
    wrapped = []
    for model in (standard, laid_out):
        torch.manual_seed(3)
        config = peft.LoraConfig(r=4, target_modules=["q_proj", "gate_proj"], init_lora_weights=False)
        wrapped.append(peft.get_peft_model(model, config))
    with torch.no_grad(), threads(2):
        torch.testing.assert_close(wrapped[1](ids).logits, wrapped[0](ids).logits, rtol=1e-5, atol=1e-5)
        assert torch.equal(wrapped[1].generate(ids, max_new_tokens=5, do_sample=False),
                           wrapped[0].generate(ids, max_new_tokens=5, do_sample=False))


def test_from_pretrained_lays_out_cpu_models_and_saves_the_standard_layout(tmp_path):
    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "a")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    assert has_decode_layout(loaded)
    assert not has_decode_layout(AutoModelForCausalLM.from_pretrained(tmp_path / "a", decode_layout=False))
    loaded.save_pretrained(tmp_path / "b")
    assert has_decode_layout(loaded)  # restored after the save
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "b", decode_layout=False)
    for (name, a), (_, b) in zip(model.state_dict().items(), reloaded.state_dict().items()):
        assert torch.equal(a, b), name
    ids = prompt(1, 6)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)
