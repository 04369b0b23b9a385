"""From what weight size a few-row product pays for being split across the cores: whole decode steps of Llama
layouts at several widths, with the split products off, on everywhere, on from each threshold, and timed per shape
(mode "auto", the default) (fp32, CPU). The measurement behind `tuning.Tuning.min_split_weight`
(`split_products.MIN_SPLIT_WEIGHT`, the shipped default) and behind mode "auto".

    HF_HUB_OFFLINE=1 .venv/bin/python -m benchmarks split_threshold [--hidden 64 128 256 384] [--layers 16]
        [--thresholds 0 16384 65536 262144] [--steps 16] [--repeats 5] [--out benchmarks/results_split_threshold.json]

For each width h: one model of ours (`preset_config("llama")`, hidden h, FFN 3h, heads of 64, `--layers` layers,
vocabulary 1024, random weights), a 32-token prompt's cache, then `--steps` cached one-token forwards (a decode
step, the weights read from memory as in use: a product timed alone keeps its weight hot in the cache and splits
profitably only at larger sizes); the value of a repeat is the median step. The variants alternate
(`measure.alternating`): "off" (`set_split_products("off")`), the split in mode "always" with `min_split_weight` set
to each `--thresholds` value (0: every product splits), the shipped value among them ("from T": what a fixed
threshold gives), and mode "auto" (each product shape timed once, at its first product, the faster kept) with the
shipped floor ("auto") and with none ("auto from 0"). Each model's auto decisions are taken in the warm-up round;
the JSON records them (per shape: split or not, both products' fastest seconds) and their timing cost. Nothing is
asserted; compare the columns of one width (same process, same model). `--smoke`: widths 32 and 64, 2 layers, 2
steps, one repeat.
"""

from __future__ import annotations

import contextlib
import statistics

import torch

from modular_decoder import ModularDecoderForCausalLM, preset_config, split_products
from modular_decoder.compat import cache_of, with_cache
from modular_decoder.tuning import Tuning, tuned, tuning

from . import harness, measure


@contextlib.contextmanager
def split_from(mode: str, threshold: int | None):
    """The split products in `mode` from `threshold` elements (`None`: the threshold in force) for the duration."""
    with split_products.using_split_products(mode), tuned(min_split_weight=tuning().min_split_weight
                                                          if threshold is None else threshold):
        yield


def model_of(hidden: int, layers: int):
    torch.manual_seed(0)
    config = preset_config("llama", vocab_size=1024, hidden_size=hidden, intermediate_size=3 * hidden,
                           num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                           num_key_value_heads=max(1, hidden // 64), max_position_embeddings=1024)
    return ModularDecoderForCausalLM(config).eval()


@torch.inference_mode()
def step_ms(model, steps: int) -> float:
    """Median ms of `steps` cached one-token forwards after a 32-token prompt (a fresh cache per call)."""
    prompt = torch.randint(0, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(1))
    out = model(prompt)
    cache, token = cache_of(out), out.logits[:, -1:].argmax(-1)
    times = [measure.wall(lambda: model(token, **with_cache(cache))) for _ in range(steps)]
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser("split_threshold", __doc__, repeats=5, smoke="widths 32 and 64, 2 layers, 2 steps, one "
                                                                         "repeat")
    parser.add_argument("--hidden", type=int, nargs="+", default=[64, 128, 256, 384])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--thresholds", type=int, nargs="+", default=[0, 1 << 14, 1 << 16, 1 << 18])
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args(argv)
    if args.smoke:
        args.hidden, args.layers, args.steps, args.repeats = [32, 64], 2, 2, 1
    run = harness.begin("split_threshold", argv, args)
    shipped = Tuning.min_split_weight
    thresholds = sorted(set(args.thresholds) | {shipped})
    variants = {"off": ("off", None), **{f"from {t}": ("always", t) for t in thresholds}, "auto": ("auto", shipped),
                "auto from 0": ("auto", 0)}
    print(f"decode step ms (median of {args.steps} steps, median of {args.repeats} repeats), {args.layers} layers, "
          f"{torch.get_num_threads()} threads; shipped MIN_SPLIT_WEIGHT = {shipped}")
    print("| hidden | weights MB | " + " | ".join(variants) + " |\n|---:|---:|" + "---:|" * len(variants))
    rows = []
    for hidden in args.hidden:
        model = model_of(hidden, args.layers)

        def case(mode, threshold):
            def run_case():
                with split_from(mode, threshold):
                    return step_ms(model, args.steps)
            return run_case

        split_products.forget_split_decisions()  # this model's shapes are timed in the warm-up round
        values = measure.alternating({name: case(*variant) for name, variant in variants.items()}, args.repeats)
        decisions = split_products.split_decisions()
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        row = {"hidden": hidden, "weights_mb": weights / 1e6,
               "largest_weight": max(p.numel() for p in model.parameters() if p.dim() == 2),
               "step_ms": {name: measure.summary(v) for name, v in values.items()},
               "auto_decisions": [{"out_in_rows_threads_slices_bias": list(key), **decision}
                                  for key, decision in decisions.items()],
               "auto_timing_ms": 1e3 * sum(decision["cost_s"] for decision in decisions.values())}
        rows.append(row)
        print(f"| {hidden} | {row['weights_mb']:.1f} | "
              + " | ".join(f"{row['step_ms'][name]['median']:.2f}" for name in variants) + " |", flush=True)
        print(f"  auto split {sum(d['split'] for d in decisions.values())} of {len(decisions)} shapes, timing "
              f"{row['auto_timing_ms']:.1f} ms", flush=True)
    harness.write_result(args.out, {"min_split_weight": shipped, "layers": args.layers, "steps": args.steps,
                                    "variants": {name: {"mode": mode, "min_split_weight": t}
                                                 for name, (mode, t) in variants.items()}, "rows": rows}, run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
