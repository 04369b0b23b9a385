"""Gemma 3n (text) against transformers' `Gemma3nForCausalLM`, with the weights carried by the conversion package:
AltUp's streams around every layer (3, then 4 with the second active), LAUREL beside attention, per-layer embeddings
over a table smaller than the vocabulary, shared keys and values, the Gaussian top-k on the first layers' gates, a
soft-capped head. Logits on our eager and SDPA backends against theirs, a left-padded batch, greedy tokens through
each side's own cache (ours dynamic and static), the cache bytes sharing saves (what transformers' cache holds), each
mechanism shown to carry signal, `Trainer` with padded and packed batches (AltUp's coefficients clamped in training
as transformers clamps them), the compiled decode step, and vLLM refused by name.
test_conversion.py proves the export round trip bit for bit, test_transformers_versions.py this on the oldest and
newest declared transformers."""

from __future__ import annotations

import copy

import pytest
import torch
from conversion_cases import converted_pair
from decoding import compiled_eager_and_reference
from family_parity import assert_cache_holds_what_transformers_holds, assert_greedy_tokens_match, assert_logits_match
from test_gpt_oss_smollm3 import IDS, assert_trainer_matches

from modular_decoder.backend_features import check_backend

pytestmark = pytest.mark.usefixtures("one_thread")

CASES_HERE = ["gemma3n_text", "gemma3n_text-four-streams"]


@pytest.fixture(scope="module", params=CASES_HERE)
def pair(request, tmp_path_factory):
    """(transformers' model with perturbed weights, ours converted from its saved folder)."""
    return converted_pair(request.param, tmp_path_factory.mktemp(request.param), "eager")[:2]


@pytest.fixture(scope="module")
def shared_pair(tmp_path_factory):
    return converted_pair("gemma3n_text", tmp_path_factory.mktemp("shared"), "eager")[:2]


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_logits_and_a_left_padded_batch_match(pair, backend):
    assert_logits_match(*pair, backend)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_tokens_through_each_sides_cache_match(pair, backend, cache):
    """A left-padded batch generated greedily by each side through its own cache, past the window of 4."""
    assert_greedy_tokens_match(*pair, backend, cache)


def test_shared_layers_cache_what_transformers_caches(shared_pair):
    assert_cache_holds_what_transformers_holds(*shared_pair)


def test_each_mechanism_carries_signal(shared_pair):
    """The proofs above would hold for a model that ignored a mechanism only if it did nothing: each does."""
    _, ours = shared_pair
    with torch.no_grad():
        reference = ours(IDS).logits
        edits = {
            "AltUp's prediction": lambda m: [layer.altup.prediction_coefs.weight.zero_() for layer in m.model.layers],
            "AltUp's correction": lambda m: [layer.altup.correction_coefs.weight.zero_() for layer in m.model.layers],
            # (a scale alone would be undone: each stream is rescaled to the embedding's RMS)
            "the streams' projections": lambda m: [p.weight.copy_(p.weight.flip(0)) for p in
                                                   m.model.residual_stream.projections],
            "LAUREL": lambda m: [setattr(layer, "laurel", None) for layer in m.model.layers],
            "per-layer embeddings": lambda m: m.model.per_layer_embeddings.embed.weight.zero_(),
            "activation sparsity": lambda m: setattr(m.model.layers[0].mlp, "act_fn", m.model.layers[0].mlp.act_fn[1]),
        }
        for name, edit in edits.items():
            changed = copy.deepcopy(ours)
            edit(changed)
            assert (changed(IDS).logits - reference).abs().max() > 1e-4, name


def test_trainer_steps_equal_transformers_class_padded_and_packed(pair, tmp_path):
    """`Trainer` on ours and on transformers' class from the same weights: the same loss at every step with
    right-padded batches; ours with the documents packed in one row gives the padded losses."""
    source, ours = pair
    assert_trainer_matches(source, ours, tmp_path, reference_packs=False)


def test_compiled_decode_step_gives_eager_and_transformers_tokens(shared_pair, two_threads):
    """`generate(**compiled_decoding())`: AltUp's streams, LAUREL, the per-layer embeddings and shared keys in a
    decode step compiled with fullgraph=True over a static cache; transformers' tokens."""
    source, ours = shared_pair
    compiled, eager, reference, graphs = compiled_eager_and_reference(ours, source, IDS[:1])
    assert graphs, "generate did not compile the decode step"
    assert torch.equal(compiled, eager)
    assert torch.equal(compiled, reference)


def test_vllm_is_refused_by_name(shared_pair):
    _, ours = shared_pair
    for field in ("residual_stream", "num_kv_shared_layers", "hidden_size_per_layer_input"):
        with pytest.raises(ValueError, match=field):
            check_backend(ours.config, "vllm")
