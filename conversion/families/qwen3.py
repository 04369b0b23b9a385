"""Qwen 3: Llama's layout with per-head RMS QK-norm and optional q/k/v/o biases."""

from __future__ import annotations

from transformers import Qwen3Config

from ..core import Family
from .common import PRE_NORMS, llama_rules, rope, source_rope, source_sizes, sizes


def to_contract(src) -> dict:
    return dict(
        sizes(src), **rope(src), norm_type="rmsnorm", norm_eps=src.rms_norm_eps, norm_position="pre",
        mlp_type="gated", hidden_act=src.hidden_act, attention_bias=src.attention_bias, qk_norm="head",
        sliding_window=src.sliding_window, layer_types=src.layer_types,
    )


def from_contract(cfg) -> Qwen3Config:
    sliding = "sliding_attention" in cfg.layer_types
    return Qwen3Config(**source_sizes(cfg), rms_norm_eps=cfg.norm_eps, hidden_act=cfg.hidden_act,
                       attention_bias=cfg.attention_bias, use_sliding_window=sliding, sliding_window=cfg.sliding_window,
                       layer_types=cfg.layer_types, rope_parameters=source_rope(cfg))


FAMILY = Family("qwen3", to_contract, from_contract, lambda src: llama_rules(PRE_NORMS, qk_norm=True), "model.",
                Qwen3Config,
                description="Qwen 3: per-head QK-norm")
