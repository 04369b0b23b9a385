"""Qwen3.5-MoE's text model (`Qwen3_5MoeForCausalLM`, `model_type="qwen3_5_moe_text"`): Qwen3.5's layout (Gated
DeltaNet layers with separate projections beside gated full attention, zero-centred norms, text-only multimodal
RoPE) with Qwen3-Next's experts in every layer: softmax top-k over `num_experts`, the kept weights renormalised
(always: the config has no `norm_topk_prob`), plus one shared expert scaled by a sigmoid gate. Its files hold one
tensor per expert; its multi-token-prediction module converts as Qwen3.5's does. (The released folders are
multimodal, `model_type="qwen3_5_moe"`: their language model converts through this family.)
"""

from __future__ import annotations

from transformers import Qwen3_5MoeTextConfig

from ..core import Family, refuse
from .common import expert_stacks, moe_rules, router_training, source_rope, source_router_training, source_sizes
from .qwen3_5 import text_rope_fields
from .qwen3_next import (MTP_LAYER, hybrid_fields, hybrid_rules, mtp_contract, source_linear_fields, source_mtp_fields,
                         with_mtp)


def to_contract(src) -> dict:
    layers = src.num_hidden_layers
    experts = dict(mlp_type="moe", mlp_layer_types=["sparse"] * layers, num_experts=src.num_experts,
                   num_experts_per_tok=src.num_experts_per_tok, moe_intermediate_size=src.moe_intermediate_size,
                   norm_topk_prob=True, n_shared_experts=1,
                   shared_expert_intermediate_size=src.shared_expert_intermediate_size, shared_expert_gate=True,
                   **router_training(src))
    fields = dict(hybrid_fields(src), **text_rope_fields(src), **experts, **mtp_contract(src, "qwen3_5_moe_text"))
    fields["intermediate_size"] = src.moe_intermediate_size  # no dense layer reads it
    return fields


def from_contract(cfg) -> Qwen3_5MoeTextConfig:
    refuse({"dense feed-forward layers (every Qwen3.5-MoE layer holds experts)": cfg.mlp_type != "moe"
            or "dense" in (cfg.mlp_layer_types or [])}, "qwen3_5_moe_text")
    sizes = {k: v for k, v in source_sizes(cfg).items() if k != "intermediate_size"}  # experts only
    return Qwen3_5MoeTextConfig(
        **sizes, rms_norm_eps=cfg.norm_eps, hidden_act=cfg.hidden_act, attention_bias=cfg.attention_bias,
        layer_types=cfg.layer_types, rope_parameters=source_rope(cfg), **source_linear_fields(cfg),
        num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
        moe_intermediate_size=cfg.moe_intermediate_size,
        shared_expert_intermediate_size=cfg.shared_expert_intermediate_size, **source_router_training(cfg),
        **source_mtp_fields(cfg, "qwen3_5_moe_text"),
    )


FAMILY = Family("qwen3_5_moe_text", to_contract, from_contract,
                lambda src: with_mtp(hybrid_rules(moe_rules(shared="shared_expert", shared_gate=True), fused=False)),
                "model.", Qwen3_5MoeTextConfig, head=("lm_head.", "mtp."),
                experts=expert_stacks() + expert_stacks(layers="mtp.layers"), mtp_layers=MTP_LAYER,
                description="Qwen3.5-MoE text folders: Gated DeltaNet hybrid, experts with a sigmoid-gated shared "
                            "expert, MTP layer",
                refusals=("dense feed-forward layers", "more than one MTP layer", "MTP embeddings of its own"))
