"""`decode_layout`: wide weights column-major, same function, tied weights stay tied, saves as usual."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from decoding import prompt, tiny_model
from modular_decoder.layout import decode_layout, standard_layout


def test_wide_weights_move_and_the_function_stays():
    model = tiny_model("smollm2")  # tied head: vocab 128 > hidden
    ids = prompt(2, 7)
    with torch.no_grad():
        before = model(ids).logits
        expected = model.generate(ids, max_new_tokens=6, do_sample=False)
    moved = decode_layout(model)
    wide = {id(m.weight) for m in model.modules()
            if isinstance(m, torch.nn.Linear) and m.weight.shape[0] > m.weight.shape[1]}
    assert moved == len(wide) > 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            out_features = module.weight.shape[0]
            column_major = module.weight.stride() == (1, out_features)
            assert column_major == (id(module.weight) in wide)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert decode_layout(model) == 0  # idempotent
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, rtol=1e-5, atol=1e-5)
        assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False), expected)


def test_save_round_trip_keeps_the_layout(tmp_path):
    model = tiny_model("llama")
    decode_layout(model)
    model.save_pretrained(tmp_path)
    assert not all(p.is_contiguous() for p in model.parameters())  # restored after the save
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    assert standard_layout(model) > 0 and all(p.is_contiguous() for p in model.parameters())
