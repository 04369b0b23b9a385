"""Qwen3-MoE: Qwen 3's attention (per-head QK-norm) with routed experts (softmax top-k) in the layers
`decoder_sparse_step` selects, gated MLPs in `mlp_only_layers`."""

from __future__ import annotations

from transformers import Qwen3MoeConfig

from ..core import Family
from .common import (PRE_NORMS, dense_layer_indices, expert_stacks, llama_rules, moe_rules, rope, router_training,
                     source_rope, source_router_training, source_sizes, sizes, sparse_layers)


def qwen_sparse_layers(src) -> list[str]:
    """transformers' rule: experts where `(i + 1) % decoder_sparse_step == 0` and i is not in `mlp_only_layers`."""
    return sparse_layers(src.num_hidden_layers, lambda i: i not in src.mlp_only_layers and src.num_experts > 0
                         and (i + 1) % src.decoder_sparse_step == 0)


def qwen_moe_fields(src) -> dict:
    """The MoE fields Qwen2-MoE and Qwen3-MoE share (a model with no sparse layer stays gated)."""
    layers = qwen_sparse_layers(src)
    if "sparse" not in layers:
        return {"mlp_type": "gated"}
    return dict(mlp_type="moe", mlp_layer_types=layers, num_experts=src.num_experts,
                num_experts_per_tok=src.num_experts_per_tok, moe_intermediate_size=src.moe_intermediate_size,
                norm_topk_prob=bool(src.norm_topk_prob), **router_training(src))


def qwen_moe_source_fields(cfg) -> dict:
    """The inverse of `qwen_moe_fields`: every dense layer listed in `mlp_only_layers`."""
    return dict(decoder_sparse_step=1, mlp_only_layers=dense_layer_indices(cfg), num_experts=cfg.num_experts,
                num_experts_per_tok=cfg.num_experts_per_tok, moe_intermediate_size=cfg.moe_intermediate_size,
                norm_topk_prob=cfg.norm_topk_prob, **source_router_training(cfg))


def to_contract(src) -> dict:
    return dict(
        sizes(src), **rope(src), norm_type="rmsnorm", norm_eps=src.rms_norm_eps, norm_position="pre",
        hidden_act=src.hidden_act, attention_bias=src.attention_bias, qk_norm="head",
        sliding_window=src.sliding_window, **qwen_moe_fields(src),
    )


def from_contract(cfg) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        **source_sizes(cfg), rms_norm_eps=cfg.norm_eps, hidden_act=cfg.hidden_act, attention_bias=cfg.attention_bias,
        use_sliding_window=cfg.sliding_window is not None, sliding_window=cfg.sliding_window,
        rope_parameters=source_rope(cfg), **qwen_moe_source_fields(cfg),
    )


FAMILY = Family("qwen3_moe", to_contract, from_contract,
                lambda src: llama_rules(PRE_NORMS, qk_norm=True, moe=moe_rules()), "model.", Qwen3MoeConfig,
                experts=expert_stacks(),
                description="Qwen3-MoE: Qwen 3's attention with routed experts")
