"""One DeepSeek Sparse Attention decode step at long cached contexts: ours (`attention_type="dsa"`, each query's
`index_topk` chosen keys gathered and scored) against dense MLA (ours, the same weights without the indexer: every
cached key scored) and transformers' `DeepseekV32ForCausalLM`, side by side in one process (fp32, CPU).

    HF_HUB_OFFLINE=1 .venv/bin/python -m benchmarks dsa_decode [--contexts 8192 32768] [--repeats 3] [--out FILE]

Shape: one layer of DeepSeek-V3.2's attention at full width (deepseek-ai/DeepSeek-V3.2-Exp config.json: hidden
7168, 128 heads, q_lora_rank 1536, kv_lora_rank 512, qk_nope 128, qk_rope 64, v 128; indexer 64 heads of 128,
top-k 2,048; its YaRN), a dense MLP of width 256 and a vocabulary of 1,024 so that the step is mostly attention.
The pair is made by transformers' `DeepseekV32ForCausalLM` and converted (`families.save_pair`); dense MLA is ours
with `attention_type="mla"` loaded with the same weights less the indexer's; every side's weights are copied into
the process's memory (`resident`). Caches are filled directly with random
latents, rotary keys and indexer keys of the right shape (a 32k-token prefill through the indexer, which scores
every pair of tokens, would take far longer than the steps measured); transformers' cache gets the same rotary keys
in its own (halves) layout, so the same contents mean the same thing to both sides and the logits are compared.

Each row: the median time of one decode step at batch 1 (`measure.alternating`: a warm-up round, then the order
reversed every other repeat), the part of ours spent in the lightning indexer's scoring and top-k, the peak memory
of one step in two separate untimed steps (the bytes of the tensors the step allocates, alive at once:
`measure.TensorBytes`, exact; and the process's resident high-water mark above the level before it:
`measure.PeakMemory`, which also sees the allocator), each cache's bytes per token, and the largest logit difference
of ours against transformers on the same cache. transformers' step up-projects the whole cache to per-head keys
and values (`EXPANDED_BYTES` per cached token, about 0.35 GB per 1k tokens at this width): where the machine's
available memory cannot hold that, its row says so and it is not run.
`--smoke`: a tiny shape, contexts 16 and 64, top-k 8.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import DeepseekV32Config, DynamicCache

from modular_decoder import ModularDecoderConfig, ModularDecoderForCausalLM
from modular_decoder.cache import ModularDecoderCache
from modular_decoder.lightning_indexer import LightningIndexer

from . import harness, measure
from .families import load_side, save_pair

# deepseek-ai/DeepSeek-V3.2-Exp config.json's attention, one layer, a small MLP and vocabulary
SHAPE = dict(vocab_size=1024, hidden_size=7168, intermediate_size=256, num_hidden_layers=1, num_attention_heads=128,
             num_key_value_heads=128, max_position_embeddings=163840, q_lora_rank=1536, kv_lora_rank=512,
             qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, index_n_heads=64, index_head_dim=128,
             index_topk=2048, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                               "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                                               "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})
SMOKE_SHAPE = dict(SHAPE, hidden_size=64, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
                   q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                   index_n_heads=4, index_head_dim=16, index_topk=8)
OURS, DENSE, REFERENCE = "ours DSA (gathered top-k)", "ours dense MLA (absorbed)", "transformers DeepseekV32"
# transformers' step holds the up-projected cache and its per-head keys at once (fp32): bytes per cached token
EXPANDED_BYTES = lambda shape: 4 * shape["num_attention_heads"] * (  # noqa: E731
    2 * (shape["qk_nope_head_dim"] + shape["v_head_dim"]) + shape["qk_nope_head_dim"] + shape["qk_rope_head_dim"])


@torch.no_grad()
def resident(model):
    """`model` with every parameter and buffer copied into the process's own memory: loaded weights may be pages
    of the saved file, which the kernel drops under memory pressure (transformers' step at 32k takes ~10 GB) and
    reads back from disk in the next step, a second or more (the file is deleted after the build; the pages stay
    mapped)."""
    for tensor in [*model.parameters(), *model.buffers()]:
        tensor.data = tensor.data.clone()
    return model


def build_models(folder: Path, shape: dict) -> dict:
    save_pair(DeepseekV32Config(**shape, first_k_dense_replace=shape["num_hidden_layers"], n_group=1, topk_group=1),
              folder)
    ours = resident(load_side(folder, "ours"))
    mla_fields = {k: v for k, v in ours.config.to_dict().items() if not k.startswith("index_")}
    dense = ModularDecoderForCausalLM(ModularDecoderConfig.from_dict(dict(mla_fields, attention_type="mla"))).eval()
    dense.load_state_dict({k: v for k, v in ours.state_dict().items() if ".indexer." not in k})
    return {OURS: ours, DENSE: dense, REFERENCE: resident(load_side(folder, "transformers"))}


def filled_cache(name: str, model, context: int, contents: list[dict]):
    """A cache holding `context` tokens (`contents` per layer), filled directly (no prefill)."""
    cache = DynamicCache(config=model.config) if name == REFERENCE else ModularDecoderCache(model.config)
    for layer_idx, layer in enumerate(contents):
        rope = layer["rope_keys"][:, :, :context]
        if name == REFERENCE:  # transformers' MLA rotary key in its halves layout: evens, then odds
            rope = torch.cat((rope[..., 0::2], rope[..., 1::2]), dim=-1)
        cache.update(layer["latents"][:, :, :context], rope, layer_idx)
        if name != DENSE:
            cache.update_indexer(layer["indexer_keys"][:, :context], layer_idx)
    return cache


def cache_bytes(cache) -> int:
    tensors = [getattr(layer, name, None) for layer in cache.layers for name in ("keys", "values", "indexer_keys")]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def available_bytes() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))


class IndexerClock:
    """Seconds spent in `LightningIndexer.select` (scores and top-k) while installed: `seconds` in all, `calls`
    the per-call times."""

    def __init__(self):
        self.calls, self._select = [], LightningIndexer.select

    def __enter__(self):
        def timed(indexer, *args, **kwargs):
            start = time.perf_counter()
            try:
                return self._select(indexer, *args, **kwargs)
            finally:
                self.calls.append(time.perf_counter() - start)

        LightningIndexer.select = timed
        return self

    def __exit__(self, *exc):
        LightningIndexer.select = self._select


@torch.inference_mode()
def measure_row(models: dict, context: int, contents: list[dict], repeats: int, shape: dict) -> dict:
    caches = {name: filled_cache(name, model, context, contents) for name, model in models.items()}
    room = available_bytes() - 2 * 2**30
    skipped = {REFERENCE: f"not run: its step needs about {EXPANDED_BYTES(shape) * context / 2**30:.1f} GiB, "
                          f"{room / 2**30:.1f} GiB available"} if EXPANDED_BYTES(shape) * context > room else {}
    runnable = {name: model for name, model in models.items() if name not in skipped}
    token, position, logits = torch.tensor([[7]]), torch.tensor([[context]]), {}

    def step(name: str):
        logits[name] = runnable[name](token, cache=caches[name], position_ids=position, use_cache=True).logits
        caches[name].crop(-1)  # back to `context` tokens for the next call

    peaks, tensor_peaks = {}, {}
    for name in runnable:
        with measure.PeakMemory() as peak:
            step(name)
        peaks[name] = peak.above_mb
        with measure.TensorBytes() as probe:
            step(name)
        tensor_peaks[name] = probe.peak_bytes / measure.MB
    with IndexerClock() as clock:
        times = measure.alternating({name: measure.seconds(lambda n=name: step(n)) for name in runnable}, repeats)
    layers = shape["num_hidden_layers"]
    per_step = [sum(clock.calls[i : i + layers]) for i in range(0, len(clock.calls), layers)][1:]  # after warm-up
    return {
        "context": context,
        "seconds": {name: statistics.median(values) for name, values in times.items()},
        "all_seconds": times,
        "indexer_seconds": statistics.median(per_step),
        "peak_mb": peaks,
        "tensor_peak_mb": tensor_peaks,
        "bytes_per_token": {name: cache_bytes(cache) // context for name, cache in caches.items()},
        "skipped": skipped,
        "max_logit_diff_vs_transformers": (logits[OURS] - logits[REFERENCE]).abs().max().item()
        if REFERENCE in logits else None,
        "max_logit_diff_dense_vs_dsa": (logits[OURS] - logits[DENSE]).abs().max().item(),
    }


def contents_of(shape: dict, longest: int) -> list[dict]:
    """Random cache contents of the right shape and scale: normed latents and indexer keys, rotary keys."""
    torch.manual_seed(1)
    latent, rope, index = shape["kv_lora_rank"], shape["qk_rope_head_dim"], shape["index_head_dim"]
    return [{"latents": torch.nn.functional.normalize(torch.randn(1, 1, longest, latent), dim=-1) * latent**0.5,
             "rope_keys": torch.randn(1, 1, longest, rope),
             "indexer_keys": torch.nn.functional.layer_norm(torch.randn(1, longest, index), (index,))}
            for _ in range(shape["num_hidden_layers"])]


def side_cells(row: dict) -> list[tuple[str, list[str]]]:
    """Each side's measured cells for one context (ms/step, dense/it, tensors MB, RSS MB, cache B/token), or the
    one reason it was skipped: the text report and docs/benchmarks.md print the same figures."""
    sides = []
    for name in (OURS, DENSE, REFERENCE):
        if name in row["skipped"]:
            sides.append((name, [row["skipped"][name]]))
            continue
        seconds = row["seconds"][name]
        sides.append((name, [f"{seconds * 1e3:,.1f}", f"{row['seconds'][DENSE] / seconds:.2f}x",
                             f"{row['tensor_peak_mb'][name]:,.1f}", f"{row['peak_mb'][name]:,.0f}",
                             f"{row['bytes_per_token'][name]:,}"]))
    return sides


def report(rows: list[dict]) -> str:
    lines = [f"torch threads: {torch.get_num_threads()}"]
    for row in rows:
        diff = row["max_logit_diff_vs_transformers"]
        against = "-" if diff is None else f"{diff:.1e}"
        lines.append(f"\ncontext {row['context']} (max |logit diff| ours vs transformers on the same cache: {against}; "
                     f"DSA vs dense: {row['max_logit_diff_dense_vs_dsa']:.1e})")
        lines.append(f"  {'model':28s} {'ms/step':>9s} {'vs dense':>9s} {'tensors MB':>11s} {'RSS MB':>8s} "
                     f"{'cache B/token':>14s}")
        for name, cells in side_cells(row):
            widths = (9, 9, 11, 8, 14)
            lines.append(f"  {name:28s} " + (" ".join(f"{cell:>{width}s}" for cell, width in zip(cells, widths))
                                              if len(cells) > 1 else cells[0]))
        lines.append(f"  of ours' step, the indexer (scores + top-k): {row['indexer_seconds'] * 1e3:.1f} ms")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser("dsa_decode", __doc__, smoke="a tiny shape, contexts 16 and 64, top-k 8, one repeat")
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    args = parser.parse_args(argv)
    shape = SMOKE_SHAPE if args.smoke else SHAPE
    if args.smoke:
        args.contexts, args.repeats = [16, 64], 1
    run = harness.begin("dsa_decode", argv, args)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        models = build_models(Path(tmp), shape)
    print(f"built and converted in {time.perf_counter() - start:.0f} s", flush=True)
    contents = contents_of(shape, max(args.contexts))
    rows = []
    for context in args.contexts:
        rows.append(measure_row(models, context, contents, args.repeats, shape))
        print(report(rows[-1:]), flush=True)
    harness.write_result(args.out, {"shape": shape, "layers": shape["num_hidden_layers"], "batch": 1,
                                    "dtype": "float32", "rows": rows}, run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
