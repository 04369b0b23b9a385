"""Kimi Linear (Moonshot, `KimiLinearForCausalLM`, transformers 5.17 onwards): Kimi Delta Attention layers (the
contract's `"linear_attention"` layers of kind `"kda"`) beside DeepSeek-V3's latent attention without RoPE (NoPE:
its decoupled key is never rotated, `position_embedding_type="none"`) and DeepSeek-V3's experts (sigmoid scores
with a correction bias, shared experts, dense first layers), pre-norm blocks.

Both layer kinds sit at `self_attn` in its files and its model; the contract's KDA layers are `linear_attn`. The
released files keep, where transformers' model holds otherwise: the forget gate's `f_a_proj`, `f_b_proj`, `dt_bias`
and `A_log` beside the other KDA tensors (its model nests them in `forget_gate`), `A_log` as (1, 1, H, 1) (the
contract's is (H,)), the three short convolutions apart (`q_conv1d`, `k_conv1d`, `v_conv1d`; its model stacks them
in `conv1d`), a sparse layer's feed-forward as `block_sparse_moe` with one tensor per expert (`w1` gate, `w3` up,
`w2` down). transformers' `save_pretrained` also names a dense layer's MLP `block_sparse_moe` (its reverse rename
holds in every layer); such folders convert too, and export writes the released layout. Its latent norms use 1e-6
whatever `rms_norm_eps` says (`latent_norm_eps`), its KDA output norm `rms_norm_eps`.

transformers 5.16 has no Kimi Linear: this module imports there (its config class looked up when used) and converts
nothing.
"""

from __future__ import annotations

import transformers

from ..core import Family, SplitTensor, in_layers, refuse, rule
from .common import PRE_NORMS, expert_stacks, llama_rules, moe_rules, source_sizes, sizes
from .deepseek_v2 import LATENT_NORM_EPS, mla_attention_rules

FAMILY_NAME = "kimi_linear"
KDA_NAMES = ("q_proj", "k_proj", "v_proj", "conv1d", "b_proj", "g_a_proj", "g_b_proj", "o_norm", "o_proj")
FORGET_GATE = ("f_a_proj.weight", "f_b_proj.weight", "dt_bias")


def config_class():
    """transformers' `KimiLinearConfig` (a `ValueError` naming the release where it has none)."""
    config = getattr(transformers, "KimiLinearConfig", None)
    if config is None:
        raise ValueError(f"transformers {transformers.__version__} has no Kimi Linear (`KimiLinearConfig`, 5.17 "
                         "onwards): install a newer release to convert it.")
    return config


def to_contract(src) -> dict:
    # transformers' class never rotates the latent attention's key; a config saying otherwise is not its model
    refuse({"latent attention with RoPE (`mla_use_nope: false`)": getattr(src, "mla_use_nope", True) is False},
           FAMILY_NAME)
    # its class never ties the head to the embedding (`_tied_weights_keys = {}`), whatever `tie_word_embeddings` says
    fields = sizes(src, num_key_value_heads=src.num_attention_heads, tie_word_embeddings=False)
    fields.pop("head_dim")  # Kimi Linear sets head_dim = qk_rope_head_dim; MLA widths are explicit below
    fields.update(position_embedding_type="none", norm_type="rmsnorm", norm_eps=src.rms_norm_eps, norm_position="pre",
                  hidden_act=src.hidden_act, attention_type="mla", q_lora_rank=src.q_lora_rank,
                  kv_lora_rank=src.kv_lora_rank, qk_nope_head_dim=src.qk_nope_head_dim,
                  qk_rope_head_dim=src.qk_rope_head_dim, v_head_dim=src.v_head_dim, latent_norm_eps=LATENT_NORM_EPS,
                  attention_bias=src.attention_bias, attention_output_bias=src.attention_bias,
                  layer_types=list(src.layer_types))
    if "linear_attention" in src.layer_types:
        fields.update(linear_attention_type="kda", linear_num_key_heads=src.linear_num_heads,
                      linear_num_value_heads=src.linear_num_heads, linear_key_head_dim=src.linear_head_dim,
                      linear_value_head_dim=src.linear_head_dim, linear_conv_kernel_dim=src.linear_conv_kernel_dim)
    if "sparse" in src.mlp_layer_types:
        fields.update(mlp_type="moe", mlp_layer_types=list(src.mlp_layer_types), num_experts=src.num_experts,
                      num_experts_per_tok=src.num_experts_per_tok, moe_intermediate_size=src.moe_intermediate_size,
                      n_shared_experts=src.n_shared_experts, router_type="sigmoid_topk",
                      norm_topk_prob=bool(src.norm_topk_prob), n_group=src.n_group or 1,
                      topk_group=src.topk_group or src.n_group or 1, routed_scaling_factor=src.routed_scaling_factor,
                      output_router_logits=bool(src.output_router_logits))
    else:
        fields["mlp_type"] = "gated"
    return fields


def from_contract(cfg):
    fields = source_sizes(cfg)
    fields.pop("head_dim")
    linear = {}
    if cfg.linear_attention_kind.in_use(cfg):
        linear = dict(linear_num_heads=cfg.linear_num_key_heads, linear_head_dim=cfg.linear_key_head_dim,
                      linear_conv_kernel_dim=cfg.linear_conv_kernel_dim)
    experts = {"mlp_layer_types": ["dense"] * cfg.num_hidden_layers}
    if cfg.mlp_type == "moe":
        experts = dict(mlp_layer_types=list(cfg.mlp_layer_types), num_experts=cfg.num_experts,
                       num_experts_per_tok=cfg.num_experts_per_tok, moe_intermediate_size=cfg.moe_intermediate_size,
                       n_shared_experts=cfg.n_shared_experts, norm_topk_prob=cfg.norm_topk_prob, n_group=cfg.n_group,
                       topk_group=cfg.topk_group, routed_scaling_factor=cfg.routed_scaling_factor,
                       output_router_logits=cfg.output_router_logits)
    return config_class()(**fields, rms_norm_eps=cfg.norm_eps, hidden_act=cfg.hidden_act,
                          attention_bias=cfg.attention_bias, q_lora_rank=cfg.q_lora_rank,
                          kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
                          qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
                          layer_types=list(cfg.layer_types), **linear, **experts)


def rules(src) -> list:
    theirs, ours = "model.layers.{layer}.self_attn", "model.layers.{layer}.linear_attn"
    kda = [rule(f"{theirs}.{name}.weight", f"{ours}.{name}.weight") for name in KDA_NAMES]
    kda += [rule(f"{theirs}.forget_gate.{name}", f"{ours}.{name}") for name in FORGET_GATE]
    kda.append(rule(f"{theirs}.forget_gate.A_log", f"{ours}.A_log", "flatten_heads"))
    attention = in_layers(mla_attention_rules(src.q_lora_rank), "attention") + in_layers(kda, "linear_attention")
    moe = moe_rules(shared="shared_experts", correction_bias=True) if "sparse" in src.mlp_layer_types else []
    return llama_rules(PRE_NORMS, attention=attention, moe=moe)


def conv_widths(config) -> list[int]:
    """The rows of `q_conv1d`, `k_conv1d` and `v_conv1d`: H·d each."""
    return [config.linear_num_heads * config.linear_head_dim] * 3


LAYER = "model.layers.{layer}"
# the released files' names -> the model's (transformers' conversion mapping for Kimi Linear); the MLP's only in the
# sparse layers on export
RENAMES = {
    **{f"{LAYER}.self_attn.{name}": f"{LAYER}.self_attn.forget_gate.{name}" for name in (*FORGET_GATE, "A_log")},
    **{f"{LAYER}.block_sparse_moe.{part}.": f"{LAYER}.mlp.{part}." for part in ("gate", "experts", "shared_experts")},
    f"{LAYER}.block_sparse_moe.": f"{LAYER}.mlp.",
}
CONVOLUTIONS = SplitTensor(tuple(f"{LAYER}.self_attn.{x}_conv1d.weight" for x in "qkv"), f"{LAYER}.self_attn.conv1d.weight",
                           conv_widths)

FAMILY = Family(FAMILY_NAME, to_contract, from_contract, rules, "model.", getattr(transformers, "KimiLinearConfig", None),
                renames=RENAMES, experts=expert_stacks(gate="w1", up="w3", down="w2"), split=(CONVOLUTIONS,),
                renamed_layers={f"{LAYER}.block_sparse_moe.": "sparse"},
                description="Kimi Linear (transformers 5.17+): Kimi Delta Attention (`kda`) beside NoPE latent attention, "
                            "DeepSeek-V3 experts",
                refusals=("latent attention with RoPE (`mla_use_nope: false`)",))
