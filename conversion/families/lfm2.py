"""LFM2 (Liquid): gated short convolutions (`"conv"` layers) beside GQA attention with per-head QK-norm, pre-norm
blocks (`operator_norm`, `ffn_norm`), a SwiGLU feed-forward (`w1` gate, `w3` up, `w2` down) and a final norm its
files call `embedding_norm`. Its convolution layers are the contract's `"linear_attention"` layers of kind
`"short_conv"` (`linear_conv_kernel_dim` its `conv_L_cache`, `conv_bias` its own).

The feed-forward width LFM2 builds is not its `intermediate_size` where `block_auto_adjust_ff_dim` is set (the
released models): 2/3 of it, times `block_ffn_dim_multiplier`, rounded up to `block_multiple_of`. The contract holds
the width built; export writes it with `block_auto_adjust_ff_dim=False`, which builds the same modules.

The released config.json files also state the blocks' and convolutions' widths (`block_dim`, `conv_dim`,
`conv_dim_out`: all `hidden_size`), which transformers' class does not read and vLLM's `Lfm2ForCausalLM` does (it
fails on a config without them); export writes them as the releases do.
"""

from __future__ import annotations

from transformers import Lfm2Config

from ..core import Family, in_layers, rule
from .common import gated_mlp, linear, norm, rope, source_rope, source_sizes, sizes

# LFM2's layer types -> the contract's
LAYER_TYPES = {"conv": "linear_attention", "full_attention": "full_attention"}


def feed_forward_width(src) -> int:
    """The width `Lfm2MLP` builds from the config (transformers' rule)."""
    width = src.intermediate_size
    if src.block_auto_adjust_ff_dim:
        width = int(2 * width / 3)
        if src.block_ffn_dim_multiplier is not None:
            width = int(src.block_ffn_dim_multiplier * width)
            width = src.block_multiple_of * ((width + src.block_multiple_of - 1) // src.block_multiple_of)
    return width


def to_contract(src) -> dict:
    layer_types = [LAYER_TYPES[t] for t in src.layer_types]
    convolutions = {}
    if "linear_attention" in layer_types:
        convolutions = dict(linear_attention_type="short_conv", linear_conv_kernel_dim=src.conv_L_cache,
                            conv_bias=src.conv_bias)
    return dict(sizes(src, intermediate_size=feed_forward_width(src)), **rope(src), norm_type="rmsnorm",
                norm_eps=src.norm_eps, norm_position="pre", mlp_type="gated", hidden_act="silu", qk_norm="head",
                layer_types=layer_types, **convolutions)


def from_contract(cfg) -> Lfm2Config:
    sizes = {k: v for k, v in source_sizes(cfg).items() if k != "head_dim"}  # LFM2 derives it: d / H
    inverse = {ours: theirs for theirs, ours in LAYER_TYPES.items()}
    widths = dict.fromkeys(("block_dim", "conv_dim", "conv_dim_out"), cfg.hidden_size)  # the releases' (vLLM reads)
    return Lfm2Config(**sizes, **widths, norm_eps=cfg.norm_eps, rope_parameters=source_rope(cfg),
                      block_auto_adjust_ff_dim=False, conv_bias=cfg.conv_bias,
                      conv_L_cache=cfg.linear_conv_kernel_dim or Lfm2Config().conv_L_cache,
                      layer_types=[inverse[t] for t in cfg.layer_types])


def rules(src) -> list:
    layer, ours = "model.layers.{layer}", "model.layers.{layer}"
    attention = []
    for theirs, mine in (("q_proj", "q_proj"), ("k_proj", "k_proj"), ("v_proj", "v_proj"), ("out_proj", "o_proj")):
        attention += linear(f"{layer}.self_attn.{theirs}", f"{ours}.self_attn.{mine}")
    attention += norm(f"{layer}.self_attn.q_layernorm", f"{ours}.self_attn.qk_norm.q_norm")
    attention += norm(f"{layer}.self_attn.k_layernorm", f"{ours}.self_attn.qk_norm.k_norm")
    convolution = []
    for theirs, mine in (("in_proj", "in_proj"), ("conv", "conv1d"), ("out_proj", "out_proj")):
        convolution += linear(f"{layer}.conv.{theirs}", f"{ours}.linear_attn.{mine}")
    return [rule("model.embed_tokens.weight", "model.embed_tokens.weight"),
            *in_layers(attention, "attention"), *in_layers(convolution, "linear_attention"),
            *gated_mlp(("w1", "w3", "w2"), "feed_forward"),
            *norm(f"{layer}.operator_norm", f"{ours}.pre_attn_norm"), *norm(f"{layer}.ffn_norm", f"{ours}.pre_mlp_norm"),
            *norm("model.embedding_norm", "model.final_norm"),  # applied after the last layer
            rule("lm_head.weight", "lm_head.weight", optional=True)]


def export_warnings(src) -> list[str]:
    """vLLM's `Lfm2ForCausalLM` ties its head to the embedding whatever the config says (the releases tie)."""
    if src.tie_word_embeddings:
        return []
    return ["`tie_word_embeddings` is False, and vLLM's `Lfm2ForCausalLM` always ties its head to the embedding: "
            "vLLM would serve this export with the embedding as its head (transformers' `Lfm2ForCausalLM` reads "
            "`lm_head.weight` as written). Serve it through transformers, or tie the head before exporting."]


FAMILY = Family("lfm2", to_contract, from_contract, rules, "model.", Lfm2Config,
                description="LFM2: gated short convolutions (`short_conv`) beside GQA with QK-norm",
                export_warnings=export_warnings)
