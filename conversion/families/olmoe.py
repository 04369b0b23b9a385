"""OLMoE: pre-norm RMSNorm, QK-norm over the whole q / k projection (as OLMo 2), and routed experts in
every layer (softmax top-k, by default not renormalised)."""

from __future__ import annotations

from transformers import OlmoeConfig

from ..core import Family, refuse
from .common import (PRE_NORMS, expert_stacks, llama_rules, moe_rules, rope, router_training, source_rope,
                     source_router_training, source_sizes, sizes)


def to_contract(src) -> dict:
    refuse({"clip_qkv (q/k/v clamped to a range)": src.clip_qkv is not None}, "olmoe")
    return dict(
        sizes(src), **rope(src), norm_type="rmsnorm", norm_eps=src.rms_norm_eps, norm_position="pre",
        hidden_act=src.hidden_act, attention_bias=src.attention_bias, qk_norm="full", mlp_type="moe",
        num_experts=src.num_experts, num_experts_per_tok=src.num_experts_per_tok,
        moe_intermediate_size=src.intermediate_size, norm_topk_prob=bool(src.norm_topk_prob), **router_training(src),
    )


def from_contract(cfg) -> OlmoeConfig:
    return OlmoeConfig(
        **dict(source_sizes(cfg), intermediate_size=cfg.moe_intermediate_size), rms_norm_eps=cfg.norm_eps,
        hidden_act=cfg.hidden_act, attention_bias=cfg.attention_bias, rope_parameters=source_rope(cfg),
        num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok, norm_topk_prob=cfg.norm_topk_prob,
        **source_router_training(cfg),
    )


FAMILY = Family("olmoe", to_contract, from_contract,
                lambda src: llama_rules(PRE_NORMS, qk_norm=True, moe=moe_rules()), "model.", OlmoeConfig,
                experts=expert_stacks(),
                description="OLMoE: full-width QK-norm, 64 experts",
                refusals=("clip_qkv",))
