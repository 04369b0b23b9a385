"""GLM-4.5 / GLM-4.6 (`glm4_moe`): pre-norm GQA with q/k/v biases (none on the output), per-head QK-norm where
`use_qk_norm` is set, partial RoPE (half of each head, the halves layout), gated MLPs in the first
`first_k_dense_replace` layers and DeepSeek-V3's mixture of experts in the rest (sigmoid scores with a correction
bias, top-k within the best groups, renormalised and scaled, one shared expert).

Its multi-token-prediction layer sits after the model's layers in the files (GLM-4.5's layer 92, GLM-4.5-Air's 46)
in DeepSeek-V3's layout (`enorm`, `hnorm`, `eh_proj`, a decoder layer, `shared_head.norm`, copies of the embedding
and the head): it converts to `mtp.layers.0` by DeepSeek-V3's rules (`deepseek_v3.mtp_rules`), and transformers'
`generate(use_mtp=True)` drafts with the same weights as ours does. A folder without it converts without it.
"""

from __future__ import annotations

from transformers import Glm4MoeConfig

from ..core import Family, Rule
from .common import PRE_NORMS, expert_stacks, llama_rules, moe_rules, rope, source_rope, source_sizes, sizes
from .deepseek_v2 import has_experts, moe_contract, moe_source_fields
from .deepseek_v3 import MTP_LAYER, declared_mtp_layers, mtp_rules


def to_contract(src) -> dict:
    fields = dict(
        sizes(src), **rope(src), norm_type="rmsnorm", norm_eps=src.rms_norm_eps, norm_position="pre",
        hidden_act=src.hidden_act, attention_bias=src.attention_bias, attention_output_bias=False,
        qk_norm="head" if src.use_qk_norm else "none", **moe_contract(src, "glm4_moe"),
        num_mtp_layers=declared_mtp_layers(src),
    )
    if fields["mlp_type"] == "moe":
        # transformers adds no balance loss for GLM-4.5; ours is DeepSeek-V3's sequence-wise one at the paper's α
        fields.update(router_type="sigmoid_topk", norm_topk_prob=bool(src.norm_topk_prob), n_group=src.n_group or 1,
                      topk_group=src.topk_group or src.n_group or 1, router_aux_loss_coef=None)
    return fields


def from_contract(cfg) -> Glm4MoeConfig:
    router = {}
    if cfg.mlp_type == "moe":
        router = dict(norm_topk_prob=cfg.norm_topk_prob, n_group=cfg.n_group, topk_group=cfg.topk_group)
    return Glm4MoeConfig(
        **source_sizes(cfg), rms_norm_eps=cfg.norm_eps, hidden_act=cfg.hidden_act, attention_bias=cfg.attention_bias,
        use_qk_norm=cfg.qk_norm == "head", rope_parameters=source_rope(cfg), **moe_source_fields(cfg), **router,
        num_mtp_layers=cfg.num_mtp_layers,
    )


def rules(src) -> list[Rule]:
    moe = moe_rules(shared="shared_experts", correction_bias=True) if has_experts(src) else []
    layer_rules = llama_rules(PRE_NORMS, qk_norm=bool(src.use_qk_norm), moe=moe)
    return layer_rules + mtp_rules(layer_rules, bool(getattr(src, "tie_word_embeddings", False)))


FAMILY = Family("glm4_moe", to_contract, from_contract, rules, "model.", Glm4MoeConfig, experts=expert_stacks(),
                mtp_layers=MTP_LAYER,
                description="GLM-4.5 / 4.6: q/k/v biases, QK-norm, partial RoPE, DeepSeek-V3's routing, MTP layer",
                refusals=("no shared experts",))
