"""DeepSeek-V2: multi-head latent attention, pre-norm RMSNorm, YaRN, gated MLPs in the first
`first_k_dense_replace` layers and a mixture of experts (routed + shared) in the rest.

The attention and expert modules keep DeepSeek's names, so the map is the identity apart from the
block norms (and the per-expert files, stacked as transformers stacks them). DeepSeek-V2 rotates
adjacent pairs (a complex product), hence `rope_interleaved=True`; its YaRN softmax adjustment
(`mscale_all_dim`) travels in `rope_parameters`, which the MLA module reads. Its router is a softmax
top-k, greedy or limited to the best groups (`topk_method`), never renormalised in transformers.
"""

from __future__ import annotations

from transformers import DeepseekV2Config

from ..core import Family, Rule, refuse
from .common import (PRE_NORMS, expert_stacks, linear, llama_rules, moe_rules, norm, rope, source_rope, source_sizes,
                     sizes)

# transformers builds DeepSeek's latent norms (q_a_layernorm, kv_a_layernorm) with this fixed eps,
# whereas the contract has one `norm_eps` for every norm.
LATENT_NORM_EPS = 1e-6


def refuse_unsupported(src, family: str) -> None:
    refuse(
        {
            f"rms_norm_eps != {LATENT_NORM_EPS} (its latent norms always use {LATENT_NORM_EPS})":
                src.rms_norm_eps != LATENT_NORM_EPS,
            "pretraining_tp > 1": getattr(src, "pretraining_tp", 1) not in (None, 1),
            # the original code's every-n-th-layer experts; transformers reads only first_k_dense_replace
            "moe_layer_freq != 1": getattr(src, "moe_layer_freq", 1) != 1,
        },
        family,
    )


def has_experts(src) -> bool:
    return bool(src.n_routed_experts) and src.first_k_dense_replace < src.num_hidden_layers


def moe_contract(src, family: str) -> dict:
    """The experts of the layers from `first_k_dense_replace` on (none: every layer a gated MLP).

    transformers adds no load-balancing loss for DeepSeek-V2 (its checkpoints' `aux_loss_alpha` weighs a
    sequence-wise loss over softmax scores, another form than Switch's), hence `router_aux_loss_coef=0`;
    DeepSeek-V3's sigmoid routers take its sequence-wise balance loss (`deepseek_v3.to_contract`).
    """
    if not has_experts(src):
        return {"mlp_type": "gated"}
    refuse({"no shared experts (transformers builds them zero-wide)": not src.n_shared_experts}, family)
    k = src.first_k_dense_replace
    return dict(
        mlp_type="moe", mlp_layer_types=["dense"] * k + ["sparse"] * (src.num_hidden_layers - k),
        num_experts=src.n_routed_experts, num_experts_per_tok=src.num_experts_per_tok,
        moe_intermediate_size=src.moe_intermediate_size, n_shared_experts=src.n_shared_experts,
        routed_scaling_factor=src.routed_scaling_factor, router_aux_loss_coef=0.0,
        output_router_logits=bool(getattr(src, "output_router_logits", False)),  # not a field of every release
    )


def moe_source_fields(cfg) -> dict:
    """The inverse of `moe_contract`: the leading dense layers become `first_k_dense_replace`."""
    if cfg.mlp_type != "moe":
        return {"first_k_dense_replace": cfg.num_hidden_layers}
    dense = cfg.mlp_layer_types.index("sparse")
    return dict(
        first_k_dense_replace=dense, n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
        moe_intermediate_size=cfg.moe_intermediate_size, n_shared_experts=cfg.n_shared_experts,
        routed_scaling_factor=cfg.routed_scaling_factor, output_router_logits=cfg.output_router_logits,
    )


def mla_contract(src, rope_interleaved: bool) -> dict:
    """Contract fields shared by DeepSeek-V2 and V3 (the feed-forward fields aside)."""
    fields = sizes(src)
    fields.pop("head_dim")  # DeepSeek sets head_dim = qk_rope_head_dim; MLA widths are explicit below
    fields["num_key_value_heads"] = src.num_attention_heads
    return dict(
        fields, **rope(src), rope_interleaved=rope_interleaved, norm_type="rmsnorm", norm_eps=src.rms_norm_eps,
        norm_position="pre", hidden_act=src.hidden_act, mlp_bias=getattr(src, "mlp_bias", False),
        attention_type="mla", q_lora_rank=src.q_lora_rank, kv_lora_rank=src.kv_lora_rank,
        qk_nope_head_dim=src.qk_nope_head_dim, qk_rope_head_dim=src.qk_rope_head_dim, v_head_dim=src.v_head_dim,
        attention_bias=src.attention_bias, attention_output_bias=src.attention_bias,
    )


def mla_source_fields(cfg, attention_type: str = "mla") -> dict:
    """The inverse of `mla_contract` and `moe_source_fields`, for a family whose layers are `attention_type`."""
    if cfg.attention_type != attention_type:
        raise ValueError(f"Only `attention_type={attention_type!r}` exports to this DeepSeek family (DeepSeek-V3.2's "
                         "`deepseek_v32` takes `'dsa'`, the others `'mla'`).")
    if not cfg.kv_latent_norm:
        raise ValueError("DeepSeek always norms the KV latent (`kv_a_layernorm`): it cannot express "
                         "`kv_latent_norm=False`.")
    fields = source_sizes(cfg)
    fields.pop("head_dim")
    return dict(
        fields, rms_norm_eps=cfg.norm_eps, hidden_act=cfg.hidden_act, attention_bias=cfg.attention_bias,
        rope_parameters=source_rope(cfg), q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
        **moe_source_fields(cfg),
    )


def mla_rules(src, correction_bias: bool = False) -> list[Rule]:
    """`model.layers.{layer}.self_attn.kv_a_proj_with_mqa` etc.: the same names on both sides, in
    the Llama-style layout for everything else; routed and shared experts in the sparse layers
    (with V3's `e_score_correction_bias`)."""
    moe = moe_rules(shared="shared_experts", correction_bias=correction_bias) if has_experts(src) else []
    return llama_rules(PRE_NORMS, attention=mla_attention_rules(src.q_lora_rank), moe=moe)


def mla_attention_rules(q_lora_rank: int | None) -> list[Rule]:
    """A latent attention layer's tensors, DeepSeek's names on both sides (`self_attn.kv_a_proj_with_mqa`, ...)."""
    attn = "model.layers.{layer}.self_attn"
    q_parts = ["q_proj"] if q_lora_rank is None else ["q_a_proj", "q_b_proj"]
    attention = []
    for proj in q_parts + ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]:
        attention += linear(f"{attn}.{proj}", f"{attn}.{proj}")
    if q_lora_rank is not None:
        attention += norm(f"{attn}.q_a_layernorm", f"{attn}.q_a_layernorm")
    return attention + norm(f"{attn}.kv_a_layernorm", f"{attn}.kv_a_layernorm")


TOPK_METHODS = ("greedy", "group_limited_greedy")


def to_contract(src) -> dict:
    refuse_unsupported(src, "deepseek_v2")
    fields = dict(mla_contract(src, rope_interleaved=True), **moe_contract(src, "deepseek_v2"))
    if fields["mlp_type"] == "moe":
        refuse({f"topk_method={src.topk_method!r} (not one of {TOPK_METHODS})": src.topk_method not in TOPK_METHODS,
                # transformers' DeepSeek-V2 never renormalises, the original code does when this is set:
                # the two disagree, so such a checkpoint has no single meaning to convert
                "norm_topk_prob=True": bool(src.norm_topk_prob)}, "deepseek_v2")
        grouped = src.topk_method == "group_limited_greedy"
        fields.update(router_type="softmax_topk", norm_topk_prob=False, n_group=src.n_group if grouped else 1,
                      topk_group=src.topk_group if grouped else 1)
    return fields


def from_contract(cfg) -> DeepseekV2Config:
    if not cfg.rope_interleaved:
        raise ValueError("DeepSeek-V2 rotates adjacent pairs only: it cannot express `rope_interleaved=False`.")
    router = {}
    if cfg.mlp_type == "moe":
        grouped = cfg.n_group > 1
        router = dict(topk_method="group_limited_greedy" if grouped else "greedy", norm_topk_prob=False,
                      n_group=cfg.n_group if grouped else None, topk_group=cfg.topk_group if grouped else None)
    return DeepseekV2Config(**mla_source_fields(cfg), mlp_bias=cfg.mlp_bias, **router)


FAMILY = Family("deepseek_v2", to_contract, from_contract, mla_rules, config_class=DeepseekV2Config,
                experts=expert_stacks(),
                description="DeepSeek-V2, V2-Lite: MLA, softmax-routed experts plus shared ones",
                refusals=("rms_norm_eps other than 1e-6", "pretraining_tp > 1", "moe_layer_freq != 1",
                          "no shared experts", "topk_method other than greedy / group_limited_greedy",
                          "norm_topk_prob=True"))
