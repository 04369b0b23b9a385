"""Gemma: Llama's layout with GEGLU, sqrt(d) embedding scale and `1 + w` RMSNorms.

Gemma stores the norm weight w and scales by 1 + w; the contract's `norm_unit_offset=True` does the
same, so the weights copy unchanged.
"""

from __future__ import annotations

import math

from transformers import GemmaConfig

from ..core import Family
from .common import PRE_NORMS, llama_rules, rope, source_rope, source_sizes, sizes


def to_contract(src) -> dict:
    return dict(
        sizes(src), **rope(src), norm_type="rmsnorm", norm_eps=src.rms_norm_eps, norm_unit_offset=True,
        norm_position="pre", mlp_type="gated", hidden_act=src.hidden_act, attention_bias=src.attention_bias,
        embedding_multiplier=math.sqrt(src.hidden_size),
    )


def from_contract(cfg) -> GemmaConfig:
    return GemmaConfig(**source_sizes(cfg), rms_norm_eps=cfg.norm_eps, hidden_act=cfg.hidden_act,
                       attention_bias=cfg.attention_bias, rope_parameters=source_rope(cfg))


FAMILY = Family("gemma", to_contract, from_contract, lambda src: llama_rules(PRE_NORMS), "model.", GemmaConfig,
                description="Gemma: GEGLU, 1 + w norms, embedding scale")
