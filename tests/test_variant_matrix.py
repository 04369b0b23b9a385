"""Every value of every contract axis, in pairwise combinations, checked for causality, cached
decoding against the full forward, eager against SDPA, the parameter formula, and a
save/load round trip."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from modular_decoder import ModularDecoderForCausalLM, parameter_count
from modular_decoder.backend_features import missing_features
from modular_decoder.tools.validate import batch_invariant_experts
from variants import CHOICES, build, variant_id

SEQ = 12


def _model(config, backend="eager"):
    torch.manual_seed(0)
    model = ModularDecoderForCausalLM._from_config(config, attn_implementation=backend)
    _perturb_norms(model)
    return model.eval()


def _perturb_norms(model):
    # Fresh norms are the identity; random scales make a misplaced norm visible. Routers get weights
    # far from the near-uniform init, so that routing differs from token to token.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.3)
            elif name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5)


@pytest.fixture(params=CHOICES, ids=[variant_id(c) for c in CHOICES])
def config(request):
    return build(request.param)


def test_causality(config):
    model = _model(config)
    ids = torch.randint(0, config.vocab_size, (2, SEQ))
    changed = ids.clone()
    changed[:, SEQ // 2 :] = (changed[:, SEQ // 2 :] + 1) % config.vocab_size
    # (routed experts as per-token products: grouped kernels round by group size, see its docstring)
    with torch.no_grad(), batch_invariant_experts(model):
        a, b = model(ids).logits, model(changed).logits
    torch.testing.assert_close(a[:, : SEQ // 2], b[:, : SEQ // 2], rtol=0, atol=0)
    assert not torch.allclose(a[:, SEQ // 2 :], b[:, SEQ // 2 :])


def test_cached_decoding_matches_full_forward(config):
    model = _model(config)
    ids = torch.randint(0, config.vocab_size, (2, SEQ))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :3], use_cache=True)
        steps = [out.logits]
        cache = out.cache
        for t in range(3, SEQ):
            out = model(ids[:, t : t + 1], cache=cache, use_cache=True)
            cache = out.cache
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)


def test_eager_matches_sdpa(config):
    if missing_features(config, "sdpa"):
        with pytest.raises(ValueError, match="cannot honour"):
            _model(config, "sdpa")
        return
    eager, sdpa = _model(config, "eager"), _model(config, "sdpa")
    ids = torch.randint(0, config.vocab_size, (2, SEQ))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # a left-padded row
    with torch.no_grad():
        a = eager(ids, attention_mask=mask).logits
        b = sdpa(ids, attention_mask=mask).logits
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(a[1, 4:], b[1, 4:], rtol=0, atol=1e-5)


def test_parameter_count_matches_formula(config):
    model = _model(config)
    assert model.num_parameters() == parameter_count(config)["total"]


def test_save_and_reload(config, tmp_path):
    model = _model(config)
    model.save_pretrained(tmp_path)
    # The saved layout reloads bit for bit; the decode layout (fused, column-major products: the
    # default on CPU) computes the same function up to fp32 reassociation.
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    laid_out = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    saved, reloaded = model.state_dict(), loaded.state_dict()
    assert saved.keys() == reloaded.keys() and all(torch.equal(saved[k], reloaded[k]) for k in saved)
    ids = torch.randint(0, config.vocab_size, (1, SEQ))
    with torch.no_grad():
        # Routed experts as per-token products here: the grouped kernels' few-row products round
        # differently with the weights' memory alignment (a reloaded tensor need not be 64-byte
        # aligned), by ~3e-8, though every weight is equal bit for bit (checked above).
        with batch_invariant_experts(model), batch_invariant_experts(loaded):
            torch.testing.assert_close(loaded.eval()(ids).logits, model(ids).logits, rtol=0, atol=0)
        expected = model(ids).logits
        torch.testing.assert_close(loaded(ids).logits, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(laid_out.eval()(ids).logits, expected, rtol=1e-5, atol=1e-5)
