"""Hyper-connections (`residual_stream="hyper_connections"`): the module against transformers' DeepSeek-V4 one, and
on a Llama layout (no DeepSeek-V4 attention or experts), a combination no published family has: cached decoding
equals the whole forward, SDPA equals eager, it saves, reloads and trains; post-norm and parallel blocks refused."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import modular_decoder  # noqa: F401
from modular_decoder import ModularDecoderConfig, parameter_count
from modular_decoder.hyper_connections import HyperConnection, HyperHead

LLAMA = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
HYPER = dict(residual_stream="hyper_connections", hc_mult=4, hc_sinkhorn_iters=7)
IDS = torch.tensor([[5, 17, 3, 42, 8, 61, 23, 11, 2, 90, 33, 7], [9, 1, 64, 12, 40, 5, 77, 18, 26, 3, 50, 14]])


def perturbed(model):
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return model.eval()


@pytest.mark.parametrize("gradients", [True, False], ids=["training", "inference"])
def test_hyper_connection_equals_transformers_deepseek_v4(gradients):
    """The mix around one sublayer and the final collapse compute what transformers' modules compute, with gradients
    and without (where Sinkhorn normalises in one buffer with `eps` as an extra row and column)."""
    transformers_v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    from transformers import DeepseekV4Config

    reference = DeepseekV4Config(hidden_size=32, hc_mult=4, hc_sinkhorn_iters=7, rms_norm_eps=1e-6, num_hidden_layers=1)
    config = ModularDecoderConfig(**{**LLAMA, **HYPER}, norm_eps=1e-6)
    torch.manual_seed(0)
    theirs, ours = transformers_v4.DeepseekV4HyperConnection(reference), HyperConnection(config)
    their_head, our_head = transformers_v4.DeepseekV4HyperHead(reference), HyperHead(config)
    with torch.no_grad():
        for module in (theirs, their_head):
            for param in module.parameters():
                param.normal_(0.0, 0.5)
    ours.load_state_dict(theirs.state_dict())
    our_head.load_state_dict({name.removeprefix("hc_"): t for name, t in their_head.state_dict().items()})
    streams, branch = torch.randn(2, 5, 4, 32), torch.nn.Linear(32, 32)
    post, comb, collapsed = theirs(streams)
    expected = post.unsqueeze(-1) * branch(collapsed).unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), streams)
    with torch.set_grad_enabled(gradients):
        mixed = ours(streams, branch)
    assert mixed.requires_grad == gradients
    torch.testing.assert_close(mixed, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(our_head(streams, leaving=True), their_head(streams), atol=0, rtol=0)
    torch.testing.assert_close(comb.sum(-2), torch.ones(2, 5, 4), atol=1e-5, rtol=0)  # Sinkhorn ends on columns
    assert torch.equal(our_head(streams[:, :, 0]), streams[:, :, :1].expand(-1, -1, 4, -1))


@pytest.mark.parametrize("placement", ["pre", "sandwich", "output"])
def test_llama_layout_with_hyper_connections(placement, tmp_path):
    config = ModularDecoderConfig(**LLAMA, **HYPER, norm_position=placement)
    torch.manual_seed(0)
    model = perturbed(AutoModelForCausalLM.from_config(config))
    assert model.num_parameters() == parameter_count(config)["total"]
    with torch.no_grad():
        whole = model(IDS).logits
        model.config._attn_implementation = "sdpa"
        torch.testing.assert_close(model(IDS).logits, whole, atol=1e-5, rtol=0)
        steps, cache = [], None
        for start, stop in ((0, 5), (5, 6), (6, 9), (9, 12)):
            out = model(IDS[:, start:stop], cache=cache, use_cache=True)
            cache = out.past_key_values if hasattr(out, "past_key_values") else out.cache
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, atol=1e-5, rtol=0)
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(IDS).logits, whole, atol=1e-5, rtol=0)


def test_hyper_connections_train_in_fp32_under_bf16_and_with_checkpointing():
    """The coefficients' parameters stay fp32 in a bf16 model (as transformers keeps them) and receive gradients,
    with gradient checkpointing on; a few steps lower the loss."""
    config = ModularDecoderConfig(**LLAMA, **HYPER)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.gradient_checkpointing_enable()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss = model(IDS, labels=IDS).loss
        loss.backward()
        assert model.model.layers[0].attn_hc.fn.grad is not None and model.model.residual_stream.fn.grad.abs().sum() > 0
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    half = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    assert half.model.layers[0].ffn_hc.fn.dtype == torch.float32 and half.model.residual_stream.base.dtype == torch.float32


@pytest.mark.parametrize("fields", [dict(norm_position="post"), dict(parallel_block=True), dict(residual_multiplier=0.5),
                                    dict(num_mtp_layers=1)])
def test_refused_where_the_streams_cannot_mix_around_a_branch(fields):
    with pytest.raises(ValueError, match="hyper_connections"):
        ModularDecoderConfig(**LLAMA, **HYPER, **fields)
    with pytest.raises(ValueError, match="hc_mult"):
        ModularDecoderConfig(**LLAMA, hc_mult=4)
