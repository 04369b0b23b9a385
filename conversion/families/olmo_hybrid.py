"""OLMo hybrid (`OlmoHybridForCausalLM`): Gated DeltaNet layers beside OLMo 3's attention. Its linear layers are
pre-norm blocks whose Gated DeltaNet allows negative eigenvalues (β = 2·σ(b): `linear_allow_neg_eigval`) and norms
its output with fla's epsilon 1e-5 (`linear_norm_eps`; its block norms use 1e-6); its attention layers are OLMo 2's
output-norm blocks (x + N(F(x))) with QK-norm over the whole projection, and RoPE where `rope_theta` is set (only
there: the linear layers read no positions; the released checkpoints set none, so every layer is NoPE).

Its files keep the Gated DeltaNet's projections and convolutions separate (`q_proj`, `k_proj`, `v_proj`, the
`q_conv1d`, `k_conv1d`, `v_conv1d` of H_k·d_k, H_k·d_k and H_v·d_v rows), which become the contract's `in_proj_qkv`
and `conv1d` (stacked, exact both ways); `g_proj` is the gate `in_proj_z`, `o_norm` the gated norm. A linear layer's
norms are `attention_layer_norm` and `feedforward_layer_norm`, an attention layer's `post_attention_layernorm` and
`post_feedforward_layernorm`, as the released checkpoints name them.

transformers' `save_pretrained` (5.16.1 to 5.25) writes another layout: the three convolutions cut into equal
thirds (not H_k·d_k, H_k·d_k, H_v·d_v rows: wrong for every checkpoint with d_v ≠ d_k, as the released one) and an
attention layer's `post_attention_layernorm` as `feedforward_layer_norm`; its own class reads that back. Such folders
convert too (the convolutions are stacked either way, and its norms renamed as transformers renames them on load);
export writes the released layout.
"""

from __future__ import annotations

from transformers import OlmoHybridConfig

from ..core import Family, SplitTensor, in_layers, rule
from .common import gated_mlp, linear, norm, rope, source_rope, source_sizes, sizes
from .qwen3_next import linear_fields, source_linear_fields

# The epsilon transformers' class gives the Gated DeltaNet's output norm (fla's `FusedRMSNormGated` default)
OUTPUT_NORM_EPS = 1e-5


def positions(src) -> dict:
    """RoPE where `rope_theta` is set, else NoPE (the released checkpoints)."""
    params = getattr(src, "rope_parameters", None) or {}
    if params.get("rope_theta") is None:
        return {"position_embedding_type": "none"}
    return rope(src)


def to_contract(src) -> dict:
    layer_types = list(src.layer_types)
    linear = {}
    if "linear_attention" in layer_types:
        linear = dict(linear_fields(src), linear_allow_neg_eigval=bool(src.linear_allow_neg_eigval),
                      linear_norm_eps=OUTPUT_NORM_EPS, linear_attention_norm_position="pre")
    return dict(sizes(src), **positions(src), norm_type="rmsnorm", norm_eps=src.rms_norm_eps, norm_position="output",
                mlp_type="gated", hidden_act=src.hidden_act, attention_bias=src.attention_bias, qk_norm="full",
                layer_types=layer_types, **linear)


def from_contract(cfg) -> OlmoHybridConfig:
    sizes = {k: v for k, v in source_sizes(cfg).items() if k != "head_dim"}  # OLMo hybrid derives it: d / H
    rope_parameters = source_rope(cfg) if cfg.uses_rope else {"rope_type": "default", "rope_theta": None}
    return OlmoHybridConfig(**sizes, rms_norm_eps=cfg.norm_eps, hidden_act=cfg.hidden_act,
                            attention_bias=cfg.attention_bias, rope_parameters=rope_parameters,
                            layer_types=list(cfg.layer_types), linear_allow_neg_eigval=cfg.linear_allow_neg_eigval,
                            **source_linear_fields(cfg))


def rules(src) -> list:
    layer, linear_attn = "model.layers.{layer}", "model.layers.{layer}.linear_attn"
    gated_deltanet = [
        rule(tuple(f"{linear_attn}.{x}_proj.weight" for x in "qkv"), f"{linear_attn}.in_proj_qkv.weight",
             "fuse_linear_qkv"),
        *(rule(f"{linear_attn}.{theirs}", f"{linear_attn}.{ours}")
          for theirs, ours in (("conv1d.weight", "conv1d.weight"), ("a_proj.weight", "in_proj_a.weight"),
                               ("b_proj.weight", "in_proj_b.weight"), ("g_proj.weight", "in_proj_z.weight"),
                               ("o_proj.weight", "out_proj.weight"), ("o_norm.weight", "norm.weight"),
                               ("A_log", "A_log"), ("dt_bias", "dt_bias"))),
        *norm(f"{layer}.input_layernorm", f"{layer}.pre_attn_norm"),
        *norm(f"{layer}.post_attention_layernorm", f"{layer}.pre_mlp_norm"),
    ]
    attention = []
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        attention += linear(f"{layer}.self_attn.{proj}", f"{layer}.self_attn.{proj}")
    attention += norm(f"{layer}.self_attn.q_norm", f"{layer}.self_attn.qk_norm.q_norm")
    attention += norm(f"{layer}.self_attn.k_norm", f"{layer}.self_attn.qk_norm.k_norm")
    attention += norm(f"{layer}.post_attention_layernorm", f"{layer}.post_attn_norm")
    attention += norm(f"{layer}.post_feedforward_layernorm", f"{layer}.post_mlp_norm")
    return [rule("model.embed_tokens.weight", "model.embed_tokens.weight"),
            *in_layers(gated_deltanet, "linear_attention"), *in_layers(attention, "attention"), *gated_mlp(),
            *norm("model.norm", "model.final_norm"), rule("lm_head.weight", "lm_head.weight", optional=True)]


def conv_widths(config) -> list[int]:
    """The rows of `q_conv1d`, `k_conv1d` and `v_conv1d`: H_k·d_k, H_k·d_k, H_v·d_v."""
    key = config.linear_num_key_heads * config.linear_key_head_dim
    return [key, key, config.linear_num_value_heads * config.linear_value_head_dim]


# The released files' names of a linear layer's norms -> the model's (transformers renames them on load, in every layer)
RENAMES = {"model.layers.{layer}.attention_layer_norm.": "model.layers.{layer}.input_layernorm.",
           "model.layers.{layer}.feedforward_layer_norm.": "model.layers.{layer}.post_attention_layernorm."}
CONVOLUTIONS = SplitTensor(tuple(f"model.layers.{{layer}}.linear_attn.{x}_conv1d.weight" for x in "qkv"),
                           "model.layers.{layer}.linear_attn.conv1d.weight", conv_widths)

FAMILY = Family("olmo_hybrid", to_contract, from_contract, rules, "model.", OlmoHybridConfig, renames=RENAMES,
                split=(CONVOLUTIONS,), renamed_layers=dict.fromkeys(RENAMES, "linear_attention"),
                description="OLMo hybrid: Gated DeltaNet (β×2, negative eigenvalues) beside output-norm attention, "
                            "RoPE on full layers only")
