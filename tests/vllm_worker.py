"""Runs in vLLM's own environment (`.venv-vllm`, see scripts/setup.sh), started once by tests/test_vllm.py:
serves saved folders with vLLM and writes what it saw as JSON. It imports vLLM and the `openai` client only;
our model code reaches vLLM as the folders' remote code.

    python tests/vllm_worker.py SPEC.json OUT.json

SPEC: {"engines": [{"name", "folder", "prompts" (token ids), "max_tokens", optional "model_impl", "dtype",
"tensor_parallel_size", "pipeline_parallel_size", "tokenizer" (bool), "env" (variables set for this engine only),
"compilation_config" (vLLM's, e.g. custom ops turned off)}], "server": {"folder", "messages",
"max_tokens", "port"} or null}. Per engine OUT holds the greedy tokens, the architecture vLLM resolved, the
class of the model it built and the class inside it, the KV-cache bytes per token its layers declare and
the linear modules it built in one decoder layer;
or the error that stopped it. One-process engines run in this process (each start costs seconds, not a
minute); tensor / pipeline parallel ones start their workers.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
import time
import traceback
import urllib.request

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process


def describe(worker) -> dict:
    """The model vLLM built on this worker and the KV-cache bytes per token its attention layers declare."""
    runner = worker.model_runner
    model = runner.model
    inner = getattr(model, "model", None)
    specs = runner.get_kv_cache_spec()
    layers = getattr(inner, "layers", None)
    first = next((layer for layer in layers if not type(layer).__name__.startswith("PPMissing")), None) if layers else None
    return {
        "model_class": type(model).__name__,
        "inner_class": type(inner).__name__ if inner is not None else None,
        "inner_module": type(inner).__module__ if inner is not None else None,
        "kv_bytes_per_token": sum(spec.page_size_bytes // spec.block_size for spec in specs.values()),
        "kv_layers": len(specs),
        # vLLM's attention layers that fold a sink into their softmax (`has_sink`: the sinks reached them)
        "attention_with_sinks": sum(1 for module in model.modules() if getattr(module, "has_sink", False)),
        # what vLLM made of one decoder layer's linears (fused q/k/v and gate/up show up as one module each)
        "layer_linears": {name: type(module).__name__ for name, module in first.named_modules()
                          if type(module).__name__.endswith("Linear")} if first is not None else None,
    }


@contextlib.contextmanager
def environment(variables: dict):
    """`variables` set for one engine, then the environment as it was. vLLM caches its variables once an
    engine has started (`vllm.envs.enable_envs_cache`), so the cache is dropped on both sides."""
    import vllm.envs

    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    vllm.envs.disable_envs_cache()
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        vllm.envs.disable_envs_cache()


def run_engine(job: dict) -> dict:
    with environment(job.get("env", {})):
        return _run_engine(job)


def _run_engine(job: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    tp, pp = job.get("tensor_parallel_size", 1), job.get("pipeline_parallel_size", 1)
    if tp * pp > 1:
        # vLLM's CPU workers bind one NUMA node each by default; on a one-node machine, give each its cores
        cpus = sorted(os.sched_getaffinity(0))
        share = max(len(cpus) // (tp * pp), 1)
        groups = [cpus[i * share:(i + 1) * share] or cpus[-1:] for i in range(tp * pp)]
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, group)) for group in groups)
    start = time.perf_counter()
    llm = LLM(
        job["folder"],
        model_impl=job.get("model_impl", "transformers"),
        trust_remote_code=True,
        dtype=job.get("dtype", "float32"),
        enforce_eager=True,
        max_model_len=job.get("max_model_len", 256),
        max_num_seqs=len(job["prompts"]),
        skip_tokenizer_init=not job.get("tokenizer", False),
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        distributed_executor_backend="uni" if tp * pp == 1 else "mp",
        seed=0,
        **({"compilation_config": job["compilation_config"]} if "compilation_config" in job else {}),
    )
    started = time.perf_counter() - start
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True, detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]], params, use_tqdm=False)
    result = {
        "tokens": [list(out.outputs[0].token_ids) for out in outputs],
        "architecture": llm.llm_engine.model_config.architecture,
        "workers": llm.collective_rpc(describe),
        "start_seconds": round(started, 1),
    }
    del llm
    gc.collect()
    return result


def run_server(job: dict) -> dict:
    """vLLM's OpenAI-compatible server on FOLDER with `--model-impl transformers --trust-remote-code` on
    127.0.0.1, asked through the `openai` client for one chat completion, plain and streamed; the server is
    killed afterwards. Started as `python -m vllm.entrypoints.openai.api_server`, the server `vllm serve`
    runs: vllm-cpu 0.32.0's `vllm` command looks up the distribution "vllm" (its own is "vllm-cpu") and exits."""
    from openai import OpenAI

    port = job["port"]
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", job["folder"],
        "--model-impl", "transformers", "--trust-remote-code", "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--max-model-len", "512", "--enforce-eager", "--max-num-seqs", "2",
    ]
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1")
    log_path = job["log"]
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + job.get("start_timeout", 300)
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {server.returncode}; see {log_path}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"vllm serve not healthy after {job.get('start_timeout', 300)} s; see {log_path}")
            time.sleep(1)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120)
        request = dict(model=job["folder"], messages=job["messages"], max_tokens=job["max_tokens"], temperature=0.0)
        reply = client.chat.completions.create(**request)
        chunks = [chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(**request, stream=True)
                  if chunk.choices]
        models = [model.id for model in client.models.list().data]
        return {"text": reply.choices[0].message.content, "stream": chunks, "models": models,
                "finish_reason": reply.choices[0].finish_reason}
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=30)


def main(spec_path: str, out_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    results: dict = {"engines": {}, "server": None}
    for job in spec["engines"]:
        began = time.perf_counter()
        try:
            result = run_engine(job)
        except Exception as error:  # recorded: a refusal is an expected outcome for some folders
            result = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-4000:]}
            gc.collect()
        result["seconds"] = round(time.perf_counter() - began, 1)
        results["engines"][job["name"]] = result
        print(f"[vllm_worker] {job['name']}: {result['seconds']} s {'error' if 'error' in result else 'ok'}",
              flush=True)
        with open(out_path, "w") as f:  # written after every engine, so a timeout keeps what was done
            json.dump(results, f)
    if spec.get("server"):
        began = time.perf_counter()
        try:
            results["server"] = run_server(spec["server"])
        except Exception as error:
            results["server"] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-4000:]}
        results["server"]["seconds"] = round(time.perf_counter() - began, 1)
        print(f"[vllm_worker] server: {results['server']['seconds']} s", flush=True)
    with open(out_path, "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
