"""How small the slices of a split product of several rows should be: cached forwards of 1 to 16 new tokens (a
speculative verify step of k+1 tokens, a small batch's decode step) on SmolLM2-135M's shapes, with each product of
2 or more rows cut into as many slices as threads, or into more slices of at least N bytes each (fp32, CPU). The
measurement behind `tuning.Tuning.split_slice_bytes`, the shipped default.

    HF_HUB_OFFLINE=1 .venv/bin/python -m benchmarks split_slices [--tokens 1 2 3 4 8 16]
        [--slices 0 65536 262144 1048576] [--steps 8] [--repeats 3] [--out benchmarks/results_split_slices.json]

One model of ours with SmolLM2-135M's shapes (`preset_config("llama")`: hidden 576, FFN 1536, 30 layers, 9 heads
of 64 and 3 K/V heads, a 49,152-token vocabulary and its 28M-parameter head; random weights: the time of a product
does not depend on its values), a 64-token prompt's cache, then `--steps` forwards of T new tokens against it
(cropped back after each: a verify step), the weights read from memory as in use (424 MB of layers and 113 MB of
head, more than the caches hold); the value of a repeat is the median forward. The variants alternate
(`measure.alternating`): `split_slice_bytes` 0 (as many slices as threads) and each `--slices` value, the shipped
one among them. A 1-token forward is the same in every variant (one row is never cut further): it is the column's
reference. Nothing is asserted. `--smoke`: 2 layers, a 4,096-token vocabulary, 2 steps, one repeat.
"""

from __future__ import annotations

import statistics

import torch

from modular_decoder import ModularDecoderForCausalLM, preset_config
from modular_decoder.cache import ModularDecoderCache
from modular_decoder.tuning import Tuning, tuned

from . import harness, measure


def smollm2_shapes(smoke: bool):
    torch.manual_seed(0)
    config = preset_config("llama", vocab_size=4096 if smoke else 49152, hidden_size=576, intermediate_size=1536,
                           num_hidden_layers=2 if smoke else 30, num_attention_heads=9, num_key_value_heads=3,
                           tie_word_embeddings=True, max_position_embeddings=2048)
    return ModularDecoderForCausalLM(config).eval()


@torch.inference_mode()
def forward_ms(model, cache, tokens: torch.Tensor, steps: int) -> float:
    """Median ms of `steps` forwards of `tokens` against `cache`, each cropped back afterwards."""
    def step():
        model(tokens, cache=cache)
        cache.crop(-tokens.shape[1])
    return 1e3 * statistics.median(measure.wall(step) for _ in range(steps))


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser("split_slices", __doc__, smoke="2 layers, a 4,096-token vocabulary, 2 steps, one repeat")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 4, 8, 16])
    parser.add_argument("--slices", type=int, nargs="+", default=[1 << 16, 1 << 18, 1 << 20])
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.repeats = 2, 1
    run = harness.begin("split_slices", argv, args)
    shipped = Tuning.split_slice_bytes
    variants = {f"{size // 1024} KiB" if size else "threads only": size
                for size in sorted(set(args.slices) | {0, shipped})}
    model = smollm2_shapes(args.smoke)
    with torch.inference_mode():
        cache = ModularDecoderCache(model.config)
        ids = torch.randint(0, model.config.vocab_size, (1, 64 + max(args.tokens)),
                            generator=torch.Generator().manual_seed(1))
        model(ids[:, :64], cache=cache)
    print(f"forward ms (median of {args.steps}, median of {args.repeats} repeats), {torch.get_num_threads()} threads; "
          f"shipped split_slice_bytes = {shipped}")
    print("| new tokens | " + " | ".join(variants) + " |\n|---:|" + "---:|" * len(variants))
    rows = []
    for count in args.tokens:
        tokens = ids[:, 64:64 + count]

        def case(size):
            def run_case():
                with tuned(split_slice_bytes=size):
                    return forward_ms(model, cache, tokens, args.steps)
            return run_case

        values = measure.alternating({name: case(size) for name, size in variants.items()}, args.repeats)
        row = {"tokens": count, "forward_ms": {name: measure.summary(v) for name, v in values.items()}}
        rows.append(row)
        print(f"| {count} | " + " | ".join(f"{row['forward_ms'][name]['median']:.2f}" for name in variants) + " |",
              flush=True)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    harness.write_result(args.out, {"split_slice_bytes": shipped, "layers": model.config.num_hidden_layers,
                                    "vocab_size": model.config.vocab_size, "weights_mb": weights / 1e6,
                                    "steps": args.steps, "variants": variants, "rows": rows}, run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
