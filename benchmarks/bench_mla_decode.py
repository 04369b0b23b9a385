"""One MLA decode step at long cached contexts: absorbed vs expanded vs transformers' DeepSeek-V3,
and a GQA model of the same width, side by side in one process (fp32, CPU).

    python benchmarks/bench_mla_decode.py [--contexts 256 1024 4096 16384] [--repeats 3] [--threads N] [--json out.json]
    python benchmarks/bench_mla_decode.py --crossover [--contexts 1024 8192] [--new-tokens 1 2 4 8 16 32 64]

`--crossover` times one step of T new tokens against a cache of S tokens, absorbed vs expanded (one
model, `decode_mode` forced), with DeepSeek-V3's attention (q_lora_rank 1536, no MoE, one layer): the
measurement behind `mla.ABSORBED_MAX_NEW_TOKENS`. `--fused-probe` times the absorbed scoring alone (16
heads, latent 512 + rotary 64) as `absorbed_attention` computes it against one fused SDPA call in
FlashMLA's MQA form (keys = values = the joint 576-wide [latent, rotary] tensor, output cropped to 512),
with the joint tensor stored and with it concatenated per step from the two cached tensors.

Shape: DeepSeek-V2-Lite's attention (hidden 2048, 16 heads, kv_lora_rank 512, qk_rope 64, qk_nope
128, v 128, no q_lora_rank), 2 dense layers, a small FFN (1408) and vocabulary (1024) so that the
step is mostly attention. Caches are filled directly with random latents of the right shape (a
16k-token prefill through the model would take far longer than the steps measured). Each row
prints the median time of one decode step, the cache bytes per token, their ratios against
transformers, and how long reading the cache once takes at the machine's measured bandwidth.
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
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, DynamicCache

from modular_decoder import ModularDecoderConfig, ModularDecoderForCausalLM
from modular_decoder.cache import ModularDecoderCache
from modular_decoder.conversion import convert
from modular_decoder.mla import set_decode_mode

SHAPE = dict(vocab_size=1024, hidden_size=2048, intermediate_size=1408, num_hidden_layers=2,
             num_attention_heads=16, max_position_embeddings=32768)
MLA = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, q_lora_rank=None)
GQA_KV_HEADS = 4  # 16 query heads of width 128 over 4 K/V heads: a common GQA ratio at this width


def build_models(folder: Path) -> dict:
    torch.manual_seed(0)
    # rope_interleave=False: both sides then store the rotary key in the same (halves) layout, so the
    # same cache contents mean the same thing to both and the first context is checked for parity.
    ref_config = DeepseekV3Config(**SHAPE, **MLA, first_k_dense_replace=SHAPE["num_hidden_layers"],
                                  rope_interleave=False, n_group=1, topk_group=1)
    reference = DeepseekV3ForCausalLM(ref_config).eval()
    reference.save_pretrained(folder / "hf")
    convert(folder / "hf", folder / "ours", progress=False)
    absorbed = ModularDecoderForCausalLM.from_pretrained(folder / "ours", dtype=torch.float32).eval()
    expanded = ModularDecoderForCausalLM.from_pretrained(folder / "ours", dtype=torch.float32).eval()
    set_decode_mode(absorbed, "absorbed")
    set_decode_mode(expanded, "expanded")
    gqa = ModularDecoderForCausalLM(ModularDecoderConfig(**SHAPE, num_key_value_heads=GQA_KV_HEADS)).eval()
    return {"ours absorbed": absorbed, "ours expanded": expanded, "transformers DeepseekV3": reference, "GQA (ours)": gqa}


def filled_cache(name: str, model, context: int, latents: list, rope_keys: list):
    """A cache holding `context` tokens, filled directly (no prefill)."""
    if name.startswith("transformers"):
        cache = DynamicCache(config=model.config)
    else:
        cache = ModularDecoderCache(model.config)
    for layer_idx in range(SHAPE["num_hidden_layers"]):
        if name.startswith("GQA"):
            kv = torch.randn(1, GQA_KV_HEADS, context, 128)
            cache.update(kv, torch.randn_like(kv), layer_idx)
        else:
            cache.update(latents[layer_idx][:, :, :context], rope_keys[layer_idx][:, :, :context], layer_idx)
    return cache


def cache_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def bandwidth() -> float:
    """Bytes per second for one streaming read (sum over a 512 MiB buffer, best of 5)."""
    buffer = torch.randn(128 * 1024 * 1024)
    best = min(_time(lambda: buffer.sum()) for _ in range(5))
    return buffer.numel() * buffer.element_size() / best


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@torch.inference_mode()
def measure(models: dict, contexts: list[int], repeats: int) -> list[dict]:
    torch.manual_seed(1)
    longest = max(contexts)
    latents = [torch.nn.functional.normalize(torch.randn(1, 1, longest, 512), dim=-1) * 512**0.5
               for _ in range(SHAPE["num_hidden_layers"])]
    rope_keys = [torch.randn(1, 1, longest, 64) for _ in range(SHAPE["num_hidden_layers"])]
    token = torch.tensor([[7]])
    rows = []
    for context in contexts:
        caches = {name: filled_cache(name, model, context, latents, rope_keys) for name, model in models.items()}
        position = torch.tensor([[context]])
        logits, times = {}, {name: [] for name in models}
        for repeat in range(repeats + 1):  # the first round is a warm-up
            for name, model in models.items():
                cache = caches[name]
                seconds = _time(lambda: logits.__setitem__(name, model(token, cache=cache, position_ids=position,
                                                                        use_cache=True).logits))
                cache.crop(-1)  # back to `context` tokens for the next repeat
                if repeat:
                    times[name].append(seconds)
        mla_names = [n for n in models if not n.startswith("GQA")]
        parity = max((logits[n] - logits["transformers DeepseekV3"]).abs().max().item() for n in mla_names)
        rows.append({
            "context": context,
            "seconds": {name: statistics.median(t) for name, t in times.items()},
            "bytes_per_token": {name: cache_bytes(c) // context for name, c in caches.items()},
            "cache_bytes": {name: cache_bytes(c) for name, c in caches.items()},
            "max_logit_diff_vs_transformers": parity,
        })
    return rows


@torch.inference_mode()
def crossover(contexts: list[int], new_tokens: list[int], repeats: int) -> list[dict]:
    """Median seconds of one T-token step against S cached tokens, absorbed and expanded."""
    torch.manual_seed(0)
    config = ModularDecoderConfig(**{**SHAPE, "num_hidden_layers": 1}, **{**MLA, "q_lora_rank": 1536}, attention_type="mla")
    model = ModularDecoderForCausalLM(config).eval()
    rows = []
    for context in contexts:
        cache = ModularDecoderCache(config)
        cache.update(torch.randn(1, 1, context, 512), torch.randn(1, 1, context, 64), 0)  # latent, rotary key
        for tokens in new_tokens:
            ids = torch.randint(0, config.vocab_size, (1, tokens))
            positions = torch.arange(context, context + tokens)[None]
            seconds = {}
            for repeat in range(repeats + 1):  # the first round is a warm-up
                for mode in ("absorbed", "expanded"):
                    set_decode_mode(model, mode)
                    took = _time(lambda: model(ids, cache=cache, position_ids=positions))
                    cache.crop(-tokens)  # back to `context` cached tokens
                    if repeat:
                        seconds.setdefault(mode, []).append(took)
            row = {"context": context, "new_tokens": tokens,
                   **{mode: statistics.median(times) for mode, times in seconds.items()}}
            rows.append(row)
            print(f"context {context:6d}  new tokens {tokens:3d}  absorbed {row['absorbed'] * 1e3:8.1f} ms  "
                  f"expanded {row['expanded'] * 1e3:8.1f} ms  expanded/absorbed {row['expanded'] / row['absorbed']:5.2f}",
                  flush=True)
    return rows


@torch.inference_mode()
def fused_probe(contexts: list[int], new_tokens: list[int], repeats: int) -> None:
    heads, latent, rotary, scale = 16, 512, 64, 0.07
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for context in contexts:
        for tokens in new_tokens:
            cached_latents, cached_rot = torch.randn(1, context, latent), torch.randn(1, context, rotary)
            q_latent, q_rot = torch.randn(1, heads * tokens, latent), torch.randn(1, heads * tokens, rotary)
            joint_query = torch.cat([q_latent, q_rot], -1)[:, None]  # (1, 1, H·T, 576): heads as query rows
            joint = torch.cat([cached_latents, cached_rot], -1)[:, None]  # (1, 1, S, 576)

            def matmuls():  # absorbed_attention's arithmetic (decode: no mask)
                scores = torch.baddbmm(q_rot @ cached_rot.transpose(1, 2), q_latent, cached_latents.transpose(1, 2))
                return torch.softmax(scores * scale, -1) @ cached_latents

            def fused_stored():
                return sdpa(joint_query, joint, joint, scale=scale)[..., :latent]

            def fused_concatenated():
                keys = torch.cat([cached_latents, cached_rot], -1)[:, None]  # a whole-cache copy per step
                return sdpa(joint_query, keys, keys, scale=scale)[..., :latent]

            difference = (matmuls() - fused_stored()[:, 0]).abs().max().item()
            best = {fn.__name__: min(_time(fn) for _ in range(repeats + 1)) * 1e3
                    for fn in (matmuls, fused_stored, fused_concatenated)}
            print(f"context {context:6d}  new tokens {tokens:3d}  " + "  ".join(f"{k} {v:7.2f} ms" for k, v in best.items())
                  + f"  max diff {difference:.1e}", flush=True)


def report(rows: list[dict], bytes_per_second: float, weight_bytes: int) -> str:
    ref = "transformers DeepseekV3"
    lines = [f"torch threads: {torch.get_num_threads()}, load average: {os.getloadavg()[0]:.1f}, "
             f"measured read bandwidth: {bytes_per_second / 1e9:.1f} GB/s, "
             f"weights read per step: {weight_bytes / 1e6:.0f} MB ({weight_bytes / bytes_per_second * 1e3:.1f} ms)"]
    for row in rows:
        lines.append(f"\ncontext {row['context']} (max |logit diff| of ours vs transformers on the same cache: "
                     f"{row['max_logit_diff_vs_transformers']:.1e})")
        lines.append(f"  {'model':26s} {'ms/step':>10s} {'speed-up':>9s} {'cache B/token':>14s} {'x smaller':>10s} "
                     f"{'read cache once (ms)':>21s}")
        for name, seconds in row["seconds"].items():
            per_token = row["bytes_per_token"][name]
            read_ms = row["cache_bytes"][name] / bytes_per_second * 1e3
            lines.append(f"  {name:26s} {seconds * 1e3:10.1f} {row['seconds'][ref] / seconds:8.1f}x {per_token:14,d} "
                         f"{row['bytes_per_token'][ref] / per_token:9.2f}x {read_ms:21.1f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096, 16384])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice); 1 is steadier on a busy machine")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--crossover", action="store_true", help="absorbed vs expanded over new tokens per step")
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--fused-probe", action="store_true", help="absorbed scoring: matmuls vs one fused SDPA call")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.fused_probe:
        fused_probe(args.contexts, args.new_tokens, args.repeats)
        return 0
    if args.crossover:
        print(f"torch threads: {torch.get_num_threads()}, load average: {os.getloadavg()[0]:.1f}")
        rows = crossover(args.contexts, args.new_tokens, args.repeats)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=2))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        models = build_models(Path(tmp))
    weight_bytes = sum(p.numel() * p.element_size() for p in models["ours absorbed"].parameters())
    bytes_per_second = bandwidth()
    rows = measure(models, args.contexts, args.repeats)
    print(report(rows, bytes_per_second, weight_bytes))
    if args.json:
        args.json.write_text(json.dumps({"bandwidth": bytes_per_second, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
