"""Safetensors files read and written one tensor at a time, so that no step holds a whole checkpoint.

Reading copies a tensor's bytes (or a range of its rows) from the file into a fresh tensor with plain
reads: memory-mapping the file (what `safetensors.safe_open` does) keeps every page read in the
process's resident memory until the file is closed, so a shard's whole size would count toward the
peak. Writing plans every shard and every tensor's place before the first byte is written (the
header comes first in a safetensors file), then writes each tensor at its place whenever it is
produced, in any order: nothing is held until a shard fills. The shards, their names, the index and
the order of tensors in a file are those `save_pretrained` writes (huggingface_hub's
`split_torch_state_dict_into_shards`, safetensors' own layout), so a folder written here is byte for
byte the one `save_pretrained` would write for the same tensors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

# safetensors' dtype codes (only those torch has)
CODES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
if hasattr(torch, "float8_e8m0fnu"):
    CODES["F8_E8M0"] = torch.float8_e8m0fnu
DTYPE_CODES = {dtype: code for code, dtype in CODES.items()}
# The order of tensors in a file that `safetensors.torch.save_file` writes: by dtype in this order (widest
# first, so that every tensor is aligned to its element size), then by name.
_FILE_ORDER = ("U64", "I64", "F64", "C64", "F32", "U32", "I32", "BF16", "F16", "U16", "I16", "F8_E8M0", "F8_E4M3",
               "F8_E5M2", "I8", "U8", "BOOL")
WEIGHTS_NAME, INDEX_NAME = "model.safetensors", "model.safetensors.index.json"
# `save_pretrained`'s default `max_shard_size` (the same from transformers 5.16 to 5.25)
MAX_SHARD_SIZE = "50GB"


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor of a safetensors file lies: `start` is its first byte in the file."""

    file: Path
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    nbytes: int

    @property
    def row_bytes(self) -> int:
        return self.nbytes // self.shape[0] if self.shape and self.shape[0] else self.nbytes


def read_layout(path) -> dict[str, StoredTensor]:
    """Every tensor of a safetensors file and where it lies; a truncated or damaged file, or a dtype torch
    cannot hold, raises a `ValueError` naming the file."""
    from modular_decoder.checkpoint_checks import read_safetensors_layout

    path = Path(path)
    data_start, tensors = read_safetensors_layout(path)
    layout = {}
    for name, (code, shape, (start, end)) in tensors.items():
        if code not in CODES:
            raise ValueError(f"{path}: tensor {name!r} has dtype {code}, which this torch cannot read.")
        layout[name] = StoredTensor(path, name, CODES[code], shape, data_start + start, end - start)
    return layout


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def read_tensor(stored: StoredTensor, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """`stored`'s tensor (or rows `[start, stop)` of its first dimension) in a new tensor of its own."""
    shape, offset, nbytes = stored.shape, 0, stored.nbytes
    if rows is not None:
        first, stop = rows
        shape, offset, nbytes = (stop - first, *stored.shape[1:]), first * stored.row_bytes, (stop - first) * stored.row_bytes
    out = torch.empty(shape, dtype=stored.dtype)
    if nbytes:
        view = _bytes_of(out)
        with open(stored.file, "rb", buffering=0) as f:
            f.seek(stored.start + offset)
            done = 0
            while done < nbytes:
                got = f.readinto(view[done:])
                if not got:
                    raise ValueError(f"{stored.file} is truncated: tensor {stored.name!r} ends past the end of the file.")
                done += got
    return out


def _meta(shape, dtype) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype, device="meta")


@dataclass
class _Slot:
    handle: object
    start: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    written: int = 0


class ShardedWriter:
    """Write a planned state dict into `folder` as `save_pretrained` does, one tensor (or rows of one) at a time.

    Args:
        folder: The (temporary) output folder.
        planned: {name: (dtype, shape)} in the order `save_pretrained` would see the state dict (it decides
            which shard each tensor goes to).
        total_parameters: Recorded in the index of a sharded checkpoint, as `save_pretrained` does.
        max_shard_size: As `save_pretrained`'s.
    """

    def __init__(self, folder, planned: dict[str, tuple[torch.dtype, tuple[int, ...]]], total_parameters: int,
                 max_shard_size: int | str = MAX_SHARD_SIZE):
        from huggingface_hub import split_torch_state_dict_into_shards

        self.folder = Path(folder)
        split = split_torch_state_dict_into_shards(
            {name: _meta(shape, dtype) for name, (dtype, shape) in planned.items()},
            filename_pattern=WEIGHTS_NAME.replace(".safetensors", "{suffix}.safetensors"), max_shard_size=max_shard_size,
        )
        self.index = None
        if split.is_sharded:
            self.index = {"metadata": {"total_parameters": total_parameters, **split.metadata},
                          "weight_map": split.tensor_to_filename}
        self.slots: dict[str, _Slot] = {}
        self.handles = []
        try:
            for filename, names in split.filename_to_tensors.items():
                self._open_shard(self.folder / filename, {name: planned[name] for name in names})
        except BaseException:
            self._close_handles()
            raise

    def __enter__(self) -> ShardedWriter:
        return self

    def __exit__(self, kind, error, tb) -> bool:
        if kind is None:
            self.close()
        else:
            self._close_handles()
        return False

    def _open_shard(self, path: Path, tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> None:
        order = sorted(tensors, key=lambda name: (_FILE_ORDER.index(DTYPE_CODES[tensors[name][0]]), name))
        header, offset, places = {"__metadata__": {"format": "pt"}}, 0, {}
        for name in order:
            dtype, shape = tensors[name]
            nbytes = _meta(shape, dtype).nbytes
            header[name] = {"dtype": DTYPE_CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            places[name] = (offset, nbytes)
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        raw += b" " * (-len(raw) % 8)  # safetensors pads its header to 8 bytes
        handle = open(path, "wb")
        self.handles.append(handle)
        handle.write(len(raw).to_bytes(8, "little") + raw)
        data = 8 + len(raw)
        handle.truncate(data + offset)  # the file at its final size; every byte is written below
        for name, (start, nbytes) in places.items():
            dtype, shape = tensors[name]
            self.slots[name] = _Slot(handle, data + start, nbytes, dtype, tuple(shape))

    def write(self, name: str, tensor: torch.Tensor, first_row: int | None = None) -> None:
        """Write `tensor` as planned tensor `name`, or as its rows from `first_row` on."""
        slot = self.slots.get(name)
        if slot is None:
            raise KeyError(f"{name} is not a planned tensor of this checkpoint.")
        shape = slot.shape if first_row is None else (tensor.shape[0], *slot.shape[1:])
        if tensor.dtype != slot.dtype or tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"{name}: got {tensor.dtype} {tuple(tensor.shape)}, planned {slot.dtype} {shape}.")
        row_bytes = slot.nbytes // slot.shape[0] if first_row is not None and slot.shape[0] else 0
        data = _bytes_of(tensor.detach().to("cpu").contiguous())
        slot.handle.seek(slot.start + (first_row or 0) * row_bytes)
        slot.handle.write(data)
        slot.written += len(data)

    def close(self) -> None:
        """Close the files and write the index; raise if a planned tensor was not written whole."""
        self._close_handles()
        unwritten = [name for name, slot in self.slots.items() if slot.written != slot.nbytes]
        if unwritten:
            raise RuntimeError(f"tensors planned but not written (or written twice): {unwritten[:20]}")
        if self.index is not None:
            text = json.dumps(self.index, indent=2, sort_keys=True) + "\n"
            (self.folder / INDEX_NAME).write_text(text, encoding="utf-8")

    def _close_handles(self) -> None:
        for handle in self.handles:
            handle.close()
        self.handles = []


def folder_files(src: Path) -> list[Path]:
    """The safetensors files of a Hugging Face folder: those its index names, else every `*.safetensors`."""
    index = src / INDEX_NAME
    if index.exists():
        from modular_decoder.checkpoint_checks import read_json_file

        try:
            names = sorted(set(read_json_file(index)["weight_map"].values()))
        except (KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"{index} is damaged: cannot read its `weight_map` ({error}).") from None
        files = [src / name for name in names]
        missing = [file.name for file in files if not file.exists()]
        if missing:
            raise FileNotFoundError(f"{index} names {missing}, which {'is' if len(missing) == 1 else 'are'} not in {src}.")
        return files
    return sorted(src.glob("*.safetensors"))


def folder_layout(src: Path) -> dict[str, StoredTensor]:
    """Every tensor of a folder's safetensors files; a tensor in two files is an error."""
    layout: dict[str, StoredTensor] = {}
    for file in folder_files(src):
        for name, stored in read_layout(file).items():
            if name in layout:
                raise ValueError(f"{src}: tensor {name!r} is in both {layout[name].file.name} and {file.name}.")
            layout[name] = stored
    return layout

