"""Serving throughput and KV-cache capacity through vLLM (never asserted; tests/test_vllm.py checks tokens).

    HF_HUB_OFFLINE=1 .venv/bin/python -m benchmarks serving [--prompts 64 --prompt-tokens 128 --new-tokens 128]
                                                            [--repeats 2] [--out FILE]

1. The converted SmolLM2-135M (fp32): 64 prompts of 128 tokens, 128 new tokens each, greedy, as one batch:
   our folder through vLLM's Transformers modeling backend, the same weights exported to transformers'
   `LlamaForCausalLM` through vLLM's native Llama, and our batched `generate()` (no vLLM). Output tokens/s.
2. A DeepSeek-V3 layout (MLA + sigmoid-routed experts; latent 512 + 64, 4 layers, random weights): the
   tokens vLLM's KV cache holds (`VLLM_CPU_KVCACHE_SPACE=1` GiB) for our folder vs the same weights exported
   to `DeepseekV3ForCausalLM` (vLLM's native class).

vLLM runs in its own environment (`.venv-vllm`, or `MODULAR_DECODER_VLLM_PYTHON`), eager (`enforce_eager`),
one engine at a time in one process (benchmarks/serving_worker.py). `--repeats N` serves both SmolLM2 engines N
times (rounds), the order alternating (ours first in odd rounds, native first in even ones), so neither side
always runs on the warmer or quieter machine; each round's ratio is printed, and their median. `--smoke`: 4
prompts of 16 tokens, 8 new, one round.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from . import harness

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("serving_worker.py")
MLA_576 = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32)
PARTS = ("vllm", "generate", "kv")
OURS, NATIVE = "ours_vllm_transformers_backend", "llama_vllm_native"


def our_generate(folder: Path, prompts: list[list[int]], new_tokens: int) -> dict:
    from modular_decoder import ModularDecoderForCausalLM

    model = ModularDecoderForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor(prompts)  # equal lengths: no padding
    with torch.no_grad():
        model.generate(ids[:1, :8], max_new_tokens=2, do_sample=False)  # warm-up
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        seconds = time.perf_counter() - start
    produced = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return {"seconds": round(seconds, 2), "output_tokens": produced, "tokens_per_s": round(produced / seconds, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser("serving", __doc__, repeats=2, smoke="4 prompts of 16 tokens, 8 new, one round")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                        help="vllm: SmolLM2 through vLLM (ours, native Llama); generate: our generate(); kv: DeepSeek-V3 capacity")
    args = parser.parse_args(argv)
    if args.smoke:
        args.prompts, args.prompt_tokens, args.new_tokens, args.repeats = 4, 16, 8, 1
    run = harness.begin("serving", argv, args)
    python = Path(os.environ.get("MODULAR_DECODER_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))

    from modular_decoder import ModularDecoderForCausalLM, preset_config
    from modular_decoder.commands.demo import GGUF_NAME, bundled_smollm2
    from modular_decoder.conversion import convert, export

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        smol, llama, ds, ds_native = root / "smollm2", root / "llama", root / "deepseek", root / "deepseek_v3"
        if {"vllm", "generate"} & set(args.parts):
            convert(bundled_smollm2(), smol, gguf_file=GGUF_NAME, progress=False)
            export(smol, llama, "llama", progress=False)
        torch.manual_seed(0)
        config = preset_config("deepseek_v3", tiny=True, hidden_size=128, num_hidden_layers=4, **MLA_576)
        ModularDecoderForCausalLM(config).save_pretrained(ds)
        export(ds, ds_native, "deepseek_v3", progress=False)

        generator = torch.Generator().manual_seed(0)
        prompts = torch.randint(100, 40000, (args.prompts, args.prompt_tokens), generator=generator).tolist()
        length = args.prompt_tokens + args.new_tokens + 16
        jobs = []
        if "vllm" in args.parts:
            pair = [dict(name=OURS, folder=str(smol), model_impl="transformers", prompts=prompts,
                         max_tokens=args.new_tokens, max_model_len=length),
                    dict(name=NATIVE, folder=str(llama), model_impl="auto", prompts=prompts,
                         max_tokens=args.new_tokens, max_model_len=length)]
            for round_ in range(1, args.repeats + 1):
                jobs += [dict(job, name=f"{job['name']}/{round_}") for job in (pair if round_ % 2 else pair[::-1])]
        if "kv" in args.parts:
            jobs += [dict(name="deepseek_ours_kv", folder=str(ds), model_impl="transformers", prompts=None,
                          max_tokens=2, max_model_len=128),
                     # vLLM's native DeepSeek-V3 reads the correction bias only with `topk_method="noaux_tc"`,
                     # which transformers' v5 config (and so the export) no longer writes
                     dict(name="deepseek_v3_native_kv", folder=str(ds_native), model_impl="auto", prompts=None,
                          max_tokens=2, max_model_len=128, hf_overrides={"topk_method": "noaux_tc"})]
        results = {}
        if jobs:
            spec, out = root / "spec.json", root / "out.json"
            spec.write_text(json.dumps({"jobs": jobs}))
            subprocess.run([str(python), str(WORKER), str(spec), str(out)], check=True, timeout=3600,
                           env=dict(os.environ, HF_HUB_OFFLINE="1"))
            results = json.loads(out.read_text())
        if "generate" in args.parts:
            results["ours_generate"] = our_generate(smol, prompts, args.new_tokens)

    vllm_version = next((r.pop("vllm") for r in list(results.values()) if "vllm" in r), None)
    for result in results.values():
        result.pop("vllm", None)
    report(results, args)
    harness.write_result(args.out, {
        "vllm": vllm_version,
        "shape": {"prompts": args.prompts, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens},
        "results": results}, run)
    return 0


def report(results: dict, args) -> None:
    for result in results.values():
        result.pop("tokens", None)
    print(f"SmolLM2-135M fp32, {args.prompts} prompts x {args.prompt_tokens} tokens, {args.new_tokens} new, greedy:")
    rounds = [r for r in range(1, args.repeats + 1) if f"{OURS}/{r}" in results]
    if rounds:
        print("| engine | " + " | ".join(f"round {r} ({'ours' if r % 2 else 'native'} first)" for r in rounds) + " |")
        print("|---|" + "---:|" * len(rounds))
        for name in (OURS, NATIVE):
            print(f"| {name} | " + " | ".join(str(results[f"{name}/{r}"]["tokens_per_s"]) for r in rounds) + " |")
        ratios = [results[f"{OURS}/{r}"]["tokens_per_s"] / results[f"{NATIVE}/{r}"]["tokens_per_s"] for r in rounds]
        print("| ratio | " + " | ".join(f"{ratio:.2f}" for ratio in ratios) + " |")
        print(f"\nmedian ratio, ours / native: {statistics.median(ratios):.2f}")
    if "ours_generate" in results:
        print(f"\nours_generate (no vLLM): {results['ours_generate']['tokens_per_s']} output tokens/s")
    if "deepseek_ours_kv" in results:
        a, b = results["deepseek_ours_kv"], results["deepseek_v3_native_kv"]
        print(f"\nDeepSeek-V3 layout, 1 GiB KV cache: ours {a['kv_capacity_tokens']:,} tokens ({a['architecture']}), "
              f"native {b['kv_capacity_tokens']:,} tokens ({b['architecture']})")


if __name__ == "__main__":
    raise SystemExit(main())
