"""Mixtral: Mistral's layout with a mixture of experts in every layer (softmax top-k, renormalised).

Files name the block `block_sparse_moe` and the experts' projections `w1` (gate), `w3` (up), `w2`
(down), one tensor per expert; transformers renames and stacks them on load, as `renames` and
`experts` do here.
"""

from __future__ import annotations

from transformers import MixtralConfig

from ..core import Family, refuse
from .common import (PRE_NORMS, expert_stacks, llama_rules, moe_rules, rope, router_training, source_rope,
                     source_router_training, source_sizes, sizes)


def to_contract(src) -> dict:
    refuse({"router_jitter_noise != 0 (training-time noise on the router input)": bool(src.router_jitter_noise)},
           "mixtral")
    return dict(
        sizes(src), **rope(src), norm_type="rmsnorm", norm_eps=src.rms_norm_eps, norm_position="pre",
        hidden_act=src.hidden_act, sliding_window=src.sliding_window, mlp_type="moe",
        num_experts=src.num_local_experts, num_experts_per_tok=src.num_experts_per_tok,
        moe_intermediate_size=src.intermediate_size, norm_topk_prob=True, **router_training(src),
    )


def from_contract(cfg) -> MixtralConfig:
    return MixtralConfig(
        **dict(source_sizes(cfg), intermediate_size=cfg.moe_intermediate_size), rms_norm_eps=cfg.norm_eps,
        hidden_act=cfg.hidden_act, sliding_window=cfg.sliding_window, rope_parameters=source_rope(cfg),
        num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok, **source_router_training(cfg),
    )


FAMILY = Family("mixtral", to_contract, from_contract, lambda src: llama_rules(PRE_NORMS, moe=moe_rules()), "model.",
                MixtralConfig, renames={"model.layers.{layer}.block_sparse_moe.": "model.layers.{layer}.mlp."},
                experts=expert_stacks(gate="w1", up="w3", down="w2"),
                description="Mixtral: experts in every layer, softmax top-k",
                refusals=("router_jitter_noise != 0",))
