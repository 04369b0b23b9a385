"""The new topology axes combined where no published family puts them: AltUp's streams, LAUREL, per-layer embeddings,
layer scalars and shared keys and values on a Llama layout (pre-norm, SwiGLU, GQA) with Llama 4's chunked RoPE layers,
NoPE temperature and weightless QK-norm; experts beside a dense MLP routed as Llama 4 routes them, on a pre-norm block;
AltUp around MLA layers with chunked attention. Each against its own no-cache forward (greedy tokens through the
dynamic, static and int8 caches, a cache filled in chunks), a left-padded row against itself alone, packed documents
against themselves alone, gradient checkpointing against plain gradients, save and load, the parameter formula."""

from __future__ import annotations

import pytest
import torch
from decoding import greedy_no_cache, prompt, steps_against_full

from modular_decoder import ModularDecoderConfig, ModularDecoderForCausalLM, parameter_count

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
            max_position_embeddings=64, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
COMBINATIONS = {
    # Llama's block with Gemma 3n's streams and side branches, Gemma 4's sharing and scalars, Llama 4's attention
    "llama_altup_laurel_ple_shared_chunked": dict(
        BASE, num_key_value_heads=2, residual_stream="altup", altup_num_inputs=3, laurel_rank=4,
        hidden_size_per_layer_input=6, layer_scalar=True, num_kv_shared_layers=2, value_norm=True,
        layer_types=["chunked_attention", "full_attention"] * 2, attention_chunk_size=3, no_rope_layers=[1, 0, 1, 0],
        attn_temperature_tuning=True, floor_scale=2, attn_scale=0.5, attn_temperature_offset=1,
        attn_temperature_layers="nope", qk_norm="weightless", rope_interleaved=True),
    # Gemma 4's experts beside a dense MLP, routed by Llama 4's top-1 sigmoid, on a pre-norm block with LAUREL
    "prenorm_dense_beside_sigmoid_experts": dict(
        BASE, mlp_type="moe", num_experts=4, num_experts_per_tok=1, moe_intermediate_size=16,
        router_type="topk_sigmoid", norm_topk_prob=False, parallel_dense_mlp=True, router_input_norm=True,
        router_expert_scale=True, laurel_rank=4),
    # AltUp around latent attention (MLA) with chunked local layers
    "mla_altup_chunked": dict(
        BASE, attention_type="mla", q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
        v_head_dim=8, residual_stream="altup", altup_num_inputs=2, attention_chunk_size=3,
        layer_types=["chunked_attention", "full_attention"] * 2),
}


@pytest.fixture(scope="module", params=sorted(COMBINATIONS))
def model(request):
    torch.manual_seed(0)
    model = ModularDecoderForCausalLM(ModularDecoderConfig(**COMBINATIONS[request.param])).eval()
    with torch.no_grad():  # every tensor off its fresh value (zero scales and unit norms hide misplacements)
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.2)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.uniform_(0.5, 1.5)
    model.generation_config.pad_token_id = 0
    return model


def test_greedy_tokens_through_every_cache_equal_the_no_cache_forward(model):
    ids = prompt(2, 7, vocab=model.config.vocab_size)
    expected = greedy_no_cache(model, ids, 8)
    caches = [None, "static"] + (["quantized"] if model.config.attention_type == "standard" else [])
    for cache in caches:
        with torch.no_grad():
            got = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, cache_implementation=cache)
        if cache == "quantized":  # int8 K/V: the tokens may part from fp32's once an argmax is within its error
            assert torch.equal(got[:, :9], expected[:, :9]), cache
        else:
            assert torch.equal(got, expected), cache


def test_a_cache_filled_in_chunks_gives_the_full_forward_with_left_padding(model):
    ids = prompt(2, 12, vocab=model.config.vocab_size, seed=3)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    steps, full = steps_against_full(model, ids, mask, [5, 1, 4, 2])
    real = mask.bool()
    torch.testing.assert_close(steps[real], full[real], rtol=0, atol=1e-5)


def test_a_left_padded_row_and_a_packed_document_compute_as_alone(model):
    ids = prompt(2, 9, vocab=model.config.vocab_size, seed=5)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        padded = model(ids, attention_mask=mask, position_ids=positions).logits[1, 3:]
        alone = model(ids[1:, 3:]).logits[0]
        packed = model(ids[:1], position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4]])).logits[0, 4:]
        second = model(ids[:1, 4:]).logits[0]
    torch.testing.assert_close(padded, alone, rtol=0, atol=1e-5)
    torch.testing.assert_close(packed, second, rtol=0, atol=1e-5)


def test_gradient_checkpointing_gives_the_plain_gradients(model):
    ids = prompt(2, 8, vocab=model.config.vocab_size, seed=7)

    def grads():
        model.zero_grad()
        model(ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    model.train()
    try:
        plain = grads()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        checkpointed = grads()
    finally:
        model.gradient_checkpointing_disable()
        model.eval()
    # every parameter learns (AltUp's output scale only where a per-layer embedding's branch reads it)
    unread = {n for n, _ in model.named_parameters()
              if n.endswith("correct_output_scale") and not model.config.hidden_size_per_layer_input}
    assert plain.keys() == checkpointed.keys() == {n for n, _ in model.named_parameters()} - unread
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], rtol=1e-5, atol=1e-6, msg=name)


def test_save_load_and_the_parameter_formula(model, tmp_path):
    assert model.num_parameters() == parameter_count(model.config)["total"]
    model.save_pretrained(tmp_path)
    loaded = ModularDecoderForCausalLM.from_pretrained(tmp_path).eval()
    ids = prompt(1, 6, vocab=model.config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("flags", [1, "0101", [1, 0]])
def test_nope_temperature_with_a_malformed_no_rope_layers_names_that_field(flags):
    """The NoPE query temperature reads `no_rope_layers`; a value that is not one flag per layer is refused naming
    it (found by test_properties: an int raised a TypeError there)."""
    fields = {name: value for name, value in COMBINATIONS["llama_altup_laurel_ple_shared_chunked"].items()
              if name != "no_rope_layers"}
    with pytest.raises(ValueError, match="`no_rope_layers`"):
        ModularDecoderConfig(**fields, no_rope_layers=flags)
