"""The benchmark suite: ours vs transformers' own class, same weights, one process, fp32.

    python -m benchmarks.run [--families llama gpt2 ...] [--repeats 3] [--json bench.json] [--quick]

For each family (see benchmarks/families.py): prefill tokens/s at 1xP and 4xP (no cache, last
logits only), greedy decode tokens/s at batch 1 and batch B over N new tokens (steps after the
prompt's forward), the median step time over the first and last 8 steps, and the peak resident
memory added during a batch-B decode. The two models run alternately inside each repeat (their
order flipping every repeat) so machine noise hits both alike; the table shows the median over
repeats, the ratio ours / transformers, and the spread (min-max) over repeats. The batch-1 decode
roofline is the measured copy bandwidth divided by the weight bytes a step must read.
`--quick` runs tiny shapes with short sequences: a smoke test, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers

from modular_decoder.layout import set_split_products

from .families import CONFIGS, build_pair
from .measure import bytes_read_per_step, copy_bandwidth, decode, prefill

# "ours" is the model as `from_pretrained` gives it (few-row products split across the cores by
# `modular_decoder.layout`, computation only); "ours, no split products" is the same
# object with them switched off around its measurements (an ablation).
MODELS = ("transformers", "ours", "ours, no split products")
# metric key -> (row label, higher is better)
ROWS = {
    "prefill_1": ("prefill 1x{P} tok/s", True),
    "prefill_4": ("prefill 4x{P} tok/s", True),
    "decode_1": ("decode b1 tok/s", True),
    "step_start_1": ("b1 step ms, first 8", False),
    "step_end_1": ("b1 step ms, last 8", False),
    "decode_B": ("decode b{B} tok/s", True),
    "peak_mb_B": ("decode b{B} peak +MB", False),
}


def _select_variant(ours, name: str) -> None:
    set_split_products(name != "ours, no split products")


def measure_family(reference, ours, args) -> dict:
    """{metric: {model: [value per repeat]}}, the two models interleaved inside every repeat."""
    vocab = reference.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(1)
    long = torch.randint(0, vocab, (4, args.prefill), generator=generator)
    short = torch.randint(0, vocab, (args.decode_batch, args.prompt), generator=generator)
    models = {"transformers": reference, "ours": ours, "ours, no split products": ours}
    values = {key: {name: [] for name in MODELS} for key in ROWS}
    with torch.inference_mode():
        for model in (reference, ours):  # warm-up: first-call allocations, lazy inits
            prefill(model, long[:1, :32])
            decode(model, short[:1], 4)
        for repeat in range(args.repeats):
            order = MODELS if repeat % 2 == 0 else MODELS[::-1]
            # Prefill forwards are short (0.2-5 s): several per repeat, interleaved across the
            # models, and their median taken, so that a burst of machine noise hits all alike.
            samples = {key: {name: [] for name in MODELS} for key in ("prefill_1", "prefill_4")}
            for _ in range(args.prefill_samples):
                for name in order:
                    _select_variant(ours, name)
                    for key, batch in (("prefill_1", long[:1]), ("prefill_4", long)):
                        samples[key][name].append(prefill(models[name], batch)["tokens_per_s"])
            for key, per_model in samples.items():
                for name, rates in per_model.items():
                    values[key][name].append(statistics.median(rates))
            for name in order:
                model = models[name]
                _select_variant(ours, name)
                one = decode(model, short[:1], args.new_tokens)
                values["decode_1"][name].append(one["tokens_per_s"])
                values["step_start_1"][name].append(one["step_ms_start"])
                values["step_end_1"][name].append(one["step_ms_end"])
                many = decode(model, short, args.new_tokens)
                values["decode_B"][name].append(many["tokens_per_s"])
                values["peak_mb_B"][name].append(many["peak_mb"])
    set_split_products(True)
    return values


def summarise(values: dict) -> dict:
    out = {}
    for key, per_model in values.items():
        row = {name: {"median": statistics.median(v), "min": min(v), "max": max(v), "all": v}
               for name, v in per_model.items()}
        ref = row["transformers"]["median"]
        row["ratio"] = {name: row[name]["median"] / ref if ref else float("nan") for name in MODELS[1:]}
        out[key] = row
    return out


def _cell(stats: dict) -> str:
    spread = stats["max"] - stats["min"]
    return f"{stats['median']:.1f} ±{spread / 2:.1f}"


def table(results: dict, args) -> str:
    lines = [
        "| family | metric | transformers | ours | ours, no split products | ratio | ratio, no split products |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for family, result in results["families"].items():
        first = True
        for key, (label, _) in ROWS.items():
            row = result["metrics"][key]
            backends = "/".join(sorted(set(result["attn_implementation"].values())))
            name = f"**{family}** ({result['label']}, {result['params_m']:.0f}M, {backends})" if first else ""
            first = False
            lines.append(f"| {name} | {label.format(P=args.prefill, B=args.decode_batch)} | "
                         + " | ".join(_cell(row[name]) for name in MODELS) + " | "
                         + " | ".join(f"{row['ratio'][name]:.2f}" for name in MODELS[1:]) + " |")
        bound = result["roofline_b1_tok_s"]
        shares = " | ".join(f"{100 * result['metrics']['decode_1'][name]['median'] / bound:.0f}% of it"
                            for name in MODELS)
        lines.append(f"| | b1 roofline {bound:.1f} tok/s ({result['step_mb']:.0f} MB/step) | {shares} | | |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefill", type=int, default=512, help="prompt length P of the prefill rows")
    parser.add_argument("--prompt", type=int, default=32, help="prompt length before decoding")
    parser.add_argument("--prefill-samples", type=int, default=3,
                        help="prefill forwards per model and repeat; their median is the repeat's value")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--decode-batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--json", type=Path, default=Path("bench_results.json"))
    parser.add_argument("--quick", action="store_true", help="tiny shapes, short sequences, 1 repeat: a smoke test")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.prefill, args.prompt, args.new_tokens, args.decode_batch = 1, 32, 8, 8, 2
        args.prefill_samples = 1
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    bandwidth = copy_bandwidth(64 if args.quick else 256)
    results = {
        "command": "python -m benchmarks.run " + " ".join(argv if argv is not None else os.sys.argv[1:]),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "threads": torch.get_num_threads(), "copy_bandwidth_gb_s": bandwidth / 1e9,
        "load_average_start": os.getloadavg(), "families": {},
    }
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s, {torch.get_num_threads()} threads, "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    for family in args.families:
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            reference, ours, label = build_pair(family, Path(tmp), args.quick)
            step_bytes = bytes_read_per_step(ours)
            params_m = sum(p.numel() for p in ours.parameters()) / 1e6
            backends = {"transformers": reference.config._attn_implementation, "ours": ours.config._attn_implementation}
            metrics = summarise(measure_family(reference, ours, args))
        del reference, ours
        results["families"][family] = {
            "label": label, "attn_implementation": backends, "params_m": params_m, "step_mb": step_bytes / 1e6,
            "roofline_b1_tok_s": bandwidth / step_bytes, "metrics": metrics,
            "seconds": time.perf_counter() - start, "load_average": os.getloadavg(),
        }
        print(f"{family}: {time.perf_counter() - start:.0f} s, load average {os.getloadavg()[0]:.2f}", flush=True)
    results["load_average_end"] = os.getloadavg()
    text = table(results, args)
    print(text)
    args.json.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
