"""GPT-NeoX / Pythia: parallel block with two LayerNorms (or serial), partial RoPE, fused per-head QKV."""

from __future__ import annotations

from transformers import GPTNeoXConfig

from ..core import Family, rule
from .common import linear, norm, rope, source_rope, source_sizes, sizes

L = "gpt_neox.layers.{layer}"
D = "model.layers.{layer}"


def to_contract(src) -> dict:
    return dict(
        sizes(src), **rope(src), norm_type="layernorm", norm_eps=src.layer_norm_eps, norm_position="pre",
        parallel_block=src.use_parallel_residual, parallel_norms="separate", mlp_type="dense",
        hidden_act=src.hidden_act, mlp_bias=True, attention_bias=src.attention_bias,
    )


def from_contract(cfg) -> GPTNeoXConfig:
    fields = source_sizes(cfg)
    del fields["num_key_value_heads"], fields["head_dim"]
    return GPTNeoXConfig(**fields, layer_norm_eps=cfg.norm_eps, use_parallel_residual=cfg.parallel_block,
                         hidden_act=cfg.hidden_act, attention_bias=cfg.attention_bias,
                         rope_parameters=source_rope(cfg))


def rules(src) -> list:
    qkv = tuple(f"{D}.self_attn.{p}_proj" for p in "qkv")
    # The fused projection is laid out per head as [q_h, k_h, v_h] (a group of one query head).
    return [
        rule("gpt_neox.embed_in.weight", "model.embed_tokens.weight"),
        *norm(f"{L}.input_layernorm", f"{D}.pre_attn_norm"),
        *norm(f"{L}.post_attention_layernorm", f"{D}.pre_mlp_norm"),
        rule(f"{L}.attention.query_key_value.weight", tuple(f"{n}.weight" for n in qkv), "split_grouped_qkv"),
        rule(f"{L}.attention.query_key_value.bias", tuple(f"{n}.bias" for n in qkv), "split_grouped_qkv", True),
        *linear(f"{L}.attention.dense", f"{D}.self_attn.o_proj"),
        *linear(f"{L}.mlp.dense_h_to_4h", f"{D}.mlp.up_proj"),
        *linear(f"{L}.mlp.dense_4h_to_h", f"{D}.mlp.down_proj"),
        *norm("gpt_neox.final_layer_norm", "model.final_norm"),
        rule("lm_head.weight", "lm_head.weight", optional=True),
    ]


FAMILY = Family("gpt_neox", to_contract, from_contract, rules, "gpt_neox.", GPTNeoXConfig,
                ignore=(".attention.bias", ".attention.masked_bias", "rotary_emb.inv_freq"), renames={"embed_out.": "lm_head."},
                description="GPT-NeoX, Pythia: parallel (or serial) block with two norms, partial RoPE, fused QKV")
