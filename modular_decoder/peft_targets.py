"""PEFT's default targets for this family: every PEFT method that has defaults for Llama has them here too.

A PEFT config without `target_modules` (`LoraConfig()`, `IA3Config()`, `VeraConfig()`, ...) takes its targets
from PEFT's table for that method, keyed by `model_type`: `TRANSFORMERS_MODELS_TO_<METHOD>_TARGET_MODULES_MAPPING`
in `peft.utils.constants` (IA3 also reads `..._IA3_FEEDFORWARD_MODULES_MAPPING`). On every PEFT release this
project supports (0.15 onwards) each method reads its table through the one dict object defined there, which
the method's module imports by name; several tables are copies of LoRA's made when PEFT is imported. So an
entry added in place to every such table is seen by every method, whichever release: `register_peft_defaults`
adds to each table that has an entry for Llama that entry in this family's module names (`LLAMA_TO_OURS`).

Part of the remote-code files: standard library only (PEFT is read from `sys.modules`, never imported).
"""

from __future__ import annotations

import sys

MODEL_TYPE = "modular_decoder"
TABLE_PREFIX = "TRANSFORMERS_MODELS_TO_"

# Llama's module name -> this family's modules in the same role, over every attention and FFN kind. Names PEFT
# does not find are harmless (a method needs only some of its targets to exist).
# A linear-attention layer makes its queries, keys and values in one projection before its convolution (Gated
# DeltaNet's `in_proj_qkv`; Mamba-2's `in_proj`, which also makes its gate and step sizes: x, B, C are its values,
# keys and queries; LFM2's short convolution's `in_proj`, its two gates and its input) and projects out by
# `out_proj` (transformers' names); Kimi Delta Attention has Llama's `q_proj` ... `o_proj`. Shared key = value
# attention (DeepSeek-V4) makes its one key = value head by `kv_proj` and projects out by `o_b_proj` after its
# grouped `o_a_proj` (which is no `nn.Linear`: a LoRA on it would not know its groups).
LLAMA_TO_OURS = {
    "q_proj": ("q_proj", "q_b_proj", "in_proj_qkv", "in_proj"),  # MLA: `q_proj`, or `q_b_proj` after its bottleneck
    "k_proj": ("k_proj", "kv_b_proj", "in_proj_qkv", "in_proj", "kv_proj"),  # MLA's per-head keys and values: `kv_b_proj`
    "v_proj": ("v_proj", "kv_b_proj", "in_proj_qkv", "in_proj", "kv_proj"),
    "o_proj": ("o_proj", "out_proj", "o_b_proj"),
    # the dense FFN and the shared experts (routed experts are fused 3-D parameters, not modules)
    "gate_proj": ("gate_proj",),
    "up_proj": ("up_proj",),
    "down_proj": ("down_proj",),
    # LayerNorm tuning: the norm before (or, post-norm and sandwich, after) attention and the FFN, the final norm
    "input_layernorm": ("pre_attn_norm", "post_attn_norm"),
    "post_attention_layernorm": ("pre_mlp_norm", "post_mlp_norm"),
    "norm": ("final_norm",),
}


def translated(llama_targets) -> list[str]:
    """Llama's targets in this family's module names, in order, each once (an unknown name is kept)."""
    names = []
    for target in llama_targets:
        for name in LLAMA_TO_OURS.get(target, (target,)):
            if name not in names:
                names.append(name)
    return names


def peft_target_tables() -> dict[str, dict]:
    """PEFT's default-target tables that hold an entry for Llama, by name; empty where PEFT is not imported."""
    constants = sys.modules.get("peft.utils.constants")
    tables = {}
    for name, table in vars(constants).items() if constants is not None else ():
        if name.startswith(TABLE_PREFIX) and isinstance(table, dict) and _names(table.get("llama")):
            tables[name] = table
    return tables


def register_peft_defaults() -> bool:
    """Add this family's entry (Llama's, translated) to every PEFT table of default targets, if PEFT is imported
    (never imports it); an entry already there (the user's) is kept. Returns whether PEFT was there.

    `ModularDecoderConfig.to_dict` calls it: PEFT reads `model.config.to_dict()` right before it looks the
    defaults up, so the entries are there whichever of PEFT and the model was loaded first, at no import cost.
    """
    tables = peft_target_tables()
    for table in tables.values():
        table.setdefault(MODEL_TYPE, translated(table["llama"]))
    return bool(tables)


def _names(entry) -> bool:
    return isinstance(entry, (list, tuple)) and bool(entry) and all(isinstance(name, str) for name in entry)


# LoRA's entry, for reference in docs and tests
PEFT_LORA_TARGET_MODULES = translated(["q_proj", "v_proj"])
