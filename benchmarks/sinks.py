"""What attention sinks cost on each CPU backend: one attention layer of gpt-oss's widths (64 query heads of 64 over
8 K/V heads), a prefill of T tokens and a decode step against S cached tokens, SDPA with sinks (a prefill: one more
key, heads 8 features wider, K and V copied per call; a decode step: the cached keys scored directly) against SDPA
without them and against the eager reference with them (time, peak memory; fp32).

    HF_HUB_OFFLINE=1 .venv/bin/python -m benchmarks sinks [--prefill 512 2048] [--contexts 2048 8192]
        [--repeats 3] [--out benchmarks/results_sinks.json]

One `StandardAttention` layer called directly with random weights and inputs (hidden 2880, `attention_sinks` on
or off, the same weights otherwise), its backend switched between cases; a prefill runs without a mask (SDPA's own
causal path), a decode step is one query against a dynamic cache holding S random keys, cropped back after each
call. Times are the median of `--repeats` alternating rounds after a warm-up (`measure.alternating`); the peak
memory above the start (`measure.PeakMemory`) is one untimed call of each. `--smoke`: a tiny shape.
"""

from __future__ import annotations

import statistics

import torch

from modular_decoder import ModularDecoderConfig
from modular_decoder.attention import StandardAttention
from modular_decoder.cache import ModularDecoderCache

from . import harness, measure

SHAPE = dict(vocab_size=1024, hidden_size=2880, num_hidden_layers=1, num_attention_heads=64, num_key_value_heads=8,
             head_dim=64, max_position_embeddings=131072)
SMOKE_SHAPE = dict(vocab_size=128, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, max_position_embeddings=1024)
# case -> (backend, with sinks)
CASES = {"sdpa_sinks": ("sdpa", True), "sdpa": ("sdpa", False), "eager_sinks": ("eager", True)}


def layers(shape: dict) -> dict[str, StandardAttention]:
    """One layer per case, all holding the same weights (the sinks only where the case has them)."""
    built = {}
    for case, (backend, sinks) in CASES.items():
        config = ModularDecoderConfig(**shape, attention_sinks=sinks)
        config._attn_implementation = backend
        torch.manual_seed(0)
        layer = StandardAttention(config, 0).eval()
        with torch.no_grad():
            for param in layer.parameters():
                param.normal_(0.0, 0.02)
        built[case] = layer
    return built


def prefill(layer, tokens: int):
    hidden = torch.randn(1, tokens, layer.config.hidden_size, generator=torch.Generator().manual_seed(1))

    def run():
        with torch.no_grad():
            layer(hidden)
    return run


def decode(layer, context: int):
    config = layer.config
    cache = ModularDecoderCache(config)
    shape = (1, config.num_key_value_heads, context, config.head_dim)
    cache.update(torch.randn(shape), torch.randn(shape), 0)
    hidden = torch.randn(1, 1, config.hidden_size)

    def run():
        with torch.no_grad():
            layer(hidden, cache=cache)
        cache.crop(-1)
    return run


def measured(make, built: dict, size: int, repeats: int) -> dict:
    runs = {case: make(layer, size) for case, layer in built.items()}
    times = measure.alternating({case: measure.seconds(run) for case, run in runs.items()}, repeats)
    out = {}
    for case, run in runs.items():
        with measure.PeakMemory("cpu") as peak:
            run()
        out[case] = {"seconds": statistics.median(times[case]), "all_seconds": times[case], "peak_mb": peak.above_mb}
    base = out["sdpa"]["seconds"]
    out["ratios"] = {case: out[case]["seconds"] / base for case in CASES if case != "sdpa"}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser("sinks", __doc__, smoke="a tiny shape, short sequences, one repeat")
    parser.add_argument("--prefill", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    args = parser.parse_args(argv)
    shape = SMOKE_SHAPE if args.smoke else SHAPE
    prefills, contexts = ([16], [32]) if args.smoke else (args.prefill, args.contexts)
    repeats = 1 if args.smoke else args.repeats
    run = harness.begin("sinks", argv, args)
    built = layers(shape)
    results = {"shape": shape, "prefill": {}, "decode": {}}
    for tokens in prefills:
        results["prefill"][str(tokens)] = measured(prefill, built, tokens, repeats)
        print(f"prefill {tokens}: {results['prefill'][str(tokens)]['ratios']}")
    for context in contexts:
        results["decode"][str(context)] = measured(decode, built, context, repeats)
        print(f"decode against {context}: {results['decode'][str(context)]['ratios']}")
    harness.write_result(args.out, results, run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
