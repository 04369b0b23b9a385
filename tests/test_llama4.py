"""Llama 4 (text) against transformers' `Llama4ForCausalLM`, with the weights carried by the conversion package:
chunked attention on the RoPE layers, NoPE layers with their temperature, the weightless norm of the rotated q and k,
interleaved RoPE, a top-1 sigmoid router scaling the expert's input beside a shared expert, dense layers between.
Logits on our eager and SDPA backends against theirs, a left-padded batch, greedy tokens through each side's own
cache (ours dynamic and static, past several chunks), each mechanism shown to matter, `Trainer` with padded and
packed batches, the compiled decode step, the backends that cannot chunk refused by name.
test_conversion.py proves the export round trip bit for bit, test_moe_model.py the router logits and losses,
test_transformers_versions.py this on the oldest and newest declared transformers."""

from __future__ import annotations

import copy

import pytest
import torch
from conversion_cases import converted_pair
from decoding import assert_compiled_decoding_matches
from family_parity import assert_gradients_match, assert_greedy_tokens_match, assert_logits_match
from test_gpt_oss_smollm3 import IDS, assert_trainer_matches, left_padded

from modular_decoder import ModularDecoderForCausalLM
from modular_decoder.backend_features import check_backend

pytestmark = pytest.mark.usefixtures("one_thread")

# "llama4_text": the NoPE layer's temperature floor Llama 4's 8,192; "-tuned": 4 tokens (reached here)
CASES_HERE = ["llama4_text", "llama4_text-tuned"]


@pytest.fixture(scope="module", params=CASES_HERE)
def pair(request, tmp_path_factory):
    """(transformers' model with perturbed weights, ours converted from its saved folder)."""
    return converted_pair(request.param, tmp_path_factory.mktemp(request.param), "eager")[:2]


@pytest.fixture(scope="module")
def plain_pair(tmp_path_factory):
    return converted_pair("llama4_text", tmp_path_factory.mktemp("plain"), "eager")[:2]


@pytest.fixture(scope="module")
def tuned_pair(tmp_path_factory):
    return converted_pair("llama4_text-tuned", tmp_path_factory.mktemp("tuned"), "eager")[:2]


def _tuned(pair) -> bool:
    """Whether the NoPE temperature changes at these positions (the "-tuned" case's floor of 4): transformers counts a
    left-padded row's temperature from its cache's slots, so its padded rows are compared in
    `test_a_left_padded_row_gets_what_it_gets_alone_with_the_nope_temperature`."""
    return pair[1].config.floor_scale == 4


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_logits_and_a_left_padded_batch_match(pair, backend):
    """The real tokens of a left-padded batch too: chunks start at each row's first real token on both sides."""
    assert_logits_match(*pair, backend, padded=not _tuned(pair))


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_tokens_through_each_sides_cache_match(pair, backend, cache):
    """Generated greedily by each side through its own cache (transformers' dynamic one; ours dynamic or static),
    past several chunks of 4: a left-padded batch (one row where the NoPE temperature changes)."""
    assert_greedy_tokens_match(*pair, backend, cache, padded=not _tuned(pair))


def test_a_left_padded_row_gets_what_it_gets_alone_with_the_nope_temperature(tuned_pair):
    """The NoPE layer's temperature grows with the position (`position_ids`): a left-padded row's real tokens get
    the logits they get alone, as vLLM computes it. (transformers' class counts the cache's slots, padding
    included, so its padded row differs from the row alone: docs/using.md.)"""
    source, ours = tuned_pair
    ids, mask = left_padded()
    with torch.no_grad():
        padded = ours(ids, attention_mask=mask).logits[1, 5:]
        alone = ours(ids[1:, 5:]).logits[0]
        theirs_padded = source(ids, attention_mask=mask).logits[1, 5:]
    torch.testing.assert_close(padded, alone, rtol=0, atol=1e-4)
    assert (theirs_padded - alone).abs().max() > 1e-3


def test_each_mechanism_changes_the_function(pair):
    """The proofs above would hold for a model that ignored a mechanism only if it did nothing: each does."""
    _, ours = pair
    config = ours.config
    changes = {"attention_chunk_size": 64}
    if config.qk_norm != "none":
        changes["qk_norm"] = "none"
    if config.attn_temperature_tuning and config.floor_scale < IDS.shape[1]:  # (a floor these positions reach)
        changes["attn_temperature_tuning"] = False
    with torch.no_grad():
        reference = ours(IDS).logits
        for field, value in changes.items():
            changed = copy.deepcopy(ours)
            setattr(changed.config, field, value)
            rebuilt = ModularDecoderForCausalLM(changed.config).eval()
            rebuilt.load_state_dict(ours.state_dict())
            assert (rebuilt(IDS).logits - reference).abs().max() > 1e-3, field
        for module in ours.modules():  # the routing weight on the expert's output instead of its input
            if hasattr(module, "weight_on_input"):
                module.weight_on_input = False
        try:
            assert (ours(IDS).logits - reference).abs().max() > 1e-3, "apply_router_weight_on_input"
        finally:
            for module in ours.modules():
                if hasattr(module, "weight_on_input"):
                    module.weight_on_input = True


def test_gradients_equal_transformers_class(pair, tmp_path):
    """A loss's gradient on every parameter, the chunked and NoPE layers' and the top-1 experts' included, is
    transformers'."""
    assert_gradients_match(*pair, tmp_path)


def test_trainer_steps_equal_transformers_class_padded_and_packed(plain_pair, tmp_path):
    """`Trainer` on ours and on transformers' class from the same weights: the same loss at every step with
    right-padded batches; ours with the documents packed in one row (each chunked from its own start) gives the
    padded losses, and so does transformers' class."""
    source, ours = plain_pair
    assert_trainer_matches(source, ours, tmp_path, reference_packs=True)


def test_compiled_decode_step_gives_eager_and_transformers_tokens(tuned_pair, two_threads):
    """`generate(**compiled_decoding())`: a static cache whose chunked layers are rings of one chunk, the decode
    step compiled with fullgraph=True (the NoPE temperature, experts and dense layers in it); the tokens equal
    eager decoding and transformers' class."""
    source, ours = tuned_pair
    assert_compiled_decoding_matches(ours, source, IDS[:1])


@pytest.mark.parametrize("backend", ["flash_attention_2", "flash_attention_3", "vllm"])
def test_backends_that_cannot_chunk_are_refused_by_name(pair, backend):
    """Flash kernels take a window, not chunks (transformers refuses them for Llama 4); vLLM's Transformers backend
    gives a layer a window or none: each is refused naming `attention_chunk_size`."""
    _, ours = pair
    with pytest.raises(ValueError, match="attention_chunk_size"):
        check_backend(ours.config, backend)
