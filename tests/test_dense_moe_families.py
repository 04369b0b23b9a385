"""Phi-3 / Phi-4, OLMo 3, Ministral 3, MiniMax-M2 and GLM-4.5 against transformers' own classes, with the weights
carried by the conversion package: logits on our eager and SDPA backends against theirs, a left-padded batch, greedy
tokens through each side's own cache (ours dynamic and static), and what each family adds changing the function
(Ministral 3's query temperature, LongRoPE's switch to its long factors during generation).
test_conversion.py proves the export round trip bit for bit, test_moe_model.py the routers' logits and losses,
test_mtp_glm4_moe.py GLM-4.5's MTP layer, test_transformers_versions.py all of this on the oldest and newest release."""

from __future__ import annotations

import copy

import pytest
import torch
from conversion_cases import CASES, perturbed, preset_parameter_counts, reference_generate
from transformers import AutoModelForCausalLM

from modular_decoder.conversion import convert

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ["phi3", "phi3-longrope", "olmo3", "ministral3", "minimax_m2", "glm4_moe", "glm4_moe-air"]
IDS = torch.tensor([[5, 17, 3, 42, 8, 61, 23, 11, 2, 90, 33, 7, 19, 4],
                    [9, 1, 64, 12, 40, 5, 77, 18, 26, 3, 50, 14, 6, 8]])


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    """(transformers' model with perturbed weights, ours converted from its saved folder)."""
    folder = tmp_path_factory.mktemp(request.param)
    _, build = CASES[request.param]
    config = build()
    config.architectures = None
    torch.manual_seed(0)
    source = perturbed(AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval())
    source.save_pretrained(folder / "src")
    convert(folder / "src", folder / "ours", progress=False)
    return source, AutoModelForCausalLM.from_pretrained(folder / "ours").eval()


def left_padded() -> tuple[torch.Tensor, torch.Tensor]:
    mask = torch.ones_like(IDS)
    mask[1, :5] = 0
    return IDS, mask


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_logits_and_a_left_padded_batch_match(pair, backend):
    """The padded row's positions count its real tokens on both sides, as generate gives them (a forward without
    `position_ids` counts them so here, and from the first column in transformers' classes: the same under RoPE,
    not under Ministral 3's temperature, which reads the absolute position)."""
    source, ours = pair
    ours.set_attn_implementation(backend)
    ids, mask = left_padded()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, source(ids).logits, rtol=0, atol=1e-4)
        got = ours(ids, attention_mask=mask).logits
        want = source(ids, attention_mask=mask, position_ids=positions).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=1e-4)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_tokens_through_each_sides_cache_match(pair, backend, cache):
    """A batch whose second row is left-padded, generated greedily by each side through its own cache (transformers'
    dynamic one; ours dynamic or static): past the sliding windows, and for LongRoPE past its switch at 16 tokens."""
    source, ours = pair
    ours.set_attn_implementation(backend)
    ids, mask = left_padded()
    kwargs = dict(attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = reference_generate(source, ids, **kwargs)
        got = ours.generate(ids, cache_implementation=None if cache == "dynamic" else "static", **kwargs)
    assert torch.equal(got, want)


def test_the_query_temperature_changes_the_function(pair):
    """Ministral 3's queries past position 4 are scaled (the parity above would hold for a model that ignored it
    only if it did nothing: it does not)."""
    source, ours = pair
    if not ours.config.attn_temperature_tuning:
        pytest.skip("no query temperature in this family")
    without = copy.deepcopy(ours)
    without.config.attn_temperature_tuning = False
    with torch.no_grad():
        assert (ours(IDS).logits - without(IDS).logits).abs().max() > 1e-2
        assert (ours(IDS[:, :4]).logits - without(IDS[:, :4]).logits).abs().max() == 0  # factor 1 before the floor


def test_longrope_generation_equals_the_forward_without_cache(pair):
    """Past LongRoPE's switch, each greedy token is the argmax of the no-cache forward over the text so far (the keys
    rotated with the short factors are not reused), as transformers' cached generation gives on 5.25; that forward is
    transformers' own; and the switch changes the function."""
    source, ours = pair
    if ours.config.rope_parameters.get("rope_type") != "longrope":
        pytest.skip("no LongRoPE in this family")
    prompt = IDS[:1]
    with torch.no_grad():
        out = ours.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
        for step in range(prompt.shape[1], out.shape[1]):
            assert ours(out[:, :step], use_cache=False).logits[0, -1].argmax() == out[0, step]
        torch.testing.assert_close(ours(out).logits, source(out).logits, rtol=0, atol=1e-4)
        short = ours(out[:, :16]).logits[:, :12]  # all positions within the short factors' range
        assert (ours(out).logits[:, :12] - short).abs().max() > 1e-3  # the long factors rotate them otherwise


# preset -> the family whose transformers class it exports to
PRESET_FAMILIES = {"phi4": "phi3", "olmo3": "olmo3", "ministral3": "ministral3", "minimax_m2": "minimax_m2",
                   "glm4_5": "glm4_moe"}


@pytest.mark.parametrize("tiny", [False, True], ids=["published", "tiny"])
@pytest.mark.parametrize("name", sorted(PRESET_FAMILIES))
def test_preset_parameters_equal_the_family_class_on_meta(name, tiny):
    """The preset exported to its family's config (`from_contract`) and built by transformers' own class on the meta
    device has exactly the contract's parameter count and ours (Phi-4: 14,659,507,200; GLM-4.5 without its MTP
    layer: 352,797,814,784)."""
    theirs, count, ours = preset_parameter_counts(name, PRESET_FAMILIES[name], tiny)
    assert theirs == count == ours
