"""The mixture-of-experts block against transformers' own MoE blocks, with the same weights.

Each family's block is built tiny, every weight (and DeepSeek-V3's score-correction bias) drawn at
random, copied into `SparseMoeBlock` under our names, and both run on the same input: outputs,
router logits and routing weights must agree. The router losses are checked against transformers'
`load_balancing_loss_func` and against the ST-MoE formula; a dispatch-level trace shows that each
expert runs once on its tokens and that a decode step touches only the chosen experts.
"""

from __future__ import annotations

import math
import types

import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
from transformers.models.granitemoe.modeling_granitemoe import GraniteMoeMoE
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock, load_balancing_loss_func
from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from modular_decoder.configuration_modular_decoder import ModularDecoderConfig
from modular_decoder.moe import MIXTURE_OF_EXPERTS, SparseMoeBlock
from modular_decoder.router_losses import load_balancing_loss, router_z_loss
from modular_decoder.routers import router_losses

pytestmark = pytest.mark.usefixtures("one_thread")

D = 16  # hidden size of every tiny block
IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")  # ours, then transformers' kernels on our module

# family: (transformers config class, block class, their fields, our MoE fields, their name -> ours)
FAMILIES = {
    "mixtral": (
        transformers.MixtralConfig, MixtralSparseMoeBlock,
        dict(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2),
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True),
        {},
    ),
    "qwen2_moe": (
        transformers.Qwen2MoeConfig, Qwen2MoeSparseMoeBlock,
        dict(moe_intermediate_size=12, shared_expert_intermediate_size=20, num_experts=6, num_experts_per_tok=2,
             norm_topk_prob=False),
        dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=12, n_shared_experts=1,
             shared_expert_intermediate_size=20, shared_expert_gate=True, norm_topk_prob=False),
        {"shared_expert.": "shared_experts."},
    ),
    "qwen3_moe": (
        transformers.Qwen3MoeConfig, Qwen3MoeSparseMoeBlock,
        dict(moe_intermediate_size=12, num_experts=8, num_experts_per_tok=3, norm_topk_prob=True),
        dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=12, norm_topk_prob=True),
        {},
    ),
    "olmoe": (
        transformers.OlmoeConfig, OlmoeSparseMoeBlock,
        dict(intermediate_size=12, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False),
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=12, norm_topk_prob=False),
        {},
    ),
    "granitemoe": (  # softmax over the k best logits == renormalised top-k of the softmax
        transformers.GraniteMoeConfig, GraniteMoeMoE,
        dict(intermediate_size=12, num_local_experts=6, num_experts_per_tok=2),
        dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=12, norm_topk_prob=True),
        {"router.": "gate."},
    ),
    "deepseek_v2": (
        transformers.DeepseekV2Config, DeepseekV2Moe,
        dict(moe_intermediate_size=12, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2,
             topk_method="greedy", routed_scaling_factor=1.5),
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=12, n_shared_experts=2,
             norm_topk_prob=False, routed_scaling_factor=1.5),
        {},
    ),
    "deepseek_v2_grouped": (
        transformers.DeepseekV2Config, DeepseekV2Moe,
        dict(moe_intermediate_size=12, n_routed_experts=16, num_experts_per_tok=3, n_shared_experts=1,
             topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=16.0),
        dict(num_experts=16, num_experts_per_tok=3, moe_intermediate_size=12, n_shared_experts=1,
             norm_topk_prob=False, n_group=4, topk_group=2, routed_scaling_factor=16.0),
        {},
    ),
    "deepseek_v3": (
        transformers.DeepseekV3Config, DeepseekV3MoE,
        dict(moe_intermediate_size=12, n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1,
             n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True),
        dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=12, n_shared_experts=1,
             router_type="sigmoid_topk", n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True),
        {},
    ),
    # biased router, softmax over the kept logits; experts with biases and the clamped SwiGLU (a limit low
    # enough to clamp these weights' activations, and another gain than gpt-oss's), stored interleaved and transposed
    "gpt_oss": (
        transformers.GptOssConfig, GptOssMLP,
        dict(intermediate_size=12, num_local_experts=6, num_experts_per_tok=2, swiglu_limit=0.4, swiglu_alpha=1.3),
        dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=12, router_type="topk_softmax",
             router_bias=True, mlp_bias=True, swiglu_limit=0.4, swiglu_alpha=1.3),
        lambda state: gpt_oss_experts_to_ours(state),
    ),
    "deepseek_v3_unnormalised": (
        transformers.DeepseekV3Config, DeepseekV3MoE,
        dict(moe_intermediate_size=12, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2,
             n_group=2, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False),
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=12, n_shared_experts=2,
             router_type="sigmoid_topk", n_group=2, topk_group=1, norm_topk_prob=False),
        {},
    ),
}


def gpt_oss_experts_to_ours(state: dict) -> dict:
    """gpt-oss's block state in our names and layout: the router is `gate`; gate/up columns interleaved
    (gate 2i, up 2i + 1) in (E, d, 2f) become [gate; up] rows in (E, 2f, d), down (E, f, d) becomes (E, d, f)."""
    def halves(x):  # interleaved gate / up along the last axis -> [gate; up]
        return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)

    out = {name.replace("router.", "gate."): tensor for name, tensor in state.items()}
    out["experts.gate_up_proj"] = halves(out["experts.gate_up_proj"]).transpose(1, 2).contiguous()
    out["experts.gate_up_proj_bias"] = halves(out["experts.gate_up_proj_bias"])
    out["experts.down_proj"] = out["experts.down_proj"].transpose(1, 2).contiguous()
    return out


def our_config(implementation: str = "eager", **moe_fields) -> ModularDecoderConfig:
    """A tiny `mlp_type="moe"` model config with the family's MoE fields."""
    config = ModularDecoderConfig(hidden_size=D, intermediate_size=40, num_hidden_layers=2, num_attention_heads=2,
                                  vocab_size=32, mlp_type="moe", **moe_fields)
    config._experts_implementation = implementation
    return config


def perturb(module: torch.nn.Module) -> None:
    """Draw every parameter and buffer at random: no zero router, no identity, no zero bias."""
    with torch.no_grad():
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            scale = 0.1 if "correction_bias" in name else 0.5 if "gate" in name and tensor.shape[-1] == D else 0.3
            tensor.normal_(0.0, scale)


def family_pair(family: str, implementation: str = "eager") -> tuple[torch.nn.Module, SparseMoeBlock]:
    """transformers' block with random weights, and ours holding the same weights."""
    config_cls, block_cls, theirs_fields, our_fields, renames = FAMILIES[family]
    their_config = config_cls(hidden_size=D, num_attention_heads=2, num_key_value_heads=2, **theirs_fields)
    their_config._experts_implementation = "eager"
    theirs = block_cls(their_config)
    perturb(theirs)
    ours = SparseMoeBlock(our_config(implementation, **our_fields))
    state = {}
    for name, tensor in theirs.state_dict().items():
        for old, new in ({} if callable(renames) else renames).items():
            name = name.replace(old, new)
        state[name] = tensor
    if callable(renames):  # a layout of its own
        state = renames(state)
    ours.load_state_dict(state, strict=True)
    return theirs, ours


def their_router(block: torch.nn.Module) -> torch.nn.Module:
    return block.router if hasattr(block, "router") else block.gate


def dense_weights(weights: torch.Tensor, indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(N, k) routing weights as an (N, E) matrix, so the order of the k slots does not matter."""
    return torch.zeros(weights.shape[0], num_experts, dtype=torch.float32).scatter(1, indices, weights.float())


# --------------------------------------------------------------------------------------------- parity


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_block_matches_transformers(family, implementation):
    theirs, ours = family_pair(family, implementation)
    for shape in [(3, 7, D), (1, 1, D)]:  # a padded-batch-sized prefill, and one decode token
        x = torch.randn(*shape)
        with torch.no_grad():
            expected = theirs(x)
            expected = expected[0] if isinstance(expected, tuple) else expected
            torch.testing.assert_close(ours(x), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_router_matches_transformers(family):
    theirs, ours = family_pair(family)
    x = torch.randn(21, D)
    with torch.no_grad():
        their_logits, their_weights, their_indices = their_router(theirs)(x)
        logits, weights, indices = ours.gate(x)
    num_experts = ours.experts.num_experts
    torch.testing.assert_close(logits, their_logits, atol=0, rtol=0)
    torch.testing.assert_close(
        dense_weights(weights, indices, num_experts), dense_weights(their_weights, their_indices, num_experts),
        atol=1e-6, rtol=1e-6,
    )


def test_correction_bias_moves_the_choice_not_the_weights():
    """DeepSeek-V3: the bias picks experts; the weights stay the unbiased sigmoid scores."""
    _, ours = family_pair("deepseek_v3")
    x = torch.randn(64, D)
    with torch.no_grad():
        logits, weights, indices = ours.gate(x)
        bias = ours.gate.e_score_correction_bias.clone()
        ours.gate.e_score_correction_bias.zero_()
        _, _, unbiased_indices = ours.gate(x)
        ours.gate.e_score_correction_bias.copy_(bias)
    assert not torch.equal(indices.sort(-1).values, unbiased_indices.sort(-1).values)
    scores = logits.sigmoid().gather(1, indices)
    torch.testing.assert_close(weights, 2.5 * scores / scores.sum(-1, keepdim=True))


def test_group_limited_routing_stays_in_the_best_groups():
    _, ours = family_pair("deepseek_v3")  # 16 experts in 4 groups, top-2 groups, k = 4
    with torch.no_grad():
        _, _, indices = ours.gate(torch.randn(200, D))
    groups_per_token = [len(set((row // 4).tolist())) for row in indices]
    assert max(groups_per_token) <= 2 and min(groups_per_token) >= 1


# --------------------------------------------------------------------------------------------- losses


def _router_logits(layers: int = 3, batch: int = 2, seq: int = 5):
    """One (batch·seq, 6) logits tensor per layer, from the 6-expert Qwen2-MoE router."""
    _, ours = family_pair("qwen2_moe")
    with torch.no_grad():
        return tuple(ours.gate(torch.randn(batch * seq, D) * (1 + i))[0] for i in range(layers))


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("module", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "gpt_oss"])
def test_load_balancing_loss_matches_transformers(module, padded):
    reference = getattr(transformers.models, module).__dict__[f"modeling_{module}"].load_balancing_loss_func
    logits = _router_logits()
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]]) if padded else None
    for top_k in (1, 2, 4):
        expected = reference(logits, 6, top_k, mask)
        torch.testing.assert_close(load_balancing_loss(logits, 6, top_k, mask), expected, atol=1e-6, rtol=1e-6)


def test_load_balancing_loss_with_cache_uses_the_newest_mask_columns():
    logits = _router_logits()
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    past = torch.ones(2, 4, dtype=mask.dtype)  # a mask that also covers 4 cached tokens
    assert load_balancing_loss(logits, 6, 2, torch.cat([past, mask], dim=1)) == load_balancing_loss(logits, 6, 2, mask)


def test_balanced_router_has_loss_one():
    """Uniform probabilities and an even split give E·Σ (k/E)·(1/E) = k: the loss's floor for k slots."""
    logits = (torch.zeros(8, 4),)
    assert math.isclose(float(load_balancing_loss(logits, 4, 1)), 1.0, rel_tol=1e-6)


@pytest.mark.parametrize("padded", [False, True])
def test_router_z_loss_is_the_st_moe_formula(padded):
    logits = _router_logits()
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]]) if padded else torch.ones(2, 5, dtype=torch.long)
    keep = mask.reshape(-1).bool()
    # (1/B) Σ_tokens (log Σ_j exp x_j)², in float64, over the real tokens of every layer
    rows = torch.cat([layer.double()[keep] for layer in logits])
    expected = (rows.exp().sum(-1).log() ** 2).mean()
    torch.testing.assert_close(router_z_loss(logits, mask if padded else None).double(), expected, rtol=1e-6, atol=0)


def test_router_losses_weights_both_terms():
    """`router_losses` of a softmax router: transformers' Mixtral balance loss, ST-MoE's z-loss written out,
    each weighted by its coefficient."""
    logits = _router_logits()
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    config = our_config(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=12, router_aux_loss_coef=0.02,
                        router_z_loss_coef=0.001)
    total, aux, z = router_losses(logits, config, mask)
    torch.testing.assert_close(aux, load_balancing_loss_func(logits, 6, 2, mask), atol=1e-6, rtol=1e-6)
    rows = torch.cat([layer.double()[mask.reshape(-1).bool()] for layer in logits])
    torch.testing.assert_close(z.double(), (rows.exp().sum(-1).log() ** 2).mean(), rtol=1e-6, atol=0)
    torch.testing.assert_close(total, 0.02 * aux + 0.001 * z)


def _deepseek_v2_expert_balance_loss(logits, n_group: int, topk_group: int, top_k: int, real) -> float:
    """DeepSeek-V2's expert-level balance loss (arXiv 2405.04434 §2.2.3, eq. 12-14) without α, over the real
    tokens of all layers, in plain Python: s_{i,t} the softmax affinities; token t selects the top-K'_r experts
    among those of the `topk_group` devices (groups) whose best affinity is highest (§2.2.2, device-limited
    routing); f_i = N'_r / (K'_r·T) · #{t selects i}; P_i = 1/T · Σ_t s_{i,t}; loss Σ_i f_i·P_i."""
    rows = [row for layer in logits for row, keep in zip(layer.double().softmax(-1).tolist(), real) if keep]
    experts, tokens = len(rows[0]), len(rows)
    size = experts // n_group
    selects, affinity = [0] * experts, [0.0] * experts
    for s in rows:
        best = sorted(range(n_group), key=lambda g: -max(s[g * size:(g + 1) * size]))[:topk_group]
        eligible = [i for g in best for i in range(g * size, (g + 1) * size)]
        for i in sorted(eligible, key=lambda i: -s[i])[:top_k]:
            selects[i] += 1
        for i in range(experts):
            affinity[i] += s[i]
    return sum(experts / (top_k * tokens) * selects[i] * affinity[i] / tokens for i in range(experts))


@pytest.mark.parametrize("padded", [False, True])
def test_group_limited_balance_loss_counts_the_chosen_experts(padded):
    """DeepSeek-V2's `group_limited_greedy`: the balance loss counts the experts the router chose within its
    best groups, not the plain top-k of the softmax. Switch's normalisation (f_i summing to k, Mixtral's) is
    K'_r times DeepSeek-V2's (f_i summing to N'_r)."""
    config = our_config(num_experts=16, num_experts_per_tok=3, moe_intermediate_size=12, n_group=4, topk_group=2,
                        norm_topk_prob=False, routed_scaling_factor=16.0)
    logits = tuple(torch.randn(10, 16) * 2 for _ in range(2))  # 2 layers, batch 2 x 5 tokens
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]]) if padded else torch.ones(2, 5, dtype=torch.long)
    plain_top_k = torch.cat(logits).topk(3, dim=-1).indices
    assert any(len(set((row // 4).tolist())) == 3 for row in plain_top_k)  # the premise: some leave the best groups
    _, aux, _ = router_losses(logits, config, mask if padded else None)
    expected = 3 * _deepseek_v2_expert_balance_loss(logits, 4, 2, 3, mask.reshape(-1).tolist())
    torch.testing.assert_close(aux.double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-6, atol=0)


# --------------------------------------------------------------------------------------------- sparsity


class ExpertSlices(TorchDispatchMode):
    """Records, for each matrix product, which expert slice of the watched 3-D parameters it read."""

    PRODUCTS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "_grouped_mm", "index"}

    def __init__(self, **params: torch.Tensor):
        super().__init__()
        self.params = params
        self.reads: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.PRODUCTS:
            for arg in args:
                if not isinstance(arg, torch.Tensor):
                    continue
                for name, param in self.params.items():
                    if arg.untyped_storage().data_ptr() == param.untyped_storage().data_ptr():
                        self.reads.append((name, arg.storage_offset() // param.stride(0)))
        return func(*args, **(kwargs or {}))


def _traced(ours: SparseMoeBlock, x: torch.Tensor):
    experts = ours.experts
    with torch.no_grad():
        _, _, indices = ours.gate(x.reshape(-1, D))
        with ExpertSlices(gate_up_proj=experts.gate_up_proj, down_proj=experts.down_proj) as trace:
            ours(x)
    return indices, trace.reads


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3"])
def test_decode_step_reads_only_the_chosen_experts(family):
    _, ours = family_pair(family)
    indices, reads = _traced(ours, torch.randn(1, 1, D))
    chosen = sorted(indices.reshape(-1).tolist())
    assert len(chosen) < ours.experts.num_experts
    assert sorted(e for name, e in reads if name == "gate_up_proj") == chosen
    assert sorted(e for name, e in reads if name == "down_proj") == chosen


def test_prefill_runs_each_used_expert_once():
    _, ours = family_pair("qwen3_moe")
    indices, reads = _traced(ours, torch.randn(2, 9, D))
    used = sorted(set(indices.reshape(-1).tolist()))
    assert sorted(e for name, e in reads if name == "gate_up_proj") == used  # one product per expert, not per token
    assert sorted(e for name, e in reads if name == "down_proj") == used


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_unchosen_experts_are_never_computed(implementation):
    """Poison every expert the decode token does not choose with NaN: a dense product would spread it."""
    _, ours = family_pair("qwen3_moe", implementation)
    x = torch.randn(1, 1, D)
    with torch.no_grad():
        clean = ours(x)
        _, _, indices = ours.gate(x.reshape(-1, D))
        unchosen = [e for e in range(ours.experts.num_experts) if e not in indices.tolist()[0]]
        ours.experts.gate_up_proj[unchosen] = float("nan")
        ours.experts.down_proj[unchosen] = float("nan")
        torch.testing.assert_close(ours(x), clean, atol=1e-6, rtol=1e-6)


def test_out_of_range_expert_ids_are_skipped():
    """transformers' expert-parallel code hands ids >= the local expert count for other ranks' experts."""
    _, ours = family_pair("mixtral")
    x = torch.randn(5, D)
    indices = torch.tensor([[0, 4], [1, 2], [4, 3], [-1, 0], [2, 1]])
    weights = torch.rand(5, 2)
    valid = (indices >= 0) & (indices < 4)
    with torch.no_grad():
        expected = ours.experts(x, indices.clamp(0, 3), weights * valid)
        torch.testing.assert_close(ours.experts(x, indices, weights), expected)


# --------------------------------------------------------------------------------------------- training


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_gradients_reach_router_experts_and_shared_experts(implementation):
    _, ours = family_pair("qwen2_moe", implementation)
    x = torch.randn(2, 3, D)
    logits, _, indices = ours.gate(x.reshape(-1, D))
    loss = ours(x).square().mean() + load_balancing_loss((logits,), 6, 2) + router_z_loss((logits,))
    loss.backward()
    assert ours.gate.weight.grad.abs().sum() > 0
    assert ours.shared_expert_gate.weight.grad.abs().sum() > 0
    assert all(p.grad.abs().sum() > 0 for p in ours.shared_experts.parameters())
    used = set(indices.reshape(-1).tolist())
    per_expert = ours.experts.gate_up_proj.grad.abs().sum(dim=(1, 2))
    assert all((per_expert[e] > 0) == (e in used) for e in range(6))
    assert ours.experts.down_proj.grad.abs().sum() > 0


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_gpt_oss_gradients_equal_transformers(implementation):
    """gpt-oss's block trained: the gradients of its router (weight and bias) and experts (weights and biases) on
    every experts implementation equal those of transformers' block on the same weights, in its layout."""
    theirs, ours = family_pair("gpt_oss", implementation)
    x = torch.randn(2, 5, D)
    theirs(x)[0].square().mean().backward()
    ours(x).square().mean().backward()
    grads = gpt_oss_experts_to_ours({name: p.grad for name, p in theirs.named_parameters()})
    for name, param in ours.named_parameters():
        assert param.grad.abs().sum() > 0, name
        torch.testing.assert_close(param.grad, grads[name], atol=1e-6, rtol=1e-5)


def test_routing_weights_get_gradient_through_the_experts():
    """The block's output depends on the router through the kept weights (no straight-through trick needed)."""
    _, ours = family_pair("mixtral")
    x = torch.randn(4, D)
    ours(x.unsqueeze(0)).sum().backward()
    assert ours.gate.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss"])
def test_lora_on_router_and_experts_trains_and_merges(family):
    import peft
    _, ours = family_pair(family)
    model = torch.nn.Sequential(ours)
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=[], init_lora_weights=False,
                             target_parameters=["0.gate.weight", "0.experts.gate_up_proj", "0.experts.down_proj"])
    lora = peft.get_peft_model(model, config)
    x = torch.randn(1, 6, D)
    trainable = [p for p in lora.parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n, p in lora.named_parameters() if p.requires_grad)
    lora(x).square().mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in trainable)
    with torch.no_grad():
        adapted = lora(x)
        merged = lora.merge_and_unload()
        torch.testing.assert_close(merged(x), adapted, atol=1e-5, rtol=1e-5)
    block = merged[0]
    assert isinstance(block, SparseMoeBlock) and block.experts.gate_up_proj.is_contiguous()


# --------------------------------------------------------------------------------------------- config

MOE_BASE = dict(hidden_size=D, intermediate_size=40, num_hidden_layers=4, num_attention_heads=2, vocab_size=32,
                mlp_type="moe", num_experts=8, num_experts_per_tok=2)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_fields_are_valid(family):
    ModularDecoderConfig(**{**MOE_BASE, **FAMILIES[family][3]})


@pytest.mark.parametrize(
    "fields, named",
    [
        (dict(mlp_layer_types=["sparse"] * 3), "mlp_layer_types"),
        (dict(mlp_layer_types=["sparse", "moe", "sparse", "sparse"]), "mlp_layer_types"),
        (dict(mlp_layer_types=["dense"] * 4), "mlp_layer_types"),
        (dict(mlp_layer_types="sparse"), "mlp_layer_types"),
        (dict(mlp_type="gated", mlp_layer_types=["dense", "sparse", "sparse", "sparse"]), "mlp_layer_types"),
        (dict(num_experts=None), "num_experts"),
        (dict(num_experts_per_tok=None), "num_experts_per_tok"),
        (dict(num_experts=0), "num_experts"),
        (dict(num_experts=2.0), "num_experts"),
        (dict(num_experts_per_tok=0), "num_experts_per_tok"),
        (dict(num_experts=4, num_experts_per_tok=5), "num_experts_per_tok"),
        (dict(moe_intermediate_size=0), "moe_intermediate_size"),
        (dict(n_shared_experts=-1), "n_shared_experts"),
        (dict(shared_expert_intermediate_size=64), "shared_expert_intermediate_size"),
        (dict(shared_expert_gate=True), "shared_expert_gate"),
        (dict(n_shared_experts=1, shared_expert_gate="yes"), "shared_expert_gate"),
        (dict(router_type="softmax"), "router_type"),
        (dict(norm_topk_prob=1), "norm_topk_prob"),
        (dict(n_group=0), "n_group"),
        (dict(num_experts=8, n_group=3), "n_group"),
        (dict(num_experts=8, n_group=4, topk_group=5), "topk_group"),
        (dict(num_experts=8, n_group=4, topk_group=1, num_experts_per_tok=3), "num_experts_per_tok"),
        (dict(num_experts=8, n_group=8, topk_group=4, router_type="sigmoid_topk", num_experts_per_tok=1),
         "router_type"),
        (dict(routed_scaling_factor=0.0), "routed_scaling_factor"),
        (dict(router_aux_loss_coef=-0.1), "router_aux_loss_coef"),
        (dict(router_z_loss_coef="1e-3"), "router_z_loss_coef"),
        (dict(output_router_logits=None), "output_router_logits"),
        (dict(mlp_bias="yes"), "mlp_bias"),
        (dict(router_bias=1), "router_bias"),
        (dict(swiglu_limit=0.0), "swiglu_limit"),
        (dict(swiglu_limit=float("inf")), "swiglu_limit"),
        (dict(swiglu_limit=7.0, swiglu_alpha=-1.0), "swiglu_alpha"),
        (dict(swiglu_alpha=1.702), "swiglu_alpha"),  # a gain without the clamped SwiGLU it belongs to
        (dict(swiglu_limit=7.0, hidden_act="gelu"), "swiglu_limit"),
        (dict(router_type="topk_softmax", norm_topk_prob=False), "norm_topk_prob"),
        (dict(router_type="topk_softmax", n_group=2), "n_group"),
    ],
)
def test_bad_moe_config_names_the_field(fields, named):
    with pytest.raises(ValueError, match=rf"`{named}\b"):
        ModularDecoderConfig(**{**MOE_BASE, **fields})


@pytest.mark.parametrize("field, value", [("num_experts", 8), ("n_shared_experts", 1), ("router_type", "sigmoid_topk"),
                                          ("mlp_layer_types", ["dense", "sparse"]), ("output_router_logits", True),
                                          ("router_aux_loss_coef", 0.01), ("router_bias", True),
                                          ("swiglu_limit", 7.0), ("swiglu_alpha", 1.702)])
def test_moe_fields_are_refused_under_other_mlp_types(field, value):
    with pytest.raises(ValueError, match=rf"`{field}`.*only applies to `mlp_type='moe'`"):
        ModularDecoderConfig(hidden_size=D, num_hidden_layers=2, num_attention_heads=2, mlp_type="gated",
                             **{field: value})


def test_defaults_are_resolved_into_the_config():
    config = ModularDecoderConfig(**{**MOE_BASE, "n_shared_experts": 2, "moe_intermediate_size": 12})
    assert config.mlp_layer_types == ["sparse"] * 4
    assert config.shared_expert_intermediate_size == 12 and config.topk_group == config.n_group == 1
    assert ModularDecoderConfig(**MOE_BASE).moe_intermediate_size == 40  # Mixtral: experts as wide as the MLP
    assert ModularDecoderConfig(**{**MOE_BASE, "mlp_layer_types": ("dense", "sparse", "sparse", "sparse")}
                                ).mlp_layer_types == ["dense", "sparse", "sparse", "sparse"]


def test_router_loss_coefficient_is_zero_without_experts(tmp_path):
    """transformers' Mixtral default with experts; 0.0 (no router, no loss) under another kind, which is how TRL's
    trainers tell a model without router logits (a non-zero one beside `output_router_logits` enables theirs)."""
    assert ModularDecoderConfig(**MOE_BASE).router_aux_loss_coef == 0.001
    assert ModularDecoderConfig(**{**MOE_BASE, "router_aux_loss_coef": 0.0}).router_aux_loss_coef == 0.0
    dense = ModularDecoderConfig(hidden_size=D, num_hidden_layers=2, num_attention_heads=2, mlp_type="gated")
    assert dense.router_aux_loss_coef == 0.0 and not dense.output_router_logits
    dense.save_pretrained(tmp_path)
    assert ModularDecoderConfig.from_pretrained(tmp_path).router_aux_loss_coef == 0.0


def test_saved_config_passes_transformers_layer_type_validation(tmp_path):
    """transformers checks `mlp_layer_types` against its own allowed values when a config is saved."""
    from transformers.configuration_utils import ALLOWED_MLP_LAYER_TYPES

    config = ModularDecoderConfig(**{**MOE_BASE, "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"]})
    assert set(config.mlp_layer_types) <= set(ALLOWED_MLP_LAYER_TYPES)
    config.save_pretrained(tmp_path)
    assert ModularDecoderConfig.from_pretrained(tmp_path).mlp_layer_types == config.mlp_layer_types


# --------------------------------------------------------------------------------------------- arithmetic

# Published config.json values (hub files, written out by hand): the fields that change parameter counts
PUBLISHED = {
    "mixtral-8x7b": (
        transformers.MixtralConfig,
        dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
             num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False),
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=14336),
        46_702_792_704,
    ),
    "qwen3-30b-a3b": (
        transformers.Qwen3MoeConfig,
        dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
             num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
             num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
             tie_word_embeddings=False),
        dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768),
        30_532_122_624,
    ),
    "deepseek-v3": (
        transformers.DeepseekV3Config,
        dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
             num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
             n_routed_experts=256, num_experts_per_tok=8, first_k_dense_replace=3, n_group=8, topk_group=4,
             kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
             routed_scaling_factor=2.5, norm_topk_prob=True, tie_word_embeddings=False),
        dict(num_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048, n_shared_experts=1,
             router_type="sigmoid_topk", n_group=8, topk_group=4),
        671_026_404_352,
    ),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_moe_parameters_match_the_family_class_on_meta(name):
    config_cls, fields, ours, published = PUBLISHED[name]
    their_config = config_cls(**fields)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(their_config)
    assert sum(p.numel() for p in model.parameters()) == published
    moe_layer = next(layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts"))
    config = ModularDecoderConfig(**{**MOE_BASE, "hidden_size": fields["hidden_size"], **ours})
    total, active = MIXTURE_OF_EXPERTS.parameters(config, 0), MIXTURE_OF_EXPERTS.active_parameters(config, 0)
    assert total == sum(p.numel() for p in moe_layer.parameters())
    expert = 3 * fields["hidden_size"] * ours["moe_intermediate_size"]
    assert total - active == (ours["num_experts"] - ours["num_experts_per_tok"]) * expert
