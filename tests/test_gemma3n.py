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

import pytest
from decoding import assert_compiled_decoding_matches
from family_parity import assert_cache_holds_what_transformers_holds
from gemma_cases import (assert_each_edit_changes_logits, pair_fixtures,  # noqa: F401  (the shared tests)
                         test_gradients_equal_transformers_class,
                         test_greedy_tokens_through_each_sides_cache_match, test_logits_and_a_left_padded_batch_match,
                         test_trainer_steps_equal_transformers_class_padded_and_packed)
from test_gpt_oss_smollm3 import IDS

from modular_decoder.backend_features import check_backend

pytestmark = pytest.mark.usefixtures("one_thread")

CASES_HERE = ["gemma3n_text", "gemma3n_text-four-streams"]
pair, shared_pair = pair_fixtures(CASES_HERE, "shared_pair")


def test_shared_layers_cache_what_transformers_caches(shared_pair):
    assert_cache_holds_what_transformers_holds(*shared_pair)


def test_each_mechanism_carries_signal(shared_pair):
    """The proofs above would hold for a model that ignored a mechanism only if it did nothing: each does."""
    assert_each_edit_changes_logits(shared_pair[1], {
        "AltUp's prediction": lambda m: [layer.altup.prediction_coefs.weight.zero_() for layer in m.model.layers],
        "AltUp's correction": lambda m: [layer.altup.correction_coefs.weight.zero_() for layer in m.model.layers],
        # (a scale alone would be undone: each stream is rescaled to the embedding's RMS)
        "the streams' projections": lambda m: [p.weight.copy_(p.weight.flip(0)) for p in
                                               m.model.residual_stream.projections],
        "LAUREL": lambda m: [setattr(layer, "laurel", None) for layer in m.model.layers],
        "per-layer embeddings": lambda m: m.model.per_layer_embeddings.embed.weight.zero_(),
        "activation sparsity": lambda m: setattr(m.model.layers[0].mlp, "act_fn", m.model.layers[0].mlp.act_fn[1]),
    }, atol=1e-4)


def test_compiled_decode_step_gives_eager_and_transformers_tokens(shared_pair, two_threads):
    """`generate(**compiled_decoding())`: AltUp's streams, LAUREL, the per-layer embeddings and shared keys in a
    decode step compiled with fullgraph=True over a static cache; transformers' tokens."""
    source, ours = shared_pair
    assert_compiled_decoding_matches(ours, source, IDS[:1])


def test_vllm_is_refused_by_name(shared_pair):
    _, ours = shared_pair
    for field in ("residual_stream", "num_kv_shared_layers", "hidden_size_per_layer_input"):
        with pytest.raises(ValueError, match=field):
            check_backend(ours.config, "vllm")
