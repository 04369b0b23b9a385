"""NoPE layers (`no_rope_layers`, SmolLM3's field: 1 rotates, 0 does not): a NoPE layer's output does not move
when the distances between positions change, a rotating layer's does; the parity with transformers' SmolLM3 is in
test_conversion.py, every backend and cache in test_backends.py (`nope_sliding`)."""

from __future__ import annotations

import pytest
import torch
from backend_cases import make_config

from modular_decoder import ModularDecoderCache, ModularDecoderConfig, ModularDecoderForCausalLM


@pytest.mark.parametrize("flags", [[0, 1], [1, 1]])
def test_a_nope_layer_ignores_the_positions(flags):
    config = make_config("gqa")
    config = ModularDecoderConfig(**{**config.to_dict(), "no_rope_layers": flags})
    torch.manual_seed(0)
    model = ModularDecoderForCausalLM(config).eval()
    with torch.no_grad():  # queries and keys large enough that the scores, and so the rotation, matter
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.normal_(0.0, 0.5)
            layer.self_attn.k_proj.weight.normal_(0.0, 0.5)
    ids = torch.randint(0, 97, (1, 7))
    positions = torch.arange(7)[None]
    with torch.no_grad():
        # (a uniform shift would not do: RoPE's scores see only distances; a cache, so that positions that do
        # not count up by one are not read as packed documents)
        states = [model(ids, position_ids=positions * stride, cache=ModularDecoderCache(config),
                        output_hidden_states=True).hidden_states for stride in (1, 3)]
    first_layer = states[0][1], states[1][1]  # the output of layer 0
    if flags[0] == 0:
        torch.testing.assert_close(*first_layer, atol=1e-6, rtol=0)
    else:
        assert (first_layer[0] - first_layer[1]).abs().max() > 1e-3
    assert (states[0][2] - states[1][2]).abs().max() > 1e-3  # layer 1 rotates in both


def test_nope_layers_are_refused_with_mla_and_without_any_rotating_layer():
    mla = make_config("mla").to_dict()
    with pytest.raises(ValueError, match="no_rope_layers"):
        ModularDecoderConfig(**{**mla, "no_rope_layers": [0, 1]})
    with pytest.raises(ValueError, match="no_rope_layers.*position_embedding_type='none'"):
        ModularDecoderConfig(**{**make_config("gqa").to_dict(), "no_rope_layers": [0, 0]})
    with pytest.raises(ValueError, match="no_rope_layers.*only applies to `position_embedding_type='rope'`"):
        ModularDecoderConfig(**{**make_config("alibi").to_dict(), "no_rope_layers": [1, 1]})
