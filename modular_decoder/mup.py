"""μP multipliers of the sublayers (Falcon-H1's): fixed factors on an attention's input, keys and output and on a
gated MLP's gate and output, beside the model-wide ones the config already has (`embedding_multiplier`,
`residual_multiplier`, `logits_scaling`: Granite's). Each kind that reads them lists them among its fields
(standard attention: the attention multipliers; the gated MLP: `mlp_multipliers`), so any other kind refuses them.

    attention:  o_proj(Attn(q, k·m_key, v)(x·m_in)) · m_out
    gated MLP:  down(act(gate(x)·m_gate) ⊙ up(x)) · m_down
"""

from __future__ import annotations

from dataclasses import dataclass

from .kinds import require_number


@dataclass(kw_only=True)
class MupFields:
    r"""μP multipliers of the attention and the gated MLP (transformers' Falcon-H1 names).

    Args:
        attention_in_multiplier (`float`): The attention's input is multiplied by this (standard attention).
        key_multiplier (`float`): The keys are multiplied by this after `k_proj`, before any rotary (standard
            attention).
        attention_out_multiplier (`float`): The attention's output (after `o_proj`) is multiplied by this
            (standard attention).
        mlp_multipliers (`list[float]`, *optional*): [gate, down]: the gated MLP's gate product is multiplied by the
            first before its activation, its output (after `down_proj`) by the second (`mlp_type="gated"`). `None`:
            both 1.
    """

    attention_in_multiplier: float = 1.0
    key_multiplier: float = 1.0
    attention_out_multiplier: float = 1.0
    mlp_multipliers: list[float] | None = None


ATTENTION_MULTIPLIERS = ("attention_in_multiplier", "key_multiplier", "attention_out_multiplier")


def validate_attention_multipliers(config) -> None:
    for name in ATTENTION_MULTIPLIERS:
        require_number(name, getattr(config, name), above=0)


def validate_mlp_multipliers(config) -> None:
    factors = config.mlp_multipliers
    if factors is None:
        return
    if not isinstance(factors, list) or len(factors) != 2:
        raise ValueError(f"`mlp_multipliers` must be [gate, down], got {factors!r}.")
    for factor in factors:
        require_number("mlp_multipliers[...]", factor, above=0)


__all__ = ["ATTENTION_MULTIPLIERS", "MupFields", "validate_attention_multipliers", "validate_mlp_multipliers"]
