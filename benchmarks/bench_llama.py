"""Side by side: the `llama` layout at SmolLM2-135M shape, ours vs transformers' LlamaForCausalLM,
same weights (random, made by transformers and converted), one process, fp32 on CPU.

    python benchmarks/bench_llama.py [--prefill 512] [--new-tokens 64] [--repeats 3] [--json out.json]

Prints prefill and greedy-decode tokens/s for both and the ratio ours / reference (median over
interleaved repeats, so machine noise hits both alike).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import modular_decoder  # noqa: F401  (registers the family)
from modular_decoder.conversion import convert

SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                     rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def build_pair(folder: Path):
    torch.manual_seed(0)
    reference = LlamaForCausalLM(LlamaConfig(**SMOLLM2_SHAPE)).eval()
    reference.save_pretrained(folder / "hf")
    convert(folder / "hf", folder / "ours", progress=False)
    ours = AutoModelForCausalLM.from_pretrained(folder / "ours").eval()
    return reference, ours


def measure(models: dict, prefill: int, new_tokens: int, repeats: int, batch: int = 1) -> dict:
    torch.manual_seed(1)
    prompt = torch.randint(0, SMOLLM2_SHAPE["vocab_size"], (batch, prefill))
    short = prompt[:, :16]
    results = {name: {"prefill": [], "decode": []} for name in models}
    with torch.inference_mode():
        for model in models.values():  # warm-up
            model(prompt[:, :32])
        for _ in range(repeats):
            for name, model in models.items():
                seconds = _time(lambda: model(prompt, use_cache=False, logits_to_keep=1))
                results[name]["prefill"].append(batch * prefill / seconds)
                seconds = _time(lambda: model.generate(short, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                                       do_sample=False, pad_token_id=0))
                results[name]["decode"].append(batch * new_tokens / seconds)
    return {name: {k: statistics.median(v) for k, v in r.items()} | {"spread": {k: (min(v), max(v)) for k, v in r.items()}}
            for name, r in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    with tempfile.TemporaryDirectory() as tmp:
        reference, ours = build_pair(Path(tmp))
        results = measure({"transformers": reference, "modular_decoder": ours}, args.prefill, args.new_tokens,
                          args.repeats)
    ref, mine = results["transformers"], results["modular_decoder"]
    print(f"{'':22}{'transformers':>14}{'modular_decoder':>17}{'ratio':>8}")
    for key, label in (("prefill", f"prefill 1x{args.prefill} tok/s"), ("decode", "greedy decode tok/s")):
        print(f"{label:22}{ref[key]:14.1f}{mine[key]:17.1f}{mine[key] / ref[key]:8.2f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
