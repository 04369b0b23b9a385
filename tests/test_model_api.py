"""The public model API: loss, logits_to_keep, positions, padding, gradient checkpointing,
generate() strategies, and clear errors for bad input."""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from modular_decoder import (
    PRESETS,
    ModularDecoderConfig,
    ModularDecoderForCausalLM,
    ModularDecoderModel,
    preset_config,
)


def _model(name="llama", **overrides):
    torch.manual_seed(0)
    return ModularDecoderForCausalLM(preset_config(name, tiny=True, **overrides)).eval()


def test_auto_classes_are_registered():
    config = AutoConfig.for_model("modular_decoder", hidden_size=32, num_attention_heads=4, num_hidden_layers=1,
                                  vocab_size=50)
    assert isinstance(config, ModularDecoderConfig)
    assert isinstance(AutoModel.from_config(config), ModularDecoderModel)
    assert isinstance(AutoModelForCausalLM.from_config(config), ModularDecoderForCausalLM)


def test_loss_shifts_labels_and_ignores_minus_100():
    model = _model()
    ids = torch.randint(0, 128, (2, 9))
    labels = ids.clone()
    labels[0, :4] = -100
    out = model(ids, labels=labels)
    logits = out.logits[:, :-1].reshape(-1, 128)
    expected = F.cross_entropy(logits, labels[:, 1:].reshape(-1), ignore_index=-100)
    torch.testing.assert_close(out.loss, expected)


def test_logits_to_keep():
    model = _model()
    ids = torch.randint(0, 128, (1, 7))
    full = model(ids).logits
    torch.testing.assert_close(model(ids, logits_to_keep=2).logits, full[:, -2:])


def test_explicit_position_ids_equal_defaults_and_shift_changes_rope():
    model = _model()
    ids = torch.randint(0, 128, (1, 6))
    default = model(ids).logits
    torch.testing.assert_close(model(ids, position_ids=torch.arange(6)[None]).logits, default)
    assert not torch.allclose(model(ids, position_ids=torch.arange(6)[None] + 3).logits, default)


@pytest.mark.parametrize("name", ["llama", "gpt2", "bloom", "gemma2", "mistral"])
def test_left_padded_batch_matches_rows_alone(name):
    model = _model(name)
    a = torch.randint(1, 128, (1, 9))
    b = torch.randint(1, 128, (1, 5))
    batch = torch.cat([a, torch.cat([torch.zeros(1, 4, dtype=torch.long), b], dim=1)])
    mask = torch.ones_like(batch)
    mask[1, :4] = 0
    logits = model(batch, attention_mask=mask).logits
    torch.testing.assert_close(logits[0], model(a).logits[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(logits[1, 4:], model(b).logits[0], rtol=0, atol=1e-5)
    out = model.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert out[0, 9:].tolist() == model.generate(a, max_new_tokens=6, do_sample=False)[0, 9:].tolist()
    assert out[1, 9:].tolist() == model.generate(b, max_new_tokens=6, do_sample=False)[0, 5:].tolist()


def test_gradient_checkpointing_gives_same_gradients():
    model = _model("gemma2").train()
    ids = torch.randint(0, 128, (2, 8))
    model(ids, labels=ids).loss.backward()
    plain = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model(ids, labels=ids).loss.backward()
    for name, grad in plain.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, grad, rtol=1e-5, atol=1e-6)


def test_the_forward_steps_are_named_helpers_with_their_policies():
    """`ModularDecoderModel.forward` reads as transformers' Llama: each policy is a helper of its own (so a
    change to one, e.g. a state reset for linear attention, is made in one place and tested there)."""
    from transformers import DynamicCache

    from modular_decoder.cache import ModularDecoderCache

    model = _model("llama").model
    positions = torch.tensor([[0, 1, 2, 0, 1]])
    empty, static = DynamicCache(config=model.config), ModularDecoderCache(model.config, "static", max_cache_len=8)
    # packed documents are looked for only in positions given without a cache
    assert model._packed_document_positions(positions, None) is positions
    assert model._packed_document_positions(positions, empty) is None
    # a static cache always sizes the masks; an empty dynamic one does not (it sizes them as no cache would)
    assert model._mask_cache(static, torch.tensor(0)) is static
    assert model._mask_cache(empty, 0) is None and model._mask_cache(empty, 3) is empty
    # no cache while training with gradient checkpointing, else the caller's choice, else the config's
    assert model._use_cache(None) is model.config.use_cache and model._use_cache(False) is False
    model.train().gradient_checkpointing = True
    assert model._use_cache(True) is False
    with pytest.raises(ValueError, match="exactly one of `input_ids` or `inputs_embeds`"):
        model._check_inputs(None, None, None, None)


def _greedy_without_cache(model, ids, steps):
    for _ in range(steps):
        nxt = model(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_greedy_generate_equals_no_cache_loop(name):
    model = _model(name)
    ids = torch.randint(0, 128, (1, 5))
    expected = _greedy_without_cache(model, ids, 12)
    assert model.generate(ids, max_new_tokens=12, do_sample=False).tolist() == expected.tolist()


def test_sampling_beam_and_assisted_generation_run_and_agree():
    model = _model("qwen3")
    ids = torch.randint(0, 128, (2, 5))
    torch.manual_seed(1)
    a = model.generate(ids, max_new_tokens=8, do_sample=True, top_k=20)
    torch.manual_seed(1)
    b = model.generate(ids, max_new_tokens=8, do_sample=True, top_k=20)
    assert a.tolist() == b.tolist()
    beams = model.generate(ids, max_new_tokens=8, num_beams=3, do_sample=False)
    assert beams.shape == (2, 13)
    one = ids[:1]
    greedy = model.generate(one, max_new_tokens=8, do_sample=False)
    draft = _model("qwen3", num_hidden_layers=1)
    assisted = model.generate(one, max_new_tokens=8, do_sample=False, assistant_model=draft)
    assert assisted.tolist() == greedy.tolist()


# ---- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, field_name",
    [
        (dict(hidden_size=30, num_attention_heads=4), "hidden_size"),
        (dict(num_attention_heads=4, num_key_value_heads=3), "num_key_value_heads"),
        (dict(norm_type="batchnorm"), "norm_type"),
        (dict(norm_position="middle"), "norm_position"),
        (dict(mlp_type="sparse"), "mlp_type"),
        (dict(mlp_type="moe"), "num_experts"),
        (dict(hidden_act="not_an_act"), "hidden_act"),
        (dict(position_embedding_type="xpos"), "position_embedding_type"),
        (dict(qk_norm="half"), "qk_norm"),
        (dict(parallel_block=True, norm_position="post"), "parallel_block"),
        (dict(partial_rotary_factor=0.125, hidden_size=32, num_attention_heads=4), "rotary"),
        (dict(layer_types=["sliding_attention"], num_hidden_layers=1), "sliding_window"),
        (dict(layer_types=["full_attention"], num_hidden_layers=2), "layer_types"),
        (dict(attention_type="mla", position_embedding_type="alibi", kv_lora_rank=8, qk_nope_head_dim=8,
              qk_rope_head_dim=4, v_head_dim=8), "rope"),
        (dict(attention_type="mla"), "kv_lora_rank"),
        (dict(attn_logit_softcapping=-1.0), "attn_logit_softcapping"),
        (dict(mlp_type="moe", num_experts=4, num_experts_per_tok=2, router_type=[]), "router_type"),
    ],
)
def test_bad_config_raises_value_error_naming_the_field(fields, field_name):
    base = dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, vocab_size=50)
    with pytest.raises(ValueError, match=field_name):
        ModularDecoderConfig(**{**base, **fields})


@pytest.mark.parametrize("fields, field_name, what", [
    (dict(layer_types=["full_attention"] * 3), "layer_types", "one entry"),
    (dict(block_types="mixer_mlp"), "block_types", "one entry"),
    (dict(mlp_type="moe", num_experts=4, num_experts_per_tok=2, mlp_layer_types=["sparse"]), "mlp_layer_types",
     "one entry"),
    (dict(layer_intermediate_sizes=[64]), "layer_intermediate_sizes", "one value"),
    (dict(activation_sparsity_pattern=[0.5, 0.0, 0.0]), "activation_sparsity_pattern", "one value"),
    (dict(no_rope_layers=[1, 0, 1]), "no_rope_layers", "one 1 (RoPE) or 0 (NoPE)"),
])
def test_a_per_layer_field_of_the_wrong_length_is_named_with_the_layer_count(fields, field_name, what):
    """Each per-layer field (`kinds.require_per_layer`) says what it must list and how many layers there are."""
    base = dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, vocab_size=50)
    value = fields[field_name]
    with pytest.raises(ValueError) as refusal:
        ModularDecoderConfig(**{**base, **fields})
    assert str(refusal.value) == (f"`{field_name}` must list {what} per layer (`num_hidden_layers`=2), "
                                  f"got {value!r}.")


@pytest.mark.parametrize("field", ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                   "max_position_embeddings"])
def test_a_required_size_of_none_is_named(field):
    """A required size left None is refused by name, before any default computes with it (it was a TypeError)."""
    base = dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, vocab_size=50)
    with pytest.raises(ValueError, match=rf"`{field}` must be an integer, got None"):
        ModularDecoderConfig(**{**base, field: None})


def test_an_odd_rotary_width_names_the_fields_that_set_it():
    with pytest.raises(ValueError) as error:
        ModularDecoderConfig(hidden_size=20, num_attention_heads=4, num_hidden_layers=2, vocab_size=50)
    for named in ("`head_dim`=5", "`hidden_size`=20", "`num_attention_heads`=4", "`partial_rotary_factor`"):
        assert named in str(error.value)
    with pytest.raises(ValueError, match=r"`head_dim`=6 x `partial_rotary_factor`=0.5 = 3,"):
        ModularDecoderConfig(hidden_size=32, num_attention_heads=4, head_dim=6, partial_rotary_factor=0.5,
                             num_hidden_layers=2, vocab_size=50)


def test_token_ids_outside_vocabulary_raise():
    model = _model()
    with pytest.raises(ValueError, match="vocab_size=128"):
        model(torch.tensor([[1, 2, 128]]))
    with pytest.raises(ValueError, match="vocab_size"):
        model(torch.tensor([[-1, 2]]))


def test_sequence_longer_than_learned_positions_raises():
    model = _model("gpt2", max_position_embeddings=16)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(torch.randint(0, 128, (1, 17)))
    model(torch.randint(0, 128, (1, 16)))  # the last learned position is fine


def test_backend_that_cannot_honour_the_config_is_refused_at_load(tmp_path):
    model = _model("gemma2")
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa")
    assert AutoModelForCausalLM.from_pretrained(tmp_path).config._attn_implementation == "eager"


def test_unknown_preset_names_the_choices():
    with pytest.raises(ValueError, match="gpt2"):
        preset_config("gpt5")
