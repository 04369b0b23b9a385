"""GPT-2: pre-norm LayerNorm, learned positions, GELU, biases, tied head; `Conv1D` weights stored (in, out)."""

from __future__ import annotations

from transformers import GPT2Config

from ..core import Family, refuse, rule
from .common import linear, norm, tokens

L = "transformer.h.{layer}"
D = "model.layers.{layer}"


def to_contract(src) -> dict:
    refuse({
        "scale_attn_by_inverse_layer_idx": src.scale_attn_by_inverse_layer_idx,
        "scale_attn_weights=False": not src.scale_attn_weights,
        "add_cross_attention": src.add_cross_attention,
    }, "gpt2")
    return dict(
        tokens(src), vocab_size=src.vocab_size, hidden_size=src.n_embd, intermediate_size=src.n_inner or 4 * src.n_embd,
        num_hidden_layers=src.n_layer, num_attention_heads=src.n_head, max_position_embeddings=src.n_positions,
        norm_type="layernorm", norm_eps=src.layer_norm_epsilon, norm_position="pre", mlp_type="dense",
        hidden_act=src.activation_function, mlp_bias=True, attention_bias=True, position_embedding_type="learned",
        tie_word_embeddings=src.tie_word_embeddings,
    )


def from_contract(cfg) -> GPT2Config:
    return GPT2Config(
        vocab_size=cfg.vocab_size, n_embd=cfg.hidden_size, n_inner=cfg.intermediate_size, n_layer=cfg.num_hidden_layers,
        n_head=cfg.num_attention_heads, n_positions=cfg.max_position_embeddings, layer_norm_epsilon=cfg.norm_eps,
        activation_function=cfg.hidden_act, tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id,
    )


def rules(src) -> list:
    return [
        rule("transformer.wte.weight", "model.embed_tokens.weight"),
        rule("transformer.wpe.weight", "model.embed_positions.embed.weight"),
        *norm(f"{L}.ln_1", f"{D}.pre_attn_norm"),
        rule(f"{L}.attn.c_attn.weight", tuple(f"{D}.self_attn.{p}_proj.weight" for p in "qkv"), "split_conv1d_qkv"),
        rule(f"{L}.attn.c_attn.bias", tuple(f"{D}.self_attn.{p}_proj.bias" for p in "qkv"), "split_qkv"),
        *linear(f"{L}.attn.c_proj", f"{D}.self_attn.o_proj", "transpose"),
        *norm(f"{L}.ln_2", f"{D}.pre_mlp_norm"),
        *linear(f"{L}.mlp.c_fc", f"{D}.mlp.up_proj", "transpose"),
        *linear(f"{L}.mlp.c_proj", f"{D}.mlp.down_proj", "transpose"),
        *norm("transformer.ln_f", "model.final_norm"),
        rule("lm_head.weight", "lm_head.weight", optional=True),
    ]


FAMILY = Family("gpt2", to_contract, from_contract, rules, "transformer.", GPT2Config,
                ignore=(".attn.bias", ".attn.masked_bias"),
                description="GPT-2: pre-norm LayerNorm, learned positions, Conv1D weights, tied head",
                refusals=("scale_attn_by_inverse_layer_idx", "scale_attn_weights=False", "add_cross_attention"))
