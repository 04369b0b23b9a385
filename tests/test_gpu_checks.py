"""What `tests/gpu/run_gpu_checks.py` relies on, checked on the CPU: its routing-flip verdict (which must not pass
a broken router or a share of flips no rounding explains), and that one model's `generate` with FlexAttention
compiles a bounded number of times."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch
from backend_cases import make_config
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch.nn.attention import flex_attention as torch_flex
from transformers.integrations import flex_attention as transformers_flex

from modular_decoder import ModularDecoderConfig, ModularDecoderForCausalLM
from modular_decoder.routers import TopKRouter


def _gpu_checks():
    path = Path(__file__).parent / "gpu" / "run_gpu_checks.py"
    spec = importlib.util.spec_from_file_location("run_gpu_checks", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def checks():
    return _gpu_checks()


def _moe_pair():
    """The variant that failed on the H200 (MLA, capped, windowed, experts): the reference and a copy (both eager:
    the verdict, not a backend, is under test here)."""
    torch.manual_seed(0)
    reference = ModularDecoderForCausalLM._from_config(make_config("mla_capped_windowed_moe"),
                                                       attn_implementation="eager").eval()
    other = copy.deepcopy(reference)
    ids = torch.randint(1, reference.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    return reference, other, dict(input_ids=ids, attention_mask=mask)


def _flip_first_router(model, tokens: int = 3):
    """Send the first `tokens` tokens of the first router to other experts (ids + 1), as a bf16 near-tie would."""
    router = next(m for m in model.modules() if isinstance(m, TopKRouter))
    experts = router.num_experts

    def flip(module, args, output):
        indices = output[2].clone()
        indices[:tokens] = (indices[:tokens] + 1) % experts
        return output[0], output[1], indices

    return router.register_forward_hook(flip)


@torch.no_grad()
def test_routing_flip_is_told_apart_from_a_real_difference(checks):
    reference, other, inputs = _moe_pair()
    with checks.recorded_routing(reference) as routing:
        want = reference(**inputs, use_cache=False).logits.float()
    assert routing and all(len(calls) == 1 for calls in routing.values())

    clean = checks.compare(other, inputs, want, fp32=True, reference_routing=routing)
    assert clean["good"] and clean["verdict"] == "ok"

    handle = _flip_first_router(other)
    flipped_without_fix = checks.compare(other, inputs, want, fp32=True)
    assert not flipped_without_fix["good"] and flipped_without_fix["verdict"] == "FAIL"
    flipped = checks.compare(other, inputs, want, fp32=True, reference_routing=routing)
    assert flipped["good"] and flipped["verdict"].startswith("ok: routing flip"), flipped
    assert 0 < flipped["flipped"] <= checks.MAX_FLIPPED_SHARE and flipped["fixed_diff"] <= 1e-3
    assert flipped["router_rel"] == 0  # with the routing fixed, the routers see the reference's hidden states
    handle.remove()

    layer = other.model.layers[1].self_attn
    with torch.no_grad():
        layer.o_proj.weight.add_(0.2 * torch.randn_like(layer.o_proj.weight))
    real = checks.compare(other, inputs, want, fp32=True, reference_routing=routing)
    assert not real["good"] and real["verdict"].startswith("FAIL: real difference"), real


@torch.no_grad()
def test_routing_flip_verdict_fails_a_broken_router_and_too_many_flips(checks):
    """Fixing the routing hides the routers: a router whose weights are wrong, or flips on far more tokens than
    bf16 near-ties explain, passed as a "routing flip" before; both are real differences."""
    reference, other, inputs = _moe_pair()
    with checks.recorded_routing(reference) as routing:
        want = reference(**inputs, use_cache=False).logits.float()

    router = next(m for m in other.modules() if isinstance(m, TopKRouter))
    saved = router.weight.clone()
    router.weight.add_(torch.randn_like(router.weight))
    broken = checks.compare(other, inputs, want, fp32=True, reference_routing=routing)
    assert not broken["good"] and broken["verdict"].startswith("FAIL: real difference"), broken
    assert broken["router_rel"] > 0.05 and broken["fixed_diff"] <= 1e-3  # the fixed run alone looked right
    router.weight.copy_(saved)

    handle = _flip_first_router(other, tokens=inputs["input_ids"].numel())  # every token of the first router
    many = checks.compare(other, inputs, want, fp32=True, reference_routing=routing)
    handle.remove()
    assert not many["good"] and many["flipped"] > checks.MAX_FLIPPED_SHARE and many["router_rel"] == 0, many


def test_fixed_routing_refuses_a_routing_of_other_inputs(checks):
    reference, other, inputs = _moe_pair()
    with torch.no_grad(), checks.recorded_routing(reference) as routing:
        reference(**inputs, use_cache=False)
    shorter = {k: v[:, :8] for k, v in inputs.items()}
    with torch.no_grad(), checks.fixed_routing(other, routing), pytest.raises(ValueError, match="recorded routing"):
        other(**shorter, use_cache=False)


def _cache_entries() -> dict[str, int]:
    """Compiled versions dynamo holds for flex's two compiled functions."""
    return {f.__name__: len(_debug_get_cache_entry_list(f.__code__))
            for f in (torch_flex.create_block_mask, torch_flex.flex_attention)}


def test_flex_generate_compiles_a_bounded_number_of_times(monkeypatch):
    """One model's `generate` with flex compiles a bounded number of times: the block-mask builder and the kernel
    compile once per mask kind (here sliding and full layers, prompt and decode step) for the first shape, once
    more (dynamic) at the second, and never again: not for more steps, not for further batch sizes or prompt
    lengths. (Dynamo guards on transformers' `mask_mod` closures, so each new mask kind compiles anew: in one
    process that builds many models, or feeds one sliding+full model both padded and unpadded batches, that
    passes dynamo's recompile limit of 8 and flex runs unfused. `run_gpu_checks.build` resets dynamo per model.)
    Dynamo's guards decide the recompiles whatever the backend, so inductor is swapped for `aot_eager` to keep
    this a CPU test."""
    compile_ = torch.compile

    def aot_eager(fn=None, **options):
        options = {**options, "backend": "aot_eager", "mode": None}
        return compile_(fn, **options) if fn is not None else (lambda f: compile_(f, **options))

    monkeypatch.setattr(torch, "compile", aot_eager)
    wrapped = transformers_flex.WrappedFlexAttention  # transformers' compiled singleton: a fresh one, restored after
    for name, fresh in (("_instance", None), ("_is_flex_compiled", False), ("_compiled_flex_attention", None)):
        monkeypatch.setattr(wrapped, name, fresh)
    torch._dynamo.reset()
    try:
        torch.manual_seed(0)
        config = ModularDecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, max_position_embeddings=256,
                                      position_embedding_type="rope", sliding_window=4,
                                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                      layer_types=["sliding_attention", "full_attention"])
        model = ModularDecoderForCausalLM._from_config(config, attn_implementation="flex_attention").eval()

        def generate(batch: int, length: int, new_tokens: int):
            ids = torch.randint(1, 64, (batch, length))
            mask = torch.ones_like(ids)
            mask[1, :3] = 0  # left padding: the padding mask joins the mask_mod closures
            model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           do_sample=False, pad_token_id=0)
            return _cache_entries()

        first = generate(2, 8, 3)
        assert first == {"create_block_mask": 4, "flex_attention": 4}  # (sliding, full) x (prompt, step)
        assert generate(2, 8, 8) == first  # more steps, another call: nothing recompiles
        second = generate(3, 11, 3)  # another shape: each compiles once more, with dynamic shapes
        assert second == {"create_block_mask": 8, "flex_attention": 8}
        assert generate(4, 5, 3) == second  # and never again
    finally:
        torch._dynamo.reset()


def test_each_checked_model_starts_with_no_compiled_flex(checks):
    """`run_gpu_checks.build` resets dynamo, so the compiles of the models built before (their `mask_mod`
    closures) do not count towards the next model's recompile limit."""
    def double(x):
        return 2 * x

    compiled = torch.compile(double, backend="eager")
    compiled(torch.ones(2))
    assert len(_debug_get_cache_entry_list(double.__code__)) == 1
    checks.build(make_config("gqa"), "eager", torch.float32, device="cpu")
    assert len(_debug_get_cache_entry_list(double.__code__)) == 0
