"""Parameter-matched FFNs: the 8d/3 rule for a gated FFN against a dense 4d one.

A dense FFN of width 4d has 2·d·4d = 8d² weights; a gated one (three matrices) matches it at
d_f = 8d/3, before rounding to a hardware-friendly multiple (the seed: "a budgeting rule, not an
intrinsic property of SwiGLU"). Each row is computed from the rule, checked against the contract's
`mlp_parameters` and against `num_parameters()` of the modules actually built.
"""

from __future__ import annotations

import math

import torch

from modular_decoder.configuration_modular_decoder import ModularDecoderConfig
from modular_decoder.contract import mlp_parameters


def gated_width(d: int, multiple_of: int = 1, expansion: float = 4.0) -> int:
    """d_f of a gated FFN with the weights of a dense one of width expansion·d, rounded up to
    `multiple_of` (Llama: `multiple_of`=256 turns d=4096 into 11008)."""
    exact = 2 * expansion * d / 3
    return int(math.ceil(exact / multiple_of) * multiple_of)


def built_parameters(d: int, d_f: int, mlp_type: str) -> int:
    """`num_parameters` of the FFN module the model builds (on the meta device: no memory)."""
    config = ModularDecoderConfig(hidden_size=d, intermediate_size=d_f, num_attention_heads=1, head_dim=d,
                                  num_hidden_layers=1, vocab_size=8, mlp_type=mlp_type, mlp_bias=False)
    with torch.device("meta"):
        module = config.mlp_kind.build(config, 0)
    return sum(p.numel() for p in module.parameters()), mlp_parameters(config)


def table(widths=(64, 512, 576, 768, 2048, 4096), multiple_of: int = 256) -> tuple[str, bool]:
    """Markdown rows for each d: dense 4d, gated at exactly 8d/3 (when integral) and rounded; the
    second value says whether every formula matched the built module."""
    rows = ["| d | dense 4d: d_f | params (8d²) | gated d_f = 8d/3 | rounded to " f"{multiple_of} | gated params (3·d·d_f) "
            "| built module | gated / dense |", "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    ok = True
    for d in widths:
        dense_built, dense_formula = built_parameters(d, 4 * d, "dense")
        exact = 8 * d / 3
        rounded = gated_width(d, multiple_of)
        gated_built, gated_formula = built_parameters(d, rounded, "gated")
        ok &= dense_built == dense_formula == 8 * d * d and gated_built == gated_formula == 3 * d * rounded
        rows.append(f"| {d} | {4 * d} | {dense_built:,} | {exact:.2f} | {rounded} | {gated_formula:,} | "
                    f"{gated_built:,} | {gated_built / dense_built:.4f} |")
    return "\n".join(rows), ok
