"""A GGUF file as a catalog of tensors dequantized one at a time.

transformers' GGUF loading builds the whole model in float32 first. Here each tensor is read from the
file when its rule runs (its bytes copied out with plain reads: the file is never mapped into this
process's memory), dequantized by gguf-py in blocks of rows, and put into the transformers model's
layout by transformers' own GGUF tensor processors (the reversed Q/K permutation of llama.cpp, Gemma's
norm offset, the experts' gate and up merged): the same steps, in the same order, as transformers'
`load_gguf_checkpoint`, one tensor at a time. So the bounded peak of a GGUF conversion is one
tensor in float32 plus its quantized bytes (and, for experts stored as gate and up, both of them).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .io import GGUFTensorInfo, check_gguf
from .sources import SourceTensor

# gguf-py's temporaries per dequantized block of rows stay around this many float32 values (64 MiB)
_CHUNK_VALUES = 16 * 2**20


def open_gguf(src: Path, gguf_file: str):
    """(source config, {transformers model name: SourceTensor}, tokenizer, generation config) of a GGUF file."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map,
                                                          load_gguf_checkpoint)

    path = src / gguf_file
    if not path.is_file():
        found = sorted(p.name for p in src.glob("*.gguf"))
        raise FileNotFoundError(f"GGUF file {gguf_file!r} not found in {src} (GGUF files there: {found or 'none'}).")
    layout = check_gguf(path)
    config = AutoConfig.from_pretrained(str(src), gguf_file=gguf_file)
    tokenizer = AutoTokenizer.from_pretrained(str(src), gguf_file=gguf_file)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    parsed = load_gguf_checkpoint(str(path), return_tensors=False)  # the metadata as transformers reads it
    processor = TENSOR_PROCESSORS.get(layout.architecture, TensorProcessor)(config=parsed["config"])
    names = get_gguf_hf_weights_map(model, processor)
    groups: dict[str, list] = {}
    for tensor in layout.tensors:  # those no model tensor maps to are skipped, as transformers skips them
        if tensor.name in names:
            groups.setdefault(names[tensor.name], []).append(tensor)
    tensors = {name: _entry(path, name, shapes[name], group, processor, names) for name, group in groups.items()}
    return config, tensors, tokenizer, GenerationConfig.from_model_config(config)


def _entry(path: Path, name: str, shape, group: list, processor, names: dict) -> SourceTensor:
    def read() -> torch.Tensor:
        parsed = {"tensors": {}}  # where processors put what they assemble from several file tensors
        result = None
        for stored in group:
            processed = processor.process(weights=_dequantized(path, stored), name=stored.name,
                                          tensor_key_mapping=names, parsed_parameters=parsed)
            if processed.name is not None and names.get(processed.name) == name:
                result = torch.from_numpy(np.copy(processed.weights))
        result = parsed["tensors"].get(name, result)
        if result is None or tuple(result.shape) != tuple(shape):
            got = None if result is None else tuple(result.shape)
            raise ValueError(f"{path}: {name} read from {[t.name for t in group]} has shape {got}, expected {shape}.")
        return result.to(torch.float32)

    return SourceTensor(name, tuple(shape), torch.float32, tuple(t.name for t in group),
                        sum(t.nbytes for t in group), read)


# GGUF tensor types stored as plain numbers, and their numpy types (gguf-py's `GGUFReader` reads them so)
_PLAIN = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}


def _raw_array(stored: GGUFTensorInfo) -> np.ndarray:
    """An empty array laid out as gguf-py's `GGUFReader` lays out the tensor's data (what `dequantize` takes)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    shape = tuple(reversed(stored.dims))
    if stored.kind in _PLAIN:
        return np.empty(shape, dtype=_PLAIN[stored.kind])
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(stored.kind)]
    return np.empty((*shape[:-1], shape[-1] // block * size), dtype=np.uint8)


def _dequantized(path: Path, stored: GGUFTensorInfo) -> np.ndarray:
    """One GGUF tensor as float32 (gguf-py's `dequantize`, block of rows by block of rows), its bytes read
    from the file into memory of its own."""
    from gguf import GGMLQuantizationType, dequantize

    raw = _raw_array(stored)
    kind = GGMLQuantizationType(stored.kind)
    view = memoryview(raw.reshape(-1).view(np.uint8))
    with open(path, "rb", buffering=0) as f:
        f.seek(stored.start)
        done = 0
        while done < len(view):
            got = f.readinto(view[done:])
            if not got:
                raise ValueError(f"{path} is truncated inside tensor {stored.name!r}.")
            done += got
    if raw.ndim < 2:
        return dequantize(raw, kind)
    rows = raw.reshape(-1, raw.shape[-1])
    first = dequantize(rows[:1], kind)
    out = np.empty((rows.shape[0], first.shape[-1]), dtype=np.float32)
    step = max(1, _CHUNK_VALUES // first.shape[-1])
    for r0 in range(0, rows.shape[0], step):
        out[r0:r0 + step] = dequantize(rows[r0:r0 + step], kind)
    return out.reshape(*raw.shape[:-1], first.shape[-1])
