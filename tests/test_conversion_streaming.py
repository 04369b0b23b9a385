"""Conversion tensor by tensor: the folder written is the one `save_pretrained` writes (shards, index, bytes),
a tied head is still checked, the source is read once per tensor and never whole, and the peak memory of
converting a checkpoint of about 1 GB in small shards stays within a few shards' worth (a gpt-oss one in MXFP4,
within a slice of one layer's experts)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch
from conversion_cases import COMMON, saved_source
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GptOssConfig, LlamaConfig, Qwen2Config

from modular_decoder import ModularDecoderForCausalLM
from modular_decoder.conversion import convert, export
from modular_decoder.conversion import stream, tensor_files
from modular_decoder.conversion.tensor_files import ShardedWriter, read_layout, read_tensor

TINY = COMMON
save = saved_source


def file_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name.startswith("model")}


def test_converted_weights_are_byte_for_byte_what_save_pretrained_writes(tmp_path):
    src = save(LlamaConfig(**TINY, num_key_value_heads=2), tmp_path / "llama")
    out = convert(src, tmp_path / "md", dtype="bfloat16", progress=False)
    ModularDecoderForCausalLM.from_pretrained(out).save_pretrained(tmp_path / "again")
    assert file_bytes(out) == file_bytes(tmp_path / "again")
    assert json.loads((out / "config.json").read_text()) == json.loads((tmp_path / "again" / "config.json").read_text())
    back = export(out, tmp_path / "back", family="llama", progress=False)
    AutoModelForCausalLM.from_pretrained(back).save_pretrained(tmp_path / "back-again")
    assert file_bytes(back) == file_bytes(tmp_path / "back-again")


@pytest.mark.parametrize("shard", ["8KB", "24KB"])
def test_shards_and_index_are_those_save_pretrained_writes(tmp_path, shard):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**TINY, num_key_value_heads=2)).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "reference", max_shard_size=shard)
    state = model.state_dict()
    planned = {k: (v.dtype, tuple(v.shape)) for k, v in state.items()}
    (tmp_path / "ours").mkdir()
    with ShardedWriter(tmp_path / "ours", planned, model.num_parameters(), max_shard_size=shard) as writer:
        for name in reversed(list(state)):  # any order: each tensor goes to its planned place
            writer.write(name, state[name])
    reference = file_bytes(tmp_path / "reference")
    assert len(reference) > 2 and file_bytes(tmp_path / "ours") == reference


def test_writer_refuses_a_tensor_it_did_not_plan_or_a_missing_one(tmp_path):
    planned = {"a": (torch.float32, (2, 3)), "b": (torch.int64, (4,))}
    with pytest.raises(ValueError, match=r"a: got torch.float32 \(3, 2\), planned torch.float32 \(2, 3\)"):
        with ShardedWriter(tmp_path, planned, 10) as writer:
            writer.write("a", torch.zeros(3, 2))
    with pytest.raises(RuntimeError, match=r"not written .*'b'"):
        with ShardedWriter(tmp_path, planned, 10) as writer:
            writer.write("a", torch.zeros(2, 3))


def test_reader_reads_what_safetensors_wrote(tmp_path):
    tensors = {"w": torch.randn(5, 3).to(torch.bfloat16), "i": torch.arange(7), "s": torch.tensor(2.5),
               "f8": torch.randn(4, 4).to(torch.float8_e4m3fn), "empty": torch.zeros(0, 4)}
    save_file(tensors, str(tmp_path / "x.safetensors"))
    layout = read_layout(tmp_path / "x.safetensors")
    for name, tensor in tensors.items():
        got = read_tensor(layout[name])
        assert got.dtype == tensor.dtype and torch.equal(got.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name
    assert torch.equal(read_tensor(layout["w"], (1, 4)), tensors["w"][1:4])


def test_tied_head_that_differs_from_the_embedding_is_refused(tmp_path):
    src = save(Qwen2Config(**TINY, num_key_value_heads=2, tie_word_embeddings=True), tmp_path / "qwen2")
    weights = load_file(src / "model.safetensors")
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"] + 1
    save_file(weights, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="`lm_head.weight` differs from `model.embed_tokens.weight`"):
        convert(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()  # equal: dropped (a tied contract)
    save_file(weights, str(src / "model.safetensors"), metadata={"format": "pt"})
    out = convert(src, tmp_path / "out", progress=False)
    assert "lm_head.weight" not in load_file(out / "model.safetensors")


def test_each_source_tensor_is_read_once_and_copies_go_through_in_blocks(tmp_path, monkeypatch):
    """Every stored tensor is read once, except the embedding a tied head is compared with; a `copy` larger
    than a block goes through in blocks of rows (the peak holds a block, not the tensor)."""
    src = save(LlamaConfig(**TINY, num_key_value_heads=2), tmp_path / "llama")
    reads = []
    original = tensor_files.read_tensor

    def counted(stored, rows=None):
        reads.append((stored.name, rows))
        return original(stored, rows)

    monkeypatch.setattr(tensor_files, "read_tensor", counted)
    monkeypatch.setattr("modular_decoder.conversion.sources.read_tensor", counted)
    monkeypatch.setattr(stream, "BLOCK_BYTES", 32 * 4 * 10)  # ten rows of the embedding (96 x 32, float32)
    convert(src, tmp_path / "md", progress=False)
    names = [name for name, _ in reads]
    stored = set(load_file(src / "model.safetensors"))
    assert set(names) == stored
    whole = [name for name, rows in reads if rows is None]
    assert len(whole) == len(set(whole))
    blocks = [rows for name, rows in reads if name == "model.embed_tokens.weight"]
    assert blocks == [(first, min(first + 10, 96)) for first in range(0, 96, 10)]


# --------------------------------------------------------------------------------------------------
# Memory: a checkpoint of about 1 GB in 100 MB shards converts with a peak that is a fraction of one shard; a gpt-oss
# checkpoint of about 1 GB in MXFP4 with a peak that is a slice of one layer's experts.

MEASURE = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from modular_decoder.conversion import convert

    def status(key):
        return int(next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(key)).split()[1])

    tiny, big, out = map(Path, sys.argv[1:4])
    convert(tiny, out / "warm-up", progress=False)  # every import and code path once, before the baseline
    Path("/proc/self/clear_refs").write_text("5")  # resets the peak (VmHWM) to the current resident size
    baseline = status("VmRSS:")
    convert(big, out / "big", progress=False)
    print(json.dumps({"baseline_kib": baseline, "peak_kib": status("VmHWM:")}))
""")
SHARD = 100 * 2**20


BYTES = {"BF16": 2, "U8": 1}


def write_sparse_shards(path: Path, config, tensors: dict[str, tuple[str, list[int]]]) -> int:
    """`config` and its `tensors` ({name: (safetensors dtype, shape)}) in shards of about 100 MB, in order, as
    `save_pretrained` would shard them. Each shard is its safetensors header followed by zeros left to the file
    system (a sparse file): written in no time, read like any other. Returns the size of the weights in bytes."""
    config.save_pretrained(path)
    sizes = {name: BYTES[code] * math.prod(shape) for name, (code, shape) in tensors.items()}
    shards, weight_map = [[]], {}
    for name in tensors:
        if sum(sizes[n] for n in shards[-1]) >= SHARD:
            shards.append([])
        shards[-1].append(name)
    for i, shard in enumerate(shards):
        file, header, offset = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors", {}, 0
        for name in shard:
            code, shape = tensors[name]
            header[name] = {"dtype": code, "shape": shape, "data_offsets": [offset, offset + sizes[name]]}
            offset += sizes[name]
            weight_map[name] = file
        raw = json.dumps(header).encode()
        with open(path / file, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            f.truncate(8 + len(raw) + offset)
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return sum(sizes.values())


def meta_state(config) -> dict[str, list[int]]:
    with torch.device("meta"):
        return {k: list(v.shape) for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}


def write_llama_in_shards(path: Path, layers: int) -> int:
    """A Llama checkpoint (bf16; 32 MiB per layer) in shards of about 100 MB."""
    config = LlamaConfig(vocab_size=8192, hidden_size=1024, intermediate_size=4096, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=64)
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = "bfloat16"
    return write_sparse_shards(path, config, {name: ("BF16", shape) for name, shape in meta_state(config).items()})


def write_gpt_oss_mxfp4_in_shards(path: Path, layers: int) -> int:
    """A gpt-oss checkpoint as published (experts in MXFP4: `*_blocks`, `*_scales`; the rest bf16) with
    gpt-oss-20b's layer shapes (32 experts of 2880 x 2880, 64 query heads of 64): 0.46 GB per layer, of which a
    layer's gate/up experts dequantize to one (32, 2880, 5760) tensor of 1.06 GB in bf16."""
    config = GptOssConfig(vocab_size=8192, hidden_size=2880, intermediate_size=2880, num_hidden_layers=layers,
                          num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
                          num_experts_per_tok=4, sliding_window=128)
    config.architectures = ["GptOssForCausalLM"]
    config.dtype = "bfloat16"
    config.quantization_config = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    tensors = {}
    for name, shape in meta_state(config).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts, inputs, outputs = shape  # stored transposed: (E, out, in / 32) groups of 32 values
            tensors[name + "_blocks"] = ("U8", [experts, outputs, inputs // 32, 16])
            tensors[name + "_scales"] = ("U8", [experts, outputs, inputs // 32])
        else:
            tensors[name] = ("BF16", shape)
    return write_sparse_shards(path, config, tensors)


@pytest.fixture
def scratch(tmp_path):
    """A folder in memory (/dev/shm) where there is room for 6 GB: writing GBs to a busy disk takes longer than
    the conversion itself, and what is measured is the process's own memory (tmpfs pages are not in its RSS)."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 6 * 2**30):
        yield tmp_path
        return
    folder = Path(tempfile.mkdtemp(dir=shm, prefix="md-memory-test-"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def peak_above_baseline(tiny: Path, big: Path, out: Path) -> int:
    """Bytes of resident memory above the baseline that converting `big` takes, in a fresh process that converted
    `tiny` first (every import and code path once)."""
    here = str(Path(__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", MEASURE, str(tiny), str(big), str(out)],
                            capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    return (measured["peak_kib"] - measured["baseline_kib"]) * 1024


def test_peak_memory_of_a_1gb_conversion_stays_within_a_shard(scratch, tmp_path):
    size = write_llama_in_shards(scratch / "big", layers=30)
    assert size > 2**30 * 0.95 and len(list((scratch / "big").glob("*.safetensors"))) >= 10
    tiny = save(LlamaConfig(**TINY, num_key_value_heads=2), tmp_path / "tiny")
    above = peak_above_baseline(tiny, scratch / "big", scratch / "out")
    print(f"converting {size / 2**20:.0f} MiB in 100 MB shards: peak {above / 2**20:.0f} MiB above the baseline")
    # the largest tensor is 8 MiB (an MLP projection): a few of them, far below one 100 MB shard, let alone 1 GB
    assert above < SHARD, f"peak {above / 2**20:.0f} MiB above the baseline"
    converted = tensor_files.folder_layout(scratch / "out" / "big")
    assert len(converted) == 3 + 30 * 9 and sum(t.nbytes for t in converted.values()) == size


def test_peak_memory_of_a_1gb_mxfp4_conversion_stays_within_a_slice_of_experts(scratch, tmp_path):
    """gpt-oss's experts dequantize from MXFP4 to 4x their size and are rearranged (gate/up de-interleaved, down
    transposed): each step holds a slice of one layer's experts (as many experts as fit a 64 MiB block, in bf16),
    never the layer's whole tensor (1.06 GB for gate/up here, three times that for the old whole-tensor path)."""
    from test_conversion_quantized import mxfp4_folder

    size = write_gpt_oss_mxfp4_in_shards(scratch / "big", layers=2)
    assert size > 2**30 * 0.9
    above = peak_above_baseline(mxfp4_folder(tmp_path / "tiny"), scratch / "big", scratch / "out")
    print(f"converting {size / 2**20:.0f} MiB of MXFP4 gpt-oss: peak {above / 2**20:.0f} MiB above the baseline")
    # a slice of at most 64 MiB (two experts' gate/up), its rearranged copy and the look-up's temporaries: about
    # 130 MiB, to which glibc's allocator adds what it keeps (measured: 270-340 MiB in all). The whole-tensor path
    # held 4.3 GiB: a layer's gate/up experts (1012 MiB in bf16) three times, and float32 temporaries.
    assert above < 8 * stream.BLOCK_BYTES, f"peak {above / 2**20:.0f} MiB above the baseline"
    converted = tensor_files.folder_layout(scratch / "out" / "big")
    assert converted["model.layers.1.mlp.experts.gate_up_proj"].shape == (32, 5760, 2880)


def test_verify_says_what_memory_it_needs_before_converting(tmp_path, monkeypatch, capsys):
    """`--verify` holds the source and the converted model in float32 side by side: where the machine's available
    memory cannot, it is refused before the conversion, with the memory it needs (not after it, out of memory)."""
    import types

    import psutil

    from modular_decoder.commands import main

    src = save(LlamaConfig(**TINY, num_key_value_heads=2), tmp_path / "llama")
    parameters = AutoModelForCausalLM.from_pretrained(src).num_parameters()
    capsys.readouterr()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(available=8 * parameters - 1))
    assert main(["convert", str(src), str(tmp_path / "out"), "--verify"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: `--verify` loads the source and the converted model side by side in float32")
    assert f"for {parameters:,} parameters" in error and len(error.splitlines()) == 1
    assert not (tmp_path / "out").exists()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(available=8 * parameters))
    assert main(["convert", str(src), str(tmp_path / "out"), "--verify"]) == 0
