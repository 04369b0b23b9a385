"""BLOOM: ALiBi, a LayerNorm on the embedding, fused per-head QKV, GELU (tanh), tied head."""

from __future__ import annotations

from transformers import BloomConfig

from ..core import Family, refuse, rule
from .common import linear, norm, tokens

L = "transformer.h.{layer}"
D = "model.layers.{layer}"


def to_contract(src) -> dict:
    refuse({"apply_residual_connection_post_layernorm": src.apply_residual_connection_post_layernorm}, "bloom")
    return dict(
        tokens(src), vocab_size=src.vocab_size, hidden_size=src.hidden_size, intermediate_size=4 * src.hidden_size,
        num_hidden_layers=src.n_layer, num_attention_heads=src.n_head, max_position_embeddings=2048,
        norm_type="layernorm", norm_eps=src.layer_norm_epsilon, norm_position="pre", mlp_type="dense",
        # BLOOM's own GELU is the tanh approximation (modeling_bloom.bloom_gelu_forward)
        hidden_act="gelu_pytorch_tanh", mlp_bias=True, attention_bias=True, position_embedding_type="alibi",
        embedding_norm=True, tie_word_embeddings=src.tie_word_embeddings,
    )


def from_contract(cfg) -> BloomConfig:
    if cfg.hidden_act not in ("gelu_pytorch_tanh", "gelu_new") or cfg.intermediate_size != 4 * cfg.hidden_size:
        raise ValueError("BLOOM has only the tanh GELU and `intermediate_size` = 4 * `hidden_size`; got "
                         f"`hidden_act`={cfg.hidden_act!r}, `intermediate_size`={cfg.intermediate_size}.")
    return BloomConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, n_layer=cfg.num_hidden_layers,
        n_head=cfg.num_attention_heads, layer_norm_epsilon=cfg.norm_eps, tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id,
    )


def rules(src) -> list:
    qkv = tuple(f"{D}.self_attn.{p}_proj" for p in "qkv")
    return [
        rule("transformer.word_embeddings.weight", "model.embed_tokens.weight"),
        *norm("transformer.word_embeddings_layernorm", "model.embed_norm"),
        *norm(f"{L}.input_layernorm", f"{D}.pre_attn_norm"),
        rule(f"{L}.self_attention.query_key_value.weight", tuple(f"{n}.weight" for n in qkv), "split_grouped_qkv"),
        rule(f"{L}.self_attention.query_key_value.bias", tuple(f"{n}.bias" for n in qkv), "split_grouped_qkv"),
        *linear(f"{L}.self_attention.dense", f"{D}.self_attn.o_proj"),
        *norm(f"{L}.post_attention_layernorm", f"{D}.pre_mlp_norm"),
        *linear(f"{L}.mlp.dense_h_to_4h", f"{D}.mlp.up_proj"),
        *linear(f"{L}.mlp.dense_4h_to_h", f"{D}.mlp.down_proj"),
        *norm("transformer.ln_f", "model.final_norm"),
        rule("lm_head.weight", "lm_head.weight", optional=True),
    ]


FAMILY = Family("bloom", to_contract, from_contract, rules, "transformer.", BloomConfig,
                description="BLOOM: ALiBi, embedding LayerNorm, fused QKV",
                refusals=("apply_residual_connection_post_layernorm",))
