"""GPT-J: parallel block with one shared LayerNorm, interleaved (rotate-every-two) partial RoPE, head bias."""

from __future__ import annotations

from transformers import GPTJConfig

from ..core import Family, rule
from .common import linear, norm, tokens

L = "transformer.h.{layer}"
D = "model.layers.{layer}"


def to_contract(src) -> dict:
    head_dim = src.n_embd // src.n_head
    return dict(
        tokens(src), vocab_size=src.vocab_size, hidden_size=src.n_embd, intermediate_size=src.n_inner or 4 * src.n_embd,
        num_hidden_layers=src.n_layer, num_attention_heads=src.n_head, max_position_embeddings=src.n_positions,
        norm_type="layernorm", norm_eps=src.layer_norm_epsilon, norm_position="pre", parallel_block=True,
        parallel_norms="shared", mlp_type="dense", hidden_act=src.activation_function, mlp_bias=True,
        attention_bias=False, position_embedding_type="rope", rope_interleaved=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        partial_rotary_factor=(src.rotary_dim or head_dim) / head_dim,
        tie_word_embeddings=src.tie_word_embeddings, lm_head_bias=True,
    )


def from_contract(cfg) -> GPTJConfig:
    return GPTJConfig(
        vocab_size=cfg.vocab_size, n_embd=cfg.hidden_size, n_inner=cfg.intermediate_size, n_layer=cfg.num_hidden_layers,
        n_head=cfg.num_attention_heads, n_positions=cfg.max_position_embeddings, rotary_dim=cfg.rotary_dim,
        layer_norm_epsilon=cfg.norm_eps, activation_function=cfg.hidden_act,
        tie_word_embeddings=cfg.tie_word_embeddings, bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
        pad_token_id=cfg.pad_token_id,
    )


def rules(src) -> list:
    return [
        rule("transformer.wte.weight", "model.embed_tokens.weight"),
        *norm(f"{L}.ln_1", f"{D}.pre_attn_norm"),
        *(rule(f"{L}.attn.{p}_proj.weight", f"{D}.self_attn.{p}_proj.weight") for p in "qkv"),
        rule(f"{L}.attn.out_proj.weight", f"{D}.self_attn.o_proj.weight"),
        *linear(f"{L}.mlp.fc_in", f"{D}.mlp.up_proj"),
        *linear(f"{L}.mlp.fc_out", f"{D}.mlp.down_proj"),
        *norm("transformer.ln_f", "model.final_norm"),
        *linear("lm_head", "lm_head"),
    ]


FAMILY = Family("gptj", to_contract, from_contract, rules, "transformer.", GPTJConfig,
                ignore=(".attn.bias", ".attn.masked_bias", "embed_positions"),
                description="GPT-J: parallel block with one norm, interleaved partial RoPE, head bias")
