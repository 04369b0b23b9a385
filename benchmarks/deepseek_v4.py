"""DeepSeek-V4 (shared key = value attention with compressed layers, hyper-connections, hash-routed experts): ours
against transformers' `DeepseekV4ForCausalLM` with the same weights, the compressed caches' bytes per token against
transformers', and one decode step as the cached context grows against the same model with a window only (CPU, fp32).

    HF_HUB_OFFLINE=1 .venv/bin/python -m benchmarks deepseek_v4 [--repeats 3] [--prompt 512] [--new-tokens 32]
        [--cache-contexts 4096 32768] [--decode-contexts 8192 16384 32768 65536] [--threads N] [--out FILE]

Side by side (`families.save_pair`: made by transformers' class, converted, both loaded with `from_pretrained`):
DeepSeek-V4's layout shrunk to hidden 512 (a window-only layer, CSA, HCA, CSA; 8 heads of 128 over one key = value
head, a quarter rotated; grouped output 2 x 128; CSA every 4 tokens with an indexer of 8 heads of 64 keeping 64
entries, HCA every 128; 4 hyper-connection streams; 8 experts of 256, 2 per token by √softplus scores, the first
layer routed by token id, one shared; vocabulary 4096): prefill of 1 x PROMPT tokens (no cache; ours SDPA, theirs
eager, the only backend it has) and greedy decode of NEW_TOKENS after a 16-token prompt (batch 1, each side through
its own cache), tokens/s and their ratio per repeat, the sides alternating, and the largest logit difference.

Cache bytes: three layers (window-only, CSA, HCA) at DeepSeek-V4-Flash's attention widths (head 512, indexer keys
128, windows of 4 and 128 tokens, a window of 128 keys), a small hidden size; each side's cache filled by a chunked
prefill of C tokens (chunks of 1,024) and its tensors counted (ours: what `payload_bytes` counts; transformers' every
tensor of its layers, each storage once), divided by C, per layer type.

Decode against the window alone: one layer of each kind at DeepSeek-V4-Flash's attention widths (64 heads of 512,
hidden 1024) and its window-only twin (the same weights, every layer `sliding_attention`: constant cost); the
compressed caches filled directly with C tokens' worth of random normed entries (a C-token prefill would take far
longer than the steps and not change what a step reads). Each row: the median time of one decode step at C cached
tokens, the ratio to the window-only model, and the cache's bytes.
`--smoke`: tiny widths, a 64-token prompt, 4 new tokens, contexts 256 and 512.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import torch
from transformers import DeepseekV4Config, DynamicCache

from modular_decoder import ModularDecoderConfig, ModularDecoderForCausalLM
from modular_decoder.cache import ModularDecoderCache
from modular_decoder.compressed_cache import CompressedLayer

from . import harness, measure
from .families import load_pair, save_pair

LAYERS = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
          "compressed_sparse_attention"]
RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
SIDE = dict(vocab_size=4096, hidden_size=512, moe_intermediate_size=256, num_hidden_layers=4, num_attention_heads=8,
            head_dim=128, q_lora_rank=256, o_groups=2, o_lora_rank=128, sliding_window=128, partial_rotary_factor=0.25,
            layer_types=LAYERS, compress_rates=RATES, index_n_heads=8, index_head_dim=64, index_topk=64,
            n_routed_experts=8, num_experts_per_tok=2, hc_mult=4, mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
            max_position_embeddings=262144)
# DeepSeek-V4-Flash's attention widths (transformers' DeepseekV4Config defaults), a small model around them
FLASH = dict(head_dim=512, index_head_dim=128, sliding_window=128, partial_rotary_factor=64 / 512, compress_rates=RATES)
CACHE_MODEL = dict(SIDE, **FLASH, hidden_size=64, num_attention_heads=1, q_lora_rank=32, o_groups=1, o_lora_rank=32,
                   index_n_heads=4, index_topk=512, num_hidden_layers=3, layer_types=LAYERS[:3], moe_intermediate_size=32,
                   mlp_layer_types=["moe"] * 3, vocab_size=256)
DECODE_MODEL = dict(CACHE_MODEL, hidden_size=1024, num_attention_heads=64, q_lora_rank=1024, o_groups=8,
                    o_lora_rank=1024, index_n_heads=64, index_topk=512)
SMOKE = dict(hidden_size=64, num_attention_heads=2, head_dim=32, q_lora_rank=32, o_groups=2, o_lora_rank=16, index_n_heads=2,
             index_head_dim=32, index_topk=8, moe_intermediate_size=32, vocab_size=256, sliding_window=16,
             compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16})


def contract(config: DeepseekV4Config) -> ModularDecoderConfig:
    """Ours for transformers' config (the conversion's translation, no weights)."""
    from modular_decoder.conversion import get_family

    return ModularDecoderConfig(**get_family("deepseek_v4").to_contract(config))


@torch.inference_mode()
def side_by_side(shape: dict, prompt_len: int, new_tokens: int, repeats: int) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        save_pair(DeepseekV4Config(**shape), Path(folder))
        theirs, ours = load_pair(Path(folder), attn_implementation=None)
    ours.config._attn_implementation = "sdpa"
    theirs.config._attn_implementation = "eager"
    prompt = torch.randint(0, shape["vocab_size"], (1, prompt_len), generator=torch.Generator().manual_seed(0))
    short = prompt[:, :16]
    models = {"transformers": theirs, "ours": ours}
    prefill = measure.alternating({n: lambda m=m: measure.prefill(m, prompt)["tokens_per_s"] for n, m in models.items()},
                                  repeats)
    decode = measure.alternating({n: lambda m=m: measure.decode(m, short, new_tokens)["tokens_per_s"]
                                  for n, m in models.items()}, repeats)
    diff = (theirs(prompt).logits - ours(prompt).logits).abs().max().item()
    tokens = {n: m.generate(short, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0) for n, m in models.items()}
    return {
        "prefill_tokens_per_s": {n: statistics.median(v) for n, v in prefill.items()},
        "decode_tokens_per_s": {n: statistics.median(v) for n, v in decode.items()},
        "prefill_ratio": statistics.median(o / t for o, t in zip(prefill["ours"], prefill["transformers"])),
        "decode_ratio": statistics.median(o / t for o, t in zip(decode["ours"], decode["transformers"])),
        "all": {"prefill": prefill, "decode": decode},
        "max_logit_diff": diff,
        "same_greedy_tokens": bool(torch.equal(tokens["ours"], tokens["transformers"])),
    }


def transformers_bytes(cache) -> dict[int, int]:
    """Every tensor transformers' cache layers hold (dicts of compressor states included), each storage once."""
    per_layer = {}
    for index, layer in enumerate(cache.layers):
        seen, total = set(), 0
        for value in vars(layer).values():
            for tensor in (value.values() if isinstance(value, dict) else [value]):
                if isinstance(tensor, torch.Tensor) and tensor.numel() and tensor.data_ptr() not in seen:
                    seen.add(tensor.data_ptr())
                    total += tensor.numel() * tensor.element_size()
        per_layer[index] = total
    return per_layer


def our_bytes(cache) -> dict[int, int]:
    out = {}
    for index, layer in enumerate(cache.layers):
        if isinstance(layer, CompressedLayer):
            out[index] = layer.payload_bytes()
        else:
            out[index] = layer.keys.numel() * layer.keys.element_size()
    return out


@torch.inference_mode()
def cache_bytes(shape: dict, contexts: list[int], chunk: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as folder:
        save_pair(DeepseekV4Config(**shape), Path(folder))
        theirs, ours = load_pair(Path(folder), attn_implementation=None)
    ours.config._attn_implementation = "sdpa"
    theirs.config._attn_implementation = "eager"
    rows = []
    for context in contexts:
        ids = torch.randint(0, shape["vocab_size"], (1, context), generator=torch.Generator().manual_seed(1))
        caches = {"transformers": DynamicCache(config=theirs.config), "ours": ModularDecoderCache(ours.config)}
        for start in range(0, context, chunk):
            piece = ids[:, start:start + chunk]
            theirs(piece, past_key_values=caches["transformers"], use_cache=True, logits_to_keep=1)
            ours(piece, cache=caches["ours"], use_cache=True, logits_to_keep=1)
        counted = {"transformers": transformers_bytes(caches["transformers"]), "ours": our_bytes(caches["ours"])}
        rows.append({"context": context, "bytes_per_token": {
            side: {shape["layer_types"][i]: count / context for i, count in layers.items()}
            for side, layers in counted.items()}})
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
    side = results["side_by_side"]
    lines = [f"side by side (DeepSeek-V4 layout, hidden {results['shapes']['side_by_side']['hidden_size']}): "
             f"max |logit diff| {side['max_logit_diff']:.1e}, same greedy tokens: {side['same_greedy_tokens']}"]
    for what in ("prefill", "decode"):
        values = side[f"{what}_tokens_per_s"]
        lines.append(f"  {what:8s} tok/s  transformers {values['transformers']:9.1f}  ours {values['ours']:9.1f}  "
                     f"ratio {side[f'{what}_ratio']:.2f}")
    lines.append("cache bytes per token (per layer):")
    for row in results["cache_bytes"]:
        for kind in row["bytes_per_token"]["ours"]:
            theirs, ours = row["bytes_per_token"]["transformers"][kind], row["bytes_per_token"]["ours"][kind]
            lines.append(f"  {row['context']:6d} {kind:30s} transformers {theirs:9.1f}  ours {ours:9.1f}")
    lines.append("decode step against the window only:")
    for row in results["decode_against_window"]:
        s = row["step_seconds"]
        lines.append(f"  {row['context']:6d} compressed {1e3 * s['compressed']:8.1f} ms  window only "
                     f"{1e3 * s['window only']:8.1f} ms  ratio {row['ratio_to_window_only']:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser("deepseek_v4", __doc__)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--cache-contexts", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--decode-contexts", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    args = parser.parse_args(argv)
    run = harness.begin("deepseek_v4", argv, args)
    shapes = {"side_by_side": SIDE, "cache_bytes": CACHE_MODEL, "decode_against_window": DECODE_MODEL}
    if args.smoke:
        shapes = {name: dict(shape, **SMOKE) for name, shape in shapes.items()}
        args.prompt, args.new_tokens, args.cache_contexts, args.decode_contexts = 64, 4, [256, 512], [256, 512]
    results = {
        "shapes": shapes,
        "side_by_side": side_by_side(shapes["side_by_side"], args.prompt, args.new_tokens, args.repeats),
        "cache_bytes": cache_bytes(shapes["cache_bytes"], args.cache_contexts, min(1024, args.cache_contexts[0])),
        "decode_against_window": decode_against_window(shapes["decode_against_window"], args.decode_contexts,
                                                       args.repeats),
    }
    print(report(results))
    harness.write_result(args.out, results, run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
