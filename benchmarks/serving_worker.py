"""Runs in vLLM's environment (`.venv-vllm`), started by benchmarks/serving.py: one engine per job, in this
process, timed. Prints nothing the caller parses; writes OUT.json.

    python benchmarks/serving_worker.py SPEC.json OUT.json

SPEC: {"jobs": [{"name", "folder", "model_impl", "prompts" (token ids) or null, "max_tokens", "max_model_len"}]}.
OUT per job: output tokens, generate seconds, output tokens/s, the KV-cache capacity in tokens, the architecture.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def run(job: dict) -> dict:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = job.get("prompts") or [[1, 2, 3]]
    llm = LLM(job["folder"], model_impl=job["model_impl"], trust_remote_code=True, dtype="float32",
              enforce_eager=True, max_model_len=job["max_model_len"], max_num_seqs=len(prompts),
              skip_tokenizer_init=True, distributed_executor_backend="uni", seed=0,
              hf_overrides=job.get("hf_overrides"))
    config = llm.llm_engine.vllm_config.cache_config
    result = {"vllm": vllm.__version__, "architecture": llm.llm_engine.model_config.architecture,
              "kv_capacity_tokens": config.num_gpu_blocks * config.block_size}
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True, detokenize=False)
    inputs = [TokensPrompt(prompt_token_ids=ids) for ids in prompts]
    llm.generate(inputs[:1], SamplingParams(temperature=0.0, max_tokens=2, detokenize=False), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(inputs, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    produced = sum(len(out.outputs[0].token_ids) for out in outputs)
    result.update(seconds=round(seconds, 2), output_tokens=produced, tokens_per_s=round(produced / seconds, 1),
                  tokens=[list(out.outputs[0].token_ids) for out in outputs])
    del llm
    gc.collect()
    return result


def main(spec_path: str, out_path: str) -> int:
    with open(spec_path) as f:
        jobs = json.load(f)["jobs"]
    results = {}
    for job in jobs:
        results[job["name"]] = run(job)
        print(f"[serving_worker] {job['name']}: {results[job['name']].get('tokens_per_s')} tok/s", flush=True)
        with open(out_path, "w") as f:
            json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
