"""Drafting on hybrids: assisted decoding, prompt lookup, early exit and `use_mtp` beside linear-attention layers.

The cache layer (`recurrent_cache.RecurrentLayer`) records the states of the tokens a crop may remove; `crop(-n)`
must leave exactly what a cache that never saw those n tokens holds. Proven three ways: each layer's window and
state after every crop against a recomputation over the accepted tokens only (the gated delta rule, and mixers of
other shapes: several slots, a window-only slot); the model's logits after every crop against the no-cache forward;
and `generate` with every drafting strategy against plain greedy decoding, ours and transformers'
(`Qwen3NextForCausalLM`, `Qwen3_5ForCausalLM`), whose own prompt lookup gives greedy's tokens on 5.25 only once its
layer records one more state (docs/using.md, "Drafting on hybrids")."""

from __future__ import annotations

import copy

import pytest
import torch
from conversion_cases import converted_pair, skip_without_class
from transformers.generation import candidate_generator

from modular_decoder import ModularDecoderCache, ModularDecoderForCausalLM, compat, delta_rule, preset_config
from modular_decoder.mtp_generation import recorded_drafts
from modular_decoder.recurrent_cache import RecurrentLayer, run_recurrence

pytestmark = pytest.mark.usefixtures("one_thread")

# An input-grounded prompt (its first six tokens come again), so prompt lookup finds drafts that are then rejected
PIECE = [41, 7, 88, 15, 62, 30]
PROMPT = torch.tensor([PIECE + [9, 77, 4] + PIECE])
GREEDY = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)
DRAFTING = {
    "prompt_lookup": dict(prompt_lookup_num_tokens=3),
    "early_exit": dict(assistant_early_exit=2),
    "assistant": dict(num_assistant_tokens=4),  # with `assistant_model`: see `test_every_drafting_strategy...`
}


# (Nemotron-H: Mamba-2 layers; Falcon-H1: Mamba-2 beside attention in hybrid layers, whose cache layer holds both;
# LFM2: a window-only short convolution; Kimi Linear: KDA's three convolutions in one window, beside latent attention;
# OLMo hybrid: Gated DeltaNet with negative eigenvalues; Qwen3.5-MoE: Gated DeltaNet beside experts)
@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5_text", "nemotron_h", "falcon_h1", "lfm2", "kimi_linear",
                                        "olmo_hybrid", "qwen3_5_moe_text"])
def pair(request, tmp_path_factory):
    """(transformers' model, ours converted from its checkpoint, the folder)."""
    skip_without_class(request.param)
    return converted_pair(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture
def crops(monkeypatch):
    """The token counts every linear-attention layer was cropped by, in order."""
    seen, crop = [], RecurrentLayer.crop

    def counting(layer, tokens_to_remove):
        seen.append(-tokens_to_remove)
        return crop(layer, tokens_to_remove)

    monkeypatch.setattr(RecurrentLayer, "crop", counting)
    return seen


# --- one layer, against a recomputation over the accepted tokens --------------------------------------------

CHANNELS, KERNEL = 6, 4


def _delta_rule_inputs(length: int, seed: int):
    torch.manual_seed(seed)
    return (torch.randn(2, length, 2, 8), torch.randn(2, length, 2, 8), torch.randn(2, length, 4, 4),
            -torch.rand(2, length, 4), torch.rand(2, length, 4))


def _decaying_sum(decay, update, state):
    """A stand-in rule with another state shape (Mamba-2's (B, H, P, N)): s_t = a_t · s_{t-1} + u_t."""
    state = torch.zeros_like(update[:, 0]) if state is None else state
    out = []
    for t in range(update.shape[1]):
        state = decay[:, t] * state + update[:, t]
        out.append(state.sum((-1, -2))[:, None])
    return torch.cat(out, dim=1), state


def _decaying_inputs(length: int, seed: int):
    torch.manual_seed(seed)
    return torch.rand(2, length, 3, 2, 5), torch.randn(2, length, 3, 2, 5)


# (inputs of a step of `length` tokens, chunked form, recurrent form, tolerance) per recurrent slot
RULES = {
    "gated_deltanet": (_delta_rule_inputs, delta_rule.chunked_gated_delta_rule, delta_rule.recurrent_gated_delta_rule),
    "decaying_sum": (_decaying_inputs, _decaying_sum, _decaying_sum),
}
# slot -> (conv window width or None, rule or None): Gated DeltaNet, several slots (three windows as transformers'
# Kimi Linear keeps them, two states), a window only
MIXERS = {
    "gated_deltanet": {0: (KERNEL, "gated_deltanet")},
    "three_slots": {0: (KERNEL, "decaying_sum"), 1: (2, None), 2: (3, "gated_deltanet")},
    "window_only": {0: (3, None)},
}


def _step(layer, mixer: dict, start: int, length: int, seed: int = 0):
    """Feed tokens [start, start + length) of a fixed random sequence through every slot of `layer`."""
    for slot, (width, rule) in mixer.items():
        torch.manual_seed(seed + slot)
        x = torch.randn(2, CHANNELS, 200)[..., start:start + length]
        if width is not None:
            layer.update_conv_state(x, state_idx=slot, conv_kernel_size=width)
        if rule is not None:
            make, chunked, recurrent = RULES[rule]
            inputs = [t[:, start:start + length] for t in make(200, seed + slot)]
            run_recurrence(layer, chunked, recurrent, inputs, state_idx=slot)


def _assert_holds_the_same(layer: RecurrentLayer, fresh: RecurrentLayer, mixer: dict) -> None:
    assert layer.get_seq_length() == fresh.get_seq_length()
    for slot, (width, rule) in mixer.items():
        if width is not None:  # the window: the last K inputs of the accepted tokens, exactly
            assert torch.equal(layer.get_conv_state(slot)[..., -width:], fresh.get_conv_state(slot)[..., -width:])
        if rule is not None:
            torch.testing.assert_close(layer.get_recurrent_state(slot), fresh.get_recurrent_state(slot),
                                       rtol=1e-5, atol=1e-5)


# (steps of the recorded forwards: the first of them begins at the prompt's end, tokens drafted per step)
SCHEDULES = {
    "verify": ([4], 3),  # a verification of 3 drafts after a prompt of 10
    "first_step": ([75], 3),  # recording on before the prompt: a long step, chunked up to its last 3 tokens
    "draft_model": ([2, 1, 1, 1], 4),  # a draft model's cache: accepted tokens, then one forward per draft
}


@pytest.mark.parametrize("mixer", MIXERS)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_each_crop_leaves_what_the_accepted_tokens_alone_leave(mixer, schedule):
    steps, drafted = SCHEDULES[schedule]
    prompt = 0 if schedule == "first_step" else 10
    recorded = sum(steps)
    for removed in range(min(recorded, drafted) + 1):
        layer = RecurrentLayer(number_of_states=3)
        if prompt:
            _step(layer, MIXERS[mixer], 0, prompt)
        layer.activate_past_recording(recurrent_states_to_keep=drafted)
        start = prompt
        for length in steps:
            _step(layer, MIXERS[mixer], start, length)
            start += length
        layer.crop(-removed)
        fresh = RecurrentLayer(number_of_states=3)
        _step(fresh, MIXERS[mixer], 0, start - removed)
        _assert_holds_the_same(layer, fresh, MIXERS[mixer])
        _step(layer, MIXERS[mixer], start - removed, 2)  # and the next step continues from there
        _step(fresh, MIXERS[mixer], start - removed, 2)
        _assert_holds_the_same(layer, fresh, MIXERS[mixer])


def test_a_crop_past_the_record_is_refused_and_changes_nothing():
    mixer = MIXERS["three_slots"]
    layer = RecurrentLayer(number_of_states=3)
    _step(layer, mixer, 0, 10)
    with pytest.raises(ValueError, match="activate_past_recording"):
        layer.crop(-1)
    layer.activate_past_recording(recurrent_states_to_keep=2)
    _step(layer, mixer, 10, 3)
    before = copy.deepcopy(layer)
    with pytest.raises(ValueError, match="back 3 tokens, but it recorded the states of its last 2"):
        layer.crop(-3)
    _assert_holds_the_same(layer, before, {slot: (None, rule) for slot, (_, rule) in mixer.items()})
    assert all(torch.equal(layer.conv_states[i], before.conv_states[i]) for i in mixer)


def test_a_step_that_keeps_every_draft_drops_the_record():
    """`crop(0)` (assisted decoding after a verification that kept all): the windows shrink back to K columns and no
    recorded state is held; a crop right after the recording starts is a no-op."""
    mixer = MIXERS["three_slots"]
    layer = RecurrentLayer(number_of_states=3)
    _step(layer, mixer, 0, 8)
    layer.activate_past_recording(recurrent_states_to_keep=3)
    layer.crop(0)
    _step(layer, mixer, 8, 4)
    assert layer.get_conv_state(0).shape[-1] == KERNEL + 3 and len(layer.state_history[0]) == 4
    layer.crop(0)
    assert [layer.get_conv_state(i).shape[-1] for i in mixer] == [width for width, _ in mixer.values()]
    assert not any(layer.state_history.values())
    fresh = RecurrentLayer(number_of_states=3)
    _step(fresh, mixer, 0, 12)
    _assert_holds_the_same(layer, fresh, mixer)


def test_reordering_a_recording_cache_reorders_what_it_rolls_back_to():
    """Beam search's reorder (and batch select) act on the recorded states too: reorder, then crop, equals crop, then
    reorder."""
    mixer = MIXERS["three_slots"]
    layers = []
    for _ in range(2):
        layer = RecurrentLayer(number_of_states=3)
        _step(layer, mixer, 0, 8)
        layer.activate_past_recording(recurrent_states_to_keep=3)
        _step(layer, mixer, 8, 3)
        layers.append(layer)
    layers[0].reorder_cache(torch.tensor([1, 0]))
    layers[0].crop(-2)
    layers[1].crop(-2)
    layers[1].reorder_cache(torch.tensor([1, 0]))
    _assert_holds_the_same(layers[0], layers[1], mixer)


# --- the model, against its no-cache forward ----------------------------------------------------------------


@pytest.mark.parametrize("first_step", [False, True])
def test_logits_after_each_crop_equal_the_no_cache_forward(pair, first_step):
    """A verification of 3 drafts (or, with `first_step`, the prompt and its drafts in one forward, as assisted
    decoding's first step), cropped by 0-3 tokens, then the next token: the logits of the forward without a cache
    over the accepted text."""
    _, ours, _ = pair
    text = torch.tensor([[5, 17, 3, 42, 8, 61, 23, 11, 2, 90, 33, 7, 64, 12, 40, 9]])
    prompt, drafts = 12, 3
    with torch.no_grad():
        cache = ModularDecoderCache(ours.config)
        if first_step:
            cache.activate_past_recording(recurrent_states_to_keep=drafts)
            ours(text[:, :prompt + drafts + 1], cache=cache)
        else:
            ours(text[:, :prompt], cache=cache)
            cache.activate_past_recording(recurrent_states_to_keep=drafts)
            ours(text[:, prompt:prompt + drafts + 1], cache=cache)
        for removed in range(drafts + 1):
            kept = prompt + drafts + 1 - removed
            cropped = copy.deepcopy(cache)
            cropped.crop(-removed)
            assert cropped.get_seq_length() == kept
            following = torch.tensor([[removed + 50]])
            step = ours(following, cache=cropped).logits[:, -1]
            expected = ours(torch.cat([text[:, :kept], following], dim=1), use_cache=False).logits[:, -1]
            torch.testing.assert_close(step, expected, rtol=0, atol=1e-5)


# --- generate, against plain greedy decoding ----------------------------------------------------------------


@pytest.mark.parametrize("strategy", DRAFTING)
def test_every_drafting_strategy_gives_plain_greedy_tokens(pair, strategy, crops):
    """Ours drafting = ours plain = transformers' plain greedy, with drafts rejected whole, in part and accepted
    (the assistant is the model itself, early exit its first two layers, prompt lookup the prompt's own text; the
    assistant's own cache is a hybrid cache rolled back too)."""
    theirs, ours, _ = pair
    extra = dict(DRAFTING[strategy], **({"assistant_model": ours} if strategy == "assistant" else {}))
    expected = theirs.generate(PROMPT, **GREEDY)
    assert torch.equal(ours.generate(PROMPT, **GREEDY), expected)
    assert torch.equal(ours.generate(PROMPT, **extra, **GREEDY), expected)
    assert crops, "no verification was rolled back"
    if strategy == "prompt_lookup":  # some steps rejected all 3 drafts, and a later one fewer (or none)
        assert 3 in crops and min(crops) < 3


def test_an_assistant_that_lengthens_its_drafts_can_be_rolled_back_all_the_way(pair):
    """With `num_assistant_tokens_schedule="heuristic"` the assistant drafts two more tokens after each step that
    kept all: the cache records up to the tokens left to generate, not just the first step's count."""
    _, ours, _ = pair
    assistant = copy.deepcopy(ours)
    assistant.generation_config.num_assistant_tokens = 2
    assistant.generation_config.num_assistant_tokens_schedule = "heuristic"
    out = ours.generate(PROMPT, assistant_model=assistant, return_dict_in_generate=True, **GREEDY)
    assert torch.equal(out.sequences, ours.generate(PROMPT, **GREEDY))
    layers = [getattr(layer, "recurrent", layer) for layer in compat.cache_of(out).layers]  # (a hybrid layer's)
    layer = next(layer for layer in layers if isinstance(layer, RecurrentLayer))
    assert layer.recurrent_states_to_keep == GREEDY["max_new_tokens"]


def test_a_left_padded_row_drafts_the_tokens_it_decodes(pair):
    theirs, ours, _ = pair
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), PROMPT], dim=1)
    mask = (padded != 0).long()
    expected = theirs.generate(padded, attention_mask=mask, **GREEDY)
    assert torch.equal(ours.generate(padded, attention_mask=mask, prompt_lookup_num_tokens=3, **GREEDY), expected)
    assert torch.equal(expected[:, 3:], theirs.generate(PROMPT, **GREEDY))


@pytest.mark.skipif(not hasattr(candidate_generator.PromptLookupCandidateGenerator, "num_drafting_tokens"),
                    reason="transformers before 5.25 does not restore a linear-attention state on crop at all")
def test_transformers_prompt_lookup_needs_one_more_recorded_state(pair, monkeypatch):
    """transformers 5.25's own prompt lookup parts from its greedy tokens on this prompt (a verification whose drafts
    are all rejected restores the state from before it); recording one more state (the whole verification token by
    token) gives its greedy tokens, which are ours. If this starts failing on its first assert, transformers fixed
    it: update docs/using.md."""
    theirs, ours, _ = pair
    if ours.config.linear_attention_type not in ("gated_deltanet", "kda"):
        pytest.skip("transformers' Mamba-2 and LFM2 classes keep greedy's tokens under prompt lookup on this prompt")
    greedy = theirs.generate(PROMPT, **GREEDY)
    assert not torch.equal(theirs.generate(PROMPT, prompt_lookup_num_tokens=3, **GREEDY), greedy)
    monkeypatch.setattr(candidate_generator.PromptLookupCandidateGenerator, "num_drafting_tokens",
                        property(lambda self: self.num_output_tokens + 1))
    fixed = theirs.generate(PROMPT, prompt_lookup_num_tokens=3, **GREEDY)
    assert torch.equal(fixed, greedy)
    assert torch.equal(ours.generate(PROMPT, prompt_lookup_num_tokens=3, **GREEDY), fixed)


def test_mtp_modules_on_a_linear_attention_layer_draft_greedy_tokens(crops):
    """MTP modules built from a linear-attention block (the model's last layer): their own cache rolls back too,
    also when the last module drafts past the modules (`mtp_draft_tokens` 3 from 2 modules)."""
    config = preset_config("qwen3_5", tiny=True, layer_types=["full_attention", "linear_attention"], num_mtp_layers=2)
    torch.manual_seed(0)
    model = ModularDecoderForCausalLM(config).eval()
    assert model.mtp.layer_type == "linear_attention"
    prompt = torch.tensor([[3, 14, 15, 92, 65, 35, 89, 79]])
    with recorded_drafts() as statistics:
        drafted = model.generate(prompt, use_mtp=True, mtp_draft_tokens=3, **GREEDY)
    assert torch.equal(drafted, model.generate(prompt, **GREEDY))
    assert statistics.drafted and crops


# --- one cache, one batch -----------------------------------------------------------------------------------


@pytest.mark.parametrize("layer_types", [["linear_attention", "full_attention"], ["full_attention", "linear_attention"],
                                         None])
def test_a_cache_reused_with_another_batch_size_is_refused_by_name(layer_types):
    """Whichever layer comes first (a linear-attention or an attention layer; a model without linear layers too)."""
    config = preset_config("qwen3_5", tiny=True, layer_types=layer_types) if layer_types else \
        preset_config("llama", tiny=True)
    model = ModularDecoderForCausalLM(config).eval()
    ids = torch.tensor([[5, 17, 3, 42], [9, 1, 64, 12]])
    with torch.no_grad():
        cache = compat.cache_of(model(ids, use_cache=True))
        for other in (ids[:1], ids.repeat(2, 1)):
            with pytest.raises(ValueError, match=r"`cache` \(a DynamicModularDecoderCache\) holds the states of a "
                                                 rf"batch of 2 sequences, and the input has {other.shape[0]}"):
                model(other, cache=cache)
        with pytest.raises(ValueError, match="batch of 2 sequences, and the input has 1"):
            model.generate(ids[:1], cache=cache, max_new_tokens=2)
        cache.reset()
        assert model(ids[:1], cache=cache).logits.shape[0] == 1  # a reset cache takes any batch


def test_a_linear_attention_layer_refuses_another_batch_size_by_itself():
    layer = RecurrentLayer()
    layer.update_conv_state(torch.randn(2, CHANNELS, 5), conv_kernel_size=KERNEL)
    layer.update_recurrent_state(torch.randn(2, 4, 8, 4))
    with pytest.raises(ValueError, match="`cache` holds a linear-attention conv window for a batch of 2 sequences"):
        layer.update_conv_state(torch.randn(1, CHANNELS, 1))
