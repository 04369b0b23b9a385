"""Gemma 4 (text, `Gemma4ForCausalLM`): Gemma 3's sandwich block and local / global layers, with plain-weight RMS norms,
per-head q / k norms and a weightless value norm, scores unscaled; global layers with their own head width and K/V
heads (`global_head_dim`, `num_global_key_value_heads`), their values taken from the key projection
(`attention_k_eq_v`) and proportional RoPE; the last `num_kv_shared_layers` layers reading earlier layers' keys and
values (twice as wide MLPs there with `use_double_wide_mlp`); per-layer embeddings (`hidden_size_per_layer_input`); a
scalar per layer (`layer_scalar`); with `enable_moe_block`, experts beside the dense MLP in every layer, routed by a
normed, scaled router with a scale per expert.

transformers holds the global layers' shapes in its `per_layer_config` (made from the `global_head_dim` and
`num_global_key_value_heads` its config takes); the contract names them as fields.
`use_bidirectional_attention="vision"` (the larger releases) lets image tokens attend both ways inside the multimodal
wrapper, where the text model itself is causal: it converts, and a text-only export leaves it unset (a `gemma4`
release export keeps the release's value); `"all"` is refused.
"""

from __future__ import annotations

import math

from transformers import Gemma4TextConfig

from ..core import Family, refuse, rule
from .common import linear, llama_rules, norm, rope, source_rope, source_sizes, sizes
from .gemma2 import SANDWICH_NORMS

GLOBAL = "full_attention"


def _global_shape(src) -> dict:
    """The global layers' head width and K/V heads where they differ from the others' (transformers keeps them in
    `per_layer_config`)."""
    full = [i for i, t in enumerate(src.layer_types[:src.num_hidden_layers]) if t == GLOBAL]
    if not full:
        return {}
    layer = src.per_layer_config[full[0]]
    shape = {}
    if layer.head_dim != src.head_dim:
        shape["global_head_dim"] = layer.head_dim
    if layer.num_key_value_heads != src.num_key_value_heads:
        shape["num_global_key_value_heads"] = layer.num_key_value_heads
    return shape


def _experts(src) -> dict:
    if not src.enable_moe_block:
        return {"mlp_type": "gated"}
    return dict(mlp_type="moe", num_experts=src.num_experts, num_experts_per_tok=src.top_k_experts,
                moe_intermediate_size=src.moe_intermediate_size, norm_topk_prob=True, parallel_dense_mlp=True,
                router_input_norm=True, router_expert_scale=True)


def _widths(src) -> list[int] | None:
    """`use_double_wide_mlp`: the layers that read shared keys and values are twice as wide."""
    shared = src.num_kv_shared_layers
    if not (src.use_double_wide_mlp and shared):
        return None
    layers = src.num_hidden_layers
    return [src.intermediate_size * (2 if i >= layers - shared else 1) for i in range(layers)]


def to_contract(src) -> dict:
    # "vision" makes image tokens attend both ways inside the multimodal wrapper; the text model itself stays causal
    refuse({"use_bidirectional_attention='all'": src.use_bidirectional_attention == "all"}, "gemma4")
    # the sliding layers' heads, as the fields' global values: the global layers' are read from `per_layer_config`
    src.allow_global_per_layer_attribute_access = True
    per_layer = src.hidden_size_per_layer_input
    return dict(
        sizes(src), **rope(src), norm_type="rmsnorm", norm_eps=src.rms_norm_eps, norm_position="sandwich",
        hidden_act=src.hidden_activation, attention_bias=src.attention_bias, attention_output_bias=src.attention_bias,
        embedding_multiplier=math.sqrt(src.hidden_size), qk_norm="head", value_norm=True, query_pre_attn_scalar=1.0,
        final_logit_softcapping=src.final_logit_softcapping, sliding_window=src.sliding_window,
        layer_types=list(src.layer_types[:src.num_hidden_layers]), **_global_shape(src),
        attention_k_eq_v=src.attention_k_eq_v, num_kv_shared_layers=src.num_kv_shared_layers,
        hidden_size_per_layer_input=per_layer, vocab_size_per_layer_input=src.vocab_size_per_layer_input if per_layer
        else None, layer_scalar=True, layer_intermediate_sizes=_widths(src), **_experts(src),
    )


def from_contract(cfg) -> Gemma4TextConfig:
    widths = cfg.layer_intermediate_sizes
    experts = dict(enable_moe_block=True, num_experts=cfg.num_experts, top_k_experts=cfg.num_experts_per_tok,
                   moe_intermediate_size=cfg.moe_intermediate_size) if cfg.mlp_type == "moe" else {}
    shape = {"global_head_dim": cfg.global_head_dim or cfg.head_dim}
    if cfg.num_global_key_value_heads is not None:
        shape["num_global_key_value_heads"] = cfg.num_global_key_value_heads
    return Gemma4TextConfig(
        **source_sizes(cfg), rms_norm_eps=cfg.norm_eps, hidden_activation=cfg.hidden_act,
        attention_bias=cfg.attention_bias, final_logit_softcapping=cfg.final_logit_softcapping,
        sliding_window=cfg.sliding_window, layer_types=list(cfg.layer_types), rope_parameters=source_rope(cfg),
        attention_k_eq_v=cfg.attention_k_eq_v, num_kv_shared_layers=cfg.num_kv_shared_layers,
        hidden_size_per_layer_input=cfg.hidden_size_per_layer_input,
        vocab_size_per_layer_input=cfg.vocab_size_per_layer_input or cfg.vocab_size,
        use_double_wide_mlp=widths is not None and widths[-1] != widths[0], **shape, **experts,
    )


LAYER = "model.layers.{layer}"


def gemma_attention_rules() -> list:
    """Gemma 3n's and Gemma 4's attention: q / k norms per head; no k / v projections or key norm where a layer reads
    another's keys and values, no `v_proj` where it takes its values from its keys (those rules are optional)."""
    attention = [*linear(f"{LAYER}.self_attn.q_proj", f"{LAYER}.self_attn.q_proj"),
                 *linear(f"{LAYER}.self_attn.o_proj", f"{LAYER}.self_attn.o_proj"),
                 *norm(f"{LAYER}.self_attn.q_norm", f"{LAYER}.self_attn.qk_norm.q_norm")]
    for name, target in (("k_proj", "k_proj"), ("v_proj", "v_proj"), ("k_norm", "qk_norm.k_norm")):
        attention += [rule(f"{LAYER}.self_attn.{name}.{p}", f"{LAYER}.self_attn.{target}.{p}", optional=True)
                      for p in ("weight", "bias")]
    return attention


def per_layer_embedding_rules() -> list:
    """The model's per-layer table, projection and norm, and each layer's branch (Gemma 3n's and Gemma 4's names)."""
    rules = [rule(f"{LAYER}.{theirs}.weight", f"{LAYER}.per_layer_input.{mine}.weight")
             for theirs, mine in (("per_layer_input_gate", "input_gate"), ("per_layer_projection", "output_proj"),
                                  ("post_per_layer_input_norm", "post_norm"))]
    model = (("embed_tokens_per_layer", "embed"), ("per_layer_model_projection", "projection"),
             ("per_layer_projection_norm", "norm"))
    return rules + [rule(f"model.{theirs}.weight", f"model.per_layer_embeddings.{mine}.weight")
                    for theirs, mine in model]


def rules(src) -> list:
    layer, ours = LAYER, LAYER
    attention = gemma_attention_rules()
    moe = []
    if src.enable_moe_block:
        moe = [rule(f"{layer}.mlp.{p}.weight", f"{ours}.mlp.dense.{p}.weight", layers="sparse")
               for p in ("gate_proj", "up_proj", "down_proj")]
        moe += [rule(f"{layer}.router.proj.weight", f"{ours}.mlp.gate.weight", layers="sparse")]
        moe += [rule(f"{layer}.router.{p}", f"{ours}.mlp.gate.{p}", layers="sparse")
                for p in ("scale", "per_expert_scale")]
        moe += [rule(f"{layer}.experts.{p}", f"{ours}.mlp.experts.{p}", layers="sparse")
                for p in ("gate_up_proj", "down_proj")]
        moe += [rule(f"{layer}.{theirs}.weight", f"{ours}.mlp.{mine}.weight", layers="sparse")
                for theirs, mine in (("post_feedforward_layernorm_1", "post_dense_norm"),
                                     ("pre_feedforward_layernorm_2", "pre_experts_norm"),
                                     ("post_feedforward_layernorm_2", "post_experts_norm"))]
    rules = llama_rules(SANDWICH_NORMS, attention=attention, moe=moe)
    rules.append(rule(f"{layer}.layer_scalar", f"{ours}.layer_scalar"))
    return rules + (per_layer_embedding_rules() if src.hidden_size_per_layer_input else [])


FAMILY = Family("gemma4_text", to_contract, from_contract, rules, "model.", Gemma4TextConfig,
                description="Gemma 4 text model: per-layer attention shapes, keys and values shared across layers, "
                            "per-layer embeddings, experts beside the dense MLP",
                refusals=("bidirectional attention (`use_bidirectional_attention='all'`)",))
