"""Qwen2-MoE (Qwen1.5-MoE): Qwen 2's attention (q/k/v biases) with routed experts plus one shared expert
scaled by a sigmoid gate; gated MLPs in `mlp_only_layers`."""

from __future__ import annotations

from transformers import Qwen2MoeConfig

from ..core import Family, refuse
from .common import PRE_NORMS, expert_stacks, llama_rules, moe_rules, rope, source_rope, source_sizes, sizes
from .qwen3_moe import qwen_moe_fields, qwen_moe_source_fields


def to_contract(src) -> dict:
    fields = qwen_moe_fields(src)
    if fields["mlp_type"] == "moe":
        refuse({"a zero-width shared expert": not src.shared_expert_intermediate_size}, "qwen2_moe")
        fields.update(n_shared_experts=1, shared_expert_intermediate_size=src.shared_expert_intermediate_size,
                      shared_expert_gate=True)
    sliding = src.sliding_window if "sliding_attention" in src.layer_types else None  # 0 when unused
    return dict(
        sizes(src), **rope(src), norm_type="rmsnorm", norm_eps=src.rms_norm_eps, norm_position="pre",
        hidden_act=src.hidden_act, attention_bias=src.qkv_bias, attention_output_bias=False,
        sliding_window=sliding, layer_types=src.layer_types, **fields,
    )


def from_contract(cfg) -> Qwen2MoeConfig:
    sliding = "sliding_attention" in cfg.layer_types
    return Qwen2MoeConfig(
        **source_sizes(cfg), rms_norm_eps=cfg.norm_eps, hidden_act=cfg.hidden_act, qkv_bias=cfg.attention_bias,
        use_sliding_window=sliding, sliding_window=cfg.sliding_window, layer_types=cfg.layer_types,
        rope_parameters=source_rope(cfg), shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
        **qwen_moe_source_fields(cfg),
    )


FAMILY = Family("qwen2_moe", to_contract, from_contract,
                lambda src: llama_rules(PRE_NORMS, moe=moe_rules(shared="shared_expert", shared_gate=True)),
                "model.", Qwen2MoeConfig, experts=expert_stacks(),
                description="Qwen1.5-MoE, Qwen2-MoE: routed experts plus a gated shared expert",
                refusals=("a zero-width shared expert",))
