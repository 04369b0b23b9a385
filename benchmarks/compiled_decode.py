"""Compiled batch-1 decoding: ours vs transformers' Llama on the real SmolLM2-135M (fp32), both eager and through
transformers' own compiled decoding.

    HF_HUB_OFFLINE=1 .venv/bin/python -m benchmarks compiled_decode [--new-tokens 64] [--repeats 3] [--out FILE]

Both models run `generate` greedily with a static cache, once eager (`disable_compile=True`) and once with
`modular_decoder.compiled_decoding()` (a `CompileConfig(fullgraph=True, dynamic=False)`, inductor, marked to
compile on a CPU too). transformers compiles nothing but the decode step: the prompt's forward stays eager, and
the tokens/s count the steps after it (`measure.decode`). The first compiled call of each model is timed as the
compile time; then the four runs (2 models x eager / compiled) take a warm-up round and `--repeats` rounds of
`measure.alternating` (the order reversed every other round). Only time is measured. Under compilation ours
keeps its split products in the graph (`modular_decoder/split_products.py`); transformers' graph calls one
matrix-vector product per weight. Nothing is asserted here; the tests check that the compiled tokens equal the
eager ones and Llama's. `--smoke`: tiny random shapes.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from modular_decoder import compiled_decoding

from . import harness, measure
from .families import build_pair

MODES = ("eager", "compiled")


def table(runs: dict) -> str:
    """The printed (and rendered) table: median ± half the spread per model and mode, and the ratios."""
    lines = ["| decode b1 tok/s (static cache) | transformers | ours | ratio |", "|---|---:|---:|---:|"]
    for mode in MODES:
        theirs, mine = runs[f"transformers/{mode}"], runs[f"ours/{mode}"]
        lines.append(f"| {mode} | {theirs['median']:.1f} ±{theirs['half_spread']:.1f} | {mine['median']:.1f} "
                     f"±{mine['half_spread']:.1f} | {mine['median'] / theirs['median']:.2f} |")
    versus_eager = runs["ours/compiled"]["median"] / runs["transformers/eager"]["median"]
    lines.append(f"| ours compiled vs transformers eager | | | {versus_eager:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser("compiled_decode", __doc__)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    run = harness.begin("compiled_decode", argv, args)
    with tempfile.TemporaryDirectory() as folder:
        reference, ours, label = build_pair("llama", Path(folder), quick=args.smoke)
    models = {"transformers": reference, "ours": ours}
    torch.manual_seed(0)
    prompt = torch.randint(0, reference.config.vocab_size, (1, 32))

    def case(name: str, mode: str):
        return lambda: measure.decode(models[name], prompt, args.new_tokens, **compiled_decoding(),
                                      disable_compile=mode == "eager")["tokens_per_s"]

    print(f"{label}, {torch.get_num_threads()} threads, static cache, {args.new_tokens} new tokens", flush=True)
    compile_seconds = {}
    with torch.inference_mode():
        for name in models:
            start = time.perf_counter()
            case(name, "compiled")()
            compile_seconds[name] = time.perf_counter() - start
            print(f"{name}: first compiled generate (compiles the decode step) {compile_seconds[name]:.0f} s",
                  flush=True)
        values = measure.alternating({f"{name}/{mode}": case(name, mode) for name in models for mode in MODES},
                                     args.repeats, label="compiled_decode")
    runs = {key: measure.summary(rates) for key, rates in values.items()}
    print("\n" + table(runs))
    harness.write_result(args.out, {"label": label, "new_tokens": args.new_tokens, "repeats": args.repeats,
                                    "compile_seconds": compile_seconds, "runs": runs}, run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
