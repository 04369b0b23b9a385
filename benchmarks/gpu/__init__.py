"""The GPU matrix: ours against transformers' own classes with the same weights, in one process.

On the device machine (one H200, no network; about 7 minutes):

    python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . && PYTHONUNBUFFERED=1 python3 -m benchmarks.gpu --out $OUT/gpu.json

Anywhere else: `python -m benchmarks gpu [--out FILE.json] [--smoke] [--parts NAME ...] [--budget SECONDS]` (or
`python -m benchmarks.gpu ...`)
(parts that would start past the budget, 420 s on the GPU by default, are recorded as skipped, and a part's
guard never runs past it; `--parts` splits the matrix over several device calls). `--smoke` runs the same code
paths on the CPU with tiny shapes in fp32 (under a minute of CPU time; the test suite runs it so the script never
rots).

Weights are random, made with transformers' own class (`LlamaForCausalLM` at the Llama-3.2-1B shape,
`DeepseekV3ForCausalLM` at DeepSeek-V2-Lite's attention widths, 16 heads at hidden 2048, with a q_lora_rank of
1536 as DeepSeek-V2/V3 have, and 8 dense layers), saved, converted with `modular_decoder.conversion.convert`
(`families.save_pair`), and both folders loaded the default way (`from_pretrained(dtype=bfloat16,
attn_implementation="sdpa")`). Each part (`PARTS`) has its own time guard and try/except; the JSON is rewritten
after every part, so a failure or a timeout loses only that part (or only its unfinished cases). Ratios are ours
relative to transformers: above 1 means ours is faster. Greedy tokens are compared wherever tokens are generated.

The parts, in the order of the run, with the seconds each is expected to take on one H200 (estimates, not yet
measured: scaled from the H200 measurement that issue 27 reports and ../shared/GPU.md records, made outside this
repository (eager generate 1,649 / 1,297 tok/s at b32 x 512 +128), and from each part's FLOPs and bytes at H200
rates; the guard in brackets):

- `llama_prefill` ~25 [60]: makes, saves and converts the Llama checkpoint, then logits parity and a prefill.
- `generate_profile` ~20 [60]: diagnoses the eager-generate gap at the big batch (ours 0.79x of transformers
  there, though a plain decode-step loop is faster for ours): a b32 x 512 +16 greedy generate under torch.profiler
  for transformers, ours, and ours on transformers' `DynamicCache` (contiguous torch.cat K/V instead of
  `growing_cache.GrowingLayer`'s prefix views). Per decode step (a 1-token call's profile subtracted): wall,
  CUDA kernels and their time, self CPU time, `cudaMalloc`/`cudaFree`/syncs/copies/launches, the SDPA
  implementation; top kernels and aten ops in the JSON.
- `llama_generate` ~30 [70] and `llama_generate_dynamic_cache` ~30 [70]: eager generate at b1 and b32, the
  second with ours on transformers' `DynamicCache` (does the cache layout account for the gap?).
- `host_syncs` ~10 [30], `flash_backends` (skipped unless a flash package imports; ~15 per backend) [40].
- `mla_step_crossover` ~35 [90]: makes the MLA checkpoint (~15), then one step of N = 1..256 new tokens
  against 8k and 32k cached tokens, ours forced absorbed vs forced expanded vs transformers: where
  `mla.ABSORBED_MAX_NEW_TOKENS` (64) should be. Also probes one fused SDPA call over the 576-wide latent cache.
- `mla_decode_grid` ~15 [60], `mla_chunked_prefill` ~40 [100].
- the four training parts, ~35 each [45, 40, 35, 35] (each reloads its pair; flex compiles on first use).
- `compiled_decode` [150]: compiles the decode step per batch size; the budget usually cuts it (or the last
  training part) short: run it with `--parts compiled_decode` in a second call.

The modules: `plan.py` (the shapes: the GPU plan and the CPU smoke plan), `bench.py` (the loaded pair and the
shared `generate` call), one module per group of parts (`llama_parts.py`, `mla_parts.py`, `diagnostics.py`,
`training.py`; each part is one function `part(bench) -> dict` whose "rows" the table shows), `timing.py` (guards,
syncs, agreement), `profiler.py` (torch.profiler digests) and `run.py` (`PARTS` in the order of the run, `main`).
A new part is a function in one of the part modules and a line in `PARTS`."""

from .plan import FULL, SMOKE  # noqa: F401
from .run import PARTS, main  # noqa: F401
