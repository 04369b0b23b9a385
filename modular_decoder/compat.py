"""The transformers internals this family uses beyond its public model API, in one place, and the oldest
transformers version the shipped code runs on.

Most are private helpers of transformers' flash- and flex-attention paths, which only the ALiBi
functions of `backends.py` need, so they are looked up when such a backend runs, never at module
import: an upstream rename then breaks that one backend with a clear error, not every load. The
experts-kernel decorator (`experts_kernels`) is looked up once, when `moe.py` defines its experts
module, and its absence only removes transformers' alternative kernels.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

# The oldest transformers this code runs on (pyproject.toml's `transformers>=` agrees: a test compares
# them). 5.24 renamed `create_causal_mask(past_key_values=)` to `cache=` and the output field
# `past_key_values` to `cache`; 5.21 added `slice_logits_to_keep`; older releases fail at import or
# at the first forward.
MIN_TRANSFORMERS = "5.24.0"


def check_transformers_version(version: str | None = None) -> None:
    """Raise `ImportError` naming the required version when the installed transformers (or `version`) is
    older than `MIN_TRANSFORMERS`. The config module calls it first, so a saved folder loaded with
    `trust_remote_code=True` on an older transformers fails with this one message."""
    from packaging.version import Version  # a dependency of transformers itself

    if version is None:
        import transformers

        version = transformers.__version__
    if Version(version) < Version(MIN_TRANSFORMERS):
        raise ImportError(
            f"modular_decoder needs transformers>={MIN_TRANSFORMERS}; this environment has transformers "
            f"{version}. Upgrade it: pip install 'transformers>={MIN_TRANSFORMERS},<6'."
        )

# backend -> {module: the private names taken from it}
_INTERNALS = {
    "flash": {
        "transformers.modeling_flash_attention_utils": (
            "_is_packed_sequence", "_prepare_from_posids", "_upad_input", "fa_peft_integration_check",
            "lazy_import_flash_attention",
        ),
        "transformers.integrations.flash_attention": ("_use_top_left_mask", "get_target_dtype"),
    },
    "flex": {
        "transformers.integrations.flex_attention": (
            "compile_friendly_flex_attention", "get_flex_attention_lse_kwargs",
        ),
    },
}


def internals(backend: str) -> SimpleNamespace:
    """transformers' helpers for `backend` ("flash" or "flex") by name, e.g. `internals("flash")._upad_input`."""
    found = {}
    for module_name, names in _INTERNALS[backend].items():
        module = importlib.import_module(module_name)
        for name in names:
            if not hasattr(module, name):
                raise ImportError(
                    f"`{module_name}.{name}` is missing from this transformers version; modular_decoder's "
                    f"{backend}-attention ALiBi path needs it. Use `attn_implementation='sdpa'` or 'eager', or "
                    "the transformers version pyproject.toml names."
                )
            found[name] = getattr(module, name)
    return SimpleNamespace(**found)


def flash_kernel_fallbacks() -> dict[str, str]:
    """transformers' `{flash implementation: Hub kernel repo}` used when flash-attn is not installed
    (empty where this transformers has none)."""
    module = importlib.import_module("transformers.modeling_flash_attention_utils")
    return getattr(module, "FLASH_ATTN_KERNEL_FALLBACK", {})


def experts_kernels():
    """transformers' `use_experts_implementation` class decorator, or `None` where this transformers lacks it.

    With it, an experts module dispatches on `config._experts_implementation` ("eager": the module's own
    forward; "grouped_mm", "batched_mm", ...: transformers' kernels on the same weights), and the
    expert-parallel plans can shard it.
    """
    try:
        module = importlib.import_module("transformers.integrations.moe")
    except ImportError:
        return None
    return getattr(module, "use_experts_implementation", None)
