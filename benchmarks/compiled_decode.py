"""Compiled batch-1 decoding: ours vs transformers' Llama on the real SmolLM2-135M (fp32), both eager
and through transformers' own compiled decoding.

    HF_HUB_OFFLINE=1 .venv/bin/python -m benchmarks.compiled_decode [--new-tokens 64] [--repeats 3]

Both models run `generate` greedily with a static cache, once eager (`disable_compile=True`) and
once with `modular_decoder.compiled_decoding()` (a `CompileConfig(fullgraph=True, dynamic=False)`,
inductor, marked to compile on a CPU too). transformers compiles nothing but the decode step: the
prompt's forward stays eager, and the tokens/s count the steps after it (`measure.decode`). The
first compiled call of each model is a warm-up, timed as the compile time; afterwards the four runs
(2 models x eager / compiled) run once per repeat, in an order shuffled afresh for every repeat
(`--seed`), so that no case always follows the same one or meets the machine's noise at the same
point. Only time is measured (no memory-sampling thread runs beside the timed calls). Under compilation ours keeps its split products in the graph
(`modular_decoder/split_products.py`); transformers' graph calls one matrix-vector product per weight.
Nothing is asserted here; the tests check that the compiled tokens equal the eager ones and Llama's.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from modular_decoder import compiled_decoding

from . import measure
from .families import build_pair


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny random shapes: a smoke test")
    parser.add_argument("--seed", type=int, default=0, help="seeds the order of the four runs in each repeat")
    parser.add_argument("--json", type=Path, help="also write the results here (benchmarks.pages renders them)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        reference, ours, label = build_pair("llama", Path(folder), quick=args.quick)
    models = {"transformers": reference, "ours": ours}
    torch.manual_seed(0)
    prompt = torch.randint(0, reference.config.vocab_size, (1, 32))
    runs = {(name, mode): [] for name in models for mode in ("eager", "compiled")}
    compile_seconds = {}

    def run(name: str, mode: str) -> float:
        return measure.decode(models[name], prompt, args.new_tokens, **compiled_decoding(),
                              disable_compile=mode == "eager")["tokens_per_s"]

    print(f"{label}, {torch.get_num_threads()} threads, static cache, {args.new_tokens} new tokens", flush=True)
    with torch.inference_mode():
        for name in models:
            start = time.perf_counter()
            run(name, "compiled")
            compile_seconds[name] = time.perf_counter() - start
            print(f"{name}: first compiled generate (compiles the decode step) {compile_seconds[name]:.0f} s",
                  flush=True)
        order, shuffle = list(runs), random.Random(args.seed).shuffle
        for repeat in range(args.repeats):
            shuffle(order)
            for key in order:
                runs[key].append(run(*key))
            print(f"repeat {repeat + 1} (" + ", ".join(f"{n} {m}" for n, m in order) + "): "
                  + ", ".join(f"{n} {m} {runs[n, m][-1]:.1f}" for n, m in runs) + " tok/s", flush=True)
    median = {key: statistics.median(values) for key, values in runs.items()}
    spread = {key: (max(values) - min(values)) / 2 for key, values in runs.items()}
    print("\n| decode b1 tok/s (static cache) | transformers | ours | ratio |\n|---|---:|---:|---:|")
    for mode in ("eager", "compiled"):
        theirs, mine = median["transformers", mode], median["ours", mode]
        print(f"| {mode} | {theirs:.1f} ±{spread['transformers', mode]:.1f} | {mine:.1f} ±{spread['ours', mode]:.1f} "
              f"| {mine / theirs:.2f} |")
    versus_eager = median["ours", "compiled"] / median["transformers", "eager"]
    print(f"| ours compiled vs transformers eager | | | {versus_eager:.2f} |")
    if args.json:
        args.json.write_text(json.dumps({
            "command": "python -m benchmarks.compiled_decode " + " ".join(argv if argv is not None else sys.argv[1:]),
            "label": label, "threads": torch.get_num_threads(), "new_tokens": args.new_tokens,
            "repeats": args.repeats, "compile_seconds": compile_seconds,
            "runs": {f"{name}/{mode}": {"median": median[name, mode], "half_spread": spread[name, mode],
                                        "min": min(values), "max": max(values), "all": values}
                     for (name, mode), values in runs.items()},
        }, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
