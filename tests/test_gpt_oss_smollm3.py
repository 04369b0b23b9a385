"""gpt-oss (sinks, alternating windows, the biased top-k-then-softmax router, experts with biases and the clamped
SwiGLU) and SmolLM3 (NoPE layers, sliding NoPE layers) against transformers' `GptOssForCausalLM` and
`SmolLM3ForCausalLM`, with the weights carried by the conversion package: logits on our eager and SDPA backends
against theirs, a left-padded batch, greedy tokens through each side's own cache (ours dynamic and static).
test_conversion.py proves the export round trip bit for bit, test_moe_model.py gpt-oss's router logits and losses,
test_transformers_versions.py all of this on the oldest and newest declared transformers."""

from __future__ import annotations

import copy

import pytest
import torch
from conversion_cases import CASES, perturbed
from transformers import AutoModelForCausalLM

from modular_decoder.conversion import convert

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ["gpt_oss", "smollm3", "smollm3-sliding"]
IDS = torch.tensor([[5, 17, 3, 42, 8, 61, 23, 11, 2, 90, 33, 7, 19, 4], [9, 1, 64, 12, 40, 5, 77, 18, 26, 3, 50, 14, 6, 8]])


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    """(transformers' model with perturbed weights, ours converted from its saved folder)."""
    folder = tmp_path_factory.mktemp(request.param)
    _, build = CASES[request.param]
    config = build()
    config.architectures = None
    torch.manual_seed(0)
    source = perturbed(AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval())
    with torch.no_grad():  # sinks of order 1, so that a dropped sink shows in the logits
        for module in source.modules():
            if getattr(module, "sinks", None) is not None:
                module.sinks.normal_(0.0, 1.5)
    source.save_pretrained(folder / "src")
    convert(folder / "src", folder / "ours", progress=False)
    return source, AutoModelForCausalLM.from_pretrained(folder / "ours").eval()


def left_padded() -> tuple[torch.Tensor, torch.Tensor]:
    mask = torch.ones_like(IDS)
    mask[1, :5] = 0
    return IDS, mask


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_logits_and_a_left_padded_batch_match(pair, backend):
    source, ours = pair
    ours.set_attn_implementation(backend)
    ids, mask = left_padded()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, source(ids).logits, rtol=0, atol=1e-4)
        got, want = ours(ids, attention_mask=mask).logits, source(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=1e-4)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_tokens_through_each_sides_cache_match(pair, backend, cache):
    """A batch whose second row is left-padded, past the sliding window, generated greedily by each side through
    its own cache (transformers' dynamic one; ours dynamic or static)."""
    source, ours = pair
    ours.set_attn_implementation(backend)
    ids, mask = left_padded()
    kwargs = dict(attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = source.generate(ids, **kwargs)
        got = ours.generate(ids, cache_implementation=None if cache == "dynamic" else "static", **kwargs)
    assert torch.equal(got, want)


def test_the_sinks_and_the_nope_layers_change_the_function(pair):
    """The proofs above would hold for a model that ignored them only if they did nothing: they do not."""
    _, ours = pair
    without = copy.deepcopy(ours)
    without.config.no_rope_layers = None  # every layer rotates
    with torch.no_grad():
        for module in without.modules():
            if getattr(module, "sinks", None) is not None:
                module.sinks.fill_(-1e4)  # no mass to the sinks
        assert (ours(IDS).logits - without(IDS).logits).abs().max() > 1e-2
