"""OLMo 3: OLMo 2's layout (a norm on each sublayer's output, x + N(F(x)), and QK-norm over the whole projection)
with sliding-window layers, three for each full one (`layer_types`), whose RoPE tables are their own
(`rope_parameters` nested by layer type: the long-context releases scale the full layers' with YaRN only)."""

from __future__ import annotations

from transformers import Olmo3Config

from ..core import Family
from .common import llama_rules, rope, source_rope, source_sizes, sizes
from .olmo2 import OUTPUT_NORMS


def to_contract(src) -> dict:
    return dict(
        sizes(src), **_one_table(rope(src)), norm_type="rmsnorm", norm_eps=src.rms_norm_eps, norm_position="output",
        mlp_type="gated", hidden_act=src.hidden_act, attention_bias=src.attention_bias, qk_norm="full",
        sliding_window=src.sliding_window, layer_types=list(src.layer_types),
    )


def from_contract(cfg) -> Olmo3Config:
    return Olmo3Config(**source_sizes(cfg), rms_norm_eps=cfg.norm_eps, hidden_act=cfg.hidden_act,
                       attention_bias=cfg.attention_bias, sliding_window=cfg.sliding_window,
                       layer_types=list(cfg.layer_types), rope_parameters=_nested(source_rope(cfg)))


def _one_table(fields: dict) -> dict:
    """One flat RoPE dict where both layer types' tables are the same (OLMo 3's short-context releases): the same
    function, and what a model built with one table exports back to."""
    tables = list(fields["rope_parameters"].values())
    if len(tables) != 2 or tables[0] != tables[1]:
        return fields
    table = dict(tables[0])
    return {**fields, "partial_rotary_factor": table.pop("partial_rotary_factor", None) or 1.0, "rope_parameters": table}


def _nested(params: dict) -> dict:
    """OLMo 3 keeps a RoPE table per layer type: a flat dict serves both."""
    if all(key in ("full_attention", "sliding_attention") for key in params):
        return params
    return {"full_attention": dict(params), "sliding_attention": dict(params)}


FAMILY = Family("olmo3", to_contract, from_contract, lambda src: llama_rules(OUTPUT_NORMS, qk_norm=True), "model.",
                Olmo3Config,
                description="OLMo 3: OLMo 2's norms, three sliding layers per full one")
