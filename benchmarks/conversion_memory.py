"""Converting and exporting checkpoints of several GB: the peak resident memory and the time, each in a fresh process.

    HF_HUB_OFFLINE=1 .venv/bin/python -m benchmarks conversion_memory [--gb 8.5] [--layouts llama mixtral gpt_oss]
        [--scratch /tmp] [--repeats 1] [--out benchmarks/results_conversion_memory.json]

For each layout a synthetic checkpoint of about --gb GB (bf16, non-zero values) is written to a folder under
--scratch in the files transformers' `save_pretrained` writes for that family (5 GB shards and an index; Mixtral:
one tensor per expert under `block_sparse_moe`), tensor by tensor. gpt-oss is written as it is published, its
experts in MXFP4 (`*_blocks`, `*_scales`: 4 bits a value) and the rest in bf16, with gpt-oss-20b's widths and
vocabulary and as many layers as make its converted (bf16) size about --gb GB. Then
`modular_decoder.conversion.convert` runs on it in a fresh process, and `export` back to the family from the converted folder in another. Each child
imports everything and converts (or exports) a tiny checkpoint of the same family first, then resets the kernel's
resident high-water mark (`VmHWM`, through /proc/self/clear_refs) and measures: the peak resident memory above
that baseline is what the conversion itself needs. Seconds are wall time of the call (reading and writing the
whole checkpoint; the disk and the machine's load dominate them). The folders are deleted after each layout.
--smoke: checkpoints of a few MB.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers as tf

from . import harness

MB, GB = 2**20, 10**9
SOURCE_SHARD = "5GB"  # the shard size of the published checkpoints the Hub shows most
LAYOUTS = ("llama", "mixtral", "gpt_oss")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM", "gpt_oss": "GptOssForCausalLM"}
# gpt-oss's experts as published: MXFP4, the tensors transformers' `Mxfp4GptOssExperts` loads
MXFP4 = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def layout_config(layout: str, gb: float):
    """A transformers config of `layout` whose bf16 weights take about `gb` GB."""
    if layout == "llama":  # Llama-2-7B's width, as many layers as the size asks (404 MB each)
        layers = max(1, round((gb * GB - 2 * 32000 * 4096 * 2) / (202_383_360 * 2)))
        return tf.LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=layers,
                              num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096)
    if layout == "mixtral":  # 8 experts of width 5632 on hidden 2048 (577 MB per layer)
        layers = max(1, round((gb * GB - 2 * 32000 * 2048 * 2) / (288_374_784 * 2)))
        return tf.MixtralConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
                                num_attention_heads=16, num_key_value_heads=8, num_local_experts=8,
                                num_experts_per_tok=2, max_position_embeddings=4096)
    if layout == "gpt_oss":  # gpt-oss-20b's widths and vocabulary (1.65 GB per layer in bf16, 0.46 GB as published)
        layers = max(1, round((gb * GB - 2 * 201088 * 2880 * 2) / (823_186_976 * 2)))
        return gpt_oss_config(num_hidden_layers=layers)
    raise ValueError(f"unknown layout {layout!r}")


def gpt_oss_config(**overrides):
    fields = dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_attention_heads=64,
                  num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4, sliding_window=128)
    return tf.GptOssConfig(**{**fields, **overrides})


def tiny_config(layout: str):
    small = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)
    if layout == "gpt_oss":
        return gpt_oss_config(**small, head_dim=16, num_local_experts=4, num_experts_per_tok=2)
    return tf.LlamaConfig(**small) if layout == "llama" else tf.MixtralConfig(**small, num_local_experts=4)


def smoke_config(layout: str):
    if layout == "gpt_oss":
        return gpt_oss_config(vocab_size=1024, hidden_size=256, intermediate_size=256, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, num_local_experts=8)
    config = layout_config(layout, 1.0)
    config.update(dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2))
    return config


def published_tensors(config, planned: dict) -> dict:
    """`planned` ({file name: (dtype, shape)}) as the family publishes it: gpt-oss's experts in MXFP4 (each (E, in,
    out) product stored as (E, out, in / 32, 16) bytes of two 4-bit codes and (E, out, in / 32) exponents); the
    others as `save_pretrained` writes them."""
    if config.model_type != "gpt_oss":
        return planned
    config.quantization_config = MXFP4
    published = {}
    for name, (dtype, shape) in planned.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts, inputs, outputs = shape
            published[name + "_blocks"] = (torch.uint8, (experts, outputs, inputs // 32, 16))
            published[name + "_scales"] = (torch.uint8, (experts, outputs, inputs // 32))
        else:
            published[name] = (dtype, shape)
    return published


def write_checkpoint(config, folder: Path) -> dict:
    """The files `save_pretrained` writes for `config`'s model (gpt-oss: as published, `published_tensors`), with
    random-looking values (MXFP4 exponents of values below 1), written tensor by tensor (never held whole). Returns
    its size and file count."""
    from modular_decoder.conversion import get_family
    from modular_decoder.conversion.api import file_tensors
    from modular_decoder.conversion.tensor_files import ShardedWriter

    config.architectures = [ARCHITECTURES[config.model_type]]
    config.dtype = "bfloat16"
    folder.mkdir(parents=True)
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    state = model.state_dict()
    planned = published_tensors(config, file_tensors(list(state), state, get_family(config.model_type))[0])
    config.save_pretrained(folder)
    torch.manual_seed(0)
    patterns = {"weights": (torch.randn(32 * MB) * 0.02).to(torch.bfloat16),  # copied over each tensor: no
                "_blocks": torch.randint(0, 256, (32 * MB,), dtype=torch.uint8),  # generation cost
                "_scales": torch.randint(118, 126, (32 * MB,), dtype=torch.uint8)}
    with ShardedWriter(folder, planned, model.num_parameters(), max_shard_size=SOURCE_SHARD) as writer:
        for name, (dtype, shape) in planned.items():
            pattern = patterns[next((key for key in ("_blocks", "_scales") if name.endswith(key)), "weights")]
            tensor = torch.empty(shape, dtype=dtype)
            flat = tensor.view(-1)
            for start in range(0, flat.numel(), pattern.numel()):
                piece = flat[start:start + pattern.numel()]
                piece.copy_(pattern[:piece.numel()])
            writer.write(name, tensor)
    files = sorted(folder.glob("*.safetensors"))
    return {"bytes": sum(f.stat().st_size for f in files), "files": len(files),
            "tensors": len(planned), "largest_tensor_bytes": max(torch.empty(s, dtype=d, device="meta").nbytes
                                                                 for d, s in planned.values())}


CHILD = """
import json, sys, time
from pathlib import Path
from modular_decoder.conversion import convert, export
from benchmarks.measure import PeakMemory

what, tiny, src, out, family = sys.argv[1:6]
run = (lambda s, o: convert(s, o, progress=False)) if what == "convert" else (
    lambda s, o: export(s, o, family=family, progress=False))
run(tiny, Path(out).parent / (Path(out).name + "-warm-up"))  # every import and code path once
with PeakMemory("cpu") as peak:
    start = time.perf_counter()
    run(src, out)
    seconds = time.perf_counter() - start
print(json.dumps({"baseline_mb": peak.start_bytes / 2**20, "peak_above_mb": peak.above_mb,
                  "method": peak.method, "seconds": seconds}))
"""


def measured(what: str, tiny: Path, src: Path, out: Path, family: str, threads: int | None) -> dict:
    """One convert or export in a fresh process: its peak above the baseline, and its seconds."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join([str(harness.ROOT),
                                                                             os.environ.get("PYTHONPATH", "")])}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    done = subprocess.run([sys.executable, "-c", CHILD, what, str(tiny), str(src), str(out), family],
                          capture_output=True, text=True, env=env, timeout=4 * 3600)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def one_layout(layout: str, args, scratch: Path) -> dict:
    config = smoke_config(layout) if args.smoke else layout_config(layout, args.gb)
    work = Path(tempfile.mkdtemp(dir=scratch, prefix=f"conversion-memory-{layout}-"))
    try:
        write_checkpoint(tiny_config(layout), work / "tiny")
        from modular_decoder.conversion import convert

        convert(work / "tiny", work / "tiny-md", progress=False)
        started = time.perf_counter()
        checkpoint = write_checkpoint(config, work / "source")
        checkpoint["write_seconds"] = time.perf_counter() - started
        checkpoint["layers"] = config.num_hidden_layers
        print(f"{layout}: {checkpoint['bytes'] / GB:.2f} GB in {checkpoint['files']} files", flush=True)
        rows = {"convert": [], "export": []}
        for repeat in range(args.repeats):
            for what, tiny, src, out in (("convert", work / "tiny", work / "source", work / "md"),
                                         ("export", work / "tiny-md", work / "md", work / "back")):
                row = measured(what, tiny, src, out, layout, args.threads)
                row["gb_per_second"] = checkpoint["bytes"] / GB / row["seconds"]
                rows[what].append(row)
                if what == "convert":
                    checkpoint["converted_bytes"] = sum(f.stat().st_size for f in out.glob("*.safetensors"))
                print(f"{layout} {what} (repeat {repeat + 1}): peak {row['peak_above_mb']:.0f} MB above the "
                      f"baseline, {row['seconds']:.0f} s", flush=True)
                shutil.rmtree(out.parent / (out.name + "-warm-up"), ignore_errors=True)
            shutil.rmtree(work / "md")
            shutil.rmtree(work / "back")
        return {"layout": layout, "checkpoint": checkpoint, **{
            what: {"peak_above_mb": max(r["peak_above_mb"] for r in runs),
                   "peak_fraction_of_checkpoint": max(r["peak_above_mb"] for r in runs) * MB / checkpoint["bytes"],
                   "seconds_median": sorted(r["seconds"] for r in runs)[len(runs) // 2], "runs": runs}
            for what, runs in rows.items()}}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser("conversion_memory", __doc__, repeats=1,
                            smoke="checkpoints of a few MB: a smoke test of the code paths, not a measurement")
    parser.add_argument("--gb", type=float, default=8.5, help="size of each synthetic checkpoint in GB (default 8.5)")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    parser.add_argument("--scratch", type=Path, default=Path(tempfile.gettempdir()),
                        help="where the checkpoints are written (and deleted): needs 3x --gb free")
    args = parser.parse_args(argv)
    needed = 3 * (0.1 if args.smoke else args.gb) * GB
    free = shutil.disk_usage(args.scratch).free
    if free < needed:
        parser.error(f"--scratch {args.scratch} has {free / GB:.1f} GB free; {needed / GB:.1f} GB are needed")
    run = harness.begin("conversion_memory", argv, args)
    results = [one_layout(layout, args, args.scratch) for layout in args.layouts]
    for result in results:
        size = result["checkpoint"]["bytes"] / GB
        for what in ("convert", "export"):
            print(f"{result['layout']:8s} {what:7s} {size:5.2f} GB: peak {result[what]['peak_above_mb']:6.0f} MB "
                  f"above the baseline ({100 * result[what]['peak_fraction_of_checkpoint']:.1f}% of the checkpoint), "
                  f"{result[what]['seconds_median']:.0f} s")
    harness.write_result(args.out, {"results": results}, run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
