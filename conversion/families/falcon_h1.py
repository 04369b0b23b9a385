"""Falcon-H1 (TII, `FalconH1ForCausalLM`): every layer runs attention and a Mamba-2 mixer side by side on the same
normed input and adds their outputs (the contract's `"hybrid"` layers), then a SwiGLU feed-forward, with Falcon-H1's
μP multipliers: the embedding's, the logits' (`lm_head_multiplier`, the contract's `logits_scaling` = its inverse),
the attention's input, keys and output, the Mamba-2 mixer's input, its five projected parts and its output, and the
MLP's gate and output. Its Mamba-2 width is `mamba_d_ssm` (the contract's heads x head width), its gated norm optional
(`mamba_rms_norm`) and placed before or after the gate (`mamba_norm_before_gate`).
"""

from __future__ import annotations

from transformers import FalconH1Config

from ..core import Family, refuse
from .common import rope, source_rope, source_sizes, sizes
from .mamba2 import bamba_layout_rules, mamba_fields, source_mamba_fields

MULTIPLIERS = ("key_multiplier", "attention_in_multiplier", "attention_out_multiplier", "ssm_in_multiplier",
               "ssm_out_multiplier", "embedding_multiplier")


def to_contract(src) -> dict:
    refuse({"different biases on the Mamba-2 input and output projections (`mamba_proj_bias`, `projectors_bias`)":
            bool(src.mamba_proj_bias) != bool(src.projectors_bias)}, "falcon_h1")
    rms_norm = bool(src.mamba_rms_norm)
    return dict(
        sizes(src), **rope(src), norm_type="rmsnorm", norm_eps=src.rms_norm_eps, norm_position="pre",
        mlp_type="gated", hidden_act=src.hidden_act, mlp_bias=src.mlp_bias, attention_bias=src.attention_bias,
        layer_types=["hybrid"] * src.num_hidden_layers, **mamba_fields(src),
        mamba_rms_norm=rms_norm, mamba_norm_before_gate=rms_norm and bool(src.mamba_norm_before_gate),
        logits_scaling=1.0 / src.lm_head_multiplier, mlp_multipliers=_factors(src.mlp_multipliers),
        ssm_multipliers=_factors(src.ssm_multipliers), **{name: float(getattr(src, name)) for name in MULTIPLIERS},
    )


def _factors(values) -> list[float] | None:
    """Falcon-H1's multiplier lists, `None` (the contract's default) where all are 1."""
    values = [float(v) for v in values]
    return None if all(v == 1.0 for v in values) else values


def from_contract(cfg) -> FalconH1Config:
    refuse({"layers other than 'hybrid' ones (`layer_types`)": any(t != "hybrid" for t in cfg.layer_types),
            f"a Mamba-2 activation ({cfg.mamba_hidden_act!r}) other than `hidden_act` ({cfg.hidden_act!r})":
                cfg.mamba_hidden_act != cfg.hidden_act}, "falcon_h1")
    return FalconH1Config(
        **source_sizes(cfg), rms_norm_eps=cfg.norm_eps, hidden_act=cfg.hidden_act, mlp_bias=cfg.mlp_bias,
        attention_bias=cfg.attention_bias, rope_parameters=source_rope(cfg),
        mamba_d_ssm=cfg.mamba_n_heads * cfg.mamba_d_head, **source_mamba_fields(cfg),
        projectors_bias=cfg.mamba_proj_bias, mamba_rms_norm=cfg.mamba_rms_norm,
        mamba_norm_before_gate=cfg.mamba_norm_before_gate, lm_head_multiplier=1.0 / cfg.logits_scaling,
        mlp_multipliers=list(cfg.mlp_multipliers or [1.0, 1.0]), ssm_multipliers=list(cfg.ssm_multipliers or [1.0] * 5),
        **{name: getattr(cfg, name) for name in MULTIPLIERS},
    )


FAMILY = Family("falcon_h1", to_contract, from_contract,
                lambda src: bamba_layout_rules(mamba_norm=bool(src.mamba_rms_norm)), "model.", FalconH1Config,
                description="Falcon-H1: attention and Mamba-2 side by side in every layer, μP multipliers",
                refusals=("different biases on the Mamba-2 input and output projections",))
