"""Hybrid linear attention (Gated DeltaNet layers beside gated full attention): ours against transformers'
`Qwen3NextForCausalLM` with the same weights, and one decode step of a linear-attention layer beside a
full-attention layer as the cached context grows (CPU, fp32).

    HF_HUB_OFFLINE=1 .venv/bin/python -m benchmarks hybrid [--repeats 3] [--prompt 512] [--new-tokens 32]
                                                           [--contexts 1024 16384] [--threads N] [--out FILE]

Side by side: Qwen3-Next's layout shrunk to hidden 1024 (4 layers, three Gated DeltaNet layers of 8 key heads and
16 value heads of 128 for each full-attention layer of 8 heads of 128 over 2 K/V heads with its output gate, QK-norm
and a quarter of each head rotating; a dense SwiGLU FFN of 2816, vocabulary 8192), made by transformers' class and
converted (`families.save_pair`), both loaded with `from_pretrained`: prefill of 1 x PROMPT tokens (no cache, the
last position's logits) and greedy decode of NEW_TOKENS after a 16-token prompt (batch 1, each side through its own
cache), tokens/s, the sides alternating (`measure.alternating`), their ratio per repeat, and the largest logit
difference of the prefill.

Flat in context: two one-layer models of ours at that width (the linear-attention layer; the gated full-attention
layer), a small FFN and vocabulary so that the step is mostly the layer. The linear layer's cache is filled by a real
prefill of C tokens (its state after them), the full layer's with C random keys and values (a C-token prefill through
attention is quadratic and would not change what a step reads). Each row: the median time of one decode step at C
cached tokens (the mean of 10 steps per repeat, every kind and context alternating in one loop; the full layer's
cache cropped back after each step, the linear layer's state has no length to crop) and the bytes its cache holds.
`--smoke`: tiny widths, a 32-token prompt, 4 new tokens, contexts 64 and 256.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import torch
from transformers import Qwen3NextConfig

from modular_decoder import ModularDecoderConfig, ModularDecoderForCausalLM
from modular_decoder.cache import ModularDecoderCache

from . import harness, measure
from .families import load_pair, save_pair

# Qwen/Qwen3-Next-80B-A3B-Instruct's proportions (config.json: hidden 2048, 16 heads of 256 over 2 K/V heads, linear
# 16 key / 32 value heads of 128, 3 linear layers per full one) at hidden 1024, dense FFN
WIDTHS = dict(hidden_size=1024, num_attention_heads=8, num_key_value_heads=2, head_dim=128, linear_num_key_heads=8,
              linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4)
SMOKE_WIDTHS = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)
LAYERS = ["linear_attention"] * 3 + ["full_attention"]
REFERENCE = "transformers Qwen3Next"
PREFILL_PIECE = 4096  # tokens per forward when a linear layer's cache is filled
OURS = "ours"


def reference_config(widths: dict) -> Qwen3NextConfig:
    return Qwen3NextConfig(**widths, vocab_size=8192 if widths is WIDTHS else 256,
                           intermediate_size=2816 if widths is WIDTHS else 128, num_hidden_layers=len(LAYERS),
                           layer_types=LAYERS, num_experts=0, max_position_embeddings=32768,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                            "partial_rotary_factor": 0.25})


@torch.inference_mode()
def side_by_side(folder: Path, config, prompt: int, new_tokens: int, repeats: int, reference: str = REFERENCE,
                 backends: tuple[str, str] = ("sdpa", "sdpa")) -> dict:
    """Prefill and decode tokens/s of transformers' class for `config` (named `reference`) and ours with the same
    weights, alternating (`backends`: transformers' attention implementation, ours), the prefill's largest logit
    difference and whether the sides decode the same greedy tokens; each decode's median step (`decode_median_step`);
    and decode steps of the two taken in turn (`decode_interleaved`, `measure.interleaved_decode_steps`)."""
    save_pair(config, folder)
    models = dict(zip((reference, OURS), load_pair(folder, attn_implementation=None)))
    for model, backend in zip(models.values(), backends):
        model.set_attn_implementation(backend)
    generator = torch.Generator().manual_seed(0)
    vocab = models[OURS].config.vocab_size
    long, short = (torch.randint(0, vocab, (1, n), generator=generator) for n in (prompt, 16))
    logits = {name: model(long, use_cache=False).logits for name, model in models.items()}  # also the warm-up
    for model in models.values():
        measure.decode(model, short, 4)

    def round_of(name: str):
        def run() -> dict:
            prefill = measure.prefill(models[name], long)["tokens_per_s"]
            decode = measure.decode(models[name], short, new_tokens)
            return {"prefill": prefill, "decode": decode["tokens_per_s"], "decode_step_ms": decode["step_ms_median"]}
        return run

    rounds = measure.alternating({name: round_of(name) for name in models}, repeats, warmup=0)
    greedy = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    tokens = [model.generate(short, attention_mask=torch.ones_like(short), **greedy) for model in models.values()]
    result = {"prompt": prompt, "new_tokens": new_tokens, "backends": dict(zip(models, backends)),
              "max_logit_diff": (logits[OURS] - logits[reference]).abs().max().item(),
              "same_greedy_tokens": bool(torch.equal(*tokens))}
    for key in ("prefill", "decode"):
        values = {name: [r[key] for r in rounds[name]] for name in models}
        ratios = [ours / theirs for ours, theirs in zip(values[OURS], values[reference])]
        result[key] = {"tokens_per_s": values, "median_tokens_per_s": {n: statistics.median(v) for n, v in values.items()},
                       "ratios": ratios, "median_ratio": statistics.median(ratios)}
    # the same decodes by their median step (ratio: its step / ours, so above 1 ours is faster, as above)
    steps = {name: [r["decode_step_ms"] for r in rounds[name]] for name in models}
    ratios = [theirs / ours for ours, theirs in zip(steps[OURS], steps[reference])]
    result["decode_median_step"] = {"step_ms": steps, "median_step_ms": {n: statistics.median(v) for n, v in steps.items()},
                                    "ratios": ratios, "median_ratio": statistics.median(ratios)}
    # and the two models stepping in turn, `repeats` x `new_tokens` steps each (ratio per pair of adjacent steps)
    times = measure.interleaved_decode_steps(models, short, repeats * new_tokens)
    ratios = [theirs / ours for ours, theirs in zip(times[OURS], times[reference])]
    result["decode_interleaved"] = {"steps": len(ratios),
                                    "median_step_ms": {n: 1e3 * statistics.median(v) for n, v in times.items()},
                                    "median_ratio": statistics.median(ratios),
                                    "quartile_ratios": statistics.quantiles(ratios, n=4)[::2] if len(ratios) > 1
                                    else ratios * 2}
    return result


def one_layer_models(widths: dict) -> dict:
    """Our one-layer models: the linear-attention layer (no positions: it reads none) and the gated full-attention
    layer (QK-norm, partial rotary), a small FFN and vocabulary."""
    common = dict(widths, vocab_size=256, intermediate_size=256, num_hidden_layers=1, norm_type="rmsnorm",
                  mlp_type="gated", hidden_act="silu", max_position_embeddings=65536)
    linear = ModularDecoderConfig(**common, layer_types=["linear_attention"], position_embedding_type="none")
    full_widths = {k: v for k, v in common.items() if not k.startswith("linear_")}
    full = ModularDecoderConfig(**full_widths, layer_types=["full_attention"], qk_norm="head", attn_output_gate=True,
                                partial_rotary_factor=0.25)
    torch.manual_seed(0)
    return {"linear_attention": ModularDecoderForCausalLM(linear).eval(),
            "full_attention": ModularDecoderForCausalLM(full).eval()}


def filled_cache(kind: str, model, context: int) -> ModularDecoderCache:
    """A cache holding `context` tokens: a linear layer's by a real prefill, the full layer's random K/V."""
    config = model.config
    cache = ModularDecoderCache(config)
    if kind != "full_attention":  # a real prefill, in pieces (the same state, bounded memory)
        tokens = torch.randint(0, config.vocab_size, (1, context))
        for start in range(0, context, PREFILL_PIECE):
            model(tokens[:, start:start + PREFILL_PIECE], cache=cache, logits_to_keep=1)
    else:
        keys = torch.randn(1, config.num_key_value_heads, context, config.head_dim)
        cache.update(keys, torch.randn_like(keys), 0)
    return cache


@torch.inference_mode()
def flat_in_context(models: dict, contexts: list[int], repeats: int, steps: int = 10) -> list[dict]:
    """Per layer kind (`models`: one-layer models by kind, "full_attention" the attention layer's) and context: the
    median time of one decode step (the mean of `steps` steps per repeat, every kind and context alternating in one
    loop, so load drift reaches each alike) and the cache's bytes."""
    token = torch.tensor([[7]])
    caches = {(kind, context): filled_cache(kind, model, context) for context in contexts
              for kind, model in models.items()}

    def case(kind: str, context: int):
        model, cache, position = models[kind], caches[kind, context], torch.tensor([[context]])

        def run():
            for _ in range(steps):
                model(token, cache=cache, position_ids=position, use_cache=True)
                if kind == "full_attention":
                    cache.crop(-1)  # back to `context` tokens
        return measure.seconds(run)

    times = measure.alternating({key: case(*key) for key in caches}, repeats)
    rows = []
    for context in contexts:
        per_step = {kind: [1e3 * t / steps for t in times[kind, context]] for kind in models}
        rows.append({"context": context, "step_ms": {k: statistics.median(v) for k, v in per_step.items()},
                     "all_step_ms": per_step,
                     "cache_bytes": {kind: caches[kind, context].payload_bytes() for kind in models}})
    return rows


def side_rows(side: dict, reference: str = REFERENCE, label: str = "") -> list[str]:
    """The prefill and decode rows of one side-by-side result: the sides' median tokens/s and ratio (median and
    range over the repeats)."""
    rows = []
    for key in ("prefill", "decode"):
        medians, ratios = side[key]["median_tokens_per_s"], side[key]["ratios"]
        rows.append(f"| {label}{key} | {medians[reference]:.1f} | {medians[OURS]:.1f} | "
                    f"{side[key]['median_ratio']:.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) |")
    return rows


def context_rows(rows: list[dict]) -> list[str]:
    """Each layer kind's decode step and cache bytes per context (markdown)."""
    lines = ["| cached tokens | layer | decode step (ms) | cache bytes |", "|---:|---|---:|---:|"]
    for row in rows:
        for kind, ms in row["step_ms"].items():
            lines.append(f"| {row['context']:,} | {kind} | {ms:.2f} | {row['cache_bytes'][kind]:,} |")
    return lines


def report(result: dict) -> str:
    """The two tables (markdown): the sides' tokens/s and ratio (median and range over the repeats), and each layer
    kind's decode step and cache bytes per context."""
    side = result["side_by_side"]
    lines = [f"| 1 x {side['prompt']} prefill / batch-1 decode of {side['new_tokens']} | {REFERENCE} tok/s | ours "
             "tok/s | ours / it (median; range) |", "|---|---:|---:|---:|", *side_rows(side), "",
             *context_rows(result["flat_in_context"])]
    return "\n".join(lines)


def side_by_side_parser(name: str, doc: str | None, contexts: list[int] | None = None,
                        families: dict | None = None):
    """`harness.parser` with the flags of a side-by-side benchmark: `--prompt`, `--new-tokens`, `--contexts`
    (`contexts`: its default; None: no such flag) and, given `families` (name -> transformers class), `--families`."""
    parser = harness.parser(name, doc)
    parser.add_argument("--prompt", type=int, default=512, help="prefill length (default 512)")
    parser.add_argument("--new-tokens", type=int, default=32, help="decoded tokens (default 32)")
    if contexts is not None:
        parser.add_argument("--contexts", type=int, nargs="+", default=contexts, help="cached tokens per row")
    if families is not None:
        parser.add_argument("--families", nargs="+", default=list(families), choices=list(families),
                            help="the families run side by side (default all)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = side_by_side_parser("hybrid", __doc__, [1024, 16384])
    args = parser.parse_args(argv)
    run = harness.begin("hybrid", argv, args)
    widths = SMOKE_WIDTHS if args.smoke else WIDTHS
    prompt, new_tokens = (32, 4) if args.smoke else (args.prompt, args.new_tokens)
    contexts = [64, 256] if args.smoke else args.contexts
    with tempfile.TemporaryDirectory() as tmp:
        result = {"widths": widths, "side_by_side": side_by_side(Path(tmp), reference_config(widths), prompt,
                                                                 new_tokens, args.repeats)}
    result["flat_in_context"] = flat_in_context(one_layer_models(widths), contexts, args.repeats)
    print(f"largest logit difference of the prefill: {result['side_by_side']['max_logit_diff']:.1e}")
    print(report(result))
    harness.write_result(args.out, result, run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
