"""DeepSeek-V3 (dense layers): DeepSeek-V2's MLA with a choice of rotary layout (`rope_interleave`).

Multi-token-prediction modules and mixture-of-experts layers are not part of the contract; a
checkpoint whose layers are all dense converts exactly.
"""

from __future__ import annotations

from transformers import DeepseekV3Config

from ..core import Family, refuse
from .deepseek_v2 import mla_contract, mla_rules, mla_source_fields, refuse_unsupported


def to_contract(src) -> dict:
    refuse_unsupported(src, "deepseek_v3")
    refuse({"an MLP bias": bool(getattr(src, "mlp_bias", False))}, "deepseek_v3")
    # V3 lays the rotary pairs out interleaved (x0, x1), (x2, x3), ... unless `rope_interleave=False`.
    return mla_contract(src, rope_interleaved=bool(src.rope_interleave))


def from_contract(cfg) -> DeepseekV3Config:
    if cfg.mlp_bias:
        raise ValueError("DeepSeek-V3 cannot express `mlp_bias=True`.")
    return DeepseekV3Config(**mla_source_fields(cfg), rope_interleave=cfg.rope_interleaved)


FAMILY = Family("deepseek_v3", to_contract, from_contract, mla_rules, config_class=DeepseekV3Config)
