"""Ministral 3 (the language model of Mistral 3 / Ministral 3 releases, `ministral3`): Mistral's layout with YaRN and a
query temperature that grows with the log of the position (`query_temperature.py`). Ministral 3 keeps the
temperature's slope in its RoPE dict (`llama_4_scaling_beta`) and reads the floor from the dict's
`original_max_position_embeddings`; here they are `attn_scale` and `floor_scale`, beside the RoPE dict, which keeps
what RoPE reads. A slope of 0 multiplies every query by exactly 1: no temperature."""

from __future__ import annotations

from transformers import Ministral3Config

from ..core import Family, refuse
from .common import PRE_NORMS, llama_rules, rope, source_rope, source_sizes, sizes

# keys of Ministral 3's RoPE dict that RoPE does not read (its config skips them when it validates the dict)
NOT_ROPE = ("llama_4_scaling_beta", "max_position_embeddings")
# the RoPE types that read `original_max_position_embeddings` (with another, only the temperature reads it)
READS_ORIGINAL_LENGTH = ("yarn", "longrope", "llama3")


def to_contract(src) -> dict:
    fields = rope(src)
    params = fields["rope_parameters"]
    beta = params.get("llama_4_scaling_beta")
    floor = params.get("original_max_position_embeddings")
    refuse({"`llama_4_scaling_beta` without an `original_max_position_embeddings` in its RoPE dict (the "
            "temperature's floor)": bool(beta) and floor is None}, "ministral3")
    fields["rope_parameters"] = {k: v for k, v in params.items() if k not in NOT_ROPE and not (
        k == "original_max_position_embeddings" and params.get("rope_type") not in READS_ORIGINAL_LENGTH)}
    temperature = dict(attn_temperature_tuning=True, floor_scale=floor, attn_scale=beta) if beta else {}
    return dict(
        sizes(src), **fields, **temperature, norm_type="rmsnorm", norm_eps=src.rms_norm_eps, norm_position="pre",
        mlp_type="gated", hidden_act=src.hidden_act, sliding_window=src.sliding_window,
    )


def from_contract(cfg) -> Ministral3Config:
    params = source_rope(cfg)
    floor = params.get("original_max_position_embeddings")
    if cfg.attn_temperature_tuning and floor != cfg.floor_scale:
        raise ValueError(f"Ministral 3 reads the query temperature's floor from its RoPE dict's "
                         f"`original_max_position_embeddings` ({floor}): it cannot express `floor_scale`="
                         f"{cfg.floor_scale}.")
    params["llama_4_scaling_beta"] = cfg.attn_scale if cfg.attn_temperature_tuning else 0.0
    params.setdefault("original_max_position_embeddings", cfg.max_position_embeddings)  # read even at slope 0
    return Ministral3Config(**source_sizes(cfg), rms_norm_eps=cfg.norm_eps, hidden_act=cfg.hidden_act,
                            sliding_window=cfg.sliding_window, rope_parameters=params)


FAMILY = Family("ministral3", to_contract, from_contract, lambda src: llama_rules(PRE_NORMS), "model.",
                Ministral3Config,
                description="Ministral 3 text model: YaRN and a query temperature by position",
                refusals=("llama_4_scaling_beta without original_max_position_embeddings",))
