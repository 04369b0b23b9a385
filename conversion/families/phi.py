"""Phi (1, 1.5, 2): parallel block with one shared LayerNorm, partial RoPE, biases everywhere, head bias."""

from __future__ import annotations

from transformers import PhiConfig

from ..core import Family, refuse, rule
from .common import linear, norm, rope, source_rope, source_sizes, sizes

L = "model.layers.{layer}"
D = "model.layers.{layer}"


def to_contract(src) -> dict:
    refuse({"qk_layernorm": src.qk_layernorm}, "phi")
    return dict(
        sizes(src), **rope(src), norm_type="layernorm", norm_eps=src.layer_norm_eps, norm_position="pre",
        parallel_block=True, parallel_norms="shared", mlp_type="dense", hidden_act=src.hidden_act, mlp_bias=True,
        attention_bias=True, lm_head_bias=True,
    )


def from_contract(cfg) -> PhiConfig:
    fields = source_sizes(cfg)
    del fields["head_dim"]
    return PhiConfig(**fields, layer_norm_eps=cfg.norm_eps, hidden_act=cfg.hidden_act, rope_parameters=source_rope(cfg))


def rules(src) -> list:
    return [
        rule("model.embed_tokens.weight", "model.embed_tokens.weight"),
        *norm(f"{L}.input_layernorm", f"{D}.pre_attn_norm"),
        *(r for p in "qkv" for r in linear(f"{L}.self_attn.{p}_proj", f"{D}.self_attn.{p}_proj")),
        *linear(f"{L}.self_attn.dense", f"{D}.self_attn.o_proj"),
        *linear(f"{L}.mlp.fc1", f"{D}.mlp.up_proj"),
        *linear(f"{L}.mlp.fc2", f"{D}.mlp.down_proj"),
        *norm("model.final_layernorm", "model.final_norm"),
        *linear("lm_head", "lm_head"),
    ]


FAMILY = Family("phi", to_contract, from_contract, rules, "model.", PhiConfig,
                description="Phi 1 / 1.5 / 2: parallel block, partial RoPE, biases",
                refusals=("qk_layernorm",))
