"""Llama 4 (text, `Llama4ForCausalLM`): chunked attention on the RoPE layers and a NoPE full-attention layer every
fourth (`no_rope_layers`) whose queries are scaled by position (`attn_temperature_tuning`); RoPE on interleaved
pairs (transformers computes it as complex numbers); a weightless RMS norm of the rotated q and k
(`use_qk_norm`); experts in the `moe_layers`: a top-1 router whose sigmoid score scales the expert's input, beside a
shared expert, and dense MLPs of `intermediate_size_mlp` elsewhere.

transformers' class holds each layer's experts as (E, d, 2f) and (E, f, d) products (`feed_forward.experts`), its
router as `feed_forward.router` and the shared expert as `feed_forward.shared_expert`; `transpose_experts` turns
the products into the contract's (E, 2f, d) = [gate; up] and (E, d, f), and back.
"""

from __future__ import annotations

from transformers import Llama4TextConfig

from ..core import Family, rule
from .common import (PRE_NORMS, llama_rules, rope, router_training, source_rope, source_router_training,
                     source_sizes, sizes)

# transformers' Llama 4 values where temperature tuning is off (its fields stay typed)
TEMPERATURE_DEFAULTS = {"floor_scale": 8192, "attn_scale": 0.1}


def _experts(src) -> dict:
    """The feed-forward fields: experts in `moe_layers` (the rest dense, `intermediate_size_mlp` wide), or a gated
    MLP everywhere when no layer has experts."""
    layers = src.num_hidden_layers
    sparse = ["sparse" if i in set(src.moe_layers) else "dense" for i in range(layers)]
    if "sparse" not in sparse:
        return {"mlp_type": "gated"}
    return dict(mlp_type="moe", mlp_layer_types=sparse, num_experts=src.num_local_experts,
                num_experts_per_tok=src.num_experts_per_tok, moe_intermediate_size=src.intermediate_size,
                n_shared_experts=1, shared_expert_intermediate_size=src.intermediate_size, router_type="topk_sigmoid",
                norm_topk_prob=False, apply_router_weight_on_input=True, **router_training(src))


def to_contract(src) -> dict:
    layers = src.num_hidden_layers
    flags = [int(flag) for flag in src.no_rope_layers[:layers]]
    layer_types = list(src.layer_types[:layers])
    chunked = "chunked_attention" in layer_types
    tuning = bool(src.attn_temperature_tuning) and not all(flags)  # it scales the NoPE layers' queries only
    return dict(
        sizes(src, intermediate_size=src.intermediate_size_mlp), **rope(src), rope_interleaved=True,
        norm_type="rmsnorm", norm_eps=src.rms_norm_eps, norm_position="pre", hidden_act=src.hidden_act,
        attention_bias=src.attention_bias, attention_output_bias=src.attention_bias,
        qk_norm="weightless" if src.use_qk_norm else "none", layer_types=layer_types,
        attention_chunk_size=src.attention_chunk_size if chunked else None,
        no_rope_layers=None if all(flags) else flags, attn_temperature_tuning=tuning,
        **(dict(floor_scale=src.floor_scale, attn_scale=src.attn_scale, attn_temperature_offset=1,
                attn_temperature_layers="nope") if tuning else {}),
        **_experts(src),
    )


def from_contract(cfg) -> Llama4TextConfig:
    layers = cfg.num_hidden_layers
    moe = cfg.mlp_type == "moe"
    experts = dict(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                   intermediate_size=cfg.moe_intermediate_size, **source_router_training(cfg)) if moe else {}
    temperature = {name: getattr(cfg, name) if cfg.attn_temperature_tuning else default
                   for name, default in TEMPERATURE_DEFAULTS.items()}
    return Llama4TextConfig(
        **{**source_sizes(cfg), **experts}, intermediate_size_mlp=cfg.intermediate_size, rms_norm_eps=cfg.norm_eps,
        hidden_act=cfg.hidden_act, attention_bias=cfg.attention_bias, rope_parameters=source_rope(cfg),
        use_qk_norm=cfg.qk_norm == "weightless", layer_types=list(cfg.layer_types),
        attention_chunk_size=cfg.attention_chunk_size,
        no_rope_layers=list(cfg.no_rope_layers or [1] * layers), attn_temperature_tuning=cfg.attn_temperature_tuning,
        moe_layers=[i for i, kind in enumerate(cfg.mlp_layer_types or []) if kind == "sparse"], **temperature,
    )


def rules(src) -> list:
    ff, mlp = "model.layers.{layer}.feed_forward", "model.layers.{layer}.mlp"
    moe = [rule(f"{ff}.router.weight", f"{mlp}.gate.weight", layers="sparse"),
           rule(f"{ff}.experts.gate_up_proj", f"{mlp}.experts.gate_up_proj", "transpose_experts", layers="sparse"),
           rule(f"{ff}.experts.down_proj", f"{mlp}.experts.down_proj", "transpose_experts", layers="sparse")]
    moe += [rule(f"{ff}.shared_expert.{proj}.weight", f"{mlp}.shared_experts.{proj}.weight", layers="sparse")
            for proj in ("gate_proj", "up_proj", "down_proj")]
    return llama_rules(PRE_NORMS, moe=moe, mlp="feed_forward")


FAMILY = Family("llama4_text", to_contract, from_contract, rules, "model.", Llama4TextConfig,
                description="Llama 4 text model (Scout, Maverick): chunked attention, NoPE layers with a query "
                            "temperature, top-1 sigmoid-routed experts beside a shared expert")
