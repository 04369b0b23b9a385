"""LoRA adapters between a family's transformers class and ours: each adapted module renamed by the family's map.

A LoRA adapter made on transformers' class of a family whose modules ours names alike (most) loads onto the converted
model as it is. Where the names differ (Llama 4's dense MLP and shared expert are `feed_forward` and
`feed_forward.shared_expert`, ours `mlp` and `mlp.shared_experts`), `convert_adapter` renames its tensors through the
family's own tensor map, and `export_adapter` back. Only a module whose weight the map copies unchanged carries its
adapter exactly by renaming; an adapter on a module the map splits, fuses or transposes, or on one that is no linear
layer on the other side, is refused naming it, never dropped.

    convert_adapter("llama4-lora", "llama4-lora-md", base_dir="Llama-4-Scout-text")   # transformers' folder
    export_adapter("llama4-lora-md", "llama4-lora-again", family="llama4_text", base_dir="llama4-md")  # ours
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import torch

from . import get_family
from .core import rule_instances
from .io import atomic_folder, check_destination

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."  # where PEFT's saved keys put the model's module names
# adapter_config.json entries whose modules or parameters this renaming does not carry: refused where set
UNCARRIED = ("modules_to_save", "target_parameters", "trainable_token_indices", "layer_replication")
_KEY = re.compile(r"^(?P<module>.+?)\.(?P<rest>lora_[A-Za-z_]+(\..+)?)$")


def module_map(rules, cfg, inverse: bool = False) -> dict[str, str | None]:
    """{module name on one side: its name on the other, or None where the map changes its weight (split, fused,
    transposed), so that its adapter cannot be renamed}; from the source's names (ours with `inverse`)."""
    names: dict[str, str | None] = {}
    for r, src, dst in rule_instances(rules, cfg):
        ins, outs = (dst, src) if inverse else (src, dst)
        modules = [name.removesuffix(".weight") for name in ins if name.endswith(".weight")]
        renamed = r.transform == "copy" and len(ins) == len(outs) == 1 and outs[0].endswith(".weight")
        for module in modules:
            names[module] = outs[0].removesuffix(".weight") if renamed else names.get(module)
    return names


def convert_adapter(src_dir, out_dir, base_dir=None, force: bool = False, input_checks=contextlib.nullcontext) -> Path:
    """Write the LoRA adapter folder `src_dir`, made on transformers' model in `base_dir` (its folder; default: the
    adapter's `base_model_name_or_path` where that is a folder), for the model `convert` makes from that folder:
    tensors and `target_modules` under our module names. Returns `out_dir`."""
    from transformers import AutoConfig

    from modular_decoder import ModularDecoderConfig, ModularDecoderForCausalLM

    with input_checks():
        check_destination(out_dir, force, sources=(src_dir,))
        config, tensors = _read_adapter(Path(src_dir))
        source = AutoConfig.from_pretrained(str(_base(config, base_dir)))
        family = get_family(source.model_type)
        cfg = ModularDecoderConfig(**family.to_contract(source))
        with torch.device("meta"):
            ours = ModularDecoderForCausalLM(cfg)
        config, tensors = carried(config, tensors, module_map(family.rules(source), cfg), ours, family.name, "ours")
    return _write_adapter(Path(out_dir), config, tensors, force, src_dir)


def export_adapter(src_dir, out_dir, family: str, base_dir=None, force: bool = False,
                   input_checks=contextlib.nullcontext) -> Path:
    """Write the LoRA adapter folder `src_dir`, made on our model in `base_dir` (its folder; default as for
    `convert_adapter`), for the model `export --family family` makes from that folder: under transformers' module
    names. Returns `out_dir`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from modular_decoder import ModularDecoderConfig

    from .api import _family_config

    with input_checks():
        check_destination(out_dir, force, sources=(src_dir,))
        config, tensors = _read_adapter(Path(src_dir))
        base_dir = _base(config, base_dir)
        cfg = AutoConfig.from_pretrained(str(base_dir))
        if not isinstance(cfg, ModularDecoderConfig):
            raise ValueError(f"{base_dir} is not a modular_decoder checkpoint (model_type={cfg.model_type!r}).")
        fam = get_family(family)
        source = _family_config(fam, cfg)
        with torch.device("meta"):
            theirs = AutoModelForCausalLM.from_config(source)
        config, tensors = carried(config, tensors, module_map(fam.rules(source), cfg, inverse=True), theirs,
                                  fam.name, f"{fam.name}'s")
    return _write_adapter(Path(out_dir), config, tensors, force, src_dir)


def carried(config: dict, tensors: dict[str, torch.Tensor], names: dict[str, str | None], model, family: str,
            side: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter config, tensors) with every adapted module renamed by `names` (`module_map`) to a module of `model`
    (on the meta device); `ValueError` naming what cannot be carried."""
    if config.get("peft_type") != "LORA":
        raise ValueError(f"Only LoRA adapters convert; this one's `peft_type` is {config.get('peft_type')!r}.")
    uncarried = [name for name in UNCARRIED if config.get(name)]
    if uncarried:
        raise ValueError(f"This adapter sets {', '.join(f'`{name}`' for name in uncarried)}, which adapter "
                         "conversion does not carry.")
    modules = dict(model.named_modules())
    renamed, out, refused = {}, {}, []
    for key, tensor in tensors.items():
        match = _KEY.match(key.removeprefix(PREFIX)) if key.startswith(PREFIX) else None
        module = match["module"] if match else key
        new = names.get(module) if match else None
        if new is None or not isinstance(modules.get(new), (torch.nn.Linear, torch.nn.Embedding)):
            refused.append(module if new is None else f"{module} (a {type(modules.get(new)).__name__} in {side})")
            continue
        renamed[module] = new
        out[f"{PREFIX}{new}.{match['rest']}"] = tensor
    if refused:
        shown = sorted(set(refused))
        raise ValueError(f"The {family} map does not carry an adapter on {', '.join(shown[:8])}"
                         f"{' ...' if len(shown) > 8 else ''}: its weight is not one linear layer's, renamed, on "
                         "both sides.")
    return _renamed_config(config, renamed, modules), out


def _renamed_config(config: dict, renamed: dict[str, str], modules) -> dict:
    """The adapter config choosing exactly the renamed modules: its target leaf names renamed where they still pick
    exactly those modules (else the modules' full names), rank and alpha patterns per module."""
    from peft.utils.other import get_pattern_key

    adapted = set(renamed.values())
    leaves = sorted({name.rsplit(".", 1)[-1] for name in adapted})
    picked = {name for name in modules if any(name == leaf or name.endswith(f".{leaf}") for leaf in leaves)}
    config = {**config, "target_modules": leaves if picked == adapted else sorted(adapted), "exclude_modules": None,
              "layers_to_transform": None, "layers_pattern": None}
    for field in ("rank_pattern", "alpha_pattern"):
        patterns = config.get(field) or {}
        config[field] = {new: patterns[key] for old, new in sorted(renamed.items())
                         if (key := get_pattern_key(list(patterns), old)) in patterns}
    return config


def _base(config: dict, base_dir) -> Path:
    """The folder of the model the adapter was made on: `base_dir`, else the adapter's own `base_model_name_or_path`
    where that is a model folder."""
    named = config.get("base_model_name_or_path")
    base = Path(base_dir) if base_dir is not None else Path(named) if named else None
    if base is None or not (base / "config.json").is_file():
        raise ValueError(f"The adapter's base model folder {str(base) + ' ' if base else ''}holds no config.json: pass "
                         "the folder of the model it was made on (`--adapter-base`, `base_dir=`).")
    return base


def _read_adapter(src: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    from modular_decoder.checkpoint_checks import read_json_file

    if not (src / ADAPTER_CONFIG).is_file():
        raise ValueError(f"{src} has no {ADAPTER_CONFIG}: not a PEFT adapter folder.")
    if not (src / ADAPTER_WEIGHTS).is_file():
        raise ValueError(f"{src} has no {ADAPTER_WEIGHTS} (a pickled adapter_model.bin is not read).")
    return read_json_file(src / ADAPTER_CONFIG), load_file(src / ADAPTER_WEIGHTS)


def _write_adapter(out: Path, config: dict, tensors: dict[str, torch.Tensor], force: bool, src) -> Path:
    from safetensors.torch import save_file

    with atomic_folder(out, force=force, sources=(src,)) as tmp:
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    return out
