"""What each attention backend can honour, declared once and checked at load.

A model whose contract needs a feature its backend lacks raises `ValueError` naming the field
when it is built or loaded, never silently computing different math. The README's
compatibility table is rendered from `BACKEND_FEATURES`.
"""

from __future__ import annotations

# Features a config may need, and the contract field that asks for each.
FEATURE_FIELDS = {
    "softcap": "attn_logit_softcapping",
    "alibi": "position_embedding_type='alibi'",
    "sliding_window": "sliding_window / layer_types",
    "mla": "attention_type='mla' (q/k width differs from v width)",
    "gqa": "num_key_value_heads < num_attention_heads",
}

ALL_FEATURES = frozenset(FEATURE_FIELDS)

# backend -> features it can honour
BACKEND_FEATURES: dict[str, frozenset[str]] = {
    "eager": ALL_FEATURES,
    "sdpa": ALL_FEATURES - {"softcap"},
    "flex_attention": ALL_FEATURES,
    # transformers' shared flash path: window, softcap, GQA and padded V for MLA, but no ALiBi slopes
    "flash_attention_2": ALL_FEATURES - {"alibi"},
    "flash_attention_3": ALL_FEATURES - {"alibi"},
    "flash_attention_4": ALL_FEATURES - {"alibi"},
}


def required_features(config) -> set[str]:
    needed = set()
    if config.attn_logit_softcapping is not None:
        needed.add("softcap")
    if config.position_embedding_type == "alibi":
        needed.add("alibi")
    if "sliding_attention" in config.layer_types:
        needed.add("sliding_window")
    if config.attention_type == "mla":
        needed.add("mla")
    if config.num_key_value_heads < config.num_attention_heads:
        needed.add("gqa")
    return needed


def missing_features(config, backend: str) -> set[str]:
    supported = BACKEND_FEATURES.get(backend.removeprefix("paged|"))
    if supported is None:  # a backend registered by the user: trust it
        return set()
    return required_features(config) - supported


def check_backend(config, backend: str) -> None:
    """Raise `ValueError` if `backend` cannot compute what `config` asks for."""
    missing = missing_features(config, backend)
    if missing:
        fields = ", ".join(f"`{FEATURE_FIELDS[f]}`" for f in sorted(missing))
        usable = [name for name in BACKEND_FEATURES if not required_features(config) - BACKEND_FEATURES[name]]
        raise ValueError(
            f"attn_implementation={backend!r} cannot honour {fields} of this config; "
            f"use one of {usable}."
        )


def default_backend(config) -> str:
    """SDPA where it can honour the config (the fast CPU default), else the eager reference."""
    return "sdpa" if not missing_features(config, "sdpa") else "eager"


def compatibility_table() -> str:
    """Markdown: feature × backend, from the declarations above."""
    backends = list(BACKEND_FEATURES)
    rows = ["| feature (field) | " + " | ".join(backends) + " |", "|---" * (len(backends) + 1) + "|"]
    for feature, field in FEATURE_FIELDS.items():
        marks = ["yes" if feature in BACKEND_FEATURES[b] else "**no**" for b in backends]
        rows.append(f"| {feature} (`{field}`) | " + " | ".join(marks) + " |")
    return "\n".join(rows)
