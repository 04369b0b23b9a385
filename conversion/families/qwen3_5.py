"""Qwen3.5's text model (`Qwen3_5ForCausalLM`, `model_type="qwen3_5_text"`): Qwen3-Next's layout (Gated DeltaNet
layers beside gated full attention, zero-centred RMSNorms) with dense gated MLPs and the linear layers' projections
stored separately (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`: the contract's own names).

Its rotary embedding is multimodal (sections of the rotated width follow time, height and width positions); for
text the three positions are equal, which makes it plain partial RoPE, so the section keys
(`mrope_section`, `mrope_interleaved`) are dropped on the way in and left to Qwen3.5's defaults on the way out. Its
multi-token-prediction module converts as Qwen3-Next's does (`qwen3_next.mtp_rules`).
"""

from __future__ import annotations

from transformers import Qwen3_5TextConfig

from ..core import Family
from .common import rope, source_rope, source_sizes
from .qwen3_next import (MTP_LAYER, hybrid_fields, hybrid_rules, mtp_contract, source_linear_fields, source_mtp_fields,
                         with_mtp)

MROPE_KEYS = ("mrope_section", "mrope_interleaved")


def text_rope_fields(src) -> dict:
    """The rotary dict of a text model: the multimodal section keys dropped (equal positions make them plain RoPE)."""
    return {"rope_parameters": {k: v for k, v in rope(src)["rope_parameters"].items() if k not in MROPE_KEYS}}


def to_contract(src) -> dict:
    return dict(hybrid_fields(src), **text_rope_fields(src), mlp_type="gated", **mtp_contract(src, "qwen3_5_text"))


def from_contract(cfg) -> Qwen3_5TextConfig:
    return Qwen3_5TextConfig(
        **source_sizes(cfg), rms_norm_eps=cfg.norm_eps, hidden_act=cfg.hidden_act, attention_bias=cfg.attention_bias,
        layer_types=cfg.layer_types, rope_parameters=source_rope(cfg), **source_linear_fields(cfg),
        **source_mtp_fields(cfg, "qwen3_5_text"),
    )


FAMILY = Family("qwen3_5_text", to_contract, from_contract, lambda src: with_mtp(hybrid_rules(fused=False)), "model.",
                Qwen3_5TextConfig, head=("lm_head.", "mtp."), mtp_layers=MTP_LAYER,
                description="Qwen3.5 text-only folders: Gated DeltaNet hybrid with dense SwiGLU, MTP layer",
                refusals=("more than one MTP layer", "MTP embeddings of its own"))
