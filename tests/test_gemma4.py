"""Gemma 4 (text) against transformers' `Gemma4ForCausalLM`, with the weights carried by the conversion package: global
layers with their own heads, values from the key projection and proportional RoPE; the last layers reading earlier
layers' keys and values (their MLPs twice as wide); per-layer embeddings; a scalar per layer; experts beside the dense
MLP. Logits on our eager and SDPA backends against theirs, a left-padded batch, greedy tokens through each side's own
cache (ours dynamic and static, past the window), the cache bytes a shared layer saves (equal to what transformers'
cache holds and to the contract's count), the router's probabilities, `Trainer` with padded and packed batches, the
compiled decode step, and what vLLM cannot serve refused by name.
test_conversion.py proves the export round trip bit for bit, test_transformers_versions.py this on the oldest and
newest declared transformers."""

from __future__ import annotations

import copy

import pytest
import torch
from conversion_cases import converted_pair
from decoding import assert_compiled_decoding_matches
from family_parity import assert_cache_holds_what_transformers_holds
from gemma_cases import (assert_each_edit_changes_logits, pair_fixtures,  # noqa: F401  (the shared tests)
                         test_gradients_equal_transformers_class,
                         test_greedy_tokens_through_each_sides_cache_match, test_logits_and_a_left_padded_batch_match,
                         test_trainer_steps_equal_transformers_class_padded_and_packed)
from test_gpt_oss_smollm3 import IDS

from modular_decoder import ModularDecoderCache, cache_bytes
from modular_decoder.backend_features import check_backend
from modular_decoder.contract import cache_bytes_per_token

pytestmark = pytest.mark.usefixtures("one_thread")

CASES_HERE = ["gemma4_text", "gemma4_text-moe"]
pair, dense_pair = pair_fixtures(CASES_HERE, "dense_pair")


def test_shared_layers_cache_nothing_as_transformers_counts_and_the_contract_says(dense_pair):
    """After a prompt of 14 tokens the sharing layers' slots hold nothing: ours holds what transformers' cache holds
    (its window of 3 on the local layers, every token on the global ones, the global layers' one K/V head of 16),
    which `contract.cache_bytes` predicts, and less than the same model without sharing would."""
    source, ours = dense_pair
    held = assert_cache_holds_what_transformers_holds(source, ours)
    unshared = copy.deepcopy(ours.config)
    unshared.num_kv_shared_layers = 0
    assert cache_bytes(unshared, IDS.shape[1], 1, torch.float32) > held
    assert cache_bytes_per_token(unshared) > cache_bytes_per_token(ours.config)
    cache = ModularDecoderCache(ours.config)
    for layer, source_layer in zip(cache.layers[-2:], (3, 2)):
        assert layer.source == source_layer and layer.keys is None


def test_each_mechanism_carries_signal(dense_pair):
    """The proofs above would hold for a model that ignored a mechanism only if it did nothing: each does."""
    assert_each_edit_changes_logits(dense_pair[1], {
        "per-layer embeddings": lambda m: m.model.per_layer_embeddings.embed.weight.zero_(),
        "per-layer branch": lambda m: [layer.per_layer_input.output_proj.weight.zero_() for layer in m.model.layers],
        "layer scalars": lambda m: [layer.layer_scalar.fill_(1.0) for layer in m.model.layers],
        "value norm": lambda m: [setattr(layer.self_attn, "value_norm", False) for layer in m.model.layers],
    }, atol=1e-3)


def test_router_probabilities_are_transformers(tmp_path):
    """With experts, `output_router_logits`: our router logits' softmax equals the probabilities transformers' class
    records for each layer (its router records probabilities, ours logits)."""
    source, ours = converted_pair("gemma4_text-moe", tmp_path, "eager")[:2]
    with torch.no_grad():
        theirs = source(IDS, output_router_logits=True).router_logits
        got = ours(IDS, output_router_logits=True).router_logits
    assert len(got) == len(theirs) == ours.config.num_hidden_layers
    for logits, probabilities in zip(got, theirs):
        torch.testing.assert_close(logits.float().softmax(-1), probabilities, rtol=0, atol=1e-6)


def test_compiled_decode_step_gives_eager_and_transformers_tokens(dense_pair, two_threads):
    """`generate(**compiled_decoding())`: a static cache whose sharing layers' slots hold nothing, the decode step
    (sharing, per-layer embeddings, proportional RoPE) compiled with fullgraph=True; transformers' tokens."""
    source, ours = dense_pair
    assert_compiled_decoding_matches(ours, source, IDS[:1])


def test_per_layer_embeddings_need_the_ids(dense_pair):
    """The per-layer table is looked up by id: `inputs_embeds` alone is refused by name."""
    _, ours = dense_pair
    with pytest.raises(ValueError, match="hidden_size_per_layer_input"):
        ours(inputs_embeds=ours.model.embed_tokens(IDS))


def test_vllm_is_refused_by_name(pair):
    """vLLM's Transformers backend allocates one head shape for every layer, pages every layer's keys, and has not
    been shown to run per-layer embeddings: each is refused naming its field."""
    _, ours = pair
    config = ours.config
    fields = ["global_head_dim"] + (["num_kv_shared_layers", "hidden_size_per_layer_input"]
                                    if config.num_kv_shared_layers else [])
    for field in fields:
        with pytest.raises(ValueError, match=field):
            check_backend(config, "vllm")
