"""What attention sinks cost on each CPU backend: one attention layer of gpt-oss's widths (64 query heads of 64 over
8 K/V heads), a prefill of T tokens and a decode step against S cached tokens, SDPA with sinks (a prefill: one more
key, heads 8 features wider, K and V copied per call; a decode step: the cached keys scored directly) against SDPA
without them and against the eager reference with them (time, peak memory; fp32).

    HF_HUB_OFFLINE=1 .venv/bin/python -m benchmarks sinks [--prefill 512 2048] [--contexts 2048 8192] [--steps 10]
        [--repeats 3] [--threads 1] [--out benchmarks/results_sinks.json]

One `StandardAttention` layer called directly with random weights and inputs (hidden 2880, `attention_sinks` on
or off, the same weights otherwise), its backend switched between cases; a prefill runs without a mask (SDPA's own
causal path), a decode step is one query against a dynamic cache holding S random keys, cropped back after each
call. A decode step's time is dominated by the layer's projections (106 MB of weights), so the decode rows also time
the attention alone: the function the layer calls (`scores_through`: SDPA's, `sinks.sdpa_attention_with_sinks` or the
eager reference) on one query against the S cached keys and values. A prefill repeat is one call; a decode repeat
(the layer's, or the attention's alone) is the mean of `--steps` calls, since one call (milliseconds) is within a
busy machine's scheduling noise. Times are the median of `--repeats` alternating rounds after a warm-up
(`measure.alternating`); the peak memory above the start (`measure.PeakMemory`) is one untimed call of each.
`--smoke`: a tiny shape.
"""

from __future__ import annotations

import statistics

import torch

from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from modular_decoder import ModularDecoderConfig
from modular_decoder.attention import StandardAttention
from modular_decoder.cache import ModularDecoderCache
from modular_decoder.eager_attention import eager_attention

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


def prefill(layer, tokens: int, steps: int = 1):
    hidden = torch.randn(1, tokens, layer.config.hidden_size, generator=torch.Generator().manual_seed(1))

    def run():
        with torch.no_grad():
            layer(hidden)
    return run


def decode(layer, context: int, steps: int = 1):
    """`steps` decode steps of the layer, each one query against a cache of `context` random keys, cropped back."""
    config = layer.config
    cache = ModularDecoderCache(config)
    shape = (1, config.num_key_value_heads, context, config.head_dim)
    cache.update(torch.randn(shape), torch.randn(shape), 0)
    hidden = torch.randn(1, 1, config.hidden_size)

    def run():
        with torch.no_grad():
            for _ in range(steps):
                layer(hidden, cache=cache)
                cache.crop(-1)
    return run


def decode_attention(layer, context: int, steps: int = 1):
    """`steps` calls of the attention function the layer calls in a decode step (its backend's, with the sinks where
    it has them), on one query against `context` random keys and values: the scoring alone, no projection."""
    config = layer.config
    query = torch.randn(1, config.num_attention_heads, 1, config.head_dim)
    key, value = (torch.randn(1, config.num_key_value_heads, context, config.head_dim) for _ in range(2))
    interface = layer.scores_through(ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation,
                                                                           eager_attention), {})

    def run():
        with torch.no_grad():
            for _ in range(steps):
                interface(layer, query, key, value, None, scaling=layer.scaling, s_aux=layer.sinks,
                          **layer.score_kwargs({}))
    return run


def measured(make, built: dict, size: int, repeats: int, steps: int = 1) -> dict:
    """{case: the median seconds of one call (a repeat: the mean of `steps` calls), every repeat, the peak memory of
    one untimed call}, and each case's ratio to SDPA without sinks."""
    runs = {case: make(layer, size, steps) for case, layer in built.items()}
    times = measure.alternating({case: measure.seconds(run) for case, run in runs.items()}, repeats)
    times = {case: [t / steps for t in values] for case, values in times.items()}
    out = {}
    for case, layer in built.items():
        with measure.PeakMemory("cpu") as peak:
            make(layer, size, 1)()
        out[case] = {"seconds": statistics.median(times[case]), "all_seconds": times[case], "peak_mb": peak.above_mb}
    base = out["sdpa"]["seconds"]
    out["ratios"] = {case: out[case]["seconds"] / base for case in CASES if case != "sdpa"}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser("sinks", __doc__, smoke="a tiny shape, short sequences, one repeat")
    parser.add_argument("--prefill", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--steps", type=int, default=10, help="decode calls per repeat, their mean its value")
    args = parser.parse_args(argv)
    shape = SMOKE_SHAPE if args.smoke else SHAPE
    prefills, contexts = ([16], [32]) if args.smoke else (args.prefill, args.contexts)
    repeats, steps = (1, 2) if args.smoke else (args.repeats, args.steps)
    run = harness.begin("sinks", argv, args)
    built = layers(shape)
    results = {"shape": shape, "steps": steps, "prefill": {}, "decode": {}, "decode_attention": {}}
    for tokens in prefills:
        results["prefill"][str(tokens)] = measured(prefill, built, tokens, repeats)
        print(f"prefill {tokens}: {results['prefill'][str(tokens)]['ratios']}")
    for context in contexts:
        for phase, make in (("decode", decode), ("decode_attention", decode_attention)):
            results[phase][str(context)] = measured(make, built, context, repeats, steps)
            print(f"{phase} against {context}: {results[phase][str(context)]['ratios']}")
    harness.write_result(args.out, results, run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
