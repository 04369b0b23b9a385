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
`project` (the split not off, more than one thread, an fp32 CPU value, `is_bare_linear` with a weight of at least
`tuning().min_split_weight`, and in mode "auto" a shape not timed slower split).

The split engages only where it computes what `F.linear` computes: fp32 input,
weight and bias, all on the CPU, plain tensors (never a DTensor, a quantized or other tensor subclass,
or a meta tensor), a contiguous 2-D weight whose input width matches the input's (anything else goes
to `F.linear`, which raises its own error), a bias of the weight's output width, no gradient needed
(grad mode off, or neither input, weight nor bias requiring grad), no CPU `torch.autocast` (where
`F.linear` computes in the autocast dtype), not while exporting (`torch.export`, ONNX's dynamo export)
nor under TorchScript (`torch.jit.trace` / `script`, and the ONNX export built on it), over a weight of at
least `tuning().min_split_weight` elements. Through `project`, only a bare `nn.Linear` is split, so hooks,
accelerate's and tensor parallelism's wrappers and PEFT's layers run as usual.

Whether such a product is split is measured on the machine it runs on (mode "auto", the default): whether
the split pays depends on the CPU (its cores, caches and memory bandwidth), so no fixed threshold serves
every machine. The first product of each shape (the weight's output and input widths, the row count, the
thread count, the slice count, a bias or none) is timed both ways on its own tensors (`_measure`: alternating
runs, the fastest of each; two rounds at least, more while the runs stay short, so that a large head costs four
runs of its product), and the faster is remembered for the process
(`split_decisions()`); the split must be clearly faster (`SPLIT_MARGIN`) to be taken. Such a timing runs the weight from the cache, as a decode step does not where the
model is larger than the caches: the split's gain there is, if anything, larger than measured, so the timing
errs toward `F.linear`, which is what every other engine runs. Either way the result is `F.linear`'s up to
rounding order (bit-equal for one row), so the decision changes speed only.

Under `torch.compile` the decision is taken at tracing, where the tensors are stand-ins without values: a
recorded decision for the shape is used, else the shape is timed on fresh tensors of its size (the same
kernels the graph calls) and recorded; with a dynamic row count (`dynamic=True`) an undecided shape takes
`F.linear`. The split then is part of the graph (the thread count is read once, at tracing): inductor fuses
the small operations between the products while the products keep streaming on all cores
(`benchmarks/compiled_decode.py`).

Modes (`set_split_products(mode)`, or the environment variable `MODULAR_DECODER_SPLIT_PRODUCTS`, read at
import, also in a saved folder's remote code):

    "auto"    (default; also `True`, and "1", "true", "yes", "on")  split where timing says it pays
    "always"  split every product that may split, untimed (what tests of the split's arithmetic need)
    "off"     (also `False`, and "0", "false", "no")                 `F.linear` everywhere

Any other value is refused with a `ValueError` naming the function or the variable.
"""

from __future__ import annotations

import contextlib
import math
import os
import time

import torch
import torch.fx
from torch import nn
from torch.nn.modules import module as module_hooks

from .tuning import Tuning, tuning

# A product with at most this many rows (a decode step's tokens) is split across the cores
FEW_ROWS = 16
# ... and only over a weight of at least `tuning().min_split_weight` elements (`tuning.py`: a setting, and the
# measurement behind its default): below it, dispatching the batched product costs more than one core's pass over
# a matrix that small, so such products are not even timed. `MIN_SPLIT_WEIGHT` is the shipped default.
MIN_SPLIT_WEIGHT = Tuning.min_split_weight
VARIABLE = "MODULAR_DECODER_SPLIT_PRODUCTS"
MODES = ("auto", "always", "off")
_SPELLINGS = {"1": "auto", "true": "auto", "yes": "auto", "on": "auto", "0": "off", "false": "off", "no": "off"}
# Mode "auto" splits a product only if the split is at least this much faster (a tie gains nothing, and the split
# keeps every core busy). The timing: rounds of one run of each (in turn first), at least `_ROUNDS[0]`, at most
# `_ROUNDS[1]`, no new round once the rounds' fastest runs add up to `_BUDGET_S` (a large head is timed over two
# rounds, a small product over all)
SPLIT_MARGIN = 0.95
_ROUNDS, _BUDGET_S = (2, 7), 0.005
_PLAIN = (torch.Tensor, nn.Parameter)
# torch.export sees F.linear; a torch without `is_exporting` keeps the split out of every compiler
_exporting = getattr(torch.compiler, "is_exporting", torch.compiler.is_compiling)


def _mode_of(value, source: str) -> str:
    """The mode `value` names (module docstring), or a `ValueError` naming `source`."""
    if isinstance(value, bool):
        return "auto" if value else "off"
    text = value.strip().lower() if isinstance(value, str) else None
    mode = _SPELLINGS.get(text, text)
    if mode not in MODES:
        raise ValueError(f"{source} must be one of {', '.join(map(repr, MODES))} (or True / False), got {value!r}.")
    return mode


_mode = _mode_of(os.environ.get(VARIABLE, "auto"), f"`{VARIABLE}`")
# shape key -> whether the split pays (mode "auto"); `_timings`: what each decision measured, for reports
_decisions: dict[tuple, bool] = {}
_timings: dict[tuple, dict] = {}


def set_split_products(mode: bool | str = "auto") -> str:
    """Split few-row products across the CPU cores, for this process: "auto" (where measured to pay, the default;
    also `True`), "always" (every product that may split) or "off" (also `False`). Returns the previous mode.

    The environment variable `MODULAR_DECODER_SPLIT_PRODUCTS` sets it at import."""
    global _mode
    previous, _mode = _mode, _mode_of(mode, "`set_split_products`'s mode")
    return previous


def split_products_mode() -> str:
    """The mode in force: "auto", "always" or "off"."""
    return _mode


def split_products_enabled() -> bool:
    """Whether few-row products may be split at all (the mode is not "off")."""
    return _mode != "off"


@contextlib.contextmanager
def using_split_products(mode: bool | str):
    """The split products in `mode` inside the block only."""
    previous = set_split_products(mode)
    try:
        yield
    finally:
        set_split_products(previous)


def split_decisions() -> dict[tuple, dict]:
    """What mode "auto" decided so far in this process: {(out features, in features, rows, threads, slices,
    bias): {"split": bool, "f_linear_s": seconds, "split_s": seconds, "cost_s": the timing's own seconds}}."""
    return {key: {"split": split, **_timings.get(key, {})} for key, split in _decisions.items()}


def forget_split_decisions() -> None:
    """Drop every recorded decision: the next product of each shape is timed again."""
    _decisions.clear()
    _timings.clear()


@torch.compiler.assume_constant_result
def _threads() -> int:
    """The intra-op thread count; a constant of the graph under `torch.compile`, where reading it
    would break the graph (a later change of the count changes only how a product is split)."""
    return torch.get_num_threads()


def _splits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> int:
    """How many slices `linear` splits `x @ weight.T + bias` into: the thread count (or more, `_cache_sized`) where
    the split is `F.linear`'s product up to rounding order and, in mode "auto", measured to pay here (module
    docstring), else 1."""
    if _mode == "off" or torch.jit.is_tracing():  # TorchScript's tracer (and ONNX's export through it): F.linear
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
    key = _shape_key(weight, rows, parts, bias is not None)
    return key[4] if _mode == "always" or _split_pays(key, x, weight, bias) else 1


def _shape_key(weight: torch.Tensor, rows: int, threads: int, with_bias: bool) -> tuple:
    """What decides whether a product pays for being split: (out features, in features, rows, threads, slices,
    bias), the slices as `_splits` cuts them."""
    parts = threads if rows == 1 else _cache_sized(threads, weight)
    return weight.shape[0], weight.shape[1], rows, threads, parts, with_bias


def _split_pays(key: tuple, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the split of `key`'s shape is faster than `F.linear` here: recorded, else timed now (a benign race:
    two threads may both time a new shape, and either answer is right)."""
    if torch.compiler.is_compiling():  # tracing: stand-in tensors, nothing to time on
        # One row (a size-1 dimension is never symbolic: the graph is for one row) and a parameter's sizes are
        # constants of the graph; more rows may be a symbolic size, which the decision cannot be keyed by: F.linear
        return key[2] == 1 and _decision_for_graph(*key)
    split = _decisions.get(key)
    if split is None:
        split = _decide(key, x, weight, bias)
    return split


@torch.compiler.assume_constant_result
def _decision_for_graph(out_features: int, in_features: int, rows: int, threads: int, parts: int,
                        with_bias: bool) -> bool:
    """`_split_pays` at tracing, a constant of the graph: the recorded decision, else one timed on fresh tensors of
    the shape (outside the tracer's fake tensors; the values do not matter to the time, ones keep the seed)."""
    key = (out_features, in_features, rows, threads, parts, with_bias)
    if key in _decisions:
        return _decisions[key]
    unfaked = getattr(torch._subclasses.fake_tensor, "unset_fake_temporarily", contextlib.nullcontext)
    with unfaked(), torch.no_grad():
        weight, x = torch.ones(out_features, in_features), torch.ones(rows, in_features)
        return _decide(key, x, weight, torch.ones(out_features) if with_bias else None)


def _decide(key: tuple, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    started = time.perf_counter()
    f_linear_s, split_s = _measure(lambda: nn.functional.linear(x, weight, bias),
                                   lambda: _product(x, weight, bias, key[4]))
    split = split_s < SPLIT_MARGIN * f_linear_s
    _timings[key] = {"f_linear_s": f_linear_s, "split_s": split_s, "cost_s": time.perf_counter() - started}
    _decisions[key] = split
    return split


def _measure(f_linear, split) -> tuple[float, float]:
    """(fastest seconds of `f_linear`, of `split`) over alternating runs (module docstring). The fastest run, not
    the median: a run the scheduler interrupts, or the first (allocations, the thread pool), is only ever slower."""
    clock = time.perf_counter
    best, runs = [math.inf, math.inf], (f_linear, split)
    for turn in range(_ROUNDS[1]):
        if turn >= _ROUNDS[0] and turn * (best[0] + best[1]) > _BUDGET_S:  # (runs, not interruptions, count)
            break
        for index in ((0, 1) if turn % 2 == 0 else (1, 0)):
            before = clock()
            runs[index]()
            best[index] = min(best[index], clock() - before)
    return best[0], best[1]


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
    return nn.functional.linear(x, weight, bias) if parts == 1 else _product(x, weight, bias, parts)


def _product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, parts: int) -> torch.Tensor:
    """`F.linear(x, weight, bias)` as one batched product over `parts` contiguous slices of the weight's rows."""
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

    The split is not off, torch runs more than one thread, `x` is an fp32 CPU value (not a tracer's proxy), `layer`
    (the linear that branch ends with) is bare and, in mode "auto", its product has not been timed slower split. The
    cheap tests come first: with one thread, on an accelerator or in half precision every forward takes the plain
    branch, with no per-product checks (a decode step has ~7 products a layer); so does a layer whose shape the timing
    kept on `F.linear`. The other branch calls each module plainly (`forward`'s own source is what vLLM's fusers read
    under its trace)."""
    if _mode == "off" or torch.jit.is_tracing():  # (TorchScript's tracer records F.linear: `_splits`)
        return False
    threads = _threads()
    if threads < 2 or is_fx_proxy(x) or x.dtype is not torch.float32 or x.device.type != "cpu":
        return False
    # The plain branch is always a safe answer: a weight below the floor, or a shape timed slower split, take it
    # before the longer `is_bare_linear` test (this runs every step for every layer; `_parameters` is read directly
    # because `layer.weight` costs a microsecond)
    weight = layer._parameters.get("weight")
    if weight is not None and (weight.numel() < tuning().min_split_weight or (
            _mode == "auto" and not torch.compiler.is_compiling() and _timed_slower(layer, weight, x, threads))):
        return False  # (under compile, `_splits` decides)
    return is_bare_linear(layer)  # (a bare `nn.Linear` holds its weight in `_parameters`: the floor is checked above)


def _timed_slower(layer: nn.Module, weight: torch.Tensor, x: torch.Tensor, threads: int) -> bool:
    """Whether mode "auto" timed `layer`'s product of `x` slower split (False where not timed yet: the branch through
    `project` times it)."""
    if weight.dim() != 2 or not x.dim() or not x.shape[-1]:
        return False
    key = _shape_key(weight, x.numel() // x.shape[-1], threads, layer._parameters.get("bias") is not None)
    return _decisions.get(key) is False


def project(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)`, a few rows of a bare `nn.Linear` on an fp32 CPU input run on all cores (`linear`).

    Anything else (PEFT or quantised layers, hooked or wrapped modules, a tracer's proxy `x`, an
    accelerator or half-precision input) is called as usual."""
    return linear(x, layer.weight, layer.bias) if takes_split_branch(layer, x) else layer(x)

