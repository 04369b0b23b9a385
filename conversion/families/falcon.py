"""Falcon: parallel attention + MLP, MQA (7B), GQA with two LayerNorms (new decoder architecture, 40B/180B).

Its fused QKV is laid out per K/V group: [q_1..q_g, k, v] for each group. The old MHA layout
([q, k, v] per head) and MQA ([all q, k, v]) are the same pattern with g = 1 and with one group.
"""

from __future__ import annotations

from transformers import FalconConfig

from ..core import Family, refuse, rule
from .common import linear, norm, rope, source_rope, tokens

L = "transformer.h.{layer}"
D = "model.layers.{layer}"


def _kv_heads(src) -> int:
    if src.new_decoder_architecture:
        return src.num_kv_heads
    return 1 if src.multi_query else src.num_attention_heads


def _separate_norms(src) -> bool:
    return bool(src.new_decoder_architecture) and (src.num_ln_in_parallel_attn or 2) == 2


def to_contract(src) -> dict:
    refuse({
        "ALiBi (alibi=True; Falcon's scaled variant)": src.alibi,
        "new_decoder_architecture without parallel_attn": src.new_decoder_architecture and not src.parallel_attn,
    }, "falcon")
    parallel = bool(src.parallel_attn or src.new_decoder_architecture)
    return dict(
        tokens(src), **rope(src), vocab_size=src.vocab_size, hidden_size=src.hidden_size,
        intermediate_size=src.ffn_hidden_size, num_hidden_layers=src.num_hidden_layers,
        num_attention_heads=src.num_attention_heads, num_key_value_heads=_kv_heads(src),
        max_position_embeddings=src.max_position_embeddings, norm_type="layernorm", norm_eps=src.layer_norm_epsilon,
        norm_position="pre", parallel_block=parallel, parallel_norms="separate" if _separate_norms(src) else "shared",
        mlp_type="dense", hidden_act=src.activation, mlp_bias=src.bias, attention_bias=src.bias,
        tie_word_embeddings=src.tie_word_embeddings,
    )


def from_contract(cfg) -> FalconConfig:
    kv, heads = cfg.num_key_value_heads, cfg.num_attention_heads
    new = cfg.parallel_block and cfg.parallel_norms == "separate" or 1 < kv < heads
    return FalconConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, ffn_hidden_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=heads, num_kv_heads=kv,
        new_decoder_architecture=new, multi_query=not new and kv == 1, parallel_attn=cfg.parallel_block,
        num_ln_in_parallel_attn=(2 if cfg.parallel_norms == "separate" else 1) if new else None,
        max_position_embeddings=cfg.max_position_embeddings, layer_norm_epsilon=cfg.norm_eps,
        activation=cfg.hidden_act, bias=cfg.attention_bias, tie_word_embeddings=cfg.tie_word_embeddings,
        rope_parameters=source_rope(cfg), bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
        pad_token_id=cfg.pad_token_id,
    )


def rules(src) -> list:
    qkv = tuple(f"{D}.self_attn.{p}_proj" for p in "qkv")
    if _separate_norms(src):
        norms = [*norm(f"{L}.ln_attn", f"{D}.pre_attn_norm"), *norm(f"{L}.ln_mlp", f"{D}.pre_mlp_norm")]
    elif src.parallel_attn or src.new_decoder_architecture:
        norms = norm(f"{L}.input_layernorm", f"{D}.pre_attn_norm")
    else:
        norms = [*norm(f"{L}.input_layernorm", f"{D}.pre_attn_norm"),
                 *norm(f"{L}.post_attention_layernorm", f"{D}.pre_mlp_norm")]
    return [
        rule("transformer.word_embeddings.weight", "model.embed_tokens.weight"),
        *norms,
        rule(f"{L}.self_attention.query_key_value.weight", tuple(f"{n}.weight" for n in qkv), "split_grouped_qkv"),
        rule(f"{L}.self_attention.query_key_value.bias", tuple(f"{n}.bias" for n in qkv), "split_grouped_qkv", True),
        *linear(f"{L}.self_attention.dense", f"{D}.self_attn.o_proj"),
        *linear(f"{L}.mlp.dense_h_to_4h", f"{D}.mlp.up_proj"),
        *linear(f"{L}.mlp.dense_4h_to_h", f"{D}.mlp.down_proj"),
        *norm("transformer.ln_f", "model.final_norm"),
        rule("lm_head.weight", "lm_head.weight", optional=True),
    ]


FAMILY = Family("falcon", to_contract, from_contract, rules, "transformer.", FalconConfig,
                description="Falcon: parallel block, MQA / GQA, fused QKV",
                refusals=("ALiBi (`alibi=True`)", "new_decoder_architecture without parallel_attn"))
