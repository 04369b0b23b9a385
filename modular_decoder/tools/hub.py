"""Hub-ready folders: everything a repository needs to load with `trust_remote_code=True` anywhere.

`save_for_hub` writes the weights (sharded above `max_shard_size`), `config.json` with `auto_map`,
the code files, the generation config, the tokenizer and a model card; `check_hub_folder` lists
what a folder still lacks. `modular-decoder push` (push_command.py) uploads such a folder.
Not a remote-code file: the model modules never import it.
"""

from __future__ import annotations

import json
from pathlib import Path

from modular_decoder.tools.cards import render_model_card

AUTO_CLASSES = ("AutoConfig", "AutoModel", "AutoModelForCausalLM")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def save_for_hub(
    model,
    folder: str | Path,
    tokenizer=None,
    *,
    base_model: str | None = None,
    repo_id: str | None = None,
    max_shard_size: int | str = "5GB",
    license: str = "apache-2.0",
) -> Path:
    """Save `model` (a `ModularDecoderForCausalLM`) and `tokenizer` into `folder` as a Hub repository.

    Args:
        model: The model; its generation config is saved with it.
        folder: Output folder (created).
        tokenizer: Saved beside the model when given (with its chat template).
        base_model: Hub id the weights came from, recorded in the card's metadata.
        repo_id: The repository the card's usage snippet names.
        max_shard_size: Safetensors shards above this size are split (transformers' format).
        license: Hub license id for the card.
    """
    folder = Path(folder)
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    card = render_model_card(model.config, base_model=base_model, repo_id=repo_id or "<user>/<repo>", license=license)
    (folder / "README.md").write_text(card)
    missing = check_hub_folder(folder, need_tokenizer=tokenizer is not None)
    if missing:  # save_pretrained should have written all of it
        raise RuntimeError(f"{folder} is incomplete after saving: {missing}")
    return folder


def check_hub_folder(folder: str | Path, need_tokenizer: bool = False) -> list[str]:
    """What `folder` lacks to be a loadable remote-code repository (empty when complete)."""
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.exists():
        return ["config.json"]
    missing = []
    auto_map = json.loads(config_path.read_text()).get("auto_map", {})
    for auto_class in AUTO_CLASSES:
        if auto_class not in auto_map:
            missing.append(f"auto_map[{auto_class}]")
            continue
        module = auto_map[auto_class].split("--")[-1].rsplit(".", 1)[0]
        if not (folder / f"{module}.py").exists():
            missing.append(f"{module}.py")
    if not any((folder / name).exists() for name in WEIGHT_FILES):
        missing.append("model.safetensors")
    for name in ("generation_config.json", "README.md"):
        if not (folder / name).exists():
            missing.append(name)
    if need_tokenizer and not (folder / "tokenizer_config.json").exists():
        missing.append("tokenizer_config.json")
    return sorted(set(missing))
