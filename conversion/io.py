"""Reading source checkpoints (Hugging Face folders, GGUF files) and writing folders atomically."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

# Files a converted (or exported) folder carries over from its source unchanged.
SIDE_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json", "vocab.json",
    "merges.txt", "vocab.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
    "generation_config.json",
)


def read_safetensors_folder(src: Path, allow_bin: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face folder: `model.safetensors`, sharded safetensors, or (opt-in,
    since it unpickles) `pytorch_model*.bin`."""
    from safetensors.torch import load_file

    files = sorted(src.glob("*.safetensors"))
    index = src / "model.safetensors.index.json"
    if index.exists():
        files = sorted({src / name for name in json.loads(index.read_text())["weight_map"].values()})
    if files:
        tensors: dict[str, torch.Tensor] = {}
        for file in files:
            tensors.update(load_file(str(file)))
        return tensors
    bins = sorted(src.glob("pytorch_model*.bin"))
    if bins and not allow_bin:
        raise ValueError(
            f"{src} holds only legacy `.bin` weights, which are loaded by unpickling (it can run code). "
            "Pass `allow_bin=True` (`--allow-bin`) if you trust the source."
        )
    if not bins:
        raise ValueError(f"{src} holds no `*.safetensors` (nor `pytorch_model*.bin`) weights.")
    tensors = {}
    for file in bins:
        tensors.update(torch.load(file, map_location="cpu", weights_only=True))
    return tensors


def read_gguf(src: Path, gguf_file: str):
    """(state dict with the family's transformers names, source config, tokenizer) from a GGUF file,
    through transformers' own GGUF loader (it dequantizes every tensor to fp32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (src / gguf_file).exists():
        raise ValueError(f"GGUF file {gguf_file!r} not found in {src}.")
    model = AutoModelForCausalLM.from_pretrained(str(src), gguf_file=gguf_file, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(src), gguf_file=gguf_file)
    state = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    return state, model.config, tokenizer, model.generation_config


def copy_side_files(src: Path, dst: Path) -> None:
    for name in SIDE_FILES:
        if (src / name).exists() and not (dst / name).exists():
            shutil.copy2(src / name, dst / name)


@contextlib.contextmanager
def atomic_folder(out: Path, force: bool = False):
    """Yield a temporary folder next to `out`; move it to `out` only if the block completes.

    An existing `out` is refused unless `force` (then replaced only after success). Whatever
    interrupts the block, the temporary folder is removed and `out` is untouched.
    """
    out = Path(out)
    if out.exists() and not force:
        raise FileExistsError(f"{out} already exists; pass force=True (`--force`) to replace it.")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / out.name)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
