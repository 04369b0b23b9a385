"""Few-row products on the standard weights, split across the CPU cores: computation only.

A batch-1 decode step multiplies one token's activations by every weight matrix. MKL runs such a
matrix-vector product on one core, so its speed is one core's share of the memory bandwidth.
`linear` issues a product of at most `FEW_ROWS` rows as one batched product whose batch is the
thread count, each element a contiguous slice of the weight's output rows: torch runs the batch on
all cores, each streaming its own part of the matrix. A product of 2 or more rows (a speculative verify
step, a small batch) is cut into more slices, each small enough for a core's cache (`_cache_sized`).

The result is `F.linear`'s up to fp32 rounding order: the same shape and dtype, each output the same
sum of products, which the batched product may add in another order than `F.linear`'s kernel (bit-equal
for a few rows, within fp32 rounding of each other for more: `tests/test_split_products.py`). The weights are never copied, moved or re-laid: the slices are views of the
parameter as it is stored, so every engine that reads or replaces parameters (accelerate, FSDP, tensor
parallel, torchao, export, safetensors) sees a standard model.

Four questions, one predicate each:

    _splits(x, weight, bias)    into how many slices `linear` splits this product (1: `F.linear` itself)
    is_bare_linear(layer)       does calling `layer` run nothing but `nn.Linear.forward`
    weight_is_readable(layer)   may a path compute from `layer.weight` in place of calling `layer`
    is_fx_proxy(x)              is `x` a symbolic tracer's stand-in rather than a value

and `takes_split_branch(layer, x)`, the branch test of a forward that routes its linears through
`project` (the split on, more than one thread, an fp32 CPU value, `is_bare_linear` with a weight of at least
`tuning().min_split_weight`).

The split engages only where it is measured to pay and computes what `F.linear` computes: fp32 input,
weight and bias, all on the CPU, plain tensors (never a DTensor, a quantized or other tensor subclass,
or a meta tensor), a contiguous 2-D weight whose input width matches the input's (anything else goes
to `F.linear`, which raises its own error), a bias of the weight's output width, no gradient needed
(grad mode off, or neither input, weight nor bias requiring grad), no CPU `torch.autocast` (where
`F.linear` computes in the autocast dtype), not while exporting (`torch.export`, ONNX's dynamo export)
nor under TorchScript (`torch.jit.trace` / `script`, and the ONNX export built on it). Through
`project`, only a bare `nn.Linear` is split, so hooks, accelerate's and tensor parallelism's wrappers
and PEFT's layers run as usual.

Under `torch.compile` the split is part of the graph (the thread count is read once, at tracing):
inductor fuses the small operations between the products while the products keep streaming on all
cores, which is what makes a compiled decode step fast (`benchmarks/compiled_decode.py`).

Off switch: the environment variable `MODULAR_DECODER_SPLIT_PRODUCTS=0` (read at import; also in
a saved folder's remote code), or `set_split_products(False)` at run time.
"""

from __future__ import annotations

import os

import torch
import torch.fx
from torch import nn
from torch.nn.modules import module as module_hooks

from .tuning import Tuning, tuning

# A product with at most this many rows (a decode step's tokens) is split across the cores
FEW_ROWS = 16
# ... and only over a weight of at least `tuning().min_split_weight` elements (`tuning.py`: a setting, and the
# measurement behind its default): below it, dispatching the batched product costs more than one core's pass over
# a matrix that small. `MIN_SPLIT_WEIGHT` is the shipped default.
MIN_SPLIT_WEIGHT = Tuning.min_split_weight
_enabled = os.environ.get("MODULAR_DECODER_SPLIT_PRODUCTS", "1").strip().lower() not in ("0", "false", "no", "off")
_PLAIN = (torch.Tensor, nn.Parameter)
# torch.export sees F.linear; a torch without `is_exporting` keeps the split out of every compiler
_exporting = getattr(torch.compiler, "is_exporting", torch.compiler.is_compiling)


def set_split_products(enabled: bool) -> None:
    """Turn on or off, for this process, splitting few-row products across the CPU cores.

    The environment variable `MODULAR_DECODER_SPLIT_PRODUCTS` sets it at import.
    """
    global _enabled
    _enabled = bool(enabled)


def split_products_enabled() -> bool:
    return _enabled


@torch.compiler.assume_constant_result
def _threads() -> int:
    """The intra-op thread count; a constant of the graph under `torch.compile`, where reading it
    would break the graph (a later change of the count changes only how a product is split)."""
    return torch.get_num_threads()


def _splits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> int:
    """How many slices `linear` splits `x @ weight.T + bias` into: the thread count where the split is
    `F.linear`'s product up to rounding order and measured to pay (module docstring), else 1."""
    if not _enabled or torch.jit.is_tracing():  # TorchScript's tracer (and ONNX's export through it): F.linear
        return 1
    parts = _threads()
    if parts < 2:  # one thread: nothing to split over (tested first, it is the cheapest)
        return 1
    if x.dim() < 1 or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        return 1  # a width F.linear refuses raises there, with its own message
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not 0 < rows <= FEW_ROWS or weight.numel() < tuning().min_split_weight:
        return 1
    if type(weight) not in _PLAIN or type(x) not in _PLAIN:  # DTensor, quantized and other subclasses
        return 1
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or not x.is_cpu or not weight.is_cpu:
        return 1  # measured for fp32 on CPU only (meta and accelerator tensors are not CPU)
    if bias is not None and (type(bias) not in _PLAIN or bias.dtype != torch.float32 or not bias.is_cpu
                             or bias.shape != weight.shape[:1]):
        return 1
    if torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    ):
        return 1  # autograd sees F.linear
    if torch.is_autocast_enabled("cpu") or _exporting():
        return 1  # autocast's dtype, and export, see F.linear
    if not weight.is_contiguous() or weight.shape[0] % parts:
        return 1
    return parts if rows == 1 else _cache_sized(parts, weight)


def _cache_sized(parts: int, weight: torch.Tensor) -> int:
    """For a product of 2 or more rows: `parts` (the thread count) doubled while the slices keep at least
    `tuning().split_slice_bytes` and divide the output rows evenly. MKL's batched product of 2 or 3 rows passes over
    a slice once per row: from memory for a slice of a large weight, from the core's cache for a small
    one (measured: `tuning.py`). The batched product hands the slices to the cores in turn."""
    smallest = tuning().split_slice_bytes
    if not smallest:
        return parts
    out_features, row_bytes = weight.shape[0], weight.shape[1] * weight.element_size()
    while out_features % (2 * parts) == 0 and out_features // (2 * parts) * row_bytes >= smallest:
        parts *= 2
    return parts


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`; with a few rows of fp32 on a multi-core CPU, computed as one
    batched product over contiguous slices of the weight's output rows (views, no copy)."""
    if torch.jit.is_scripting():  # `torch.jit.script` compiles this branch only: F.linear
        return nn.functional.linear(x, weight, bias)
    else:
        return _split_linear(x, weight, bias)


def _split_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    parts = _splits(x, weight, bias)
    if parts == 1:
        return nn.functional.linear(x, weight, bias)
    out_features, in_features = weight.shape
    rows, width = x.numel() // in_features, out_features // parts
    # Views written as single `as_strided` calls: a decode step issues hundreds of these products and
    # each tensor op costs microseconds of dispatch (one `as_strided` instead of view + transpose + reshape + expand)
    slices = weight.as_strided((parts, in_features, width), (width * in_features, 1, in_features))
    if x.is_contiguous():  # every slice reads the same rows of x (stride 0 over the parts)
        x_parts = x.as_strided((parts, rows, in_features), (0, in_features, 1))
    else:
        x_parts = x.reshape(1, rows, in_features).expand(parts, rows, in_features)
    y = torch.bmm(x_parts, slices)  # (parts, rows, width)
    if rows > 1:
        y = y.transpose(0, 1).reshape(rows, out_features)
    y = y.view(*x.shape[:-1], out_features)
    return y if bias is None else y + bias


def is_bare_linear(layer: nn.Module, module_type: type[nn.Module] = nn.Linear) -> bool:
    """Whether calling `layer` runs nothing but `nn.Linear.forward` (or `module_type`'s).

    That is, a plain `nn.Linear` (a
    parametrization changes its type) with no forward or backward hooks, its own or global, and no
    instance-level `forward` (accelerate's wrappers)."""
    return (
        type(layer) is module_type
        and not layer._forward_hooks
        and not layer._forward_pre_hooks
        and not layer._backward_hooks
        and not layer._backward_pre_hooks
        and "forward" not in layer.__dict__
        and not module_hooks._global_forward_hooks
        and not module_hooks._global_forward_pre_hooks
        and not module_hooks._global_backward_hooks
        and not module_hooks._global_backward_pre_hooks
    )


def weight_is_readable(layer: nn.Module, module_type: type[nn.Module] = nn.Linear) -> bool:
    """Whether a path may compute from `layer.weight` (and `layer.bias`) in place of calling `layer`.

    As absorbed MLA does: a bare linear (or bare `module_type`, e.g. a convolution a fused kernel reads) whose weight
    and bias are plain tensors (not a DTensor, a quantized or other tensor subclass), so that any product of them
    is what `layer(x)` computes."""
    return (
        is_bare_linear(layer, module_type)
        and type(layer.weight) in _PLAIN
        and (layer.bias is None or type(layer.bias) in _PLAIN)
    )


def is_fx_proxy(x) -> bool:
    """Whether `x` is a symbolic tracer's stand-in (`torch.fx.Proxy`) rather than a value.

    vLLM's Transformers
    backend fx-traces our modules with proxies to recognise projections, norms and the MLA chain: a shortcut
    must then take the plain path (module calls, the explicit formula) and attention the cache-free path."""
    return isinstance(x, torch.fx.Proxy)


def takes_split_branch(layer: nn.Module, x) -> bool:
    """Whether a forward with two branches takes the one through `project` (few-row products split across cores).

    The split is on, torch runs more than one thread, `x` is an fp32 CPU value (not a tracer's proxy) and `layer`
    (the linear that branch ends with) is bare. The cheap tests come first: with one thread, on an accelerator or in
    half precision every forward takes the plain branch, with no per-product checks (a decode step has ~7 products a
    layer). The other branch calls each module plainly (`forward`'s own source is what vLLM's fusers read under its
    trace)."""
    return (
        _enabled and _threads() > 1 and not is_fx_proxy(x) and x.dtype is torch.float32 and x.device.type == "cpu"
        and is_bare_linear(layer) and layer.weight.numel() >= tuning().min_split_weight
    )


def project(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)`, a few rows of a bare `nn.Linear` on an fp32 CPU input run on all cores (`linear`).

    Anything else (PEFT or quantised layers, hooked or wrapped modules, a tracer's proxy `x`, an
    accelerator or half-precision input) is called as usual."""
    return linear(x, layer.weight, layer.bias) if takes_split_branch(layer, x) else layer(x)

