"""GPT-1 (openai-gpt): post-norm blocks, learned positions, GELU, biases, tied head, `Conv1D` weights."""

from __future__ import annotations

from transformers import OpenAIGPTConfig

from ..core import Family, rule
from .common import tokens

L = "transformer.h.{layer}"
D = "model.layers.{layer}"
# openai-gpt's own activation table (modeling_openai.ACT_FNS): its "gelu" is the tanh approximation.
AFN = {"gelu": "gelu_new", "relu": "relu", "silu": "silu", "swish": "silu"}
AFN_BACK = {"gelu_new": "gelu", "relu": "relu", "silu": "silu"}


def to_contract(src) -> dict:
    if src.afn not in AFN:
        raise ValueError(f"openai-gpt `afn`={src.afn!r} is not one of {sorted(AFN)}.")
    return dict(
        tokens(src), vocab_size=src.vocab_size, hidden_size=src.n_embd, intermediate_size=4 * src.n_embd,
        num_hidden_layers=src.n_layer, num_attention_heads=src.n_head, max_position_embeddings=src.n_positions,
        norm_type="layernorm", norm_eps=src.layer_norm_epsilon, norm_position="post", mlp_type="dense",
        hidden_act=AFN[src.afn], mlp_bias=True, attention_bias=True, position_embedding_type="learned",
        tie_word_embeddings=src.tie_word_embeddings,
    )


def from_contract(cfg) -> OpenAIGPTConfig:
    if cfg.hidden_act not in AFN_BACK:
        raise ValueError(f"openai-gpt cannot express `hidden_act`={cfg.hidden_act!r}; it has {sorted(AFN_BACK)}.")
    return OpenAIGPTConfig(
        vocab_size=cfg.vocab_size, n_embd=cfg.hidden_size, n_layer=cfg.num_hidden_layers, n_head=cfg.num_attention_heads,
        n_positions=cfg.max_position_embeddings, layer_norm_epsilon=cfg.norm_eps, afn=AFN_BACK[cfg.hidden_act],
        tie_word_embeddings=cfg.tie_word_embeddings, bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
        pad_token_id=cfg.pad_token_id,
    )


def rules(src) -> list:
    return [
        rule("transformer.tokens_embed.weight", "model.embed_tokens.weight"),
        rule("transformer.positions_embed.weight", "model.embed_positions.embed.weight"),
        rule(f"{L}.attn.c_attn.weight", tuple(f"{D}.self_attn.{p}_proj.weight" for p in "qkv"), "split_conv1d_qkv"),
        rule(f"{L}.attn.c_attn.bias", tuple(f"{D}.self_attn.{p}_proj.bias" for p in "qkv"), "split_qkv"),
        rule(f"{L}.attn.c_proj.weight", f"{D}.self_attn.o_proj.weight", "transpose"),
        rule(f"{L}.attn.c_proj.bias", f"{D}.self_attn.o_proj.bias"),
        rule(f"{L}.ln_1.weight", f"{D}.post_attn_norm.weight"),
        rule(f"{L}.ln_1.bias", f"{D}.post_attn_norm.bias"),
        rule(f"{L}.mlp.c_fc.weight", f"{D}.mlp.up_proj.weight", "transpose"),
        rule(f"{L}.mlp.c_fc.bias", f"{D}.mlp.up_proj.bias"),
        rule(f"{L}.mlp.c_proj.weight", f"{D}.mlp.down_proj.weight", "transpose"),
        rule(f"{L}.mlp.c_proj.bias", f"{D}.mlp.down_proj.bias"),
        rule(f"{L}.ln_2.weight", f"{D}.post_mlp_norm.weight"),
        rule(f"{L}.ln_2.bias", f"{D}.post_mlp_norm.bias"),
        rule("lm_head.weight", "lm_head.weight", optional=True),
    ]


FAMILY = Family("openai-gpt", to_contract, from_contract, rules, "transformer.", OpenAIGPTConfig,
                ignore=(".attn.bias", "position_ids"),
                description="GPT-1: post-norm blocks, learned positions, GELU, biases", vllm_native=False)
