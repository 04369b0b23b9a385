"""Attention sinks (`attention_sinks`): the eager reference against the formula, the parameter as transformers
names and initialises it, and how each backend computes it (test_backends*.py compare every backend with eager
on the `sinks_sliding` and `mla_sinks` variants: plain, padded, packed, cached, chunked, static, assisted):
SDPA through its fused path (no mask materialised where SDPA had none), flash only with a kernel that takes
sinks, flex refused by name where its kernel cannot return the log-sum-exp."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers.integrations.flex_attention as transformers_flex
from backend_cases import install_reference_kernels, make_config, make_model, padded_batch, reference_fa3_varlen_func
from torch import nn

from modular_decoder import ModularDecoderForCausalLM
from modular_decoder.contract import parameter_count
from modular_decoder.eager_attention import attention_probs
from modular_decoder.sinks import sdpa_attention_with_sinks

TOL = dict(atol=1e-5, rtol=1e-4)


def test_probabilities_follow_the_formula_and_a_fully_masked_row_attends_to_nothing():
    torch.manual_seed(0)
    scores, sinks = torch.randn(2, 3, 4, 5), torch.randn(3)
    keep = torch.ones(2, 1, 4, 5, dtype=torch.bool)
    keep[1, :, 2] = False  # one query of the second row sees no key
    module = nn.Module()
    probs = attention_probs(module, scores.clone(), keep, sinks=sinks)
    exp = scores.exp() * keep
    expected = exp / (exp.sum(-1, keepdim=True) + sinks.exp().view(1, 3, 1, 1))
    torch.testing.assert_close(probs, expected)
    assert torch.equal(probs[1, :, 2], torch.zeros(3, 5))
    assert (probs.sum(-1) < 1).all()


def test_parameter_name_init_and_count():
    config = make_config("sinks_sliding")
    torch.manual_seed(0)
    model = ModularDecoderForCausalLM(config)
    sinks = {name: p for name, p in model.named_parameters() if "sinks" in name}
    assert sorted(sinks) == [f"model.layers.{i}.self_attn.sinks" for i in range(config.num_hidden_layers)]
    for param in sinks.values():
        assert type(param) is nn.Parameter and param.shape == (config.num_attention_heads,) and param.is_contiguous()
        assert 0 < param.std() < 5 * config.initializer_range  # normal(0, initializer_range), as transformers' gpt-oss
    assert parameter_count(config)["total"] == model.num_parameters()
    assert parameter_count(make_config("mla_sinks"))["total"] == ModularDecoderForCausalLM(make_config("mla_sinks")).num_parameters()


def _sdpa_calls(monkeypatch) -> list[dict]:
    calls, sdpa = [], F.scaled_dot_product_attention

    def record(query, key, value, attn_mask=None, is_causal=False, **kwargs):
        calls.append(dict(q=tuple(query.shape), k=tuple(key.shape), mask=attn_mask, is_causal=is_causal))
        return sdpa(query, key, value, attn_mask=attn_mask, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", record)
    return calls


def test_sdpa_keeps_its_causal_path_and_widens_by_one_aligned_block(monkeypatch):
    """An unpadded prefill: SDPA gets no mask and `is_causal` (one leading query keeps the sink in its
    top-left causal mask), heads 8 features wider; a decode step scores the cached keys directly, not widened
    (no copy of the cache), nor through SDPA."""
    import modular_decoder.sinks as sinks

    model = make_model("sinks_sliding", "sdpa")
    calls, direct = _sdpa_calls(monkeypatch), []
    few_queries = sinks.few_queries_with_sinks
    monkeypatch.setattr(sinks, "few_queries_with_sinks",
                        lambda q, k, *args: direct.append((tuple(q.shape), tuple(k.shape))) or few_queries(q, k, *args))
    ids = torch.randint(0, 97, (1, 4))  # within the window: no layer needs a mask
    with torch.no_grad():
        out = model(ids, use_cache=True)
        layers = len(calls)
        model(ids[:, :1], cache=out.cache)
    head_dim = model.config.head_dim
    assert layers == model.config.num_hidden_layers and len(calls) == layers and len(direct) == layers
    for call in calls:
        assert call["mask"] is None and call["is_causal"] and call["q"][-2:] == (5, head_dim + 8)
    for q, k in direct:
        assert q[-2:] == (1, head_dim) and k[-2:] == (5, head_dim)


def test_a_few_queries_score_directly_as_eager():
    """Decode and verify steps (up to `FEW_QUERIES` queries, a mask or one query) score the cached keys directly:
    equal to eager with a bool mask, an additive one, a bias, and a fully masked row (which attends to nothing)."""
    import modular_decoder.sinks as sinks
    from modular_decoder.eager_attention import eager_attention

    torch.manual_seed(0)
    module = make_model("sinks_sliding").model.layers[0].self_attn
    q, k, v, s_aux = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 6), torch.randn(4)
    keep = torch.rand(2, 1, 3, 11) > 0.3  # longer than the keys, as a static cache's mask is
    keep[1, :, 2] = False
    additive = torch.zeros(2, 1, 3, 11).masked_fill(~keep, torch.finfo(torch.float32).min)
    bias = torch.randn(1, 4, 3, 11)
    for mask, position_bias in [(keep, None), (additive, None), (keep, bias)]:
        got = sinks.few_queries_with_sinks(q, k, v, mask, 0.3, s_aux, position_bias)
        want, _ = eager_attention(module, q, k, v, mask[..., :9], scaling=0.3, s_aux=s_aux,
                                  position_bias=None if position_bias is None else position_bias[..., :9])
        torch.testing.assert_close(got, want, **TOL)
        assert torch.equal(sdpa_attention_with_sinks(module, q, k, v, mask, scaling=0.3, s_aux=s_aux,
                                                     position_bias=position_bias)[0], got)
    assert torch.equal(got[1, 2], torch.zeros(4, 6))
    one, _ = eager_attention(module, q[:, :, :1], k, v, None, scaling=0.3, s_aux=s_aux)
    torch.testing.assert_close(sinks.few_queries_with_sinks(q[:, :, :1], k, v, None, 0.3, s_aux), one, **TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_function_equals_eager_with_masks_bias_and_static_slots(dtype):
    """The function alone: a bool and an additive mask, an ALiBi-style bias, queries against a static cache's
    empty slots with no mask (SDPA's top-left causal), MLA's narrower values."""
    torch.manual_seed(0)
    module = make_model("sinks_sliding").model.layers[0].self_attn
    from modular_decoder.eager_attention import eager_attention

    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 6)
    sinks = torch.randn(4)
    keep = torch.rand(2, 1, 5, 9) > 0.3
    additive = torch.zeros(2, 1, 5, 9).masked_fill(~keep, torch.finfo(torch.float32).min)
    bias = torch.randn(1, 4, 5, 9)
    static_keep = (torch.arange(9)[None, :] <= torch.arange(5)[:, None])[None, None]
    cases = [(keep, None), (additive, None), (keep, bias), (None, None)]
    for mask, position_bias in cases:
        args = [x.to(dtype) for x in (q, k, v)]
        got, _ = sdpa_attention_with_sinks(module, *args, mask, scaling=0.3, s_aux=sinks, position_bias=position_bias)
        eager_mask = static_keep if mask is None else mask
        want, _ = eager_attention(module, *args, eager_mask, scaling=0.3, s_aux=sinks,
                                  position_bias=None if position_bias is None else position_bias.to(dtype))
        tolerance = TOL if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(got, want, **tolerance)


def test_flash_passes_the_sinks_to_a_kernel_that_takes_them(monkeypatch):
    kernels = install_reference_kernels(monkeypatch)
    model = make_model("sinks_sliding", "flash_attention_3")
    ids, mask = padded_batch()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    assert kernels
    for layer, call in zip(model.model.layers, kernels):
        torch.testing.assert_close(call["s_aux"], layer.self_attn.sinks)


def test_flash_refuses_a_kernel_without_sinks(monkeypatch):
    install_reference_kernels(monkeypatch, varlen=reference_fa3_varlen_func)
    model = make_model("sinks_sliding", "flash_attention_3")
    with pytest.raises(ValueError, match="takes no sinks.*attention_sinks"):
        model(input_ids=torch.randint(0, 97, (1, 6)))


def test_flash_attention_2_refuses_sinks_at_load():
    with pytest.raises(ValueError, match="attention_sinks"):
        ModularDecoderForCausalLM._from_config(make_config("sinks_sliding"), attn_implementation="flash_attention_2")


def test_flex_without_a_log_sum_exp_is_refused_by_name(monkeypatch):
    def compiled_cpu_flex(*args, **kwargs):  # what torch's inductor raises on CPU for `return_lse`
        raise NotImplementedError("torch.compile on CPU only supports inference and `return_lse` is not supported yet.")

    monkeypatch.setattr(transformers_flex, "compile_friendly_flex_attention", compiled_cpu_flex)
    model = make_model("sinks_sliding", "flex_attention")
    with pytest.raises(ValueError, match="attention_sinks.*sdpa or eager"):
        model(input_ids=torch.randint(0, 97, (1, 6)))


def test_sink_gradients_equal_eager():
    """Training: the loss's gradient reaches every sink through SDPA's formulation as through eager's (flex has
    no backward on CPU)."""
    ids, mask = padded_batch()
    grads = {}
    for name in ("eager", "sdpa"):
        model = make_model("sinks_sliding", name).train()
        loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
        loss.backward()
        grads[name] = torch.stack([layer.self_attn.sinks.grad for layer in model.model.layers])
    assert grads["eager"].abs().min() > 0
    torch.testing.assert_close(grads["sdpa"], grads["eager"], **TOL)


@pytest.mark.parametrize("variant", ["sinks_sliding", "mla_sinks"])
def test_tensor_parallel_plan_keeps_attention_with_sinks_whole(variant):
    """The sinks are per-head parameters no parallel style splits beside q/k/v: with them every rank holds the
    whole attention (transformers plans gpt-oss's so), and only the feed-forward is split. (Run by hand on two
    gloo processes: `tp_plan="auto"` gives the one-process logits within 3e-8.)"""
    plan = make_config(variant).base_model_tp_plan
    assert plan and not any(".self_attn." in key for key in plan), plan
    plain = make_config("gqa" if variant == "sinks_sliding" else "mla").base_model_tp_plan
    assert any(".self_attn." in key for key in plain)
