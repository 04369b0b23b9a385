"""Qwen3-Next: Gated DeltaNet layers beside full-attention layers (3:1 in the released models), zero-centred
RMSNorms, full layers with per-head QK-norm, partial rotary and a sigmoid gate on the attention output, and
Qwen2-MoE's experts (routed top-k plus one gated shared expert) in the layers `decoder_sparse_step` selects.

The linear layers' fused projections (`in_proj_qkvz`, `in_proj_ba`, rows grouped per key head) become the
contract's separate `in_proj_qkv` / `in_proj_z` and `in_proj_b` / `in_proj_a` by named transforms (the same rows
reordered, exact both ways). The multi-token-prediction module the released checkpoints ship (`mtp.*`, config.json's
`mtp_num_hidden_layers`, which transformers' class keeps as an extra field and skips on load) converts to the
contract's `mtp.layers.0` (`mtp_rules`): `fc` is DeepSeek's `eh_proj`, `pre_fc_norm_embedding` / `pre_fc_norm_hidden`
its `enorm` / `hnorm`, `norm` its `post_norm`, `layers.0` a full-attention layer; a folder without it converts with
`num_mtp_layers=0`. Its `fc` and norms are shared by every module, so a checkpoint with more than one is refused.
"""

from __future__ import annotations

from transformers import Qwen3NextConfig

from ..core import Family, in_layers, mtp_block_rules, refuse, refuse_export, rule
from .common import (PRE_NORMS, expert_stacks, linear, llama_rules, moe_rules, norm, rope, source_rope, source_sizes,
                     sizes)
from .qwen3_moe import qwen_moe_fields, qwen_moe_source_fields

LINEAR_FIELDS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                 "linear_conv_kernel_dim")
# Where Qwen3-Next's and Qwen3.5's files keep the MTP module's layer (`{mtp}` = k)
MTP_LAYER = "mtp.layers.{mtp}."


def linear_fields(src) -> dict:
    """The linear-attention sizes, where some layer is a linear-attention layer."""
    if "linear_attention" not in src.layer_types:
        return {}
    return {name: getattr(src, name) for name in LINEAR_FIELDS}


def source_linear_fields(cfg) -> dict:
    return {name: getattr(cfg, name) for name in LINEAR_FIELDS if getattr(cfg, name) is not None}


def hybrid_fields(src) -> dict:
    """What Qwen3-Next and Qwen3.5 share: zero-centred RMSNorms, pre-norm blocks, full layers with per-head
    QK-norm and the output gate, and the linear layers."""
    return dict(sizes(src), **rope(src), norm_type="rmsnorm", norm_eps=src.rms_norm_eps, norm_unit_offset=True,
                norm_position="pre", hidden_act=src.hidden_act, attention_bias=src.attention_bias, qk_norm="head",
                attn_output_gate=True, layer_types=list(src.layer_types), **linear_fields(src))


def hybrid_rules(mlp: dict[str, list] | None = None, fused: bool = True) -> list:
    """The tensor map of both families: full layers as Qwen 3's attention, linear layers' projections fused
    per key head (Qwen3-Next, `fused`) or already separate (Qwen3.5), and the feed-forward of `mlp`."""
    src = "model.layers.{layer}.linear_attn"
    if fused:
        projections = [
            rule(f"{src}.in_proj_qkvz.weight", (f"{src}.in_proj_qkv.weight", f"{src}.in_proj_z.weight"),
                 "split_grouped_qkvz"),
            rule(f"{src}.in_proj_ba.weight", (f"{src}.in_proj_b.weight", f"{src}.in_proj_a.weight"), "split_grouped_ba"),
        ]
    else:
        projections = [rule(f"{src}.{name}.weight", f"{src}.{name}.weight")
                       for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")]
    same = [rule(f"{src}.{name}", f"{src}.{name}") for name in ("conv1d.weight", "dt_bias", "A_log", "norm.weight")]
    linear_attention = in_layers(projections + same + linear(f"{src}.out_proj", f"{src}.out_proj"), "linear_attention")
    attention = []
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        attention += linear(f"model.layers.{{layer}}.self_attn.{proj}", f"model.layers.{{layer}}.self_attn.{proj}")
    for which in ("q_norm", "k_norm"):
        attention += norm(f"model.layers.{{layer}}.self_attn.{which}", f"model.layers.{{layer}}.self_attn.qk_norm.{which}")
    return llama_rules(PRE_NORMS, attention=in_layers(attention, "attention") + linear_attention, moe=mlp)


def mtp_contract(src, family: str) -> dict:
    """The MTP modules config.json declares (`mtp_num_hidden_layers`); `convert` keeps those the files hold."""
    count = getattr(src, "mtp_num_hidden_layers", 0) or 0
    refuse({f"{count} MTP layers sharing one `mtp.fc` and `mtp.norm`": count > 1,
            "MTP embeddings of its own (`mtp_use_dedicated_embeddings`)":
                bool(getattr(src, "mtp_use_dedicated_embeddings", False)),
            # its MTP layer attends fully; the contract builds MTP blocks of the last layer's kinds
            "an MTP layer after a last layer that is not full attention":
                bool(count) and list(src.layer_types)[-1] != "full_attention"}, family)
    return {"num_mtp_layers": count}


def mtp_rules(layer_rules: list) -> list:
    """The MTP module in the files (`mtp.fc`, `mtp.pre_fc_norm_*`, `mtp.layers.0`, `mtp.norm`) -> `mtp.layers.0`."""
    dst = "mtp.layers.{mtp}"
    return [*mtp_block_rules(layer_rules, "model.layers.{layer}.", MTP_LAYER),
            rule("mtp.fc.weight", f"{dst}.eh_proj.weight"),
            *norm("mtp.pre_fc_norm_embedding", f"{dst}.enorm"),
            *norm("mtp.pre_fc_norm_hidden", f"{dst}.hnorm"),
            *norm("mtp.norm", f"{dst}.post_norm")]


def with_mtp(layer_rules: list) -> list:
    return layer_rules + mtp_rules(layer_rules)


def to_contract(src) -> dict:
    fields = qwen_moe_fields(src)
    if fields["mlp_type"] == "moe":
        fields.update(n_shared_experts=1, shared_expert_intermediate_size=src.shared_expert_intermediate_size,
                      shared_expert_gate=True)
    return dict(hybrid_fields(src), **fields, **mtp_contract(src, "qwen3_next"))


def from_contract(cfg) -> Qwen3NextConfig:
    if cfg.mlp_type == "moe":
        experts = dict(qwen_moe_source_fields(cfg), shared_expert_intermediate_size=cfg.shared_expert_intermediate_size)
    else:  # every layer the dense MLP
        experts = dict(num_experts=0, mlp_only_layers=[])
    return Qwen3NextConfig(
        **source_sizes(cfg), rms_norm_eps=cfg.norm_eps, hidden_act=cfg.hidden_act, attention_bias=cfg.attention_bias,
        layer_types=cfg.layer_types, rope_parameters=source_rope(cfg), **source_linear_fields(cfg), **experts,
        **source_mtp_fields(cfg, "qwen3_next"),
    )


def source_mtp_fields(cfg, family: str) -> dict:
    """The inverse of `mtp_contract` (an extra field of transformers' config, written to config.json); refuses the
    modules the format cannot hold: more than one (they share one `mtp.fc` and `mtp.norm`), or modules built of a
    last layer that is not full attention (its MTP layer attends fully)."""
    count, last = cfg.num_mtp_layers, cfg.layer_types[-1]
    refuse_export({f"`num_mtp_layers`={count} (one module at most: the modules would share `mtp.fc` and `mtp.norm`)":
                       count > 1,
                   f"`num_mtp_layers`={count} after a last layer of `layer_types` {last!r} (its MTP layer is a "
                   "full-attention layer; the modules are built of the last layer's kind)":
                       count == 1 and last != "full_attention"}, family)
    return {"mtp_num_hidden_layers": count} if count else {}


FAMILY = Family("qwen3_next", to_contract, from_contract,
                lambda src: with_mtp(hybrid_rules(moe_rules(shared="shared_expert", shared_gate=True))),
                "model.", Qwen3NextConfig, head=("lm_head.", "mtp."),
                experts=expert_stacks() + expert_stacks(layers="mtp.layers"), mtp_layers=MTP_LAYER,
                description="Qwen3-Next: Gated DeltaNet layers 3:1 with gated attention, experts, MTP layer",
                refusals=("more than one MTP layer", "MTP embeddings of its own"))
