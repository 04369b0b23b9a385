"""Gemma 3 (text): Gemma 2's block with per-head QK-norm and a separate RoPE base for local layers."""

from __future__ import annotations

from transformers import Gemma3TextConfig

from ..core import Family, refuse
from .common import llama_rules
from .gemma2 import SANDWICH_NORMS, sandwich_contract, sandwich_source


def to_contract(src) -> dict:
    refuse({"use_bidirectional_attention": bool(getattr(src, "use_bidirectional_attention", False))}, "gemma3")
    return dict(sandwich_contract(src), qk_norm="head")


FAMILY = Family("gemma3_text", to_contract, lambda cfg: Gemma3TextConfig(**sandwich_source(cfg)),
                lambda src: llama_rules(SANDWICH_NORMS, qk_norm=True), "model.", Gemma3TextConfig,
                description="Gemma 3 text-only folders (270M, 1B): Gemma 2 with QK-norm and a RoPE table per layer "
                            "type",
                refusals=("use_bidirectional_attention",))
