"""The README's table of attention backends: contract feature (and input layout) × backend, rendered
from the declarations of `backend_features.py`, with the caveats a user of each backend should know.

    python -c "from modular_decoder.tools.compatibility import compatibility_table; print(compatibility_table())"

`tests/test_backends.py` checks that the README holds the current table.
"""

from __future__ import annotations

from ..backend_features import BACKEND_FEATURES, FEATURE_FIELDS

# Input layouts every backend handles (proven in tests/test_backends*.py), listed for the table.
INPUT_LAYOUTS = {
    "padded": "2-D attention_mask with padding",
    "packed": "position_ids restarting at 0, batch 1, no attention_mask",
}

# Caveats that are not contract features but that a user of the backend should know.
BACKEND_NOTES: dict[str, str] = {
    "sdpa": "GQA without repeating K/V only when there is no mask (torch's `enable_gqa`); "
    "ALiBi as an additive bias; sinks as one more key whose score is the sink (K and V copied 8 features wider "
    "per call), except in a step of at most 8 queries (decode), which scores its keys directly",
    "flex_attention": "no attention dropout while training (transformers raises); on CPU torch compiles it "
    "(about a minute the first time); ALiBi as a `score_mod` from the slopes; sinks by the kernel's "
    "log-sum-exp, which torch's compiled CPU kernel does not return (a ValueError names them there)",
    "flash_attention_2": "ALiBi through the kernel's `alibi_slopes`; V padded to the q/k width for MLA",
    "flash_attention_3": "sinks only with a kernel that takes them (vLLM's FA3 build, `s_aux`); another raises "
    "a ValueError naming them when called",
    "flash_attention_4": "sinks through the kernel's `learnable_sink`",
    "vllm": "set by vLLM's Transformers modeling backend, which serves a saved folder with its own attention "
    "(paged cache; MLA from its latent cache), lm_head and fused experts",
}


def compatibility_table() -> str:
    """Markdown: contract feature (and input layout) × backend, from `BACKEND_FEATURES`, and the notes."""
    backends = list(BACKEND_FEATURES)
    rows = ["| feature (field) | " + " | ".join(backends) + " |", "|---" * (len(backends) + 1) + "|"]
    for feature, field in FEATURE_FIELDS.items():
        marks = ["yes" if feature in BACKEND_FEATURES[b] else "**no** (ValueError at load)" for b in backends]
        rows.append(f"| {feature} (`{field}`) | " + " | ".join(marks) + " |")
    for layout, meaning in INPUT_LAYOUTS.items():
        rows.append(f"| {layout} input ({meaning}) | " + " | ".join("yes" for _ in backends) + " |")
    notes = [f"- `{name}`: {note}." for name, note in BACKEND_NOTES.items()]
    return "\n".join(rows + [""] + notes)
