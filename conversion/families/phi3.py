"""Phi-3 and Phi-4 (`phi3`): Llama's pre-norm layout with the q/k/v projections fused into one `qkv_proj` and the
gate and up projections into one `gate_up_proj` (split here, fused again on export: the same rows), partial RoPE
(`partial_rotary_factor`, Phi-4-mini's 0.75) and LongRoPE (`rope_type: longrope`: short factors up to
`original_max_position_embeddings`, long ones past it), and a sliding window on every layer where `sliding_window`
is set (Phi-3-mini-4k's 2,047)."""

from __future__ import annotations

from transformers import Phi3Config

from ..core import Family, rule
from .common import PRE_NORMS, llama_rules, rope, source_rope, source_sizes, sizes

L = "model.layers.{layer}"


def to_contract(src) -> dict:
    return dict(
        sizes(src), **rope(src), norm_type="rmsnorm", norm_eps=src.rms_norm_eps, norm_position="pre",
        mlp_type="gated", hidden_act=src.hidden_act, sliding_window=src.sliding_window,
    )


def from_contract(cfg) -> Phi3Config:
    fields = source_sizes(cfg)
    del fields["head_dim"]  # Phi-3 derives it: hidden_size / num_attention_heads
    rope_parameters = source_rope(cfg)
    return Phi3Config(**fields, rms_norm_eps=cfg.norm_eps, hidden_act=cfg.hidden_act, sliding_window=cfg.sliding_window,
                      rope_parameters=rope_parameters, original_max_position_embeddings=rope_parameters.get(
                          "original_max_position_embeddings", cfg.max_position_embeddings))


def rules(src) -> list:
    attention = [rule(f"{L}.self_attn.qkv_proj.weight",
                      tuple(f"{L}.self_attn.{p}_proj.weight" for p in "qkv"), "split_qkv"),
                 rule(f"{L}.self_attn.o_proj.weight", f"{L}.self_attn.o_proj.weight")]
    mlp = [rule(f"{L}.mlp.gate_up_proj.weight", (f"{L}.mlp.gate_proj.weight", f"{L}.mlp.up_proj.weight"),
                "split_gate_up", layers="dense"),
           rule(f"{L}.mlp.down_proj.weight", f"{L}.mlp.down_proj.weight", layers="dense")]
    return [r for r in llama_rules(PRE_NORMS, attention=attention) if "mlp." not in r.src[0]] + mlp


FAMILY = Family("phi3", to_contract, from_contract, rules, "model.", Phi3Config,
                description="Phi-3, Phi-4: fused qkv_proj and gate_up_proj, LongRoPE, partial RoPE")
