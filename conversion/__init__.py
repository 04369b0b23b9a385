"""Conversion between public checkpoints and modular_decoder, in both directions.

Not part of the remote-code files: the model modules never import from here. Each source family
is one small declarative module in `families/`, registered in `FAMILIES` by its transformers
`model_type`; add a family by adding one line (its `Family`'s `description` and facts give it its row in the table
of families, `table.py`). A multimodal release (Gemma 3, Mistral 3, Qwen3.5 folders) converts its language model
through one of these and keeps the rest beside it: one line in `multimodal.WRAPPERS`.

    from modular_decoder.conversion import convert, export
    convert("path/to/llama", "out/llama-md")                   # Hugging Face folder
    convert("path/to/dir", "out/smollm2", gguf_file="x.gguf")  # GGUF file
    export("out/llama-md", "out/llama-again", family="llama")
"""

from __future__ import annotations

import importlib

from .core import Family
from .multimodal import WRAPPERS

# source `model_type` -> module exposing `FAMILY`
FAMILIES: dict[str, str] = {
    "openai-gpt": "modular_decoder.conversion.families.openai_gpt",
    "gpt2": "modular_decoder.conversion.families.gpt2",
    "opt": "modular_decoder.conversion.families.opt",
    "gptj": "modular_decoder.conversion.families.gptj",
    "gpt_neox": "modular_decoder.conversion.families.gpt_neox",
    "falcon": "modular_decoder.conversion.families.falcon",
    "bloom": "modular_decoder.conversion.families.bloom",
    "llama": "modular_decoder.conversion.families.llama",
    "mistral": "modular_decoder.conversion.families.mistral",
    "qwen2": "modular_decoder.conversion.families.qwen2",
    "qwen3": "modular_decoder.conversion.families.qwen3",
    "gemma": "modular_decoder.conversion.families.gemma",
    "gemma2": "modular_decoder.conversion.families.gemma2",
    "gemma3_text": "modular_decoder.conversion.families.gemma3",
    "olmo2": "modular_decoder.conversion.families.olmo2",
    "phi": "modular_decoder.conversion.families.phi",
    "deepseek_v2": "modular_decoder.conversion.families.deepseek_v2",
    "deepseek_v3": "modular_decoder.conversion.families.deepseek_v3",
    "deepseek_v32": "modular_decoder.conversion.families.deepseek_v32",
    "deepseek_v4": "modular_decoder.conversion.families.deepseek_v4",
    "mixtral": "modular_decoder.conversion.families.mixtral",
    "qwen2_moe": "modular_decoder.conversion.families.qwen2_moe",
    "qwen3_moe": "modular_decoder.conversion.families.qwen3_moe",
    "olmoe": "modular_decoder.conversion.families.olmoe",
    "granitemoe": "modular_decoder.conversion.families.granitemoe",
    "qwen3_next": "modular_decoder.conversion.families.qwen3_next",
    "qwen3_5_text": "modular_decoder.conversion.families.qwen3_5",
    "gpt_oss": "modular_decoder.conversion.families.gpt_oss",
    "smollm3": "modular_decoder.conversion.families.smollm3",
    "bamba": "modular_decoder.conversion.families.bamba",
    "granitemoehybrid": "modular_decoder.conversion.families.granitemoehybrid",
    "nemotron_h": "modular_decoder.conversion.families.nemotron_h",
    "falcon_h1": "modular_decoder.conversion.families.falcon_h1",
    "phi3": "modular_decoder.conversion.families.phi3",
    "olmo3": "modular_decoder.conversion.families.olmo3",
    "ministral3": "modular_decoder.conversion.families.ministral3",
    "minimax_m2": "modular_decoder.conversion.families.minimax_m2",
    "glm4_moe": "modular_decoder.conversion.families.glm4_moe",
    "lfm2": "modular_decoder.conversion.families.lfm2",
    "qwen3_5_moe_text": "modular_decoder.conversion.families.qwen3_5_moe",
    "olmo_hybrid": "modular_decoder.conversion.families.olmo_hybrid",
    "kimi_linear": "modular_decoder.conversion.families.kimi_linear",
    "llama4_text": "modular_decoder.conversion.families.llama4",
    "gemma4_text": "modular_decoder.conversion.families.gemma4",
    "gemma3n_text": "modular_decoder.conversion.families.gemma3n",
}


def get_family(name: str) -> Family:
    """The text family registered for transformers `model_type` `name`; `ValueError` if there is none."""
    if name in WRAPPERS:
        raise ValueError(f"{name!r} is a multimodal release, not a text family: `convert` reads its folder's language "
                         f"model, and `export --family {name}` writes a converted one back into the release.")
    if name not in FAMILIES:
        raise ValueError(f"Unknown source family {name!r}; convertible families: {sorted(FAMILIES)}.")
    return importlib.import_module(FAMILIES[name]).FAMILY


from .api import compare_with_source, convert, export  # noqa: E402

__all__ = ["FAMILIES", "WRAPPERS", "get_family", "convert", "export", "compare_with_source"]
