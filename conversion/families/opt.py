"""OPT: pre-norm LayerNorm, ReLU, learned positions whose table starts 2 rows early (the offset)."""

from __future__ import annotations

from transformers import OPTConfig

from ..core import Family, refuse, rule
from .common import linear, norm, tokens

L = "model.decoder.layers.{layer}"
D = "model.layers.{layer}"


def to_contract(src) -> dict:
    refuse({
        "project_in/project_out (word_embed_proj_dim != hidden_size)": src.word_embed_proj_dim != src.hidden_size,
        "post-norm blocks (do_layer_norm_before=False)": not src.do_layer_norm_before,
        "no final layer norm (_remove_final_layer_norm)": bool(getattr(src, "_remove_final_layer_norm", False)),
        "LayerNorms without weights (layer_norm_elementwise_affine=False)": not src.layer_norm_elementwise_affine,
    }, "opt")
    return dict(
        tokens(src), vocab_size=src.vocab_size, hidden_size=src.hidden_size, intermediate_size=src.ffn_dim,
        num_hidden_layers=src.num_hidden_layers, num_attention_heads=src.num_attention_heads,
        max_position_embeddings=src.max_position_embeddings, norm_type="layernorm", norm_eps=1e-5,
        norm_position="pre", mlp_type="dense", hidden_act=src.activation_function, mlp_bias=src.enable_bias,
        attention_bias=src.enable_bias, position_embedding_type="learned", learned_position_offset=2,
        tie_word_embeddings=src.tie_word_embeddings,
    )


def from_contract(cfg) -> OPTConfig:
    return OPTConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, word_embed_proj_dim=cfg.hidden_size,
        ffn_dim=cfg.intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, max_position_embeddings=cfg.max_position_embeddings,
        activation_function=cfg.hidden_act, enable_bias=cfg.attention_bias, do_layer_norm_before=True,
        tie_word_embeddings=cfg.tie_word_embeddings, bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
        pad_token_id=cfg.pad_token_id,
    )


def rules(src) -> list:
    # OPT's position table has `max_position_embeddings + 2` rows; the contract's
    # `learned_position_offset=2` keeps the same rows, so it copies unchanged.
    return [
        rule("model.decoder.embed_tokens.weight", "model.embed_tokens.weight"),
        rule("model.decoder.embed_positions.weight", "model.embed_positions.embed.weight"),
        *norm(f"{L}.self_attn_layer_norm", f"{D}.pre_attn_norm"),
        *linear(f"{L}.self_attn.q_proj", f"{D}.self_attn.q_proj"),
        *linear(f"{L}.self_attn.k_proj", f"{D}.self_attn.k_proj"),
        *linear(f"{L}.self_attn.v_proj", f"{D}.self_attn.v_proj"),
        *linear(f"{L}.self_attn.out_proj", f"{D}.self_attn.o_proj"),
        *norm(f"{L}.final_layer_norm", f"{D}.pre_mlp_norm"),
        *linear(f"{L}.fc1", f"{D}.mlp.up_proj"),
        *linear(f"{L}.fc2", f"{D}.mlp.down_proj"),
        *norm("model.decoder.final_layer_norm", "model.final_norm"),
        rule("lm_head.weight", "lm_head.weight", optional=True),
    ]


FAMILY = Family("opt", to_contract, from_contract, rules, "model.", OPTConfig,
                description="OPT: learned positions offset by 2, ReLU",
                refusals=("word_embed_proj_dim != hidden_size", "post-norm blocks", "no final norm",
                          "LayerNorms without weights"))
