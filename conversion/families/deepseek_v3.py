"""DeepSeek-V3: DeepSeek-V2's MLA with a choice of rotary layout (`rope_interleave`) and experts routed
by sigmoid scores plus a load-balancing correction bias, within the best `topk_group` of `n_group`
groups, renormalised and scaled by `routed_scaling_factor`.

The multi-token-prediction module (layer `num_hidden_layers` of the Hub files) is not part of the
model transformers builds, nor of the contract.
"""

from __future__ import annotations

from transformers import DeepseekV3Config

from ..core import Family, refuse
from .common import expert_stacks
from .deepseek_v2 import mla_contract, mla_rules, mla_source_fields, moe_contract, refuse_unsupported


def to_contract(src) -> dict:
    # V3 lays the rotary pairs out interleaved (x0, x1), (x2, x3), ... unless `rope_interleave=False`.
    return v3_contract(src, "deepseek_v3", rope_interleaved=bool(src.rope_interleave))


def v3_contract(src, family: str, rope_interleaved: bool) -> dict:
    """DeepSeek-V3's contract fields (and DeepSeek-V3.2's, which adds the indexer to them)."""
    refuse_unsupported(src, family)
    refuse({"an MLP bias": bool(getattr(src, "mlp_bias", False))}, family)
    fields = dict(mla_contract(src, rope_interleaved=rope_interleaved), **moe_contract(src, family))
    if fields["mlp_type"] == "moe":
        n_group = src.n_group or 1
        fields.update(router_type="sigmoid_topk", norm_topk_prob=bool(src.norm_topk_prob), n_group=n_group,
                      topk_group=src.topk_group or n_group,
                      # the α of its sequence-wise balance loss: the Hub config.json's `aux_loss_alpha` where the
                      # source config kept it (transformers' class drops it), else the paper's 0.0001
                      router_aux_loss_coef=getattr(src, "aux_loss_alpha", None))
    return fields


def from_contract(cfg) -> DeepseekV3Config:
    return DeepseekV3Config(**v3_source_fields(cfg), rope_interleave=cfg.rope_interleaved)


def v3_source_fields(cfg, attention_type: str = "mla", family: str = "DeepSeek-V3") -> dict:
    """The inverse of `v3_contract` (the rotary layout aside)."""
    if cfg.mlp_bias:
        raise ValueError(f"{family} cannot express `mlp_bias=True`.")
    router = {}
    if cfg.mlp_type == "moe":
        router = dict(norm_topk_prob=cfg.norm_topk_prob, n_group=cfg.n_group, topk_group=cfg.topk_group,
                      aux_loss_alpha=cfg.router_aux_loss_coef)
    return dict(mla_source_fields(cfg, attention_type), **router)


FAMILY = Family("deepseek_v3", to_contract, from_contract, lambda src: mla_rules(src, correction_bias=True),
                config_class=DeepseekV3Config, experts=expert_stacks())
