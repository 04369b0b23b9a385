"""Weights published quantized, dequantized on reading: FP8 (with block, per-tensor or per-channel scales, in the
formats `fp8_format` reads) and MXFP4 experts.

Each function computes what transformers computes when it loads the same checkpoint with
`FineGrainedFP8Config(dequantize=True)` or `Mxfp4Config(dequantize=True)` (the same float32
arithmetic, one rounding to the output dtype), a block of rows at a time so that the float32
temporaries stay small whatever the tensor's size.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

# The float32 temporaries of one step hold at most about this many elements (64 MiB).
_CHUNK_ELEMENTS = 16 * 2**20
# E2M1 values of the 16 FP4 codes (transformers' `FP4_VALUES`, the OCP Microscaling spec)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def fp8_scale_name(weight: str, suffix: str = "_scale_inv") -> str:
    """The name of a weight's scale: `x.weight` -> `x.weight_scale_inv`, as FP8 checkpoints and transformers'
    `Fp8Quantize` write it (a fused experts tensor `x.gate_up_proj` -> `x.gate_up_proj_scale_inv`), or with the
    suffix of another format (`_scale`: compressed-tensors, fbgemm)."""
    return weight + suffix


@dataclass(frozen=True)
class Fp8Format:
    """How an FP8 checkpoint scales its weights: each weight `w` is w_fp8 times the entry of its scale tensor
    `w + scale_suffix` for its block, `block` (rows, cols) where the format fixes it, else `None`: one scale for the
    whole tensor or one per output row, told by the scale's shape (`scale_blocks`)."""

    scale_suffix: str
    block: tuple[int, int] | None
    description: str  # for the model card: what the source's weights were


FP8 = "FP8 (`float8_e4m3fn`)"
# compressed-tensors' weight strategies that are one scale per block of a fixed shape (or per tensor, per row)
_COMPRESSED_STRATEGIES = {"tensor": "one scale per tensor", "channel": "one scale per output channel",
                          "block": "one scale per {0}x{1} block"}


def fp8_format(quantization: dict, where: str) -> Fp8Format | None:
    """The FP8 layout of a `quantization_config`, None where it is not FP8. Read: `quant_method` "fp8" with a 2-D
    `weight_block_size` (DeepSeek-V3, Qwen3 -FP8, MiniMax-M2) or none (one `weight_scale_inv` per tensor: Ministral 3,
    Devstral 2); "compressed-tensors" in its "float-quantized" format with 8-bit float weights scaled per tensor, per
    channel (GLM-4.5 -FP8) or per block (`weight_scale`); "fbgemm_fp8" (one `weight_scale` per output channel).
    Another layout of these methods is refused by name (`ValueError`)."""
    method = quantization.get("quant_method")
    if method == "fp8":
        block = quantization.get("weight_block_size")
        if block is None:
            return Fp8Format("_scale_inv", None, f"{FP8} with one scale per tensor")
        if len(block) != 2:
            raise ValueError(f"{where}: an FP8 checkpoint whose `weight_block_size` is {block!r}, not 2-D, cannot be "
                             "converted.")
        return Fp8Format("_scale_inv", (int(block[0]), int(block[1])),
                         f"{FP8} with one scale per {block[0]}x{block[1]} block")
    if method == "fbgemm_fp8":
        return Fp8Format("_scale", None, f"{FP8} with one scale per output channel (fbgemm)")
    if method == "compressed-tensors":
        return _compressed_tensors_format(quantization, where)
    return None


def _compressed_tensors_format(quantization: dict, where: str) -> Fp8Format:
    """compressed-tensors' FP8: every config group's weights 8-bit floats, symmetric, one strategy of
    `_COMPRESSED_STRATEGIES`; its integer and 4-bit formats are refused naming the format."""
    groups = list((quantization.get("config_groups") or {}).values())
    formats = {group.get("format") or quantization.get("format") for group in groups} or {quantization.get("format")}
    weights = [group.get("weights") or {} for group in groups]
    layouts = {(w.get("num_bits"), w.get("type"), w.get("strategy"), tuple(w.get("block_structure") or ()),
                w.get("symmetric", True)) for w in weights}
    if formats != {"float-quantized"} or len(layouts) != 1:
        raise ValueError(f"{where} is quantized with compressed-tensors in the format(s) {sorted(map(str, formats))}"
                         f" with weights {sorted(map(str, layouts))}, which convert cannot read; it reads its "
                         "'float-quantized' FP8 (8-bit float weights, one layout for every group).")
    bits, kind, strategy, block, symmetric = layouts.pop()
    if bits != 8 or kind != "float" or not symmetric or strategy not in _COMPRESSED_STRATEGIES \
            or (strategy == "block") != (len(block) == 2):
        raise ValueError(f"{where}: compressed-tensors weights of {bits} bits of type {kind!r}, strategy "
                         f"{strategy!r}{f' {list(block)}' if block else ''}, symmetric={symmetric}, cannot be read; "
                         "convert reads symmetric 8-bit float weights scaled per tensor, channel or block.")
    what = _COMPRESSED_STRATEGIES[strategy].format(*block)
    return Fp8Format("_scale", tuple(block) or None, f"{FP8} with {what} (compressed-tensors)")


def scale_blocks(weight_shape: tuple[int, ...], scale_shape: tuple[int, ...], block: tuple[int, int] | None,
                 name: str):
    """(block, a function giving the scale tensor as `dequantize_fp8` reads it for a weight of `weight_shape` or a
    block of its leading rows) for a scale of `scale_shape`: the format's own block, or where it has none, one scale
    per tensor (read as one per row, so that a large tensor still dequantizes a few rows at a time) or per output
    row. `ValueError` naming `name` for another shape."""
    *lead, rows, cols = weight_shape
    if block is not None:
        return block, lambda scale: scale
    count = math.prod(scale_shape)
    if count == math.prod(lead):  # one per tensor (a scalar, (1,) or (1, 1) each)
        return (1, cols), lambda scale: scale.reshape(-1, 1, 1).expand(-1, rows, 1).reshape(
            *scale.shape[:len(lead)], rows, 1)
    if count == math.prod(lead) * rows and (not scale_shape or scale_shape[-1] in (1, rows)):
        return (1, cols), lambda scale: scale.reshape(*scale.shape[:len(lead)], rows, 1)
    raise ValueError(f"{name}: a scale of shape {tuple(scale_shape)} is neither one per tensor nor one per output "
                     f"row of a weight of shape {tuple(weight_shape)}.")


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype,
                   name: str = "weight") -> torch.Tensor:
    """`weight` (float8, (..., rows, cols)) times its per-block `scale_inv` (..., ceil(rows/bm), ceil(cols/bn)),
    each block (bm, bn) = `block` scaled by its entry; the product in float32, rounded once to `dtype`.

    Scales stored as bytes (E8M0 exponents, `uint8`) stand for 2**(byte - 127), as in transformers. A last
    block that the weight's shape cuts short is scaled by its entry like the others (DeepSeek's own
    `weight_dequant`). Raises a `ValueError` naming `name` if the scale grid does not fit the weight.
    """
    rows, cols = weight.shape[-2:]
    bm, bn = block
    grid = (math.ceil(rows / bm), math.ceil(cols / bn))
    if tuple(scale_inv.shape) != (*weight.shape[:-2], *grid):
        raise ValueError(f"{name}: its scales have shape {tuple(scale_inv.shape)}, but a weight of shape "
                         f"{tuple(weight.shape)} in blocks of {bm}x{bn} needs {(*weight.shape[:-2], *grid)}.")
    scales = (scale_inv.to(torch.float32) - 127.0).exp2() if scale_inv.dtype == torch.uint8 else scale_inv.to(torch.float32)
    weight, scales = weight.reshape(-1, rows, cols), scales.reshape(-1, *grid)
    out = torch.empty(weight.shape, dtype=dtype)
    step = max(1, _CHUNK_ELEMENTS // (bm * cols)) * bm  # whole row blocks per step
    for i in range(weight.shape[0]):
        for r0 in range(0, rows, step):
            r1 = min(r0 + step, rows)
            q = weight[i, r0:r1].to(torch.float32)
            s = scales[i, r0 // bm:math.ceil(r1 / bm)]
            if (r1 - r0) % bm == 0 and cols % bn == 0:  # the reshape transformers does: no expanded scales
                product = q.reshape(-1, bm, grid[1], bn) * s[:, None, :, None]
            else:
                product = q * s.repeat_interleave(bm, 0)[: r1 - r0].repeat_interleave(bn, 1)[:, :cols]
            out[i, r0:r1] = product.reshape(r1 - r0, cols).to(dtype)
    return out.reshape(*scale_inv.shape[:-2], rows, cols)


def dequantize_fp4_blocks(packed: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype,
                          name: str = "weight") -> torch.Tensor:
    """FP4-packed weights as DeepSeek-V4 publishes its experts (`expert_dtype="fp4"`): `packed` (..., rows, cols / 2)
    bytes holding two E2M1 codes each, low nibble first, `scale_inv` (..., rows / bm, cols / bn) whose grid sets the
    block (DeepSeek-V4: one scale per 32 values of a row). What transformers' `Fp8Dequantize` computes: the values
    in float32 times their block's scale, rounded once to `dtype`."""
    codes = packed.contiguous().view(torch.uint8)
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    values = torch.stack((lut[(codes & 0x0F).long()], lut[(codes >> 4).long()]), dim=-1).flatten(-2)
    rows, cols = values.shape[-2:]
    grid = tuple(scale_inv.shape[-2:])
    if rows % grid[0] or cols % grid[1]:
        raise ValueError(f"{name}: FP4 values of shape {(rows, cols)} do not divide into its scale grid {grid}.")
    return dequantize_fp8(values, scale_inv, (rows // grid[0], cols // grid[1]), dtype, name)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, name: str = "weight") -> torch.Tensor:
    """MXFP4 experts as gpt-oss publishes them: `blocks` (E, R, G, 16) bytes, two E2M1 codes each (low nibble
    first), `scales` (E, R, G) E8M0 exponents (2**(byte - 127)) for each group of 32 values. Returns the
    (E, G * 32, R) tensor transformers' `GptOssExperts` holds, each value E2M1 * 2**exponent in float32, rounded
    once to `dtype`: a transposed view of the dequantized (E, R, G * 32), whose rows are the stored ones (so a
    transform that transposes it back, as the contract's layout does, copies rows, not single values)."""
    if blocks.dim() != 4 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ValueError(f"{name}: MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not "
                         "match ((E, R, G, B) and (E, R, G) expected).")
    experts, rows, groups, width = blocks.shape
    table = _mxfp4_values(dtype)
    out = torch.empty(experts, rows, groups * width * 2, dtype=dtype)
    step = max(1, _CHUNK_ELEMENTS // (groups * width * 2))
    for e in range(experts):
        for r0 in range(0, rows, step):
            r1 = min(r0 + step, rows)
            # one look-up per byte: (its scale, the byte) -> its two values, already scaled and rounded
            index = blocks[e, r0:r1].to(torch.int32)
            index |= scales[e, r0:r1].to(torch.int32)[..., None] << 8
            torch.index_select(table, 0, index.reshape(-1), out=out[e, r0:r1].view(-1, 2))
    return out.transpose(1, 2)


@functools.cache
def _mxfp4_values(dtype: torch.dtype) -> torch.Tensor:
    """(256 * 256, 2): for scale byte s and packed byte b, at s * 256 + b, the low and high nibble's E2M1 values
    times 2**(s - 127), in float32 (`ldexp`, as transformers' `convert_moe_packed_tensors` scales), rounded to
    `dtype`."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    pairs = torch.stack((lut.repeat(16), lut.repeat_interleave(16)), dim=-1)  # byte b -> (low nibble, high nibble)
    exponents = torch.arange(256, dtype=torch.int32) - 127
    return torch.ldexp(pairs.expand(256, 256, 2), exponents[:, None, None]).to(dtype).reshape(-1, 2)
