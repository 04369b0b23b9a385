"""MiniMax-M2: Mixtral's layout (experts in every layer, files with `block_sparse_moe` and per-expert `w1` / `w3` /
`w2`, renamed and stacked as transformers does on load) with QK-norm over the whole projection (as OLMo 2), partial
RoPE (`rotary_dim` 64 of 128) and DeepSeek-V3's sigmoid router without groups or scaling: experts chosen on
sigmoid(logit) + a correction bias, weighted by the sigmoids, renormalised. The bias sits on the block in its files
(`block_sparse_moe.e_score_correction_bias`), on the router here (`mlp.gate.e_score_correction_bias`)."""

from __future__ import annotations

from transformers import MiniMaxM2Config

from ..core import Family, refuse, rule
from .common import (PRE_NORMS, expert_stacks, llama_rules, moe_rules, rope, source_rope, source_sizes, sizes)

BIAS = "model.layers.{layer}.mlp.e_score_correction_bias"


def to_contract(src) -> dict:
    refuse({"router_jitter_noise != 0 (training-time noise on the router input)": bool(src.router_jitter_noise)},
           "minimax_m2")
    return dict(
        sizes(src), **rope(src), norm_type="rmsnorm", norm_eps=src.rms_norm_eps, norm_position="pre",
        hidden_act=src.hidden_act, qk_norm="full", mlp_type="moe", num_experts=src.num_local_experts,
        num_experts_per_tok=src.num_experts_per_tok, moe_intermediate_size=src.intermediate_size,
        router_type="sigmoid_topk", norm_topk_prob=True, router_aux_loss_coef=src.router_aux_loss_coef,
        output_router_logits=bool(src.output_router_logits),
    )


def from_contract(cfg) -> MiniMaxM2Config:
    return MiniMaxM2Config(
        **dict(source_sizes(cfg), intermediate_size=cfg.moe_intermediate_size), rms_norm_eps=cfg.norm_eps,
        hidden_act=cfg.hidden_act, rope_parameters=source_rope(cfg), num_local_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_tok, router_aux_loss_coef=cfg.router_aux_loss_coef,
        output_router_logits=cfg.output_router_logits,
    )


def rules(src) -> list:
    bias = rule(BIAS, BIAS.replace("mlp.", "mlp.gate."), layers="sparse")
    return llama_rules(PRE_NORMS, qk_norm=True, moe=[*moe_rules(), bias])


FAMILY = Family("minimax_m2", to_contract, from_contract, rules, "model.", MiniMaxM2Config,
                renames={"model.layers.{layer}.block_sparse_moe.": "model.layers.{layer}.mlp."},
                experts=expert_stacks(gate="w1", up="w3", down="w2"),
                description="MiniMax-M2: full-width QK-norm, partial RoPE, sigmoid-routed experts",
                refusals=("router_jitter_noise != 0",))
