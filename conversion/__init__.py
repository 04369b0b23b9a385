"""Conversion between public checkpoints and modular_decoder, in both directions.

Not part of the remote-code files: the model modules never import from here. Each source family
is one small declarative module in `families/`, registered in `FAMILIES` by its transformers
`model_type`; add a family by adding one line.

    from modular_decoder.conversion import convert, export
    convert("path/to/llama", "out/llama-md")                   # Hugging Face folder
    convert("path/to/dir", "out/smollm2", gguf_file="x.gguf")  # GGUF file
    export("out/llama-md", "out/llama-again", family="llama")
"""

from __future__ import annotations

import importlib

from .core import Family

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
    "mixtral": "modular_decoder.conversion.families.mixtral",
    "qwen2_moe": "modular_decoder.conversion.families.qwen2_moe",
    "qwen3_moe": "modular_decoder.conversion.families.qwen3_moe",
    "olmoe": "modular_decoder.conversion.families.olmoe",
    "granitemoe": "modular_decoder.conversion.families.granitemoe",
    "qwen3_next": "modular_decoder.conversion.families.qwen3_next",
    "qwen3_5_text": "modular_decoder.conversion.families.qwen3_5",
    "gpt_oss": "modular_decoder.conversion.families.gpt_oss",
    "smollm3": "modular_decoder.conversion.families.smollm3",
    "llama4_text": "modular_decoder.conversion.families.llama4",
    "gemma4_text": "modular_decoder.conversion.families.gemma4",
    "gemma3n_text": "modular_decoder.conversion.families.gemma3n",
}


# Multimodal checkpoints whose language model is a registered family: named in the refusal, so a user sees the
# text family converts and that this folder's vision tower is why it does not (nothing is dropped silently).
MULTIMODAL_WRAPPERS: dict[str, str] = {"qwen3_5": "qwen3_5_text", "llama4": "llama4_text", "gemma4": "gemma4_text",
                                        "gemma3n": "gemma3n_text"}


def get_family(name: str) -> Family:
    """The family registered for transformers `model_type` `name`; `ValueError` if there is none."""
    if name in MULTIMODAL_WRAPPERS:
        raise ValueError(f"Source family {name!r} is a multimodal checkpoint (a vision tower beside the language "
                         f"model); its language model's family {MULTIMODAL_WRAPPERS[name]!r} converts, from a folder "
                         "holding that model alone, but not from this one.")
    if name not in FAMILIES:
        raise ValueError(f"Unknown source family {name!r}; convertible families: {sorted(FAMILIES)}.")
    return importlib.import_module(FAMILIES[name]).FAMILY


from .api import compare_with_source, convert, export  # noqa: E402

__all__ = ["FAMILIES", "get_family", "convert", "export", "compare_with_source"]
