"""A source checkpoint as a catalog of tensors that are read only when asked for.

Every entry knows its name, shape, dtype and the bytes it reads, and reads itself on demand: a tensor
of a safetensors file; a weight published quantized, dequantized as it is read (FP8 with block
scales, MXFP4 experts: `quantized.py`); a mixture-of-experts tensor that the file stores one tensor per
expert, assembled expert by expert into the one 3-D tensor the model holds (`ExpertStack`). So the
catalog of a 700 GB checkpoint costs its headers, and reading one entry costs that entry.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .core import Family, rename
from .quantized import (Fp8Format, dequantize_fp4_blocks, dequantize_fp8, dequantize_mxfp4, fp8_format, fp8_scale_name,
                        scale_blocks)

# Storage dtypes of FP4-packed weights beside an FP8 checkpoint's scales (DeepSeek-V4's experts: int8)
FP4_PACKED = (torch.int8, torch.uint8, *((torch.float4_e2m1fn_x2,) if hasattr(torch, "float4_e2m1fn_x2") else ()))
from .tensor_files import StoredTensor, folder_layout, read_tensor


@dataclass(frozen=True)
class SourceTensor:
    """One tensor of the source, read on demand.

    Args:
        name: Its name (a file's name, then the transformers model's, see `model_tensors`).
        shape, dtype: Of the tensor `read` returns.
        files: The source-file tensors it is made of (each is consumed by reading this one).
        nbytes: The bytes it reads from the source.
        read: Returns the tensor, in memory of its own.
        read_rows: Returns rows `[start, stop)` of its first dimension, where that can be done without
            reading the rest (None where it cannot).
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    files: tuple[str, ...]
    nbytes: int
    read: Callable[[], torch.Tensor]
    read_rows: Callable[[int, int], torch.Tensor] | None = None

    def meta(self) -> torch.Tensor:
        """A tensor of this shape and dtype that holds no data (for planning)."""
        return torch.empty(self.shape, dtype=self.dtype, device="meta")


def stored_tensor(stored: StoredTensor) -> SourceTensor:
    return SourceTensor(stored.name, stored.shape, stored.dtype, (stored.name,), stored.nbytes,
                        lambda: read_tensor(stored), lambda a, b: read_tensor(stored, (a, b)))


def tensor_in_memory(name: str, tensor: torch.Tensor) -> SourceTensor:
    return SourceTensor(name, tuple(tensor.shape), tensor.dtype, (name,), tensor.nbytes, lambda: tensor,
                        lambda a, b: tensor[a:b] if tensor.dim() else None)


def safetensors_tensors(src: Path) -> dict[str, SourceTensor]:
    """Every tensor of a folder's safetensors files (headers read, nothing else)."""
    return {name: stored_tensor(stored) for name, stored in folder_layout(src).items()}


def folder_tensors(src: Path, allow_bin: bool = False) -> dict[str, SourceTensor]:
    """Every tensor of a Hugging Face folder: `model.safetensors`, sharded safetensors, or (opt-in, since it
    unpickles) `pytorch_model*.bin`."""
    tensors = safetensors_tensors(src)
    if tensors:
        return tensors
    bins = sorted(src.glob("pytorch_model*.bin"))
    if bins and not allow_bin:
        raise ValueError(
            f"{src} holds only legacy `.bin` weights, which are loaded by unpickling (it can run code). "
            "Pass `allow_bin=True` (`--allow-bin`) if you trust the source."
        )
    if not bins:
        raise ValueError(f"{src} holds no `*.safetensors` (nor `pytorch_model*.bin`) weights.")
    return bin_tensors(bins)


def bin_tensors(files: list[Path]) -> dict[str, SourceTensor]:
    """Legacy `pytorch_model*.bin` files, memory-mapped where their format allows (unpickling: trusted
    sources only; the caller asks the user first)."""
    tensors = {}
    for file in files:
        try:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # the pre-zip format cannot be memory-mapped: read whole
            state = torch.load(file, map_location="cpu", weights_only=True)
        tensors.update({name: tensor_in_memory(name, tensor) for name, tensor in state.items()})
    return tensors


# ---------------------------------------------------------------------------------------------------------
# Quantized checkpoints: each quantized weight and its scales become one entry that dequantizes as it reads.

def quantization_of(config) -> dict | None:
    """The source config's `quantization_config` as a dict, or None."""
    quantization = getattr(config, "quantization_config", None)
    if quantization is None:
        return None
    return dict(quantization if isinstance(quantization, dict) else quantization.to_dict())


def describe_quantization(quantization: dict | None) -> str | None:
    """A phrase for the model card: what the source's weights were."""
    if quantization is None:
        return None
    if quantization.get("quant_method") == "mxfp4":
        return "MXFP4 experts (E2M1 values, one E8M0 scale per 32)"
    fp8 = fp8_format(quantization, "the source")
    experts = " and FP4 experts (E2M1 values, one scale per 32)" if quantization.get("expert_dtype") == "fp4" else ""
    return fp8.description + experts if fp8 is not None else str(quantization.get("quant_method"))


def dequantized(tensors: dict[str, SourceTensor], quantization: dict | None, dtype: torch.dtype,
                where: str) -> dict[str, SourceTensor]:
    """`tensors` with every quantized weight and its scales replaced by one entry that reads the weight
    dequantized to `dtype`. Supported: the FP8 formats `quantized.fp8_format` reads (block, per-tensor and
    per-channel scales: DeepSeek-V3, Kimi K2, Qwen3 -FP8, MiniMax-M2, Ministral 3, GLM-4.5 -FP8) and "mxfp4"
    (gpt-oss); any other is refused by name."""
    if quantization is None:
        _refuse_float8(tensors.values(), where, "the config has no `quantization_config` to scale them by")
        return tensors
    method = quantization.get("quant_method")
    if method == "mxfp4":
        return _mxfp4_entries(tensors, dtype)
    fp8 = fp8_format(quantization, where)
    if fp8 is not None:
        return _fp8_entries(tensors, fp8, dtype, where)
    raise ValueError(f"{where} is quantized with `quant_method`={method!r}, which convert cannot read; it reads FP8 "
                     "('fp8', 'fbgemm_fp8', compressed-tensors' 'float-quantized') and MXFP4 ('mxfp4') checkpoints.")


def _combined(name: str, parts: list[SourceTensor], shape, dtype, read, read_rows=None) -> SourceTensor:
    return SourceTensor(name, tuple(shape), dtype, tuple(f for p in parts for f in p.files),
                        sum(p.nbytes for p in parts), read, read_rows)


def _refuse_float8(tensors, where: str, why: str) -> None:
    """A float8 tensor cast without its scales would be wrong in silence: refuse it by name."""
    bare = [t.name for t in tensors if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)]
    if bare:
        raise ValueError(f"{where}: float8 tensor(s) {bare[:5]} cannot be dequantized: {why}.")


# Activation scales (static FP8 activations): what transformers' dequantized load drops
_ACTIVATION_SCALES = (".activation_scale", ".input_scale")


def _fp8_entries(tensors: dict[str, SourceTensor], fp8: Fp8Format, dtype, where: str) -> dict[str, SourceTensor]:
    out = {}
    scales = {scale for name in tensors if (scale := fp8_scale_name(name, fp8.scale_suffix)) in tensors}
    for name, tensor in tensors.items():
        if name in scales or name.endswith(_ACTIVATION_SCALES):
            continue  # read with its weight
        scale = tensors.get(fp8_scale_name(name, fp8.scale_suffix))
        if scale is None:
            _refuse_float8([tensor], where, f"`{fp8_scale_name(name, fp8.scale_suffix)}` is missing")
            out[name] = tensor
            continue
        if tensor.dtype in FP4_PACKED:  # DeepSeek-V4's FP4 experts: two values a byte, their scale grid sets the block
            out[name] = _combined(name, [tensor, scale], (*tensor.shape[:-1], 2 * tensor.shape[-1]), dtype,
                                  lambda w=tensor, s=scale, name=name: dequantize_fp4_blocks(w.read(), s.read(), dtype,
                                                                                             name))
            continue
        block, as_grid = scale_blocks(tensor.shape, scale.shape, fp8.block, name)

        def read(w=tensor, s=scale, name=name, block=block, as_grid=as_grid):
            return dequantize_fp8(w.read(), as_grid(s.read()), block, dtype, name)

        def read_rows(a, b, w=tensor, s=scale, name=name, block=block, as_grid=as_grid):  # experts of a 3-D tensor
            return dequantize_fp8(w.read_rows(a, b), as_grid(s.read_rows(a, b)), block, dtype, name)

        rows = read_rows if len(tensor.shape) > 2 and tensor.read_rows and scale.read_rows else None
        out[name] = _combined(name, [tensor, scale], tensor.shape, dtype, read, rows)
    return out


def _mxfp4_entries(tensors: dict[str, SourceTensor], dtype) -> dict[str, SourceTensor]:
    out = dict(tensors)
    for name in [n for n in tensors if n.endswith("_blocks")]:
        base = name[: -len("_blocks")]
        scales = tensors.get(base + "_scales")
        if scales is None:
            continue
        blocks = out.pop(name)
        out.pop(scales.name)
        experts, rows, groups, width = blocks.shape

        def read(b=blocks, s=scales, base=base):
            return dequantize_mxfp4(b.read(), s.read(), dtype, base)

        def read_rows(e0, e1, b=blocks, s=scales, base=base):
            return dequantize_mxfp4(b.read_rows(e0, e1), s.read_rows(e0, e1), dtype, base)

        out[base] = _combined(base, [blocks, scales], (experts, groups * width * 2, rows), dtype, read,
                              read_rows if blocks.read_rows and scales.read_rows else None)
    return out


# ---------------------------------------------------------------------------------------------------------
# File names -> the transformers model's names


def model_tensors(tensors: dict[str, SourceTensor], family: Family) -> dict[str, SourceTensor]:
    """File names -> the transformers model's names: old prefixes renamed as transformers does on load,
    the causal-LM prefix (`transformer.`, `model.`) added where a base model was saved, per-expert tensors
    stacked into the model's 3-D experts tensors (read expert by expert), and buffers that hold no weights
    dropped (old causal masks)."""
    keep = (family.prefix, *family.head) if family.prefix else None
    named = {}
    for tensor in tensors.values():
        if tensor.name.startswith(tuple(family.dropped)):  # not held by the family's model (`Family.dropped`)
            continue
        name = rename(rename(tensor.name, family.aliases), family.renames)
        if keep is not None and not name.startswith(keep):
            name = family.prefix + name
        named[name] = dataclasses.replace(tensor, name=name)
    for stack in family.experts:
        for dst, group in stack.groups(named).items():
            named[dst] = stacked(dst, [[named.pop(name) for name in part] for part in group])
    for split in family.split:
        for dst, group in split.groups(named).items():
            named[dst] = concatenated(dst, [named.pop(name) for name in group])
    return {name: t for name, t in named.items() if not any(name.endswith(suffix) for suffix in family.ignore)}


def concatenated(name: str, parts: list[SourceTensor]) -> SourceTensor:
    """One tensor from parts stacked along dim 0 (a `core.SplitTensor`)."""
    odd = [p.name for p in parts if (p.shape[1:], p.dtype) != (parts[0].shape[1:], parts[0].dtype)]
    if odd:
        raise ValueError(f"Parts of {name} differ in shape or dtype: {odd} against {parts[0].name}.")
    shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
    return _combined(name, parts, shape, parts[0].dtype, lambda: torch.cat([p.read() for p in parts]))


def stacked(name: str, parts: list[list[SourceTensor]]) -> SourceTensor:
    """One (E, sum of the parts' rows, ...) tensor from per-expert pieces: `parts[j][e]` is part j of expert e
    (gate, up), the parts concatenated along dim 1. Read expert by expert into the result."""
    first = [part[0] for part in parts]
    for part in parts:
        odd = [p.name for p in part if (p.shape, p.dtype) != (part[0].shape, part[0].dtype)]
        if odd:
            raise ValueError(f"Experts of {name} differ in shape or dtype: {odd[:5]} against {part[0].name}.")
    widths = [p.shape[0] for p in first]
    shape = (len(parts[0]), sum(widths), *first[0].shape[1:])
    dtype = first[0].dtype

    def read_rows(e0: int, e1: int) -> torch.Tensor:
        out = torch.empty((e1 - e0, *shape[1:]), dtype=dtype)
        for e in range(e0, e1):
            offset = 0
            for part, width in zip(parts, widths):
                out[e - e0, offset:offset + width] = part[e].read()
                offset += width
        return out

    pieces = [p for part in parts for p in part]
    return _combined(name, pieces, shape, dtype, lambda: read_rows(0, shape[0]), read_rows)
