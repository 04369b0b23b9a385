"""SmolLM3: Llama's layout with NoPE layers (`no_rope_layers`: 1 rotates, 0 does not; every fourth layer in
SmolLM3-3B), sliding windows only where `use_sliding_window` says so."""

from __future__ import annotations

from transformers import SmolLM3Config

from ..core import Family, refuse
from .common import PRE_NORMS, llama_rules, rope, source_rope, source_sizes, sizes


def to_contract(src) -> dict:
    layers = src.num_hidden_layers
    sliding = "sliding_attention" in src.layer_types[:layers]
    refuse({"sliding layers in `layer_types` with `use_sliding_window=False` (its masks would slide and its flash "
            "path would not)": sliding and not src.use_sliding_window}, "smollm3")
    flags = [int(flag) for flag in src.no_rope_layers[:layers]]
    return dict(
        sizes(src), **rope(src), norm_type="rmsnorm", norm_eps=src.rms_norm_eps, norm_position="pre",
        mlp_type="gated", hidden_act=src.hidden_act, attention_bias=src.attention_bias,
        attention_output_bias=src.attention_bias, mlp_bias=src.mlp_bias,
        sliding_window=src.sliding_window if sliding else None, layer_types=list(src.layer_types[:layers]),
        no_rope_layers=None if all(flags) else flags,
    )


def from_contract(cfg) -> SmolLM3Config:
    sizes = {k: v for k, v in source_sizes(cfg).items() if k != "head_dim"}  # SmolLM3 derives it: d / H
    sliding = "sliding_attention" in cfg.layer_types
    return SmolLM3Config(
        **sizes, rms_norm_eps=cfg.norm_eps, hidden_act=cfg.hidden_act, attention_bias=cfg.attention_bias,
        mlp_bias=cfg.mlp_bias, rope_parameters=source_rope(cfg), use_sliding_window=sliding,
        sliding_window=cfg.sliding_window if sliding else None, layer_types=list(cfg.layer_types),
        no_rope_layers=list(cfg.no_rope_layers or [1] * cfg.num_hidden_layers),
    )


FAMILY = Family("smollm3", to_contract, from_contract, lambda src: llama_rules(PRE_NORMS), "model.", SmolLM3Config,
                description="SmolLM3: NoPE every fourth layer",
                refusals=("sliding layers with `use_sliding_window=False`",))
