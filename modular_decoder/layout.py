"""Weight memory layout and matrix-vector products for batch-1 decoding on CPU.

A decode step multiplies one token's activations by every weight matrix: products that only
stream the weights from memory, so their speed is the speed at which each matrix is streamed,
plus a fixed cost per call. Three changes (never of values, names or shapes) make that faster:

- fusion: linear layers that read the same input (q/k/v; an MLP's gate and up) get their weights
  stored as slices of one column-major buffer, so one product serves them all. Modules declare
  such groups in a `FUSED_PROJECTIONS` class attribute and ask `fused_projection(self, key)` in
  `forward`; it answers only while the fused buffer is still what the parameters hold (not after
  a dtype/device move, a PEFT wrap or a forward hook on a member) and no gradient must reach the
  parameters, else the module runs its separate layers as usual.
- column-major wide weights: a weight with more outputs than inputs (the vocabulary head, a dense
  MLP's up projection) is stored with strides (1, out).
- `linear`: MKL runs a matrix-vector product on one core; a product with at most `FEW_ROWS` rows
  is instead issued as one batched product over the thread count, which torch runs in parallel
  (a column-major weight split along its inputs, a row-major one along its outputs).

Measured on the 2-core AVX2 VM of `benchmarks/` (fp32, one row, weights cycled through memory,
`F.linear` on the standard layout -> this module): SmolLM2's q/k/v 0.19 -> 0.08 ms, o 0.11 ->
0.06 ms, gate+up 0.58 -> 0.25 ms, down 0.21 -> 0.12 ms, the 49152 x 576 head 9.3 -> 3.4 ms: a
whole decode step's products 42 -> 19 ms, about 27 GB/s, the read bandwidth of the machine.
Matrix-matrix products (prefill, training) run at the same speed in either layout.

`ModularDecoderForCausalLM.from_pretrained` applies `decode_layout` to models loaded on the CPU;
`save_pretrained` writes the standard layout.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules import module as module_hooks


class FusedProjection:
    """Several `nn.Linear` of one owner module reading the same input, whose weights (and biases)
    are views of one column-major buffer: `self(x)` returns their outputs from a single product."""

    def __init__(self, owner: nn.Module, names: tuple[str, ...]):
        members = [owner._modules[name] for name in names]
        first = members[0].weight
        self.names, self.members = names, tuple(members)
        self.sizes = [m.out_features for m in members]
        buffer = torch.empty(first.shape[1], sum(self.sizes), dtype=first.dtype, device=first.device)
        self.weight = buffer.t()  # (sum of outputs, in), column-major
        has_bias = members[0].bias is not None
        self.bias = torch.empty(sum(self.sizes), dtype=first.dtype, device=first.device) if has_bias else None
        offset = 0
        with torch.no_grad():
            for member, size in zip(members, self.sizes):
                rows = slice(offset, offset + size)
                self.weight[rows].copy_(member.weight)
                member.weight.data = self.weight[rows]
                if has_bias:
                    self.bias[rows].copy_(member.bias)
                    member.bias.data = self.bias[rows]
                offset += size
        self.pointers = tuple((m.weight.data_ptr(), m.bias.data_ptr() if has_bias else 0) for m in members)

    @staticmethod
    def fusable(owner: nn.Module, names: tuple[str, ...]) -> bool:
        members = [owner._modules.get(name) for name in names]
        if not all(type(m) is nn.Linear for m in members):  # quantised / PEFT-wrapped layers keep theirs
            return False
        first = members[0]
        return all(
            m.in_features == first.in_features
            and (m.bias is None) == (first.bias is None)
            and m.weight.dtype == first.weight.dtype
            and m.weight.device == first.weight.device
            and m.weight.device.type != "meta"
            for m in members
        )

    def intact(self, owner: nn.Module) -> bool:
        """The same member modules, their weights and biases still views of the fused buffer."""
        for name, member, (weight_ptr, bias_ptr) in zip(self.names, self.members, self.pointers):
            if owner._modules.get(name) is not member or member.weight.data_ptr() != weight_ptr:
                return False
            if member.bias is not None and member.bias.data_ptr() != bias_ptr:
                return False
        return True

    def usable(self, owner: nn.Module) -> bool:
        """`intact`, each member a plain layer without hooks, and no gradient has to reach them (the
        fused product bypasses their parameters). Runs before every fused product."""
        if torch.compiler.is_compiling() or not self.intact(owner):
            return False
        grad = torch.is_grad_enabled()
        for member in self.members:
            if not _runs_plain(member):
                return False
            if grad and (member.weight.requires_grad or (member.bias is not None and member.bias.requires_grad)):
                return False
        return True

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """All members' outputs, concatenated along the last dimension."""
        return linear(x, self.weight, self.bias)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.product(x).split(self.sizes, dim=-1)


# A product with at most this many rows (a decode step's tokens) is split across the cores by hand
FEW_ROWS = 16


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, with a few rows on a multi-core CPU computed as one batched product whose batch is
    the thread count: torch runs the batch in parallel, where MKL streams a matrix-vector product
    on one core. A column-major weight is split along its inputs (partial products summed), a
    row-major one along its outputs. Measured (2 cores, fp32, one row, same layout): the 49152 x 576
    head 5.3 -> 3.4 ms, 576 -> 3072 0.35 -> 0.25 ms, 1536 -> 576 0.21 -> 0.12 ms."""
    shape = x.shape
    rows = x.numel() // shape[-1] if shape[-1] else 0
    if (
        not 0 < rows <= FEW_ROWS
        or x.dtype != torch.float32  # measured for fp32 on CPU only
        or not x.is_cpu
        or (weight.requires_grad and torch.is_grad_enabled())  # the split view is detached
        or torch.compiler.is_compiling()
    ):
        return nn.functional.linear(x, weight, bias)
    parts = torch.get_num_threads()
    plan = weight.__dict__.get("_decode_split")
    if plan is None or plan[0] != (weight.data_ptr(), weight.stride(), parts):
        plan = _split_plan(weight, parts)
    split, by_inputs, out_features = plan[1:]
    if split is None:
        return nn.functional.linear(x, weight, bias)
    if by_inputs:  # split: (parts, in/parts, out); partial products summed
        pieces = x.reshape(parts, 1, -1) if rows == 1 else x.reshape(rows, parts, -1).transpose(0, 1)
        y = torch.bmm(pieces, split).sum(0)
    else:  # split: (parts, in, out/parts); slices of the output side by side
        y = torch.bmm(x.reshape(1, rows, -1).expand(parts, rows, -1), split)
        y = (y.transpose(0, 1) if rows > 1 else y).reshape(rows, out_features)
    if bias is not None:
        y = y + bias
    return y.view(*shape[:-1], out_features)


def _split_plan(weight: torch.Tensor, parts: int) -> tuple:
    """(key, split view or None, split along the inputs?, out_features), kept on the weight tensor
    while its storage, strides and the thread count stay the same."""
    out_features, in_features = weight.shape
    split, by_inputs = None, False
    if parts > 1:
        if weight.stride() == (1, out_features) and in_features % parts == 0:
            split, by_inputs = weight.detach().t().view(parts, in_features // parts, out_features), True
        elif weight.is_contiguous() and out_features % parts == 0:
            split = weight.detach().view(parts, out_features // parts, in_features).transpose(1, 2)
    plan = ((weight.data_ptr(), weight.stride(), parts), split, by_inputs, out_features)
    weight.__dict__["_decode_split"] = plan
    return plan


def _runs_plain(layer: nn.Module) -> bool:
    """True for a plain `nn.Linear` whose call would run nothing but its own forward: no module or
    global hooks, no instance-level `forward` (accelerate's wrappers)."""
    return (
        type(layer) is nn.Linear
        and not layer._forward_hooks
        and not layer._forward_pre_hooks
        and "forward" not in layer.__dict__
        and not module_hooks._global_forward_hooks
        and not module_hooks._global_forward_pre_hooks
    )


def project(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)`; a plain `nn.Linear` without hooks goes through `linear` (a few rows run on all
    cores). Anything else (PEFT / quantised layers, hooked modules) is called as usual."""
    return linear(x, layer.weight, layer.bias) if _runs_plain(layer) else layer(x)


def fused_projection(owner: nn.Module, key: str) -> FusedProjection | None:
    """The owner's fused group `key` if `decode_layout` built it and it is still valid, else None."""
    fused = owner.__dict__.get("_fused_projections")
    if not fused:
        return None
    group = fused.get(key)
    return group if group is not None and group.usable(owner) else None


def _fuse(model: nn.Module) -> int:
    moved = 0
    for module in model.modules():
        groups = getattr(module, "FUSED_PROJECTIONS", None)
        if not groups:
            continue
        fused = module.__dict__.setdefault("_fused_projections", {})
        for key, names in groups.items():
            if key in fused and fused[key].intact(module):
                continue
            if FusedProjection.fusable(module, names):
                fused[key] = FusedProjection(module, names)
                moved += len(names)
    return moved


def decode_layout(model: nn.Module) -> int:
    """Fuse the declared projection groups and store every other wide `nn.Linear` weight
    column-major, in place. Values, names, shapes and ties are unchanged; tied weights (a head
    sharing the embedding) move once. Returns the number of weights moved (0 when already laid out).
    """
    moved = _fuse(model)
    seen = {  # fused members are laid out already
        id(member.weight)
        for module in model.modules()
        for group in module.__dict__.get("_fused_projections", {}).values()
        for member in group.members
    }
    for module in model.modules():
        if type(module) is not nn.Linear or id(module.weight) in seen or module.weight.device.type == "meta":
            continue
        seen.add(id(module.weight))
        weight = module.weight
        out_features, in_features = weight.shape
        if out_features > in_features and weight.stride() != (1, out_features):
            with torch.no_grad():
                weight.data = weight.data.t().contiguous().t()
            moved += 1
    return moved


# The name `from_pretrained(..., decode_layout=...)` leaves free for this function
apply_decode_layout = decode_layout


def has_decode_layout(model: nn.Module) -> bool:
    return any(module.__dict__.get("_fused_projections") for module in model.modules()) or not all(
        p.is_contiguous() for p in model.parameters()
    )


def standard_layout(model: nn.Module) -> int:
    """Undo `decode_layout`: drop the fused groups and make every parameter contiguous again (the
    layout transformers' save expects). Returns the number of parameters moved."""
    for module in model.modules():
        for group in module.__dict__.pop("_fused_projections", {}).values():
            for member in group.members:  # contiguous slices of the fused bias: give each its own storage
                if member.bias is not None and member.bias.data_ptr() in {ptr for _, ptr in group.pointers}:
                    member.bias.data = member.bias.data.clone()
    moved = 0
    for param in model.parameters():
        if not param.is_contiguous():
            with torch.no_grad():
                param.data = param.data.contiguous()
            moved += 1
    return moved
