"""DeepSeek-V4 (shared key = value attention with compressed layers, hyper-connections, hash-routed experts): ours
against transformers' `DeepseekV4ForCausalLM` with the same weights, the compressed caches' bytes per token against
transformers', and one decode step as the cached context grows against the same model with a window only (CPU, fp32
timings; bf16 caches).

    HF_HUB_OFFLINE=1 .venv/bin/python -m benchmarks deepseek_v4 [--repeats 3] [--prompt 512] [--new-tokens 32]
        [--cache-contexts 4096 32768] [--decode-contexts 8192 16384 32768 65536] [--threads N] [--out FILE]

Side by side (`hybrid.side_by_side`: made by transformers' class, converted, both loaded with `from_pretrained`):
DeepSeek-V4's layout shrunk to hidden 512 (a window-only layer, CSA, HCA, CSA; 8 heads of 128 over one key = value
head, a quarter rotated; grouped output 2 x 128; CSA every 4 tokens with an indexer of 8 heads of 64 keeping 64
entries, HCA every 128; 4 hyper-connection streams; 8 experts of 256, 2 per token by √softplus scores, the first
layer routed by token id, one shared; vocabulary 4096): prefill of 1 x PROMPT tokens (no cache, the last position's
logits; ours SDPA, theirs eager, the only backend it has) and greedy decode of NEW_TOKENS after a 16-token prompt
(batch 1, each side through its own cache), tokens/s and their ratio per repeat, the sides alternating, the largest
logit difference of the prefill and whether the greedy tokens are the same.

Cache bytes (`meta_cache.bytes_per_token`): the `deepseek_v4` preset (DeepSeek-V4-Flash: 43 layers, HCA and CSA, heads
of 512, an indexer of 128 keeping 512 entries, windows of 128), both sides built on the meta device in bf16 and run
through each side's own cache: a prefill of C tokens and one decode step; every tensor each cache layer holds (the
window, the compressed entries, the compressors' pending tokens), each storage once, at its allocated size, per token
and layer type, beside ours' payload and, from the contract's arithmetic (`contract.cache_bytes`), what the same model
would hold with every layer attending to all its keys (`full_attention`, one key = value of 512 per token and layer).

Decode against the window alone: one layer of each kind at DeepSeek-V4-Flash's attention widths (64 heads of 512,
hidden 1024) and its window-only twin (the same weights, every layer `sliding_attention`: constant cost); the
compressed caches filled directly with C tokens' worth of random normed entries (a C-token prefill would take far
longer than the steps and not change what a step reads). Each row: the median time of one decode step at C cached
tokens, the ratio to the window-only model, and the cache's bytes.
`--smoke`: tiny widths, a 64-token prompt, 4 new tokens, the tiny preset at 40 and 100 tokens, contexts 256 and 512.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import torch
from transformers import DeepseekV4Config

from modular_decoder import ModularDecoderConfig, ModularDecoderForCausalLM, preset_config
from modular_decoder.cache import ModularDecoderCache
from modular_decoder.compressed_cache import CompressedLayer
from modular_decoder.contract import cache_bytes

from . import harness, measure, meta_cache
from .hybrid import side_by_side, side_by_side_parser, side_rows

LAYERS = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
          "compressed_sparse_attention"]
RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
REFERENCE = "DeepseekV4ForCausalLM"
SIDE = dict(vocab_size=4096, hidden_size=512, moe_intermediate_size=256, num_hidden_layers=4, num_attention_heads=8,
            head_dim=128, q_lora_rank=256, o_groups=2, o_lora_rank=128, sliding_window=128, partial_rotary_factor=0.25,
            layer_types=LAYERS, compress_rates=RATES, index_n_heads=8, index_head_dim=64, index_topk=64,
            n_routed_experts=8, num_experts_per_tok=2, hc_mult=4, mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
            max_position_embeddings=262144)
# DeepSeek-V4-Flash's attention widths (transformers' DeepseekV4Config defaults), one layer of each kind around them
FLASH = dict(head_dim=512, index_head_dim=128, sliding_window=128, partial_rotary_factor=64 / 512, compress_rates=RATES)
DECODE_MODEL = dict(SIDE, **FLASH, hidden_size=1024, num_attention_heads=64, q_lora_rank=1024, o_groups=8,
                    o_lora_rank=1024, index_n_heads=64, index_topk=512, num_hidden_layers=3, layer_types=LAYERS[:3],
                    moe_intermediate_size=32, mlp_layer_types=["moe"] * 3, vocab_size=256)
# (8 indexer heads: a tie at the k-th place, where every head's ReLU zeroes two entries' scores, stays rare; with 2
# the sides break such ties differently and their logits part)
SMOKE = dict(hidden_size=64, num_attention_heads=2, head_dim=32, q_lora_rank=32, o_groups=2, o_lora_rank=16,
             index_n_heads=8, index_head_dim=32, index_topk=8, moe_intermediate_size=32, vocab_size=256, sliding_window=16,
             compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16})


def contract(config: DeepseekV4Config) -> ModularDecoderConfig:
    """Ours for transformers' config (the conversion's translation, no weights)."""
    from modular_decoder.conversion import get_family

    return ModularDecoderConfig(**get_family("deepseek_v4").to_contract(config))


def compression_bytes(contexts: list[int], smoke: bool) -> list[dict]:
    """`meta_cache.bytes_per_token` rows of the `deepseek_v4` preset, each with what the same model would hold with
    every layer attending to all its keys (the contract's payload, per token)."""
    rows = meta_cache.bytes_per_token("deepseek_v4", "deepseek_v4", contexts, tiny=smoke)
    config = preset_config("deepseek_v4", tiny=smoke)
    dense = preset_config("deepseek_v4", tiny=smoke, layer_types=["full_attention"] * config.num_hidden_layers,
                          compress_rates=None, index_n_heads=None, index_head_dim=None, index_topk=None,
                          compressed_layers=False,
                          rope_parameters={"full_attention": dict(config.rope_parameters["sliding_attention"])})
    for row in rows:
        tokens = row["context"] + 1
        row["ours_payload_every_layer_full_per_token"] = cache_bytes(dense, tokens, dtype=torch.bfloat16) / tokens
    return rows


def filled(model, context: int) -> ModularDecoderCache:
    """A cache holding `context` tokens of random content: each window's last keys, each compressed layer's entries
    of the windows completed and its last tokens' projections (normed as the model norms them)."""
    config, generator = model.config, torch.Generator().manual_seed(2)
    cache = ModularDecoderCache(config)
    normed = lambda *shape: torch.nn.functional.normalize(torch.randn(*shape, generator=generator), dim=-1) * shape[-1] ** 0.5  # noqa: E731
    window = config.sliding_window - 1
    for index, layer in enumerate(cache.layers):
        layer.update(normed(1, 1, window, config.head_dim), None)
        layer.cumulative_length = context
        if isinstance(layer, CompressedLayer):
            compression = model.model.layers[index].self_attn.compressor
            streams = {"compressor": compression.compressor}
            if compression.indexer is not None:
                streams["indexer"] = compression.indexer.compressor
            for name, compressor in streams.items():
                projected = compressor.kv_proj.out_features
                layer.tails[name] = (torch.randn(1, layer.tail_length, projected, generator=generator),
                                     torch.randn(1, layer.tail_length, projected, generator=generator))
                entries = layer._slots(name, torch.zeros(1, 1, compressor.width))
                entries[:, : context // layer.rate] = normed(1, context // layer.rate, compressor.width)
    return cache


@torch.inference_mode()
def decode_against_window(shape: dict, contexts: list[int], repeats: int) -> list[dict]:
    config = contract(DeepseekV4Config(**shape))
    window_config = ModularDecoderConfig(**{**config.to_dict(), "layer_types": ["sliding_attention"] * len(shape["layer_types"]),
                                            "compress_rates": None, "index_n_heads": None, "index_head_dim": None,
                                            "index_topk": None, "rope_parameters": {"sliding_attention": dict(
                                                config.rope_parameters["sliding_attention"])}})
    torch.manual_seed(0)
    compressed = ModularDecoderForCausalLM(config).eval()
    window = ModularDecoderForCausalLM(window_config).eval()
    window.load_state_dict(compressed.state_dict(), strict=False)
    compressed.config._attn_implementation = window.config._attn_implementation = "sdpa"
    rows = []
    for context in contexts:
        caches = {"compressed": filled(compressed, context), "window only": filled(window, context)}
        models = {"compressed": compressed, "window only": window}
        token, steps = torch.tensor([[7]]), {name: 0 for name in models}

        def step(name):
            position = torch.tensor([[context + steps[name]]])
            models[name](token, cache=caches[name], position_ids=position, use_cache=True)
            steps[name] += 1

        times = measure.alternating({name: measure.seconds(lambda n=name: step(n)) for name in models}, repeats)
        seconds = {name: statistics.median(values) for name, values in times.items()}
        rows.append({"context": context, "step_seconds": seconds, "all_seconds": times,
                     "ratio_to_window_only": seconds["compressed"] / seconds["window only"],
                     "cache_bytes": {name: cache.payload_bytes() for name, cache in caches.items()}})
    return rows


def report(results: dict) -> str:
    """The three tables (markdown)."""
    side = results["side_by_side"]
    lines = [f"| DeepSeek-V4 layout, hidden {results['shapes']['side_by_side']['hidden_size']}: 1 x {side['prompt']} "
             f"prefill / batch-1 decode of {side['new_tokens']} | transformers tok/s | ours tok/s | ours / it "
             "(median; range) |", "|---|---:|---:|---:|", *side_rows(side, REFERENCE),
             f"(largest logit difference {side['max_logit_diff']:.1e}; same greedy tokens: "
             f"{side['same_greedy_tokens']})", "", *meta_cache.TABLE_HEAD,
             *meta_cache.rows_markdown("deepseek_v4", results["cache_bytes"], (
                 "every layer attending in full (the contract's payload)",
                 "ours_payload_every_layer_full_per_token"))]
    lines += ["", "| cached tokens | compressed step (ms) | window only step (ms) | ratio | compressed cache bytes |",
              "|---:|---:|---:|---:|---:|"]
    for row in results["decode_against_window"]:
        s = row["step_seconds"]
        lines.append(f"| {row['context']:,} | {1e3 * s['compressed']:.1f} | {1e3 * s['window only']:.1f} | "
                     f"{row['ratio_to_window_only']:.2f} | {row['cache_bytes']['compressed']:,} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = side_by_side_parser("deepseek_v4", __doc__)
    parser.add_argument("--cache-contexts", type=int, nargs="+", default=[4096, 32768],
                        help="cached tokens per cache-bytes row")
    parser.add_argument("--decode-contexts", type=int, nargs="+", default=[8192, 16384, 32768, 65536],
                        help="cached tokens per decode-step row")
    args = parser.parse_args(argv)
    run = harness.begin("deepseek_v4", argv, args)
    shapes = {"side_by_side": SIDE, "decode_against_window": DECODE_MODEL}
    if args.smoke:
        shapes = {name: dict(shape, **SMOKE) for name, shape in shapes.items()}
        args.prompt, args.new_tokens, args.cache_contexts, args.decode_contexts = 64, 4, [40, 100], [256, 512]
    with tempfile.TemporaryDirectory() as folder:
        side = side_by_side(Path(folder), DeepseekV4Config(**shapes["side_by_side"]), args.prompt, args.new_tokens,
                            args.repeats, reference=REFERENCE, backends=("eager", "sdpa"))
    print(f"side by side: prefill {side['prefill']['median_ratio']:.2f}x, decode {side['decode']['median_ratio']:.2f}x "
          f"(ours / {REFERENCE}); largest logit difference {side['max_logit_diff']:.1e}", flush=True)
    results = {
        "shapes": shapes,
        "side_by_side": side,
        "cache_bytes": compression_bytes(args.cache_contexts, args.smoke),
        "decode_against_window": decode_against_window(shapes["decode_against_window"], args.decode_contexts,
                                                       args.repeats),
    }
    print(report(results))
    harness.write_result(args.out, results, run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
