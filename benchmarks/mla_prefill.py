"""MLA chunked prefill against a growing cache: ours vs transformers' `DeepseekV3ForCausalLM`, same weights.

    python -m benchmarks.mla_prefill [--tokens 8192] [--chunk 2048] [--layers 2] [--rounds 2] [--threads N]
                                     [--json benchmarks/results_mla_prefill.json]

DeepSeek-V3's attention (hidden 2048, 16 heads, q_lora_rank 1536, kv_lora_rank 512, nope 128, rope 64,
v 128), `--layers` dense layers, a small FFN (1408) and vocabulary (1024) so the step is mostly attention;
fp32, sdpa, batch 1. Weights are made by transformers' class, saved, and `convert`ed. Every chunk after
the first is a multi-token step against the cache (`logits_to_keep=1`), each side's own cache.

- time: both models in this process, `--rounds` alternating rounds after a warm-up, the median per side;
- peak memory: one fresh process per side (`--measure SIDE`): the kernel's high-water mark of resident
  memory (`VmHWM`, reset through /proc/self/clear_refs just before the prefill; `benchmarks.memory.Peak`)
  above the RSS at that moment, i.e. the cache plus every transient of the prefill, weights excluded
  (both sides read the same weights before the reset by a warm-up chunk);
- parity: the largest difference of the last token's logits.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, DynamicCache
from transformers import __version__ as transformers_version

from benchmarks.memory import MALLOC_ENV, MB, Peak
from modular_decoder import ModularDecoderForCausalLM
from modular_decoder.cache import ModularDecoderCache
from modular_decoder.compat import with_cache
from modular_decoder.conversion import convert

ROOT = Path(__file__).resolve().parents[1]
SHAPE = dict(vocab_size=1024, hidden_size=2048, intermediate_size=1408, num_attention_heads=16,
             q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
             max_position_embeddings=32768, n_group=1, topk_group=1)
SIDES = ("transformers", "ours")


def build(folder: Path, layers: int) -> None:
    torch.manual_seed(0)
    config = DeepseekV3Config(**SHAPE, num_hidden_layers=layers, first_k_dense_replace=layers)
    DeepseekV3ForCausalLM(config).save_pretrained(folder / "transformers")
    convert(folder / "transformers", folder / "ours", progress=False)


def load(folder: Path, side: str):
    cls = DeepseekV3ForCausalLM if side == "transformers" else ModularDecoderForCausalLM
    return cls.from_pretrained(folder / side, dtype=torch.float32, attn_implementation="sdpa").eval()


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
    model = load(folder, side)
    chunked_prefill(model, side, prompt(chunk), chunk)  # reads every weight in: not part of the peak
    with Peak() as peak:
        before = peak.peak
        chunked_prefill(model, side, prompt(tokens), chunk)
    return {"side": side, "peak_mb": (peak.peak - before) / MB, "method": peak.method}


def peak_in_fresh_process(folder: Path, side: str, args) -> dict:
    env = {**os.environ, **MALLOC_ENV, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "benchmarks.mla_prefill", "--measure", side, "--folder", str(folder),
               "--tokens", str(args.tokens), "--chunk", str(args.chunk), "--threads", str(torch.get_num_threads())]
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--json", type=Path, help="also write the results here (docs/benchmarks.md renders them)")
    parser.add_argument("--measure", choices=SIDES, help=argparse.SUPPRESS)  # the fresh per-side process
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.measure:
        print(json.dumps(measure_peak(args.folder, args.measure, args.tokens, args.chunk)))
        return 0

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build(folder, args.layers)
        peaks = {side: peak_in_fresh_process(folder, side, args) for side in SIDES}
        print(f"peak MB above pre-prefill RSS: {peaks}", flush=True)
        models = {side: load(folder, side) for side in SIDES}
    ids = prompt(args.tokens)
    logits, seconds = {}, {side: [] for side in SIDES}
    for round_ in range(args.rounds + 1):  # round 0 is a warm-up
        for side in SIDES if round_ % 2 else reversed(SIDES):
            start = time.perf_counter()
            logits[side] = chunked_prefill(models[side], side, ids, args.chunk)
            if round_:
                seconds[side].append(time.perf_counter() - start)
    median = {side: statistics.median(times) for side, times in seconds.items()}
    print(f"MLA chunked prefill: {args.tokens} tokens in chunks of {args.chunk}, {args.layers} dense layers, "
          f"batch 1, fp32, sdpa; torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}")
    print(f"max |last-token logit diff| ours vs transformers: {(logits['ours'] - logits['transformers']).abs().max():.1e}")
    print(f"{'':14s} {'seconds (median of ' + str(args.rounds) + ')':>24s} {'peak MB above pre-prefill RSS':>30s}")
    for side in SIDES:
        print(f"{side:14s} {median[side]:24.2f} {peaks[side]['peak_mb']:30.0f}")
    print(f"ours / transformers: time {median['ours'] / median['transformers']:.2f}x, "
          f"peak memory {peaks['ours']['peak_mb'] / peaks['transformers']['peak_mb']:.2f}x "
          f"(peak method: {peaks['ours']['method']})")
    if args.json:
        args.json.write_text(json.dumps({
            "command": "python -m benchmarks.mla_prefill " + " ".join(argv if argv is not None else sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "transformers": transformers_version,
            "shape": {"tokens": args.tokens, "chunk": args.chunk, "layers": args.layers, **SHAPE},
            "threads": torch.get_num_threads(), "load_average": os.getloadavg()[0],
            "seconds": {side: seconds[side] for side in SIDES}, "median_seconds": median,
            "peak_mb": {side: peaks[side]["peak_mb"] for side in SIDES}, "peak_method": peaks["ours"]["method"],
            "max_last_token_logit_diff": float((logits["ours"] - logits["transformers"]).abs().max()),
        }, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
