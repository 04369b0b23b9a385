"""One MLA decode step at long cached contexts: ours absorbed and expanded against transformers' DeepseekV3, and a
GQA model of the same width, side by side in one process (fp32, CPU).

    HF_HUB_OFFLINE=1 .venv/bin/python -m benchmarks mla_decode [--contexts 256 1024 4096 16384] [--repeats 3]
                                                                [--threads N] [--out FILE]

Shape: DeepSeek-V2-Lite's attention (hidden 2048, 16 heads, kv_lora_rank 512, qk_rope 64, qk_nope 128, v 128, no
q_lora_rank), 2 dense layers, a small FFN (1408) and vocabulary (1024) so that the step is mostly attention. The
pair is made by transformers' `DeepseekV3ForCausalLM` and converted (`families.save_pair`); ours is loaded twice,
with `decode_mode` forced absorbed and expanded. Caches are filled directly with random latents of the right shape
(a 16k-token prefill through the model would take far longer than the steps measured). Each row: the median time
of one decode step (`measure.alternating`: a warm-up round, then the order reversed every other repeat), the cache
bytes per token, their ratios against transformers, and how long reading the cache once takes at the machine's
measured read bandwidth. `--smoke`: a tiny MLA shape, contexts 16 and 64.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import DeepseekV3Config, DynamicCache

from modular_decoder import ModularDecoderConfig, ModularDecoderForCausalLM
from modular_decoder.cache import ModularDecoderCache
from modular_decoder.mla import set_decode_mode

from . import harness, measure
from .families import load_side, save_pair

# DeepSeek-V2-Lite's attention (deepseek-ai/DeepSeek-V2-Lite config.json), 2 dense layers, small FFN and vocabulary
SHAPE = dict(vocab_size=1024, hidden_size=2048, intermediate_size=1408, num_hidden_layers=2,
             num_attention_heads=16, max_position_embeddings=32768)
MLA = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, q_lora_rank=None)
SMOKE_SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   max_position_embeddings=1024)
SMOKE_MLA = dict(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, q_lora_rank=None)
GQA_KV_HEADS = 4  # 16 query heads over 4 K/V heads: a common GQA ratio at this width
REFERENCE = "transformers DeepseekV3"


def build_models(folder: Path, shape: dict, mla: dict) -> dict:
    # rope_interleave=False: both sides then store the rotary key in the same (halves) layout, so the same cache
    # contents mean the same thing to both and the logits are compared.
    save_pair(DeepseekV3Config(**shape, **mla, first_k_dense_replace=shape["num_hidden_layers"],
                               rope_interleave=False, n_group=1, topk_group=1), folder)
    absorbed, expanded = load_side(folder, "ours"), load_side(folder, "ours")
    set_decode_mode(absorbed, "absorbed")
    set_decode_mode(expanded, "expanded")
    torch.manual_seed(0)
    gqa = ModularDecoderForCausalLM(ModularDecoderConfig(**shape, num_key_value_heads=GQA_KV_HEADS)).eval()
    return {"ours absorbed": absorbed, "ours expanded": expanded, REFERENCE: load_side(folder, "transformers"),
            "GQA (ours)": gqa}


def filled_cache(name: str, model, context: int, latents: list, rope_keys: list):
    """A cache holding `context` tokens, filled directly (no prefill)."""
    config = model.config
    cache = DynamicCache(config=config) if name == REFERENCE else ModularDecoderCache(config)
    for layer_idx in range(config.num_hidden_layers):
        if name.startswith("GQA"):
            kv = torch.randn(1, GQA_KV_HEADS, context, config.hidden_size // config.num_attention_heads)
            cache.update(kv, torch.randn_like(kv), layer_idx)
        else:
            cache.update(latents[layer_idx][:, :, :context], rope_keys[layer_idx][:, :, :context], layer_idx)
    return cache


def cache_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def read_bandwidth(megabytes: int = 512) -> float:
    """Bytes per second of one streaming read (a sum over the buffer, best of 5)."""
    buffer = torch.randn(megabytes * 2**20 // 4)
    best = min(measure.wall(buffer.sum) for _ in range(5))
    return buffer.numel() * buffer.element_size() / best


@torch.inference_mode()
def measure_steps(models: dict, contexts: list[int], repeats: int, mla: dict) -> list[dict]:
    torch.manual_seed(1)
    longest, layers = max(contexts), next(iter(models.values())).config.num_hidden_layers
    latent, rope = mla["kv_lora_rank"], mla["qk_rope_head_dim"]
    latents = [torch.nn.functional.normalize(torch.randn(1, 1, longest, latent), dim=-1) * latent**0.5
               for _ in range(layers)]
    rope_keys = [torch.randn(1, 1, longest, rope) for _ in range(layers)]
    token = torch.tensor([[7]])
    rows = []
    for context in contexts:
        caches = {name: filled_cache(name, model, context, latents, rope_keys) for name, model in models.items()}
        position = torch.tensor([[context]])
        logits = {}

        def case(name: str):
            def step():
                logits[name] = models[name](token, cache=caches[name], position_ids=position, use_cache=True).logits
                caches[name].crop(-1)  # back to `context` tokens for the next repeat
            return measure.seconds(step)

        times = measure.alternating({name: case(name) for name in models}, repeats)
        mla_names = [n for n in models if not n.startswith("GQA")]
        rows.append({
            "context": context,
            "seconds": {name: statistics.median(t) for name, t in times.items()},
            "all_seconds": times,
            "bytes_per_token": {name: cache_bytes(c) // context for name, c in caches.items()},
            "cache_bytes": {name: cache_bytes(c) for name, c in caches.items()},
            "max_logit_diff_vs_transformers": max((logits[n] - logits[REFERENCE]).abs().max().item()
                                                  for n in mla_names),
        })
    return rows


def report(rows: list[dict], bytes_per_second: float, weight_bytes: int) -> str:
    lines = [f"torch threads: {torch.get_num_threads()}, measured read bandwidth: {bytes_per_second / 1e9:.1f} GB/s, "
             f"weights read per step: {weight_bytes / 1e6:.0f} MB ({weight_bytes / bytes_per_second * 1e3:.1f} ms)"]
    for row in rows:
        lines.append(f"\ncontext {row['context']} (max |logit diff| of ours vs transformers on the same cache: "
                     f"{row['max_logit_diff_vs_transformers']:.1e})")
        lines.append(f"  {'model':26s} {'ms/step':>10s} {'speed-up':>9s} {'cache B/token':>14s} {'x smaller':>10s} "
                     f"{'read cache once (ms)':>21s}")
        for name, seconds in row["seconds"].items():
            per_token = row["bytes_per_token"][name]
            read_ms = row["cache_bytes"][name] / bytes_per_second * 1e3
            lines.append(f"  {name:26s} {seconds * 1e3:10.1f} {row['seconds'][REFERENCE] / seconds:8.1f}x "
                         f"{per_token:14,d} {row['bytes_per_token'][REFERENCE] / per_token:9.2f}x {read_ms:21.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser("mla_decode", __doc__, smoke="a tiny MLA shape, contexts 16 and 64, one repeat")
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096, 16384])
    args = parser.parse_args(argv)
    shape, mla = (SMOKE_SHAPE, SMOKE_MLA) if args.smoke else (SHAPE, MLA)
    if args.smoke:
        args.contexts, args.repeats = [16, 64], 1
    run = harness.begin("mla_decode", argv, args)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        models = build_models(Path(tmp), shape, mla)
    print(f"built and converted in {time.perf_counter() - start:.0f} s", flush=True)
    weight_bytes = sum(p.numel() * p.element_size() for p in models["ours absorbed"].parameters())
    bytes_per_second = read_bandwidth(16 if args.smoke else 512)
    rows = measure_steps(models, args.contexts, args.repeats, mla)
    print(report(rows, bytes_per_second, weight_bytes))
    harness.write_result(args.out, {"shape": {**shape, **mla}, "read_bandwidth_gb_s": bytes_per_second / 1e9,
                                    "weight_bytes": weight_bytes, "rows": rows}, run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
