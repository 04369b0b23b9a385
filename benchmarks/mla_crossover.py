"""Where MLA's absorbed step stops paying: one step of T new tokens against S cached tokens, ours forced absorbed
against forced expanded, and the absorbed step's query block (fp32, CPU). The measurement behind
`tuning.Tuning.absorbed_max_new_tokens` and `.absorbed_query_block`.

    HF_HUB_OFFLINE=1 .venv/bin/python -m benchmarks mla_crossover [--contexts 1024 8192]
        [--new-tokens 1 8 16 32 64 128 256] [--query-blocks 1 4 8 16 64] [--repeats 3] [--fused-probe]
        [--out benchmarks/results_mla_crossover.json]

One MLA layer of DeepSeek-V2-Lite's attention widths with a low-rank query as DeepSeek-V2/V3 have (hidden 2048,
16 heads, q_lora_rank 1536, kv_lora_rank 512, rope 64, nope 128, v 128), random weights, its latent cache filled
directly with S random tokens. For each (S, T): the median time of absorbed and of expanded (`measure.alternating`,
the modes alternating, a warm-up round first) and, in a separate untimed run of each, the peak memory above the
start (`measure.PeakMemory`; the process runs with glibc's mmap threshold fixed, `memory.MALLOC_ENV`, so a freed
block goes back to the kernel and the next step's peak is its own). Then, at the largest T not above
`absorbed_max_new_tokens`, the absorbed step with each `--query-blocks` value as its query block (time and peak;
and the peak of the absorbed scoring alone, `measure.TensorBytes`, in bytes per cached token and in score blocks).
Then a prefill of T tokens into an empty static cache of each capacity S, absorbed against expanded (both compute
over every slot). The settings are `modular_decoder.tuning`'s.
`--fused-probe` also times the absorbed scoring alone as the explicit matmuls against one fused SDPA call in
FlashMLA's MQA form (keys = values = the joint 576-wide [latent, rotary] tensor, output cropped to 512).
`--smoke`: a tiny shape.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys

import torch

from modular_decoder import ModularDecoderConfig, ModularDecoderForCausalLM
from modular_decoder.cache import ModularDecoderCache
from modular_decoder.mla import set_decode_mode
from modular_decoder.tuning import tuned, tuning

from . import harness, measure
from .memory import MALLOC_ENV

# DeepSeek-V2-Lite's attention widths (16 heads at hidden 2048) with DeepSeek-V2/V3's low-rank query, one layer
SHAPE = dict(vocab_size=1024, hidden_size=2048, intermediate_size=1408, num_hidden_layers=1, num_attention_heads=16,
             max_position_embeddings=65536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
             v_head_dim=128, q_lora_rank=1536)
SMOKE_SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                   max_position_embeddings=1024, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
                   v_head_dim=16, q_lora_rank=32)
MODES = ("absorbed", "expanded")


def query_block(block: int):
    """The absorbed step's query block set to `block` for the duration (the `tuning` setting, restored after)."""
    return tuned(absorbed_query_block=block)


class Step:
    """One T-token step of `model` against its cache of `context` tokens, cropped back after every call."""

    def __init__(self, model, context: int, tokens: int):
        config = model.config
        self.model, self.context, self.tokens = model, context, tokens
        self.cache = ModularDecoderCache(config)
        self.cache.update(torch.randn(1, 1, context, config.kv_lora_rank),
                          torch.randn(1, 1, context, config.qk_rope_head_dim), 0)  # latent, rotary key
        self.ids = torch.randint(0, config.vocab_size, (1, tokens))
        self.positions = torch.arange(context, context + tokens)[None]

    def __call__(self, mode: str):
        set_decode_mode(self.model, mode)
        try:
            self.model(self.ids, cache=self.cache, position_ids=self.positions)
        finally:
            self.cache.crop(-self.tokens)  # back to `context` cached tokens

    def peak_mb(self, mode: str) -> float:
        with measure.PeakMemory("cpu") as peak:
            self(mode)
        return peak.above_mb

    def scoring_peak(self) -> dict:
        """The absorbed scoring alone (`absorbed_attention` on this step's queries and the cache), measured by
        `measure.TensorBytes`: its peak in bytes, per cached token, and in score blocks, a block being the
        (1, H, query block, S) fp32 scores of one pass."""
        attention = self.model.model.layers[0].self_attn
        config = self.model.config
        heads, context = config.num_attention_heads, self.context
        q_nope = torch.randn(1, heads, self.tokens, config.qk_nope_head_dim)
        q_rot = torch.randn(1, heads, self.tokens, config.qk_rope_head_dim)
        layer = self.cache.layers[0]
        with measure.TensorBytes() as probe:
            attention.absorbed_attention(q_nope, q_rot, layer.keys, layer.values, None)
        block = min(tuning().absorbed_query_block, self.tokens)
        return {"bytes": probe.peak_bytes, "bytes_per_cached_token": probe.peak_bytes / context,
                "score_blocks": probe.peak_bytes / (heads * block * context * 4)}


@torch.inference_mode()
def crossover(model, contexts: list[int], new_tokens: list[int], repeats: int) -> list[dict]:
    rows = []
    for context in contexts:
        for tokens in new_tokens:
            step = Step(model, context, tokens)
            times = measure.alternating({mode: measure.seconds(lambda mode=mode: step(mode)) for mode in MODES},
                                        repeats)
            row = {"context": context, "new_tokens": tokens,
                   **{mode: statistics.median(times[mode]) for mode in MODES}, "all_seconds": times,
                   "peak_mb": {mode: step.peak_mb(mode) for mode in MODES}}
            rows.append(row)
            print(f"context {context:6d}  new tokens {tokens:3d}  absorbed {row['absorbed'] * 1e3:8.1f} ms "
                  f"[{row['peak_mb']['absorbed']:6.1f} MB]  expanded {row['expanded'] * 1e3:8.1f} ms "
                  f"[{row['peak_mb']['expanded']:6.1f} MB]  expanded/absorbed {row['expanded'] / row['absorbed']:5.2f}",
                  flush=True)
    return rows


@torch.inference_mode()
def query_blocks(model, contexts: list[int], tokens: int, blocks: list[int], repeats: int) -> list[dict]:
    """The absorbed T-token step with each query block: median time and peak memory above the start."""
    rows = []
    for context in contexts:
        step = Step(model, context, tokens)

        def case(block: int):
            def run():
                with query_block(block):
                    step("absorbed")
            return measure.seconds(run)

        times = measure.alternating({block: case(block) for block in blocks}, repeats)
        for block in blocks:
            with query_block(block):
                peak, scoring = step.peak_mb("absorbed"), step.scoring_peak()
            rows.append({"context": context, "new_tokens": tokens, "query_block": block,
                         "seconds": statistics.median(times[block]), "all_seconds": times[block], "peak_mb": peak,
                         "scoring_peak": scoring})
            print(f"context {context:6d}  new tokens {tokens:3d}  query block {block:3d}  "
                  f"{rows[-1]['seconds'] * 1e3:8.1f} ms  peak {peak:7.1f} MB  scoring alone "
                  f"{scoring['bytes_per_cached_token']:7.0f} B per cached token ({scoring['score_blocks']:.2f} score "
                  "blocks)", flush=True)
    return rows


@torch.inference_mode()
def static_prefill(model, capacities: list[int], new_tokens: list[int], repeats: int) -> list[dict]:
    """A prefill of T tokens into an empty static cache of each capacity, absorbed against expanded: both forms
    compute over the cache's every slot, so this is the crossover of a short first step (`scoring_path`)."""
    ids = {tokens: torch.randint(0, model.config.vocab_size, (1, tokens)) for tokens in new_tokens}
    rows = []
    for capacity in capacities:
        for tokens in new_tokens:
            def case(mode: str, tokens=tokens, capacity=capacity):
                def run():
                    set_decode_mode(model, mode)
                    model(ids[tokens], cache=ModularDecoderCache(model.config, "static", max_cache_len=capacity))
                return measure.seconds(run)

            times = measure.alternating({mode: case(mode) for mode in MODES}, repeats)
            row = {"capacity": capacity, "new_tokens": tokens, **{m: statistics.median(times[m]) for m in MODES},
                   "all_seconds": times}
            rows.append(row)
            print(f"static cache {capacity:6d}  prefill {tokens:3d}  absorbed {row['absorbed'] * 1e3:8.1f} ms  "
                  f"expanded {row['expanded'] * 1e3:8.1f} ms  expanded/absorbed {row['expanded'] / row['absorbed']:5.2f}",
                  flush=True)
    set_decode_mode(model, "auto")
    return rows


@torch.inference_mode()
def fused_probe(shape: dict, contexts: list[int], new_tokens: list[int], repeats: int) -> list[dict]:
    heads, latent, rotary = shape["num_attention_heads"], shape["kv_lora_rank"], shape["qk_rope_head_dim"]
    scale = (shape["qk_nope_head_dim"] + rotary) ** -0.5
    sdpa = torch.nn.functional.scaled_dot_product_attention
    rows = []
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
            ms = {name: 1e3 * seconds for name, seconds in measure.median_seconds(
                {fn.__name__: fn for fn in (matmuls, fused_stored, fused_concatenated)}, repeats).items()}
            rows.append({"context": context, "new_tokens": tokens, "ms": ms, "max_abs_diff": difference})
            print(f"context {context:6d}  new tokens {tokens:3d}  " + "  ".join(f"{k} {v:7.2f} ms" for k, v in ms.items())
                  + f"  max diff {difference:.1e}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser("mla_crossover", __doc__, smoke="a tiny MLA shape, two short contexts, one repeat")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[1, 8, 16, 32, 64, 128, 256])
    parser.add_argument("--query-blocks", type=int, nargs="+", default=[1, 4, 8, 16, 64])
    parser.add_argument("--fused-probe", action="store_true", help="also: absorbed scoring as matmuls vs one fused "
                                                                   "SDPA call")
    args = parser.parse_args(argv)
    if not all(os.environ.get(k) == v for k, v in MALLOC_ENV.items()):  # peaks need glibc's fixed mmap threshold
        argv = list(sys.argv[1:] if argv is None else argv)
        return subprocess.call([sys.executable, "-m", "benchmarks", "mla_crossover", *argv], cwd=harness.ROOT,
                               env={**os.environ, **MALLOC_ENV})
    shape = SMOKE_SHAPE if args.smoke else SHAPE
    if args.smoke:
        args.contexts, args.new_tokens, args.query_blocks, args.repeats = [16, 64], [1, 4, 16], [1, 8], 1
    run = harness.begin("mla_crossover", argv, args)
    torch.manual_seed(0)
    model = ModularDecoderForCausalLM(ModularDecoderConfig(**shape, attention_type="mla")).eval()
    rows = crossover(model, args.contexts, args.new_tokens, args.repeats)
    at = max([t for t in args.new_tokens if t <= tuning().absorbed_max_new_tokens], default=args.new_tokens[0])
    blocks = query_blocks(model, args.contexts, at, args.query_blocks, args.repeats)
    short = [t for t in args.new_tokens if t > 1]  # a prefill of one token is a decode step's shape
    results = {"shape": shape, "absorbed_max_new_tokens": tuning().absorbed_max_new_tokens,
               "absorbed_query_block": tuning().absorbed_query_block, "crossover": rows, "query_blocks": blocks,
               "static_prefill": static_prefill(model, args.contexts, short, args.repeats)}
    if args.fused_probe:
        results["fused_probe"] = fused_probe(shape, args.contexts, [1, 8], args.repeats)
    harness.write_result(args.out, results, run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
