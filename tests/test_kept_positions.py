"""A forward keeping the last k positions' logits runs the layers that share keys and values on those k positions only
(`kept_positions.py`): the logits equal the last k of the whole forward on every stream kind (one stream, AltUp's,
hyper-connections), both backends that take a cut mask, a left-padded batch, packed documents and a cache filled
before; the cut reaches the last layer where it applies and not where a caller records every position, where the
backend takes no cut mask, or where a `None` mask would stand for more than one kept query."""

from __future__ import annotations

import pytest
import torch
from conversion_cases import perturbed
from decoding import greedy_no_cache, prompt

from modular_decoder import ModularDecoderConfig, ModularDecoderForCausalLM
from modular_decoder.cache import ModularDecoderCache

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=5, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, num_kv_shared_layers=2, sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
                         "full_attention"], rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
LAYOUTS = {
    # Gemma 4's: per-layer inputs, layer scalars, sandwich norms
    "single": dict(BASE, hidden_size_per_layer_input=6, layer_scalar=True, norm_position="sandwich"),
    # Gemma 3n's: AltUp's streams (n, B, T, d), LAUREL
    "altup": dict(BASE, residual_stream="altup", altup_num_inputs=3, laurel_rank=4, hidden_size_per_layer_input=6),
    # hyper-connections' streams (B, T, n, d) on a Llama layout
    "hyper_connections": dict(BASE, residual_stream="hyper_connections", hc_mult=2, hc_sinkhorn_iters=3),
}


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def model(request):
    torch.manual_seed(0)  # (every tensor off its fresh value: zero scales and unit norms hide misplacements)
    model = perturbed(ModularDecoderForCausalLM(ModularDecoderConfig(**LAYOUTS[request.param])).eval())
    model.generation_config.pad_token_id = 0
    return model


class LastLayerPositions:
    """Records the positions the last layer runs on (its stream's positions dim)."""

    def __init__(self, model):
        from modular_decoder.registries import RESIDUAL_STREAMS

        self.dim, self.seen = RESIDUAL_STREAMS.of(model.config).position_dim, []
        self.handle = model.model.layers[-1].register_forward_pre_hook(
            lambda module, args: self.seen.append(args[0].shape[self.dim]))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("keep", [1, 3])
def test_kept_logits_equal_the_whole_forwards_and_the_cut_reaches_the_last_layer(model, backend, keep):
    """Left-padded and packed: the kept positions' logits are the whole forward's; the last layer sees k positions
    (with SDPA's causal flag in play, a single kept query only)."""
    model.set_attn_implementation(backend)
    ids = prompt(2, 9, vocab=model.config.vocab_size, seed=4)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    packed = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4]] * 2)
    for kwargs in ({}, {"attention_mask": mask}, {"position_ids": packed}):
        with torch.no_grad(), LastLayerPositions(model) as last:
            whole = model(ids, **kwargs).logits
            kept = model(ids, logits_to_keep=keep, **kwargs).logits
        torch.testing.assert_close(kept, whole[:, -keep:], rtol=0, atol=1e-5)
        causal_flag = backend == "sdpa" and not kwargs  # (no mask: SDPA's is_causal)
        assert last.seen == [9, 9 if causal_flag and keep > 1 else keep], kwargs


def test_after_a_cache_filled_before_and_through_generate(model):
    """A prompt's second chunk with `logits_to_keep=1` over a cache filled by the first gives the whole forward's
    last logits; greedy generation (its prefill keeps 1) equals the no-cache loop."""
    model.set_attn_implementation("sdpa")
    ids = prompt(2, 10, vocab=model.config.vocab_size, seed=6)
    with torch.no_grad():
        whole = model(ids).logits[:, -1:]
        cache = ModularDecoderCache(model.config)
        model(ids[:, :6], cache=cache, use_cache=True)
        with LastLayerPositions(model) as last:
            kept = model(ids[:, 6:], cache=cache, use_cache=True, logits_to_keep=1).logits
        torch.testing.assert_close(kept, whole, rtol=0, atol=1e-5)
        assert last.seen == [1]
        got = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert torch.equal(got, greedy_no_cache(model, ids, 6))


def test_no_cut_where_every_position_is_read_or_the_backend_takes_no_cut_mask(model):
    """Hidden states, attentions or router logits recorded, or a backend without a cut mask (flex): every position
    runs through the last layer."""
    ids = prompt(1, 8, vocab=model.config.vocab_size, seed=7)
    cases = [("sdpa", {"output_hidden_states": True}), ("eager", {"output_attentions": True}),
             ("sdpa", {"output_router_logits": True})]
    if model.config.residual_stream == "single":  # (one layout: flex compiles its kernel, seconds)
        cases.append(("flex_attention", {}))
    for backend, kwargs in cases:
        model.set_attn_implementation(backend)
        with torch.no_grad(), LastLayerPositions(model) as last:
            out = model(ids, logits_to_keep=1, **kwargs)
        assert last.seen == [8] and out.logits.shape[1] == 1, (backend, kwargs)
    model.set_attn_implementation("sdpa")
