"""Running a family's map over a source catalog tensor by tensor, into planned output shards.

Two passes. The first runs every rule instance on tensors that hold no data (the meta device), so
the produced names and shapes are known, and checked against the target model, before a byte is
read. The second reads what each instance needs, applies its transform, and writes the results at
their planned places (`tensor_files.ShardedWriter`). A large tensor that can be read a block of rows at a
time (a stacked experts tensor, a dequantized one, a plain stored tensor), under a transform that works row by
row of dim 0 (a copy; gpt-oss's experts rearranged within each expert: `Transform.per_expert`), goes through in
blocks, so no step holds more than a block and what the transform makes of it, whatever the tensor's size.
"""

from __future__ import annotations

from collections.abc import Callable
import math
from dataclasses import dataclass

import torch

from .core import TRANSFORMS, RuleInstance
from .sources import SourceTensor
from .tensor_files import ShardedWriter

# A tensor larger than this (as read, or as produced) goes through in blocks of rows of about this size (at least
# one row), where its transform allows
BLOCK_BYTES = 64 * 2**20


def plan_shapes(plan: list[RuleInstance], tensors: dict[str, SourceTensor], cfg) -> dict[str, torch.Tensor]:
    """{output name: a meta tensor of its shape and dtype}: the transforms run on tensors without data
    (transforms must therefore be shape operations, as every one in `TRANSFORMS` is)."""
    produced: dict[str, torch.Tensor] = {}
    for instance in plan:
        produced.update(instance.apply([tensors[name].meta() for name in instance.inputs], cfg))
    return produced


def produce(instance: RuleInstance, tensors: dict[str, SourceTensor], cfg) -> dict[str, torch.Tensor]:
    """The instance's outputs, its inputs read from the source."""
    return instance.apply([tensors[name].read() for name in instance.inputs], cfg)


@dataclass(frozen=True)
class Sink:
    """Where (part of) a produced tensor is written: the whole of it under `file`; for an experts tensor saved one
    tensor per expert, expert `expert`'s rows `rows` (of dim 1); for a tensor the files keep in parts along dim 0,
    its rows `rows` (of dim 0, `expert` None)."""

    file: str
    expert: int | None = None
    rows: slice | None = None


def write_plan(plan: list[RuleInstance], tensors: dict[str, SourceTensor], cfg, writer: ShardedWriter,
               sinks: dict[str, list[Sink]], dtype: torch.dtype | None = None,
               progress: Callable[[int, int], None] | None = None) -> None:
    """Produce every instance's outputs and write them to their `sinks`; floating-point tensors are cast to
    `dtype` when given. `progress(bytes, tensors)` is called after each step with the bytes read and the source
    tensors finished."""
    for instance in plan:
        source = tensors[instance.inputs[0]]
        step = _rows_per_block(instance, source)
        if step:
            read_bytes = source.nbytes // source.shape[0]
            for first in range(0, source.shape[0], step):
                block = source.read_rows(first, min(first + step, source.shape[0]))
                for name, tensor in instance.apply([block], cfg).items():
                    _write(writer, sinks[name], tensor, dtype, first)
                if progress is not None:
                    progress(block.shape[0] * read_bytes, 0)
                del block, tensor  # before the next block is read: one block alive at a time
            if progress is not None:
                progress(0, len(source.files))
            continue
        for name, tensor in produce(instance, tensors, cfg).items():
            _write(writer, sinks[name], tensor, dtype)
        if progress is not None:
            progress(sum(tensors[name].nbytes for name in instance.inputs),
                     sum(len(tensors[name].files) for name in instance.inputs))


def _rows_per_block(instance: RuleInstance, source: SourceTensor) -> int:
    """How many rows of dim 0 each step reads, where `instance` goes through in blocks; 0 where it goes whole."""
    if not (TRANSFORMS[instance.rule.transform].per_expert and len(instance.inputs) == 1
            and source.read_rows is not None and source.shape and source.shape[0]):
        return 0
    # the larger of what a row reads (a stored tensor) and what it becomes (a dequantized one, 4x its MXFP4 bytes)
    row_bytes = max(source.nbytes // source.shape[0], math.prod(source.shape[1:]) * source.dtype.itemsize)
    if row_bytes * source.shape[0] <= BLOCK_BYTES:
        return 0
    return max(1, BLOCK_BYTES // row_bytes)


def _write(writer: ShardedWriter, sinks: list[Sink], tensor: torch.Tensor, dtype, first_row: int | None = None):
    if dtype is not None and tensor.is_floating_point():
        tensor = tensor.to(dtype)
    for sink in sinks:
        if sink.expert is None and sink.rows is not None:  # a part of dim 0 (`core.SplitTensor`)
            start = first_row or 0
            low, high = max(sink.rows.start, start), min(sink.rows.stop, start + tensor.shape[0])
            if low < high:
                whole = (low, high) == (sink.rows.start, sink.rows.stop)
                writer.write(sink.file, tensor[low - start:high - start].contiguous(),
                             None if whole else low - sink.rows.start)
            continue
        if sink.expert is None:
            writer.write(sink.file, tensor, first_row)
            continue
        index = sink.expert - (first_row or 0)
        if 0 <= index < tensor.shape[0]:
            writer.write(sink.file, tensor[index, sink.rows].contiguous())
