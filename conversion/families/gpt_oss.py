"""gpt-oss: pre-norm RMSNorm, GQA with biases and a learned sink per head in every softmax (attention sinks),
sliding and full layers alternating, YaRN, and experts in every layer: a biased router that keeps the k largest
logits and softmaxes over those, experts with biases and a clamped SwiGLU.

transformers' class holds each layer's experts as (E, d, 2f) products whose gate and up columns interleave
(gate 2i, up 2i + 1), (E, 2f) biases likewise, and (E, f, d) down products: the `interleaved_gate_up` and
`transpose_experts` transforms rearrange them into the contract's [gate; up] (E, 2f, d) and (E, d, f), and back.
The published checkpoints store the experts in MXFP4 (`*_blocks`, `*_scales`), which conversion dequantizes
when it reads them (`conversion/quantized.py`); this map sees the bf16 tensors that `save_pretrained` writes.
"""

from __future__ import annotations

from transformers import GptOssConfig

from ..core import Family, refuse, rule
from .common import PRE_NORMS, llama_rules, rope, router_training, source_rope, source_router_training, source_sizes, sizes

# What transformers 5.16-5.19's `GptOssExperts` computes whatever config.json says (later releases read
# `swiglu_limit` and `swiglu_alpha` from the config)
FIXED_SWIGLU = {"swiglu_limit": 7.0, "swiglu_alpha": 1.702}


def _swiglu(src) -> dict:
    """The clamped SwiGLU's limit and gain: the config's where this transformers' class reads it, else the values
    it computes with (a config.json saying otherwise is refused: this release would not compute it)."""
    fields = getattr(GptOssConfig, "__dataclass_fields__", {})
    values = {}
    for name, fixed in FIXED_SWIGLU.items():
        value = getattr(src, name, fixed)
        if name not in fields:
            refuse({f"`{name}`={value} (this transformers' gpt-oss computes {fixed})": value != fixed}, "gpt_oss")
        values[name] = value
    return values


def to_contract(src) -> dict:
    return dict(
        sizes(src), **rope(src), norm_type="rmsnorm", norm_eps=src.rms_norm_eps, norm_position="pre",
        hidden_act=src.hidden_act, attention_bias=src.attention_bias, attention_output_bias=src.attention_bias,
        attention_sinks=True, sliding_window=src.sliding_window, layer_types=list(src.layer_types), mlp_type="moe",
        num_experts=src.num_local_experts, num_experts_per_tok=src.num_experts_per_tok,
        moe_intermediate_size=src.intermediate_size, router_type="topk_softmax", router_bias=True, mlp_bias=True,
        **_swiglu(src), **router_training(src),
    )


def from_contract(cfg) -> GptOssConfig:
    swiglu = {name: getattr(cfg, name) for name in FIXED_SWIGLU
              if name in getattr(GptOssConfig, "__dataclass_fields__", {})}
    return GptOssConfig(
        **dict(source_sizes(cfg), intermediate_size=cfg.moe_intermediate_size), rms_norm_eps=cfg.norm_eps,
        hidden_act=cfg.hidden_act, attention_bias=cfg.attention_bias, sliding_window=cfg.sliding_window,
        layer_types=list(cfg.layer_types), rope_parameters=source_rope(cfg), num_local_experts=cfg.num_experts,
        num_experts_per_tok=cfg.num_experts_per_tok, **swiglu, **source_router_training(cfg),
    )


def rules(src) -> list:
    mlp, attn = "model.layers.{layer}.mlp", "model.layers.{layer}.self_attn"
    moe = [rule(f"{mlp}.router.weight", f"{mlp}.gate.weight", layers="sparse"),
           rule(f"{mlp}.router.bias", f"{mlp}.gate.bias", layers="sparse"),
           rule(f"{mlp}.experts.gate_up_proj", f"{mlp}.experts.gate_up_proj", "interleaved_gate_up", layers="sparse"),
           rule(f"{mlp}.experts.gate_up_proj_bias", f"{mlp}.experts.gate_up_proj_bias", "interleaved_gate_up",
                layers="sparse"),
           rule(f"{mlp}.experts.down_proj", f"{mlp}.experts.down_proj", "transpose_experts", layers="sparse"),
           rule(f"{mlp}.experts.down_proj_bias", f"{mlp}.experts.down_proj_bias", layers="sparse")]
    return llama_rules(PRE_NORMS, moe=moe) + [rule(f"{attn}.sinks", f"{attn}.sinks")]


FAMILY = Family("gpt_oss", to_contract, from_contract, rules, "model.", GptOssConfig,
                description="gpt-oss: attention sinks, alternating windows, clamped SwiGLU experts with biases",
                refusals=("a SwiGLU limit or alpha other than this transformers release's gpt-oss computes",))
