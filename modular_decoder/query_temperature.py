"""Query temperature by position: each query is multiplied by a factor that grows with the log of its position, so
attention stays sharp far past the length a model was trained at (Nakanishi 2025, arXiv 2501.19399; Ministral 3,
Llama 4):

    q_t <- q_t · (1 + attn_scale · log(1 + floor(p_t / floor_scale)))        p_t: the query's position id

The factor is 1 for the first `floor_scale` positions and steps up once per `floor_scale` after them. It is applied
after the rotary positions, to the queries only (the cached keys are not scaled), in the query's dtype, as
transformers' `Ministral3Attention` applies it. Ministral 3 keeps its two numbers in `rope_parameters`
(`llama_4_scaling_beta`, and `original_max_position_embeddings` as the floor): the conversion moves them here.
Llama 4 applies the same idea with a position one higher (`floor((p + 1) / floor_scale)`), on its NoPE layers only;
that family needs a position offset and a layer choice beside these fields. Standard attention only (the attention
kind's registry entry owns these fields, `attention.StandardKind`).

Part of the remote-code files: torch only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kinds import require_bool, require_int, require_number


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
    """

    attn_temperature_tuning: bool = False
    floor_scale: int | None = None
    attn_scale: float | None = None


FIELDS = ("attn_temperature_tuning", "floor_scale", "attn_scale")


def validate_query_temperature(config) -> None:
    """The three fields set together (both numbers with the switch, neither without it); `ValueError` naming them."""
    require_bool("attn_temperature_tuning", config.attn_temperature_tuning)
    if not config.attn_temperature_tuning:
        for name in ("floor_scale", "attn_scale"):
            if getattr(config, name) is not None:
                raise ValueError(f"`{name}`={getattr(config, name)!r} sets the query temperature, and "
                                 "`attn_temperature_tuning` is False: set it True or leave the field unset.")
        return
    require_int("floor_scale", config.floor_scale, minimum=1)
    require_number("attn_scale", config.attn_scale)


def query_temperature(config, position_ids: torch.Tensor | None) -> torch.Tensor | None:
    """The (B, 1, T, 1) factor of each query (float32), or None where the config does not scale queries. A position
    is needed: `ValueError` without one."""
    if not config.attn_temperature_tuning:
        return None
    if position_ids is None:
        raise ValueError("`attn_temperature_tuning` scales each query by its position: the attention needs "
                         "`position_ids`.")
    steps = torch.floor(position_ids / config.floor_scale)  # float32, as transformers' Ministral 3 computes it
    return (1 + config.attn_scale * torch.log(1 + steps))[:, None, :, None]


def scale_queries(q: torch.Tensor, factor: torch.Tensor | None) -> torch.Tensor:
    """q (B, H, T, D) times the factor, cast to q's dtype first (as transformers' Ministral 3 multiplies)."""
    return q if factor is None else q * factor.to(q.dtype)


__all__ = ["QueryTemperatureFields", "FIELDS", "validate_query_temperature", "query_temperature", "scale_queries"]
