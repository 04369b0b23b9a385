"""GraniteMoE: Llama's attention scaled by `attention_multiplier`, routed experts in every layer
(softmax over the k best logits, i.e. the renormalised softmax top-k), and Granite's μP scalings
(`embedding_multiplier`, `residual_multiplier`, `logits_scaling`).

Files store the experts already stacked, under older names (`input_linear`, `output_linear`,
`router.layer`), which transformers renames on load as `renames` does here.
"""

from __future__ import annotations

from transformers import GraniteMoeConfig

from ..core import Family, rule
from .common import (PRE_NORMS, llama_rules, rope, router_training, source_rope, source_router_training, source_sizes,
                     sizes)

MOE = "model.layers.{layer}.block_sparse_moe"


def to_contract(src) -> dict:
    return dict(
        sizes(src), **rope(src), norm_type="rmsnorm", norm_eps=src.rms_norm_eps, norm_position="pre",
        hidden_act=src.hidden_act, attention_bias=src.attention_bias,
        # the scores' scale is `attention_multiplier` itself: q·k · s^-1/2 with s = multiplier^-2
        query_pre_attn_scalar=src.attention_multiplier ** -2, embedding_multiplier=src.embedding_multiplier,
        residual_multiplier=src.residual_multiplier, logits_scaling=src.logits_scaling, mlp_type="moe",
        num_experts=src.num_local_experts, num_experts_per_tok=src.num_experts_per_tok,
        moe_intermediate_size=src.intermediate_size, norm_topk_prob=True, **router_training(src),
    )


def from_contract(cfg) -> GraniteMoeConfig:
    scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
    return GraniteMoeConfig(
        **dict(source_sizes(cfg), intermediate_size=cfg.moe_intermediate_size), rms_norm_eps=cfg.norm_eps,
        hidden_act=cfg.hidden_act, attention_bias=cfg.attention_bias, rope_parameters=source_rope(cfg),
        attention_multiplier=scale, embedding_multiplier=cfg.embedding_multiplier,
        residual_multiplier=cfg.residual_multiplier, logits_scaling=cfg.logits_scaling,
        num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok, **source_router_training(cfg),
    )


def rules(src):
    mlp = "model.layers.{layer}.mlp"
    moe = [rule(f"{MOE}.router.weight", f"{mlp}.gate.weight", layers="sparse"),
           rule(f"{MOE}.experts.gate_up_proj", f"{mlp}.experts.gate_up_proj", layers="sparse"),
           rule(f"{MOE}.experts.down_proj", f"{mlp}.experts.down_proj", layers="sparse")]
    return llama_rules(PRE_NORMS, moe=moe)


FAMILY = Family("granitemoe", to_contract, from_contract, rules, "model.", GraniteMoeConfig, renames={
    f"{MOE}.input_linear.weight": f"{MOE}.experts.gate_up_proj",
    f"{MOE}.output_linear.weight": f"{MOE}.experts.down_proj",
    f"{MOE}.router.layer.weight": f"{MOE}.router.weight",
},
                description="Granite MoE: muP multipliers on embeddings, residuals, attention and logits")
