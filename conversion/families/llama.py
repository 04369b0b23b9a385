"""Llama (meta-llama/Llama-2/3, SmolLM2): pre-norm RMSNorm, SwiGLU, RoPE, GQA."""

from __future__ import annotations

from transformers import LlamaConfig

from ..core import Family, refuse
from .common import PRE_NORMS, llama_rules, rope, source_rope, source_sizes, sizes


def to_contract(src) -> dict:
    refuse({"pretraining_tp > 1": getattr(src, "pretraining_tp", 1) not in (None, 1)}, "llama")
    return dict(
        sizes(src), **rope(src), norm_type="rmsnorm", norm_eps=src.rms_norm_eps, norm_position="pre",
        mlp_type="gated", hidden_act=src.hidden_act, mlp_bias=src.mlp_bias, attention_bias=src.attention_bias,
    )


def from_contract(cfg) -> LlamaConfig:
    return LlamaConfig(
        **source_sizes(cfg), rms_norm_eps=cfg.norm_eps, hidden_act=cfg.hidden_act, mlp_bias=cfg.mlp_bias,
        attention_bias=cfg.attention_bias, rope_parameters=source_rope(cfg),
    )


FAMILY = Family("llama", to_contract, from_contract, lambda src: llama_rules(PRE_NORMS), "model.", LlamaConfig,
                description="Llama 2 / 3, SmolLM2: RMSNorm, SwiGLU, RoPE, GQA",
                refusals=("pretraining_tp > 1",))
