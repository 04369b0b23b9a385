"""Qwen 2: Llama's layout with q/k/v biases (none on o_proj) and optional upper sliding layers."""

from __future__ import annotations

from transformers import Qwen2Config

from ..core import Family
from .common import PRE_NORMS, llama_rules, rope, source_rope, source_sizes, sizes


def to_contract(src) -> dict:
    return dict(
        sizes(src), **rope(src), norm_type="rmsnorm", norm_eps=src.rms_norm_eps, norm_position="pre",
        mlp_type="gated", hidden_act=src.hidden_act, attention_bias=True, attention_output_bias=False,
        sliding_window=src.sliding_window, layer_types=src.layer_types,
    )


def from_contract(cfg) -> Qwen2Config:
    sliding = "sliding_attention" in cfg.layer_types
    return Qwen2Config(**source_sizes(cfg), rms_norm_eps=cfg.norm_eps, hidden_act=cfg.hidden_act,
                       use_sliding_window=sliding, sliding_window=cfg.sliding_window, layer_types=cfg.layer_types,
                       rope_parameters=source_rope(cfg))


FAMILY = Family("qwen2", to_contract, from_contract, lambda src: llama_rules(PRE_NORMS), "model.", Qwen2Config,
                description="Qwen 2 / 2.5: q/k/v biases")
