"""transformers' Gemma 4 assistant (`Gemma4AssistantForCausalLM`) drafting for a converted Gemma 4: the keys and values
and hidden state our model hands it equal those transformers' `Gemma4ForCausalLM` hands it, so every draft (its ids
and logits) and every token of `generate(assistant_model=...)` is transformers' own with the same assistant, and the
tokens are plain greedy decoding's; with the sharing layers' sources and, without sharing, each type's last layer;
a left-padded row; sampling from the same seed; our int8 cache; what the assistant cannot read refused by name; the private parts of transformers' generate this
relies on where `compat.GENERATION_HOOKS` names them. test_transformers_versions.py runs this file on the oldest and
newest declared release.

The assistant here drafts mostly the token it was given (its table is the target's and its input projection passes the
target's embedding through; its layers' outputs are scaled down but not off), so that drafts are accepted in part, as
a trained assistant's are: the steps that keep some drafts and drop others crop both caches and move the hidden state
and keys the assistant reads next, past the window of 4."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch
import transformers as tf
from conversion_cases import converted_pair
from transformers.generation import GenerationMixin

from modular_decoder import ModularDecoderConfig, ModularDecoderForCausalLM, preset_config
from modular_decoder.compat import GENERATION_HOOKS, cache_of, kv_assistant_generator, with_cache
from modular_decoder.kv_assistant import check_kv_assistant

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = torch.tensor([[12, 85, 3, 40, 61, 7, 29]])
NEW = 24


def assistant_for(target, seed: int = 1) -> tf.Gemma4AssistantForCausalLM:
    """A tiny Gemma 4 assistant reading `target`'s keys and values (its heads shaped as the target's), which drafts
    mostly the token it is given: the target's table as its own (tied head), its input projection passing the target's
    embedding through, its layers' outputs normed down to a tenth. Three drafts a step."""
    config = target.config
    full = config.per_layer_config[config.layer_types.index("full_attention")]
    sliding = config.per_layer_config[config.layer_types.index("sliding_attention")]
    width = config.hidden_size
    text = tf.Gemma4TextConfig(
        vocab_size=config.vocab_size, hidden_size=width, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=sliding.num_key_value_heads, head_dim=sliding.head_dim, global_head_dim=full.head_dim,
        attention_k_eq_v=config.attention_k_eq_v, num_global_key_value_heads=full.num_key_value_heads,
        sliding_window=config.sliding_window, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=64)
    torch.manual_seed(seed)
    assistant = tf.Gemma4AssistantForCausalLM(tf.Gemma4AssistantConfig(text_config=text, backbone_hidden_size=width))
    with torch.no_grad():
        for parameter in assistant.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.3)
        assistant.model.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        assistant.pre_projection.weight.zero_()[:, :width] = torch.eye(width) * width ** -0.5
        for layer in assistant.model.layers:
            layer.post_attention_layernorm.weight.fill_(0.1)
            layer.post_feedforward_layernorm.weight.fill_(0.1)
    assistant.generation_config.num_assistant_tokens = 3
    return assistant.eval()


@pytest.fixture(scope="module", params=["gemma4_text", "gemma4_text-moe"])
def trio(request, tmp_path_factory):
    """(transformers' Gemma 4, ours converted from it, an assistant for both): with the last two layers reading layers
    3 and 2's keys and values (which the assistant reads), then without sharing (each type's last layer)."""
    theirs, ours, _ = converted_pair(request.param, tmp_path_factory.mktemp(request.param), "eager")
    return theirs, ours, assistant_for(theirs)


def drafted(model, assistant, ids, monkeypatch, **kwargs) -> tuple[torch.Tensor, list]:
    """`model.generate(ids, assistant_model=assistant)` greedily, and each step's (prefix length, drafted ids,
    draft logits) as transformers' drafter made them."""
    generator = kv_assistant_generator()
    steps, original = [], generator.get_candidates

    def recorded(self, input_ids, *args, **inner):
        candidates, logits = original(self, input_ids, *args, **inner)
        if logits is not None:
            steps.append((input_ids.shape[1], candidates[0, input_ids.shape[1]:], logits))
        return candidates, logits

    monkeypatch.setattr(generator, "get_candidates", recorded)
    with torch.no_grad():
        tokens = model.generate(ids, assistant_model=assistant, max_new_tokens=NEW, do_sample=False, **kwargs)
    monkeypatch.undo()
    return tokens, steps


def greedy(model, ids, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=NEW, do_sample=False, **kwargs)


def assert_same_drafts(ours: list, theirs: list) -> None:
    assert len(ours) == len(theirs)
    for (length, ids, logits), (their_length, their_ids, their_logits) in zip(ours, theirs):
        assert length == their_length and torch.equal(ids, their_ids)
        torch.testing.assert_close(logits, their_logits, rtol=1e-4, atol=1e-4)


def test_shared_kv_states_and_last_hidden_state_are_transformers(trio):
    """What the assistant reads of the model's output: per attention type the keys and values of the layer transformers
    reads them from, after a prompt and after a step through the cache (a sliding layer's window), and the last hidden
    state; ours equal transformers'."""
    theirs, ours, _ = trio
    kwargs = dict(return_shared_kv_states=True, output_hidden_states=True, use_cache=True)
    with torch.no_grad():
        first, their_first = ours(PROMPT, **kwargs), theirs(PROMPT, **kwargs)
        step = torch.tensor([[5, 9]])
        second, their_second = (model(step, **with_cache(cache_of(out)), **kwargs)
                                for model, out in ((ours, first), (theirs, their_first)))
    for got, want in ((first, their_first), (second, their_second)):
        assert set(got.shared_kv_states) == set(want.shared_kv_states) == {"sliding_attention", "full_attention"}
        for layer_type, (keys, values) in want.shared_kv_states.items():
            torch.testing.assert_close(got.shared_kv_states[layer_type][0], keys, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got.shared_kv_states[layer_type][1], values, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.hidden_states[-1], want.hidden_states[-1], rtol=1e-5, atol=1e-5)
    assert second.shared_kv_states["sliding_attention"][0].shape[2] < second.shared_kv_states["full_attention"][0].shape[2]
    assert ours(PROMPT).shared_kv_states is None  # only when asked


def test_drafts_and_tokens_are_transformers_and_greedy(trio, monkeypatch):
    """Every draft (ids and logits) of `generate(assistant_model=...)` on ours equals transformers' Gemma 4 with the same
    assistant, and the tokens equal both, and plain greedy decoding's; some drafts were kept and some dropped."""
    theirs, ours, assistant = trio
    tokens, steps = drafted(ours, assistant, PROMPT, monkeypatch)
    their_tokens, their_steps = drafted(theirs, assistant, PROMPT, monkeypatch)
    assert_same_drafts(steps, their_steps)
    assert torch.equal(tokens, their_tokens)
    assert torch.equal(tokens, greedy(ours, PROMPT)) and torch.equal(tokens, greedy(theirs, PROMPT))
    kept = [next((i for i, (a, b) in enumerate(zip(ids, tokens[0, length:])) if a != b), len(ids))
            for length, ids, _ in steps]
    assert any(k > 0 for k in kept) and any(k < 3 for k in kept), kept
    assert max(length for length, _, _ in steps) > 2 * ours.config.sliding_window


@pytest.mark.parametrize("trio", ["gemma4_text"], indirect=True)
def test_a_left_padded_row_drafts_as_transformers(trio, monkeypatch):
    """A prompt left-padded by three (transformers drafts for one row at a time): the same drafts and tokens as
    transformers' Gemma 4 with the assistant, and ours' greedy tokens for that row."""
    theirs, ours, assistant = trio
    ids = torch.cat([torch.zeros(1, 3, dtype=torch.long), PROMPT], dim=1)
    mask = (ids != 0).long()
    kwargs = dict(attention_mask=mask, pad_token_id=0)
    tokens, steps = drafted(ours, assistant, ids, monkeypatch, **kwargs)
    their_tokens, their_steps = drafted(theirs, assistant, ids, monkeypatch, **kwargs)
    assert_same_drafts(steps, their_steps)
    assert torch.equal(tokens, their_tokens) and torch.equal(tokens, greedy(ours, ids, **kwargs))


@pytest.mark.parametrize("trio", ["gemma4_text"], indirect=True)
def test_sampling_and_the_int8_cache(trio, monkeypatch):
    """Sampling: the tokens transformers' Gemma 4 samples with the assistant from the same seed (its loop accepts drafts
    by speculative sampling, from the drafts' logits). Our int8 cache: its own greedy tokens with the assistant."""
    theirs, ours, assistant = trio
    sampled = []
    for model in (ours, theirs):
        torch.manual_seed(0)
        with torch.no_grad():
            sampled.append(model.generate(PROMPT, assistant_model=assistant, max_new_tokens=NEW, do_sample=True))
    assert torch.equal(*sampled)
    int8 = dict(cache_implementation="quantized")
    assert torch.equal(drafted(ours, assistant, PROMPT, monkeypatch, **int8)[0], greedy(ours, PROMPT, **int8))


def test_what_the_assistant_cannot_read_is_refused_by_name(trio):
    """`generate(assistant_model=...)` refuses before any forward a model without the assistant's two attention types,
    with latent attention, without rotary positions, with other head shapes, another hidden size or vocabulary."""
    _, ours, assistant = trio
    check_kv_assistant(ours.config, assistant)  # ours as converted: accepted
    gemma4 = {k: v for k, v in ours.config.to_dict().items() if k in ModularDecoderConfig.declared_fields()}
    layouts = {
        "layer_types": preset_config("llama", tiny=True),
        "attention_type": preset_config("deepseek_v3", tiny=True),
        "position_embedding_type": ModularDecoderConfig(**{**gemma4, "position_embedding_type": "alibi"}),
        "global_head_dim": ModularDecoderConfig(**{**gemma4, "global_head_dim": 8}),
        "hidden_size": ModularDecoderConfig(**{**gemma4, "hidden_size": 48}),
        "vocab_size": ModularDecoderConfig(**{**gemma4, "vocab_size": 100, "vocab_size_per_layer_input": None}),
    }
    for field, config in layouts.items():
        with pytest.raises(ValueError, match=field):
            ModularDecoderForCausalLM(config).generate(PROMPT, assistant_model=assistant, max_new_tokens=2)


def test_the_private_generation_hooks_are_where_compat_names_them():
    """Fails when transformers moves what drafting with its Gemma 4 assistant relies on (`compat.GENERATION_HOOKS`):
    its drafter, the keywords its constructor takes, what it reads of the model's output; transformers picking it
    by the assistant's class name, for its own Gemma targets only."""
    module, name, words = GENERATION_HOOKS["kv_assistant_generator"]
    generator = getattr(importlib.import_module(module), name)
    assert all(word in inspect.getsource(generator) for word in words), [w for w in words if w not in
                                                                          inspect.getsource(generator)]
    parameters = inspect.signature(generator.__init__).parameters
    assert {"assistant_model", "target_model_input_embeddings", "generation_config"} <= set(parameters)
    older = {"input_ids", "model_kwargs", "inputs_tensor", "logits_processor"}  # 5.16's; 5.25 takes them as **kwargs
    assert older <= set(parameters) or any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    choosing = inspect.getsource(GenerationMixin._get_candidate_generator)
    assert all(f'"{prefix}"' in choosing for prefix in GENERATION_HOOKS["kv_assistant_classes"])
    assert f"{name}(" in choosing
    assert tf.Gemma4AssistantForCausalLM.__name__.startswith(GENERATION_HOOKS["kv_assistant_classes"])
