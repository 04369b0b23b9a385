"""Every benchmark `python -m benchmarks NAME` runs: its module, what it measures, and the JSON it commits.

A new benchmark is one module under `benchmarks/` with a `main(argv) -> int` built on `benchmarks.harness`, and one
`Benchmark(...)` line below (benchmarks/README.md says how). `python -m benchmarks --help` lists this table, and
`python -m benchmarks.pages` renders it into benchmarks/README.md.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Benchmark:
    name: str  # python -m benchmarks NAME
    module: str  # benchmarks.MODULE, whose main(argv) runs it
    measures: str  # one sentence: what it measures against what
    writes: str | None = None  # the committed result JSON under benchmarks/ (None: nothing committed)


BENCHMARKS = (
    Benchmark("run", "run", "seven families against transformers' own class (CPU, fp32): prefill, decode, "
              "training throughput, memory in fresh processes, the largest decode batch in a budget", "results.json"),
    Benchmark("compiled_decode", "compiled_decode", "batch-1 decode of SmolLM2-135M, eager and compiled (static "
              "cache), ours against transformers' Llama", "results_compiled_decode.json"),
    Benchmark("serving", "serving", "SmolLM2-135M served by vLLM through its Transformers backend against vLLM's "
              "native Llama; the MLA KV-cache capacity in vLLM", "results_serving.json"),
    Benchmark("mla_prefill", "mla_prefill", "MLA chunked prefill against a growing cache: time and peak memory, "
              "ours against transformers' DeepseekV3", "results_mla_prefill.json"),
    Benchmark("mla_decode", "mla_decode", "one MLA decode step at long cached contexts: ours absorbed and expanded, "
              "transformers' DeepseekV3, a GQA model of the same width"),
    Benchmark("dsa_decode", "dsa_decode", "one DeepSeek Sparse Attention decode step at 8k and 32k cached tokens "
              "(DeepSeek-V3.2 width, top-k 2,048): ours against dense MLA and transformers' DeepseekV32, time and "
              "peak memory", "results_dsa_decode.json"),
    Benchmark("mla_crossover", "mla_crossover", "one MLA step of T new tokens against S cached: absorbed against "
              "expanded, and the absorbed step's query block (time, peak memory): where `ABSORBED_MAX_NEW_TOKENS` "
              "and `ABSORBED_QUERY_BLOCK` come from", "results_mla_crossover.json"),
    Benchmark("split_threshold", "split_threshold", "decode steps of Llama layouts at several widths with the split "
              "products off, everywhere, and from each weight size: where `MIN_SPLIT_WEIGHT` comes from",
              "results_split_threshold.json"),
    Benchmark("split_slices", "split_slices", "forwards of 1 to 16 new tokens (a speculative verify step, a small "
              "batch) on SmolLM2-135M's shapes with the split products' slices of each size: where `tuning`'s "
              "`split_slice_bytes` comes from", "results_split_slices.json"),
    Benchmark("decode_profile", "decode_profile", "where a decode step's time goes (products vs the rest), and the "
              "host's time per generate step"),
    Benchmark("cache", "cache", "static cache + compile against the dynamic cache; the int8 K/V cache's "
              "error on SmolLM2-135M"),
    Benchmark("mtp_decode", "mtp_decode", "batch-1 greedy decode of SmolLM2-135M with added MTP modules "
              "(generate(use_mtp=True)) against plain generate, transformers' Llama, prompt lookup and early exit: "
              "tokens/s, acceptance, the same tokens, the parts of a step", "results_mtp_decode.json"),
    Benchmark("draft_vocab", "draft_vocab", "one MTP module's draft on SmolLM2-135M with the whole head against a "
              "head over the top 4k/8k/16k token ids (FR-Spec), at 1 and 2 threads, and what those ids cover of the "
              "model's greedy text", "results_draft_vocab.json"),
    Benchmark("reshape_smollm2", "reshape_smollm2", "each reshape transformation of SmolLM2-135M: parameters, KV "
              "bytes per token, held-out perplexity", "results_reshape_smollm2.json"),
    Benchmark("reshape_mla", "reshape_mla", "SmolLM2-135M converted to MLA (TransMLA's steps) at several ranks: KV "
              "bytes, held-out perplexity, conversion time and memory", "results_reshape_mla.json"),
    Benchmark("conversion_memory", "conversion_memory", "converting and exporting synthetic checkpoints of 8.5 GB "
              "(Llama and Mixtral layouts, bf16, 5 GB shards; gpt-oss as published, MXFP4 experts, about 8.5 GB "
              "once converted) in fresh processes: the peak resident memory above the baseline, and the time",
              "results_conversion_memory.json"),
    Benchmark("sinks", "sinks", "one attention layer of gpt-oss's widths, prefill and a decode step: SDPA with "
              "attention sinks against SDPA without them and eager with them (time, peak memory)", "results_sinks.json"),
    Benchmark("hybrid", "hybrid", "hybrid linear attention: prefill and decode against transformers' "
              "Qwen3NextForCausalLM, and one decode step of a Gated DeltaNet layer beside a full-attention layer at "
              "1k and 16k cached tokens (time, cache bytes)", "results_hybrid.json"),
    Benchmark("deepseek_v4", "deepseek_v4", "DeepSeek-V4: prefill and decode against transformers' "
              "DeepseekV4ForCausalLM, the compressed caches' bytes per token against transformers' at 4k and 32k, "
              "and one decode step from 8k to 64k cached tokens against the same model with a window only",
              "results_deepseek_v4.json"),
    Benchmark("topologies", "topologies", "Llama 4, Gemma 4 and Gemma 3n (text): prefill and decode against each "
              "transformers class, and the cache bytes per token the Gemma 3n and Gemma 4 layouts keep with their "
              "layers sharing keys and values, against transformers' at 4k and 32k", "results_topologies.json"),
    Benchmark("mixers", "mixers", "the recurrent mixers (LFM2's short convolution, OLMo hybrid's and Qwen3.5-MoE's "
              "Gated DeltaNet, Kimi Linear's KDA): prefill and decode against each transformers class, one decode step "
              "of each mixer beside full attention from 1k to 16k cached tokens, prompt lookup against plain decoding "
              "on each family, state bytes against K/V bytes", "results_mixers.json"),
    Benchmark("hybrid_drafting", "hybrid_drafting", "prompt lookup on small 3:1 hybrids (Gated DeltaNet, LFM2's short "
              "convolution) trained in the run to copy: greedy decoding of input-grounded prompts plain and with prompt "
              "lookup, ours against each transformers class with the same weights (tokens/s, drafts kept, the same "
              "tokens)", "results_hybrid_drafting.json"),
    Benchmark("mamba2", "mamba2", "the Mamba-2 hybrids (Bamba, Granite 4.0-H, Nemotron-H, Falcon-H1): prefill and "
              "decode against each transformers class, and one decode step of a Mamba-2 layer beside a full-attention "
              "layer from 1k to 16k cached tokens (time, state bytes against KV bytes)", "results_mamba2.json"),
    Benchmark("gpu", "gpu", "the GPU matrix (bf16, one accelerator): prefill, eager and compiled generate, MLA "
              "decode and chunked prefill, training steps, diagnostics; `--smoke` runs its code paths on the CPU",
              "results_gpu.json"),
)

BY_NAME = {benchmark.name: benchmark for benchmark in BENCHMARKS}
