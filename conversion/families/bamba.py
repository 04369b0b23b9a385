"""Bamba (IBM, `BambaForCausalLM`): Mamba-2 layers with attention at the layers `attn_layer_indices` lists, RoPE
on half of each attention head (`partial_rotary_factor` 0.5, fixed by its config class), pre-norm RMSNorm blocks
with a SwiGLU feed-forward after either mixer. Its mixer sits at `mamba`, its feed-forward at `feed_forward`."""

from __future__ import annotations

from transformers import BambaConfig

from ..core import Family, refuse
from .common import rope, source_rope, source_sizes, sizes
from .mamba2 import bamba_layout_rules, mamba_expand, mamba_fields, source_mamba_fields


def to_contract(src) -> dict:
    refuse({f"a z-loss on the logits (`z_loss_coefficient`={src.z_loss_coefficient})": bool(src.z_loss_coefficient)},
           "bamba")
    return dict(
        sizes(src), **rope(src), norm_type="rmsnorm", norm_eps=src.rms_norm_eps, norm_position="pre",
        mlp_type="gated", hidden_act=src.hidden_act, mlp_bias=src.mlp_bias, attention_bias=src.attention_bias,
        layer_types=list(src.layers_block_type), **mamba_fields(src),
    )


def from_contract(cfg) -> BambaConfig:
    refuse({f"a Mamba-2 activation ({cfg.mamba_hidden_act!r}) other than `hidden_act` ({cfg.hidden_act!r})":
            cfg.mamba_hidden_act != cfg.hidden_act}, "bamba")
    attention = [i for i, kind in enumerate(cfg.layer_types) if kind == "full_attention"]
    rope_parameters = source_rope(cfg)
    rope_parameters.pop("partial_rotary_factor", None)  # its config class sets 0.5 itself
    return BambaConfig(
        **source_sizes(cfg), rms_norm_eps=cfg.norm_eps, hidden_act=cfg.hidden_act, mlp_bias=cfg.mlp_bias,
        attention_bias=cfg.attention_bias, rope_parameters=rope_parameters, attn_layer_indices=attention,
        mamba_expand=mamba_expand(cfg), **source_mamba_fields(cfg),
    )


FAMILY = Family("bamba", to_contract, from_contract, lambda src: bamba_layout_rules(), "model.", BambaConfig,
                description="Bamba: Mamba-2 layers with attention at listed layers, RoPE on half of each head",
                vllm_native=False,  # vLLM 0.23 dropped its Bamba class
                refusals=("a z-loss on the logits (`z_loss_coefficient`)",))
