"""MLA chunked prefill against a growing cache: ours vs transformers' `DeepseekV3ForCausalLM`, same weights.

    python -m benchmarks mla_prefill [--tokens 8192] [--chunk 2048] [--layers 2] [--repeats 2] [--threads N]
                                     [--out benchmarks/results_mla_prefill.json]

DeepSeek-V2-Lite's attention widths with a low-rank query (hidden 2048, 16 heads, q_lora_rank 1536, kv_lora_rank
512, nope 128, rope 64, v 128; DeepSeek-V3 has these head widths but 128 heads at hidden 7168), `--layers` dense
layers, a small FFN (1408) and vocabulary (1024) so the step is mostly attention; fp32, sdpa, batch 1. Weights are
made by transformers' class, saved, and `convert`ed (`families.save_pair`). Every chunk after the first is a
multi-token step against the cache (`logits_to_keep=1`), each side's own cache.

- time: both models in this process, a warm-up round and `--repeats` alternating rounds (`measure.alternating`),
  the median per side;
- peak memory: one fresh process per side: `measure.PeakMemory` (the kernel's high-water mark of resident memory,
  reset just before the prefill) above the RSS at that moment, i.e. the cache plus every transient of the prefill,
  weights excluded (both sides read the same weights before the reset by a warm-up chunk);
- parity: the largest difference of the last token's logits.

`--smoke`: 256 tokens in chunks of 64, one repeat.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from transformers import DeepseekV3Config, DynamicCache

from modular_decoder.cache import ModularDecoderCache
from modular_decoder.compat import with_cache

from . import harness, measure
from .families import load_side, save_pair
from .memory import MALLOC_ENV

ROOT = Path(__file__).resolve().parents[1]
SHAPE = dict(vocab_size=1024, hidden_size=2048, intermediate_size=1408, num_attention_heads=16,
             q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
             max_position_embeddings=32768, n_group=1, topk_group=1)
SIDES = ("transformers", "ours")


def build(folder: Path, layers: int) -> None:
    save_pair(DeepseekV3Config(**SHAPE, num_hidden_layers=layers, first_k_dense_replace=layers), folder)


def new_cache(model, side: str):
    return DynamicCache(config=model.config) if side == "transformers" else ModularDecoderCache(model.config)


@torch.inference_mode()
def chunked_prefill(model, side: str, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """The last token's logits after prefilling `ids` chunk by chunk into a fresh cache."""
    cache = new_cache(model, side)
    for start in range(0, ids.shape[1], chunk):
        logits = model(input_ids=ids[:, start : start + chunk], **with_cache(cache), use_cache=True,
                       logits_to_keep=1).logits
    return logits[:, -1]


def prompt(tokens: int) -> torch.Tensor:
    return torch.randint(0, SHAPE["vocab_size"], (1, tokens), generator=torch.Generator().manual_seed(1))


def measure_peak(folder: Path, side: str, tokens: int, chunk: int) -> dict:
    """In this (fresh) process: peak RSS of one chunked prefill above the RSS just before it."""
    model = load_side(folder, side)
    chunked_prefill(model, side, prompt(chunk), chunk)  # reads every weight in: not part of the peak
    with measure.PeakMemory("cpu") as peak:
        chunked_prefill(model, side, prompt(tokens), chunk)
    return {"side": side, "peak_mb": peak.above_mb, "method": peak.method}


def peak_in_fresh_process(folder: Path, side: str, args) -> dict:
    env = {**os.environ, **MALLOC_ENV, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "benchmarks.mla_prefill", "--measure", side, "--folder", str(folder),
               "--tokens", str(args.tokens), "--chunk", str(args.chunk), "--threads", str(torch.get_num_threads())]
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = harness.parser("mla_prefill", __doc__, repeats=2, smoke="256 tokens in chunks of 64, one repeat")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--measure", choices=SIDES, help=argparse.SUPPRESS)  # the fresh per-side process
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.tokens, args.chunk, args.repeats = 256, 64, 1
    run = harness.begin("mla_prefill", argv, args)
    if args.measure:
        print(json.dumps(measure_peak(args.folder, args.measure, args.tokens, args.chunk)))
        return 0

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build(folder, args.layers)
        peaks = {side: peak_in_fresh_process(folder, side, args) for side in SIDES}
        print(f"peak MB above pre-prefill RSS: {peaks}", flush=True)
        models = {side: load_side(folder, side) for side in SIDES}
    ids = prompt(args.tokens)
    logits = {}

    def case(side: str):
        def prefill():
            logits[side] = chunked_prefill(models[side], side, ids, args.chunk)
        return measure.seconds(prefill)

    seconds = measure.alternating({side: case(side) for side in SIDES}, args.repeats)
    median = {side: statistics.median(times) for side, times in seconds.items()}
    difference = float((logits["ours"] - logits["transformers"]).abs().max())
    print(f"MLA chunked prefill: {args.tokens} tokens in chunks of {args.chunk}, {args.layers} dense layers, "
          f"batch 1, fp32, sdpa; torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}")
    print(f"max |last-token logit diff| ours vs transformers: {difference:.1e}")
    print(f"{'':14s} {'seconds (median of ' + str(args.repeats) + ')':>24s} {'peak MB above pre-prefill RSS':>30s}")
    for side in SIDES:
        print(f"{side:14s} {median[side]:24.2f} {peaks[side]['peak_mb']:30.0f}")
    print(f"ours / transformers: time {median['ours'] / median['transformers']:.2f}x, "
          f"peak memory {peaks['ours']['peak_mb'] / peaks['transformers']['peak_mb']:.2f}x "
          f"(peak method: {peaks['ours']['method']})")
    harness.write_result(args.out, {
        "shape": {"tokens": args.tokens, "chunk": args.chunk, "layers": args.layers, **SHAPE},
        "seconds": seconds, "median_seconds": median,
        "peak_mb": {side: peaks[side]["peak_mb"] for side in SIDES}, "peak_method": peaks["ours"]["method"],
        "max_last_token_logit_diff": difference}, run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
