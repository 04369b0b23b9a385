"""Each router kind trains with its own paper's balancing: softmax routers with Switch's load-balancing loss
(beside transformers' Mixtral in test_moe_block.py), sigmoid routers with DeepSeek-V3's complementary
sequence-wise balance loss (arXiv 2412.19437 §2.1.2) and, opt-in, its auxiliary-loss-free bias update. The
formulas are written out here independently, on cases small enough to check by hand."""

from __future__ import annotations

import math

import pytest
import torch
from decoding import prompt

from modular_decoder import ModularDecoderConfig, ModularDecoderForCausalLM, preset_config
from modular_decoder.router_losses import sequence_balance_loss, track_expert_load, update_router_bias

pytestmark = pytest.mark.usefixtures("one_thread")


def _logit(p: float) -> float:
    return math.log(p / (1 - p))


def test_sequence_balance_loss_by_hand():
    """One sequence of two tokens, 4 experts, K=1. Affinities (0.8, 0.2, 0.2, 0.2) and (0.2, 0.8, 0.2, 0.2):
    f = 4/(1·2)·(1, 1, 0, 0) = (2, 2, 0, 0); s' = s/1.4, P = (1/2.8, 1/2.8, 0.4/2.8, 0.4/2.8); Σ f·P = 4/2.8 = 10/7."""
    a, b = _logit(0.8), _logit(0.2)
    logits = torch.tensor([[a, b, b, b], [b, a, b, b]])
    torch.testing.assert_close(sequence_balance_loss((logits,), 4, 1, batch_size=1), torch.tensor(10 / 7))
    # uniform affinities: P_i = 1/E and Σ_i f_i = N_r whatever the ties, so the loss is exactly 1
    torch.testing.assert_close(sequence_balance_loss((torch.zeros(6, 4),), 4, 2, batch_size=2), torch.tensor(1.0))


def _reference(router_logits, num_experts, top_k, mask):
    """Eq. 17-20 token by token in float64: per sequence of real tokens, per layer; mean over sequences, sum
    over layers."""
    batch, seq = mask.shape
    total = 0.0
    for logits in router_logits:
        scores = logits.double().sigmoid().view(batch, seq, num_experts)
        per_sequence = []
        for b in range(batch):
            tokens = [t for t in range(seq) if mask[b, t]]
            if not tokens:
                continue
            f = [0.0] * num_experts
            p = [0.0] * num_experts
            for t in range(seq):
                if not mask[b, t]:
                    continue
                s = scores[b, t]
                for i in s.topk(top_k).indices.tolist():
                    f[i] += num_experts / (top_k * len(tokens))
                for i in range(num_experts):
                    p[i] += float(s[i] / s.sum()) / len(tokens)
            per_sequence.append(sum(fi * pi for fi, pi in zip(f, p)))
        total += sum(per_sequence) / len(per_sequence)
    return torch.tensor(total, dtype=torch.float64)


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_sequence_balance_loss_matches_the_formula_with_padding(top_k):
    generator = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(3 * 5, 8, generator=generator) * (1 + i) for i in range(2))  # 2 layers, B=3, T=5
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1], [0, 0, 0, 0, 0]])  # the last row is all padding
    got = sequence_balance_loss(logits, 8, top_k, batch_size=3, attention_mask=mask)
    torch.testing.assert_close(got.double(), _reference(logits, 8, top_k, mask), rtol=1e-6, atol=0)


def _sigmoid_model(**overrides) -> ModularDecoderForCausalLM:
    config = preset_config("deepseek_v3", tiny=True, **overrides)
    torch.manual_seed(0)
    return ModularDecoderForCausalLM(config)


def test_sigmoid_model_trains_with_the_sequence_wise_loss():
    """Defaults: DeepSeek-V3's α for sigmoid routers, transformers' Mixtral 0.001 for softmax ones; the model's
    `aux_loss` is the formula over its own router logits, and `loss` adds α times it (no z-loss: a softmax term)."""
    assert ModularDecoderConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, mlp_type="moe",
                                num_experts=4, num_experts_per_tok=2, router_type="sigmoid_topk"
                                ).router_aux_loss_coef == 0.0001
    assert ModularDecoderConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, mlp_type="moe",
                                num_experts=4, num_experts_per_tok=2).router_aux_loss_coef == 0.001
    model = _sigmoid_model(router_aux_loss_coef=0.01)
    ids = prompt(2, 7, vocab=model.config.vocab_size)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    with torch.no_grad():
        plain = model(ids, attention_mask=mask, labels=ids)
        out = model(ids, attention_mask=mask, labels=ids, output_router_logits=True)
    config = model.config
    expected = _reference(out.router_logits, config.num_experts, config.num_experts_per_tok, mask)
    torch.testing.assert_close(out.aux_loss.double(), expected, rtol=1e-6, atol=0)
    assert out.z_loss is None
    torch.testing.assert_close(out.loss, plain.loss + 0.01 * out.aux_loss)
    with pytest.raises(ValueError, match="`router_z_loss_coef`"):
        preset_config("deepseek_v3", tiny=True, router_z_loss_coef=0.001)


@pytest.mark.parametrize("hashed", [1, 3])
def test_layers_routed_by_token_id_record_no_router_logits(hashed):
    """On a Llama-like layout with experts in all 3 layers, the first `num_hash_layers` pick their experts from the
    token-id table: their logits are not in `router_logits` (as transformers' DeepSeek-V4), the balance loss is
    the formula over the learned routers' logits alone, and with every layer hashed there is no balance loss."""
    config = ModularDecoderConfig(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                                  mlp_type="moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                  router_type="sigmoid_topk", num_hash_layers=hashed, router_aux_loss_coef=0.01)
    torch.manual_seed(0)
    model = ModularDecoderForCausalLM(config).eval()
    ids = prompt(2, 7, vocab=config.vocab_size)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    gates = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda module, args, out: gates.append(out[0]))
             for layer in model.model.layers]
    with torch.no_grad():
        plain = model(ids, attention_mask=mask, labels=ids)
        out = model(ids, attention_mask=mask, labels=ids, output_router_logits=True)
    for hook in hooks:
        hook.remove()
    learned = gates[3 + hashed:]  # (the first 3 calls were the plain forward's)
    assert len(out.router_logits) == len(learned) == 3 - hashed
    for got, gate in zip(out.router_logits, learned):
        torch.testing.assert_close(got, gate, rtol=0, atol=0)
    if learned:
        expected = _reference(learned, config.num_experts, config.num_experts_per_tok, mask)
        torch.testing.assert_close(out.aux_loss.double(), expected, rtol=1e-6, atol=0)
        torch.testing.assert_close(out.loss, plain.loss + 0.01 * out.aux_loss)
    else:
        assert out.aux_loss is None
        torch.testing.assert_close(out.loss, plain.loss)


def test_dense_config_refuses_a_router_setting_and_old_files_still_load(tmp_path):
    """A router setting given to a dense config is refused (not rewritten to 0.0); the value every config.json
    held before the default became per kind is dropped only when a saved file is read."""
    dense = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, mlp_type="gated")
    with pytest.raises(ValueError, match="`router_aux_loss_coef`=0.001 only applies to `mlp_type='moe'`"):
        ModularDecoderConfig(**dense, router_aux_loss_coef=0.001)
    assert ModularDecoderConfig.from_dict({**dense, "router_aux_loss_coef": 0.001}).router_aux_loss_coef == 0.0


def _imbalance(load: torch.Tensor) -> float:
    return float(load.max() / load.mean())


def test_bias_update_moves_load_toward_balance():
    """Routers skewed toward two experts; a few training steps (forward in training mode, then the update) with
    γ = 0.05: each update moves an overloaded expert's bias down by γ and an underloaded one's up by γ, and the
    load of the last step is closer to even than the first's."""
    model = _sigmoid_model(n_group=1, topk_group=1)
    routers = [m for m in model.modules() if getattr(m, "e_score_correction_bias", None) is not None]
    with torch.no_grad():
        for router in routers:
            router.weight[:2] += 0.5 * router.weight[:2].sign()  # experts 0, 1 score high on many tokens
            router.weight[:2] *= 4
    assert track_expert_load(model) == len(routers)
    model.train()
    ids = prompt(4, 16, vocab=model.config.vocab_size)
    loads = []
    for step in range(40):
        with torch.no_grad():
            model(ids)
        load = routers[0].expert_load.clone()
        loads.append(load)
        before = routers[0].e_score_correction_bias.clone()
        assert update_router_bias(model, 0.05) == len(routers)
        moved = routers[0].e_score_correction_bias - before
        torch.testing.assert_close(moved, 0.05 * torch.sign(load.mean() - load))
        assert routers[0].expert_load.sum() == 0  # counts cleared for the next step
    assert _imbalance(loads[-1]) < 0.75 * _imbalance(loads[0]), (loads[0], loads[-1])


def test_bias_update_needs_tracking_and_leaves_eval_forwards_alone():
    model = _sigmoid_model()
    with pytest.raises(ValueError, match="track_expert_load"):
        update_router_bias(model, 0.001)
    track_expert_load(model)
    with torch.no_grad():
        model.eval()(prompt(1, 5, vocab=model.config.vocab_size))  # inference counts nothing
    router = next(m for m in model.modules() if getattr(m, "e_score_correction_bias", None) is not None)
    assert router.expert_load.sum() == 0
    assert "expert_load" not in "".join(model.state_dict())


def test_trainer_callback_updates_the_bias_each_step(tmp_path):
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    from modular_decoder.tools.training import RouterBiasCallback

    model = _sigmoid_model()
    ids = prompt(8, 8, vocab=model.config.vocab_size)
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    args = TrainingArguments(tmp_path, max_steps=3, per_device_train_batch_size=4, learning_rate=0.0,
                             report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[RouterBiasCallback(step_size=0.01)])
    trainer.train()
    router = next(m for m in model.modules() if getattr(m, "e_score_correction_bias", None) is not None)
    bias = router.e_score_correction_bias
    # three updates of ±0.01 (or 0 for an expert exactly at the mean): on the grid, and moved
    assert torch.allclose(bias / 0.01, (bias / 0.01).round(), atol=1e-4) and bias.abs().max() > 0
    assert bias.abs().max() <= 0.03 + 1e-6


def test_sigmoid_router_is_built_in_fp32_under_a_half_default_dtype():
    """`_keep_in_fp32_modules_strict` names the sigmoid router: built under a bf16 default dtype (`from_config`,
    transformers' `test_keep_in_fp32_modules_strict_also_hardcode_fp32`) it is fp32 too, the rest bf16."""
    config = preset_config("deepseek_v3", tiny=True)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = ModularDecoderForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    router = next(m for m in model.modules() if getattr(m, "e_score_correction_bias", None) is not None)
    assert router.weight.dtype == router.e_score_correction_bias.dtype == torch.float32
    assert model.lm_head.weight.dtype == torch.bfloat16
