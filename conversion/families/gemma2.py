"""Gemma 2: Gemma with sandwich norms, logit soft-caps, `query_pre_attn_scalar` and local/global layers."""

from __future__ import annotations

import math

from transformers import Gemma2Config

from ..core import Family
from .common import llama_rules, rope, source_rope, source_sizes, sizes

SANDWICH_NORMS = {
    "input_layernorm": "pre_attn_norm",
    "post_attention_layernorm": "post_attn_norm",
    "pre_feedforward_layernorm": "pre_mlp_norm",
    "post_feedforward_layernorm": "post_mlp_norm",
}


def sandwich_contract(src) -> dict:
    """What Gemma 2 and Gemma 3 share."""
    return dict(
        sizes(src), **rope(src), norm_type="rmsnorm", norm_eps=src.rms_norm_eps, norm_unit_offset=True,
        norm_position="sandwich", mlp_type="gated", hidden_act=src.hidden_activation,
        attention_bias=src.attention_bias, embedding_multiplier=math.sqrt(src.hidden_size),
        attn_logit_softcapping=src.attn_logit_softcapping, final_logit_softcapping=src.final_logit_softcapping,
        query_pre_attn_scalar=src.query_pre_attn_scalar, sliding_window=src.sliding_window,
        layer_types=src.layer_types,
    )


def sandwich_source(cfg) -> dict:
    return dict(
        source_sizes(cfg), rms_norm_eps=cfg.norm_eps, hidden_activation=cfg.hidden_act,
        attention_bias=cfg.attention_bias, attn_logit_softcapping=cfg.attn_logit_softcapping,
        final_logit_softcapping=cfg.final_logit_softcapping, query_pre_attn_scalar=cfg.query_pre_attn_scalar,
        sliding_window=cfg.sliding_window, layer_types=cfg.layer_types, rope_parameters=source_rope(cfg),
    )


FAMILY = Family("gemma2", sandwich_contract, lambda cfg: Gemma2Config(**sandwich_source(cfg)),
                lambda src: llama_rules(SANDWICH_NORMS), "model.", Gemma2Config,
                description="Gemma 2: sandwich norms, soft-caps, local and global layers")
