"""Mistral: Llama's layout with a sliding window on every layer (when `sliding_window` is set)."""

from __future__ import annotations

from transformers import MistralConfig

from ..core import Family
from .common import PRE_NORMS, llama_rules, rope, source_rope, source_sizes, sizes


def to_contract(src) -> dict:
    return dict(
        sizes(src), **rope(src), norm_type="rmsnorm", norm_eps=src.rms_norm_eps, norm_position="pre",
        mlp_type="gated", hidden_act=src.hidden_act, sliding_window=src.sliding_window,
    )


def from_contract(cfg) -> MistralConfig:
    return MistralConfig(**source_sizes(cfg), rms_norm_eps=cfg.norm_eps, hidden_act=cfg.hidden_act,
                         sliding_window=cfg.sliding_window, rope_parameters=source_rope(cfg))


FAMILY = Family("mistral", to_contract, from_contract, lambda src: llama_rules(PRE_NORMS), "model.", MistralConfig,
                description="Mistral: Llama's layout with a sliding window")
