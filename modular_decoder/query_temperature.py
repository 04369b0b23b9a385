"""Query temperature by position: each query is multiplied by a factor that grows with the log of its position, so
attention stays sharp far past the length a model was trained at (Nakanishi 2025, arXiv 2501.19399; Ministral 3,
Llama 4):

    q_t <- q_t · (1 + attn_scale · log(1 + floor((p_t + offset) / floor_scale)))     p_t: the query's position id

The factor is 1 for the first `floor_scale` positions and steps up once per `floor_scale` after them. It is applied
after the rotary positions, to the queries only (the cached keys are not scaled), in the query's dtype, as
transformers' `Ministral3Attention` applies it. Ministral 3 keeps its two numbers in `rope_parameters`
(`llama_4_scaling_beta`, and `original_max_position_embeddings` as the floor): the conversion moves them here.
Llama 4 applies it with a position one higher (`attn_temperature_offset=1`) and on its NoPE layers only
(`attn_temperature_layers="nope"`, the layers `no_rope_layers` marks 0). p_t is the token's position id, so a
left-padded row gets what it gets alone (transformers' Llama 4 counts its cache's slots, padding included; vLLM
counts positions, as here). Standard attention only (the attention kind's registry entry owns these fields,
`attention.StandardKind`).

Part of the remote-code files: torch only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kinds import field_default, require_bool, require_choice, require_int, require_number
from .positions import validate_no_rope_layers


@dataclass(kw_only=True)
class QueryTemperatureFields:
    """Config fields of the query temperature (transformers' Llama 4 names).

    Args:
        attn_temperature_tuning (`bool`): Multiply each query by 1 + `attn_scale` · log(1 + floor(p / `floor_scale`)),
            p its position id (Ministral 3). Standard attention only.
        floor_scale (`int`, *optional*): The positions per step of the factor (Ministral 3: its RoPE's
            `original_max_position_embeddings`, 16,384). Required with `attn_temperature_tuning`.
        attn_scale (`float`, *optional*): The factor's slope β (Ministral 3: `llama_4_scaling_beta`, 0.1). Required
            with `attn_temperature_tuning`.
        attn_temperature_offset (`int`): Added to each position before the floor (Llama 4: 1). 0 otherwise.
        attn_temperature_layers (`str`): Which layers scale their queries: `"all"` (Ministral 3) or `"nope"`, the
            NoPE layers of `no_rope_layers` only (Llama 4).
    """

    attn_temperature_tuning: bool = False
    floor_scale: int | None = None
    attn_scale: float | None = None
    attn_temperature_offset: int = 0
    attn_temperature_layers: str = "all"


FIELDS = ("attn_temperature_tuning", "floor_scale", "attn_scale", "attn_temperature_offset", "attn_temperature_layers")
TEMPERATURE_LAYERS = ("all", "nope")


def validate_query_temperature(config) -> None:
    """The fields set together (both numbers with the switch, none of them without it; NoPE layers where only those
    scale); `ValueError` naming them."""
    require_bool("attn_temperature_tuning", config.attn_temperature_tuning)
    if not config.attn_temperature_tuning:
        for name in FIELDS[1:]:
            if getattr(config, name) != field_default(config, name):
                raise ValueError(f"`{name}`={getattr(config, name)!r} sets the query temperature, and "
                                 "`attn_temperature_tuning` is False: set it True or leave the field unset.")
        return
    require_int("floor_scale", config.floor_scale, minimum=1)
    require_number("attn_scale", config.attn_scale)
    require_int("attn_temperature_offset", config.attn_temperature_offset, minimum=0)
    require_choice("attn_temperature_layers", config.attn_temperature_layers, TEMPERATURE_LAYERS)
    validate_no_rope_layers(config)  # (read below; the positions' own check may run after this one)
    if config.attn_temperature_layers == "nope" and (config.no_rope_layers is None or all(config.no_rope_layers)):
        raise ValueError("`attn_temperature_layers`='nope' scales the queries of the NoPE layers, and `no_rope_layers` "
                         "has none (a 0 marks one).")


def query_temperature(config, position_ids: torch.Tensor | None) -> torch.Tensor | None:
    """The (B, 1, T, 1) factor of each query (float32), or None where the config does not scale queries. A position
    is needed: `ValueError` without one."""
    if not config.attn_temperature_tuning:
        return None
    if position_ids is None:
        raise ValueError("`attn_temperature_tuning` scales each query by its position: the attention needs "
                         "`position_ids`.")
    # float32, as transformers' Ministral 3 computes it
    steps = torch.floor((position_ids + config.attn_temperature_offset) / config.floor_scale)
    return (1 + config.attn_scale * torch.log(1 + steps))[:, None, :, None]


def scale_queries(q: torch.Tensor, factor: torch.Tensor | None) -> torch.Tensor:
    """q (B, H, T, D) times the factor, cast to q's dtype first (as transformers' Ministral 3 multiplies)."""
    return q if factor is None else q * factor.to(q.dtype)


__all__ = ["QueryTemperatureFields", "FIELDS", "validate_query_temperature", "query_temperature", "scale_queries"]
