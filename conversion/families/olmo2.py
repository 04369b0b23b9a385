"""OLMo 2: norms on each sublayer's output (x + N(F(x))) and QK-norm over the whole projection."""

from __future__ import annotations

from transformers import Olmo2Config

from ..core import Family
from .common import llama_rules, rope, source_rope, source_sizes, sizes

OUTPUT_NORMS = {"post_attention_layernorm": "post_attn_norm", "post_feedforward_layernorm": "post_mlp_norm"}


def to_contract(src) -> dict:
    return dict(
        sizes(src), **rope(src), norm_type="rmsnorm", norm_eps=src.rms_norm_eps, norm_position="output",
        mlp_type="gated", hidden_act=src.hidden_act, attention_bias=src.attention_bias, qk_norm="full",
    )


def from_contract(cfg) -> Olmo2Config:
    return Olmo2Config(**source_sizes(cfg), rms_norm_eps=cfg.norm_eps, hidden_act=cfg.hidden_act,
                       attention_bias=cfg.attention_bias, rope_parameters=source_rope(cfg))


FAMILY = Family("olmo2", to_contract, from_contract, lambda src: llama_rules(OUTPUT_NORMS, qk_norm=True), "model.",
                Olmo2Config,
                description="OLMo 2: a norm on each sublayer's output, full-width QK-norm")
