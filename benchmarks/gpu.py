"""The GPU matrix: ours against transformers' own classes with the same weights, in one process.

On the device machine (one H200, no network; about 7 minutes):

    python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . && PYTHONUNBUFFERED=1 python3 -m benchmarks.gpu --out $OUT/gpu.json

Anywhere else: `python -m benchmarks.gpu [--out FILE.json] [--smoke] [--parts NAME ...] [--budget SECONDS]`
(parts that would start past the budget, 420 s on the GPU by default, are recorded as skipped, and a part's
guard never runs past it; `--parts` splits the matrix over several device calls). `--smoke` runs the same code
paths on the CPU with tiny shapes in fp32 (under a minute of CPU time; the test suite runs it so the script never
rots).

Weights are random, made with transformers' own class (`LlamaForCausalLM` at the Llama-3.2-1B shape,
`DeepseekV3ForCausalLM` at DeepSeek-V3's attention dims with 8 dense layers), saved, converted with
`modular_decoder.conversion.convert`, and both folders loaded the default way (`from_pretrained(dtype=bfloat16,
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
- `mla_step_crossover` ~35 [90]: makes the DeepSeek-V3 checkpoint (~15), then one step of N = 1..256 new tokens
  against 8k and 32k cached tokens, ours forced absorbed vs forced expanded vs transformers: where
  `mla.ABSORBED_MAX_NEW_TOKENS` (64) should be. Also probes one fused SDPA call over the 576-wide latent cache.
- `mla_decode_grid` ~15 [60], `mla_chunked_prefill` ~40 [100].
- the four training parts, ~35 each [45, 40, 35, 35] (each reloads its pair; flex compiles on first use).
- `compiled_decode` [150]: compiles the decode step per batch size; the budget usually cuts it (or the last
  training part) short: run it with `--parts compiled_decode` in a second call."""

from __future__ import annotations

import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import transformers as tf

import modular_decoder  # noqa: F401  (registers the family with the Auto classes)
from modular_decoder.compat import with_cache
from modular_decoder.mla import ABSORBED_MAX_NEW_TOKENS, set_decode_mode

from . import harness
from .families import LORA_TARGETS
from .gpu_plan import FULL, SMOKE, Plan, deepseek_v3_config, llama_config
from .gpu_profile import difference, digest, profiled
from .gpu_timing import PartTimeout, Skip, agreement, count_syncs, cuda_peak, part_guard, ratio, timed, wall
from .mla_prefill import chunked_prefill, new_cache
from .pages import gpu_table

FLASH_BACKENDS = ("flash_attention_2", "flash_attention_3", "flash_attention_4")


class Bench:
    """The plan, the device, the checkpoints on disk and the pair of models currently loaded."""

    def __init__(self, plan: Plan, folder: Path, device: str):
        self.plan, self.folder, self.device = plan, folder, device
        self.models: dict[str, tuple] = {}
        self.gen = torch.Generator().manual_seed(0)

    def ids(self, *shape: int) -> torch.Tensor:
        return torch.randint(1, self.plan.vocab_of(self.family), shape, generator=self.gen).to(self.device)

    def pair(self, family: str, fresh: bool = False) -> tuple:
        """(transformers' model, ours) for `family`, loaded from disk; the other family's pair is freed first."""
        self.family = family
        if fresh or family not in self.models:
            self.models.clear()
            _empty_cache()
            self._checkpoints(family)
            self.models[family] = tuple(self._load(self.folder / family / side) for side in ("hf", "ours"))
        return self.models[family]

    def _checkpoints(self, family: str) -> None:
        from modular_decoder.conversion import convert

        folder = self.folder / family
        if (folder / "ours").exists():
            return
        config = (llama_config if family == "llama" else deepseek_v3_config)(self.plan)
        torch.manual_seed(0)
        with torch.device(self.device):  # random init on the GPU: seconds instead of a minute on the host
            reference = tf.AutoModelForCausalLM.from_config(config, dtype=self.plan.dtype)
        reference.save_pretrained(folder / "hf")
        del reference
        convert(folder / "hf", folder / "ours", progress=False)

    def _load(self, path: Path):
        model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=self.plan.dtype, attn_implementation="sdpa")
        return model.to(self.device).eval()


def _empty_cache() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------------
# Llama-3.2-1B shape: prefill, eager and compiled generate, host syncs, flash backends
# --------------------------------------------------------------------------------------------------


@torch.inference_mode()
def llama_prefill(bench: Bench) -> dict:
    theirs, ours = bench.pair("llama")
    ids = bench.ids(1, bench.plan.logits_tokens)
    diff = (ours(ids).logits.float() - theirs(ids).logits.float()).abs().max().item()
    prompt = bench.ids(1, bench.plan.prefill_tokens)
    seconds = timed({"transformers": theirs, "ours": ours},
                    lambda m: m(prompt, use_cache=False, logits_to_keep=1), bench.plan.step_repeats)
    n = bench.plan.prefill_tokens
    return {"logits_tokens": bench.plan.logits_tokens, "logits_max_abs_diff": diff,
            "transformers_ms": 1e3 * seconds["transformers"], "ours_ms": 1e3 * seconds["ours"],
            "ratio": ratio(seconds), "rows": [
                (f"logits, {bench.plan.logits_tokens} tokens, max abs diff", "", f"{diff:.3g}", ""),
                (f"prefill 1 x {n}, `logits_to_keep=1` (ms)", f"{1e3 * seconds['transformers']:.2f}",
                 f"{1e3 * seconds['ours']:.2f}", f"{ratio(seconds):.2f}x")]}


def _generate(model, prompt, new_tokens: int, **kwargs):
    return model.generate(prompt, attention_mask=kwargs.pop("attention_mask", torch.ones_like(prompt)),
                          max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                          **kwargs)


def no_extra(model) -> dict:
    return {}


def dynamic_cache(model) -> dict:
    """generate's kwargs giving `model` a fresh transformers `DynamicCache` (torch.cat: contiguous K/V) in place
    of this family's default (`growing_cache.GrowingLayer`: prefix views of pre-allocated storage)."""
    return with_cache(tf.DynamicCache(config=model.config))


@torch.inference_mode()
def _generate_pair(bench: Bench, label: str, batch: int, prompt_len: int, extra: dict | None = None,
                   **kwargs) -> tuple[dict, tuple]:
    """Greedy `generate` of `plan.new_tokens` on both sides: tokens/s (whole call, prompt included) and agreement.
    `extra` maps a side to a function of its model returning more kwargs for each call (a fresh cache, say)."""
    theirs, ours = bench.pair("llama")
    prompt, new = bench.ids(batch, prompt_len), bench.plan.new_tokens
    tokens, extra = {}, extra or {}

    def run(model):
        more = extra.get("ours" if model is ours else "transformers", no_extra)(model)
        tokens[model] = _generate(model, prompt, new, **kwargs, **more)

    seconds = timed({"transformers": theirs, "ours": ours}, run, bench.plan.repeats)
    rates = {side: batch * new / s for side, s in seconds.items()}
    agree = agreement(tokens[theirs], tokens[ours], prompt_len)
    result = {"batch": batch, "prompt": prompt_len, "new_tokens": new, "transformers_tok_s": rates["transformers"],
              "ours_tok_s": rates["ours"], "ratio": ratio(seconds), "greedy_agreement": agree}
    row = (f"{label} b{batch}, {prompt_len}-token prompt{'s' if batch > 1 else ''}, +{new} (tok/s)",
           f"{rates['transformers']:,.1f}", f"{rates['ours']:,.1f}",
           f"{ratio(seconds):.2f}x{'' if agree['equal'] else ' (tokens differ: ' + str(agree['fraction']) + ')'}")
    return result, row


def _generate_batches(bench: Bench, label: str, **kwargs) -> dict:
    """`_generate_pair` at batch 1 and at the plan's big batch; a guard firing at the second keeps the first."""
    plan, result, rows = bench.plan, {}, []
    for batch, prompt_len in ((1, plan.prompt_b1), (plan.big_batch, plan.prompt_big)):
        try:
            result[f"b{batch}"], row = _generate_pair(bench, label, batch, prompt_len, **kwargs)
        except PartTimeout as error:  # keep the batch already measured; the guard fires once, so stop here
            result[f"b{batch}"] = {"timeout": str(error)}
            rows.append((f"{label} b{batch}", "", str(error), ""))
            break
        rows.append(row)
    return result | {"rows": rows}


def llama_generate(bench: Bench) -> dict:
    return _generate_batches(bench, "eager `generate`")


def llama_generate_dynamic_cache(bench: Bench) -> dict:
    """`llama_generate` with ours given transformers' `DynamicCache`: if the eager-generate gap to transformers
    closes, the cache layout (non-contiguous prefix views, pre-allocated storage) is its cause."""
    return {"ours_cache": "transformers DynamicCache"} | _generate_batches(
        bench, "eager `generate`, ours on transformers' `DynamicCache`", extra={"ours": dynamic_cache})


# The three sides of `generate_profile`: (name, which model of the pair, generate's extra kwargs).
PROFILE_SIDES = (("transformers", 0, no_extra), ("ours", 1, no_extra), ("ours_dynamic_cache", 1, dynamic_cache))


@torch.inference_mode()
def generate_profile(bench: Bench) -> dict:
    """Where the big-batch eager-generate gap goes: a greedy `generate` of `plan.profile_new_tokens` tokens (b
    `big_batch` x `prompt_big`) under torch.profiler, for transformers' Llama, ours, and ours on transformers'
    `DynamicCache`. The same call with one new token (the prefill alone) is profiled too, and the difference
    divided by the extra steps gives the cost of one decode step, prefill excluded (`per_decode_step`); the whole
    call's figures are kept as `call`."""
    pair, plan = bench.pair("llama"), bench.plan
    prompt, new = bench.ids(plan.big_batch, plan.prompt_big), plan.profile_new_tokens
    sides = {name: _profile_side(pair[index], prompt, new, extra) for name, index, extra in PROFILE_SIDES}
    result = {"batch": plan.big_batch, "prompt": plan.prompt_big, "new_tokens": new, **sides}
    if bench.device != "cuda":
        result["note"] = "no CUDA: kernels, kernel time and CUDA runtime calls are zero (CPU activity only)"
    elif not sides["transformers"]["call"]["kernels"]:  # kineto's CUDA tracing (CUPTI) can fail with a warning only
        result["note"] = "the profiler recorded no CUDA kernel: CUDA activity tracing (CUPTI) did not run here"
    return result | {"rows": _profile_rows(result)}


def _profile_side(model, prompt: torch.Tensor, new: int, extra) -> dict:
    """One side of `generate_profile`: unprofiled and profiled walls, the profile's digests, the peak memory."""
    def call(tokens: int):
        return lambda: _generate(model, prompt, tokens, **extra(model))

    call(new)()  # warm-up
    plain_one = wall(call(1))
    with cuda_peak() as peak:
        plain = wall(call(new))
    profiled_s, whole = profiled(call(new))
    _, prefill = profiled(call(1))
    return {"wall_s": plain, "profiled_wall_s": profiled_s, "prefill_wall_s": plain_one,
            "decode_step_ms": 1e3 * (plain - plain_one) / (new - 1), "peak_gib": peak.gib,
            "peak_above_start_gib": peak.above_gib, "call": digest(whole),
            "per_decode_step": digest(difference(whole, prefill, new - 1))}


def _profile_rows(result: dict) -> list[tuple]:
    """Rows of `generate_profile`: each figure for ours, then for ours on transformers' `DynamicCache`."""
    head = f"generate b{result['batch']} x {result['prompt']} +{result['new_tokens']}"
    figures = (  # (label, how a side's entry shows it, whether a ratio transformers / ours means anything)
        ("wall per decode step (ms, unprofiled)", lambda e: f"{e['decode_step_ms']:.2f}", "decode_step_ms"),
        ("CUDA kernels per decode step", lambda e: f"{e['per_decode_step']['kernels']:.0f}", None),
        ("CUDA kernel time per decode step (ms)", lambda e: f"{e['per_decode_step']['kernel_ms']:.2f}", None),
        ("self CPU time per decode step (ms, profiled)", lambda e: f"{e['per_decode_step']['self_cpu_ms']:.2f}",
         None),
        ("CUDA runtime calls per decode step: Malloc/Free/StreamSync/DeviceSync/MemcpyAsync/LaunchKernel",
         lambda e: "/".join(f"{n:.4g}" for n in e["per_decode_step"]["runtime_calls"].values()), None),
        ("SDPA implementation (calls per decode step)", lambda e: _sdpa_cell(e["per_decode_step"]["sdpa"]), None),
        ("peak memory above the start (GiB)", lambda e: "" if e["peak_above_start_gib"] is None
         else f"{e['peak_above_start_gib']:.2f}", None),
    )
    rows = []
    for label, show, ratio_of in figures:
        for side, suffix in (("ours", ""), ("ours_dynamic_cache", " [ours on transformers' `DynamicCache`]")):
            theirs, ours = result["transformers"], result[side]
            speed = f"{theirs[ratio_of] / ours[ratio_of]:.2f}x" if ratio_of and ours[ratio_of] > 0 else ""
            rows.append((f"{head}: {label}{suffix}", show(theirs), show(ours), speed))
    return rows


def _sdpa_cell(ops: dict) -> str:
    return ", ".join(f"{name.removeprefix('aten::')} x{count:.3g}" for name, count in ops.items()) or "none"


def compiled_decode(bench: Bench) -> dict:
    """`cache_implementation="static"`: transformers compiles the decode step (CUDA graphs) on a GPU, anew for
    each batch size; on the CPU it does not compile by default, so the smoke run times the static cache eagerly
    (same calls)."""
    result = {"compiled": bench.device == "cuda"}
    if bench.device != "cuda":
        result["note"] = "no CUDA: transformers compiles the static-cache decode step only on a GPU; timed eagerly"
    return result | _generate_batches(bench, "compiled decode (static cache)", cache_implementation="static")


def host_syncs(bench: Bench) -> dict:
    """Host syncs (`torch.cuda.set_sync_debug_mode("warn")` warnings) in a left-padded batched `generate` and in
    two training steps (forward + backward)."""
    if bench.device != "cuda":
        raise Skip("no CUDA: torch.cuda.set_sync_debug_mode counts device-to-host syncs, which a CPU does not have")
    theirs, ours = bench.pair("llama")
    plan = bench.plan
    prompt = bench.ids(plan.big_batch, plan.prompt_b1)
    mask = torch.ones_like(prompt)
    mask[1::2, : plan.prompt_b1 // 4] = 0  # every other row left-padded
    batch = bench.ids(2, plan.prompt_b1)
    counts = {}
    for side, model in (("transformers", theirs), ("ours", ours)):
        with torch.inference_mode():
            _generate(model, prompt, 2, attention_mask=mask)  # warm-up
            generate = count_syncs(lambda: _generate(model, prompt, plan.sync_new_tokens, attention_mask=mask))

        def two_steps():
            for _ in range(2):
                model(input_ids=batch, labels=batch, use_cache=False).loss.backward()

        model.train()
        training = count_syncs(two_steps)
        model.eval().zero_grad(set_to_none=True)
        counts[side] = {"generate": generate, "two_training_steps": training}
    return {"generate_batch": plan.big_batch, "new_tokens": plan.sync_new_tokens, **counts, "rows": [
        (f"host syncs, generate b{plan.big_batch} +{plan.sync_new_tokens}, left-padded",
         str(counts["transformers"]["generate"]), str(counts["ours"]["generate"]), ""),
        ("host syncs, two training steps", str(counts["transformers"]["two_training_steps"]),
         str(counts["ours"]["two_training_steps"]), "")]}


def flash_available() -> dict[str, bool]:
    """Which flash backends can run here (`Skip` without CUDA: the kernels are CUDA-only)."""
    import transformers.utils as hf_utils

    if not torch.cuda.is_available():
        raise Skip("no CUDA: flash kernels run on a GPU only (their parity tests: tests/test_backends.py)")
    return {name: getattr(hf_utils, f"is_flash_attn_{name[-1]}_available")() for name in FLASH_BACKENDS}


def use_backend(model, name: str) -> None:
    model.set_attn_implementation(name)  # the load-time path: checks the kernel package and the config


def flash_backends(bench: Bench) -> dict:
    """Each flash backend whose package imports: prefill time and greedy b1 tokens, both sides."""
    available = flash_available()
    if not any(available.values()):
        raise Skip("no flash package imports here (flash_attn, flash_attn_interface, flash_attn.cute)")
    result, rows = {"available": available}, []
    theirs, ours = bench.pair("llama")
    for name in (n for n, ok in available.items() if ok):
        try:
            for model in (theirs, ours):
                use_backend(model, name)
            prefill = llama_prefill(bench)
            result[name], row = _generate_pair(bench, f"{name} generate", 1, bench.plan.prompt_b1)
            result[name]["prefill"] = {k: v for k, v in prefill.items() if k != "rows"}
            rows += [(f"{name}: {r[0]}", *r[1:]) for r in prefill["rows"][1:]] + [row]
        except Exception as error:  # one backend failing keeps the others
            result[name] = {"error": f"{type(error).__name__}: {error}"[:400]}
        finally:
            for model in (theirs, ours):
                use_backend(model, "sdpa")
    return result | {"rows": rows}


# --------------------------------------------------------------------------------------------------
# DeepSeek-V3 attention dims: the MLA decode-step grid and chunked prefill
# --------------------------------------------------------------------------------------------------


def _filled_cache(model, batch: int, context: int, side: str, device: str):
    """A cache holding `context` random tokens (latent and rotary key per layer), filled without a prefill."""
    config, dtype, cache = model.config, model.dtype, new_cache(model, side)
    for layer in range(config.num_hidden_layers):
        latent = torch.randn(batch, 1, context, config.kv_lora_rank, device=device, dtype=dtype)
        cache.update(latent, torch.randn(batch, 1, context, config.qk_rope_head_dim, device=device, dtype=dtype),
                     layer)
    return cache


@torch.inference_mode()
def mla_decode_grid(bench: Bench) -> dict:
    """One decode step against a cache of each (batch, context): median time, caches filled directly."""
    theirs, ours = bench.pair("deepseek_v3")
    plan, points, rows = bench.plan, {}, []
    grid = [(b, c) for b in plan.grid_batches for c in plan.grid_contexts] + list(plan.grid_extra)
    for batch, context in grid:
        key = f"b{batch}_ctx{context}"
        try:
            caches = {m: _filled_cache(m, batch, context, side, bench.device)
                      for side, m in (("transformers", theirs), ("ours", ours))}
            step = bench.ids(batch, 1)
            position = torch.full((batch, 1), context, device=bench.device)

            def run(model):
                model(step, **with_cache(caches[model]), position_ids=position, use_cache=True)
                caches[model].crop(-1)  # back to `context` tokens (a positive length is refused)

            seconds = timed({"transformers": theirs, "ours": ours}, run, plan.step_repeats)
            points[key] = {"transformers_ms": 1e3 * seconds["transformers"], "ours_ms": 1e3 * seconds["ours"],
                           "ratio": ratio(seconds)}
            rows.append((f"MLA decode step b{batch} x {context:,} context (ms)", f"{1e3 * seconds['transformers']:.2f}",
                         f"{1e3 * seconds['ours']:.2f}", f"{ratio(seconds):.2f}x"))
        except torch.OutOfMemoryError as error:
            points[key] = {"oom": str(error)[:300]}
            rows.append((f"MLA decode step b{batch} x {context:,} context", "", "out of memory", ""))
        except PartTimeout as error:  # keep the points already measured
            points[key] = {"timeout": str(error)}
            rows.append((f"MLA decode step b{batch} x {context:,} context", "", str(error), ""))
            break
        finally:
            caches = None
            _empty_cache()
    return {"points": points, "rows": rows}


# The sides of one crossover cell: (name, which model of the pair, the decode mode forced on ours).
CROSSOVER_SIDES = (("transformers", 0, None), ("absorbed", 1, "absorbed"), ("expanded", 1, "expanded"))


@torch.inference_mode()
def mla_step_crossover(bench: Bench) -> dict:
    """One step of N new tokens against a filled cache, for each (batch, context) of `plan.crossover_points` and
    each N of `plan.crossover_new_tokens`: transformers, ours forced absorbed, ours forced expanded (median time,
    peak memory above the start, an out-of-memory recorded per cell). Where absorbed stops beating expanded is
    what `mla.ABSORBED_MAX_NEW_TOKENS` should be. Each point also probes one fused SDPA call for N = 1
    (`_fused_probe`)."""
    pair, plan, points, rows = bench.pair("deepseek_v3"), bench.plan, {}, []
    try:
        for batch, context in plan.crossover_points:
            points[f"b{batch}_ctx{context}"] = point = {}
            try:
                caches = [_filled_cache(model, batch, context, side, bench.device)
                          for side, model in zip(("transformers", "ours"), pair)]
                for new in plan.crossover_new_tokens:
                    point[f"new{new}"] = cell = _crossover_cell(bench, pair, caches, batch, context, new)
                    rows.append(_crossover_row(batch, context, new, cell))
            except torch.OutOfMemoryError as error:  # filling the caches
                point["oom"] = str(error)[:300]
                rows.append((f"MLA step b{batch} x {context:,}", "", "out of memory filling the caches", ""))
            finally:
                caches = None
                _empty_cache()
            point["fused_probe"] = probe = _fused_probe(bench, pair[1].config, batch, context)
            rows.append(_probe_row(batch, context, probe))
    except PartTimeout as error:  # keep the cells already measured
        points["timeout"] = str(error)
        rows.append(("MLA step crossover: the rest", "", str(error), ""))
    finally:
        set_decode_mode(pair[1], "auto")
    return {"absorbed_max_new_tokens": ABSORBED_MAX_NEW_TOKENS, "points": points, "rows": rows}


def _crossover_cell(bench: Bench, pair: tuple, caches: list, batch: int, context: int, new: int) -> dict:
    """Each side of one (batch, context, N) step: {"ms", "peak_gib"} or {"oom"}."""
    ids = bench.ids(batch, new)
    position = torch.arange(context, context + new, device=bench.device).expand(batch, -1)
    cell = {}
    for side, index, mode in CROSSOVER_SIDES:
        model, cache = pair[index], caches[index]
        if mode:
            set_decode_mode(model, mode)

        def run(model):
            try:
                model(ids, **with_cache(cache), position_ids=position, use_cache=True)
            finally:
                _crop_to(cache, context)  # also after an out-of-memory part way through the layers

        cell[side] = _step_cost(model, run, bench.plan.step_repeats)
    return cell


def _crop_to(cache, context: int) -> None:
    """Each layer back to `context` tokens (layer by layer: a failed step may have grown only the first ones;
    a negative length, which every supported transformers release takes)."""
    for layer in cache.layers:
        extra = layer.get_seq_length() - context
        if extra > 0:
            layer.crop(-extra)


def _step_cost(model, run, repeats: int) -> dict:
    """Median ms of `run(model)` (after a warm-up) and one more run's peak memory above the allocation before it."""
    try:
        seconds = timed({"side": model}, run, repeats)["side"]
        with cuda_peak() as peak:
            run(model)
        return {"ms": 1e3 * seconds, "peak_gib": peak.above_gib}
    except torch.OutOfMemoryError as error:
        _empty_cache()
        return {"oom": str(error)[:300]}


def _crossover_row(batch: int, context: int, new: int, cell: dict) -> tuple:
    absorbed, expanded = cell["absorbed"], cell["expanded"]
    both = "ms" in absorbed and "ms" in expanded
    return (f"MLA step b{batch} x {context:,} + {new} new (ms [peak above start]; ours: absorbed / expanded; "
            f"ratio: expanded / absorbed)", _cost_cell(cell["transformers"]),
            f"{_cost_cell(absorbed)} / {_cost_cell(expanded)}",
            f"{expanded['ms'] / absorbed['ms']:.2f}x" if both else "")


def _cost_cell(entry: dict) -> str:
    if "oom" in entry:
        return "out of memory"
    return f"{entry['ms']:.2f}" + ("" if entry["peak_gib"] is None else f" [{entry['peak_gib']:.2f} GiB]")


@torch.inference_mode()
def _fused_probe(bench: Bench, config, batch: int, context: int) -> dict:
    """The absorbed scoring of one new token as explicit matmuls (`MultiHeadLatentAttention.absorbed_attention`'s
    arithmetic) and as one SDPA call over the joint [latent, rotary] cache with a single K/V head and the heads
    as query rows (keys = values, output cropped to the latent): median times, the largest difference, and which
    SDPA implementation and kernels the fused call ran. Does PyTorch take a 576-wide head, and how fast?"""
    heads, latent, rotary = config.num_attention_heads, config.kv_lora_rank, config.qk_rope_head_dim
    scale = (config.qk_nope_head_dim + rotary) ** -0.5
    try:
        def random(*shape):
            return torch.randn(*shape, device=bench.device, dtype=bench.plan.dtype)

        latents, rot, q_latent, q_rot = (random(batch, context, latent), random(batch, context, rotary),
                                         random(batch, heads, latent), random(batch, heads, rotary))
        joint = torch.cat([latents, rot], -1)[:, None]  # (B, 1, S, d_c + d_R): stored as one tensor
        joint_query = torch.cat([q_latent, q_rot], -1)[:, None]  # (B, 1, H, d_c + d_R): heads as query rows

        def matmuls():
            scores = torch.baddbmm(q_rot @ rot.transpose(1, 2), q_latent, latents.transpose(1, 2))
            return torch.softmax(scores * scale, -1) @ latents

        def fused():
            return torch.nn.functional.scaled_dot_product_attention(joint_query, joint, joint, scale=scale)[
                ..., :latent]

        seconds = timed({"matmuls": matmuls, "sdpa": fused}, lambda run: run(), bench.plan.step_repeats)
        diff = (matmuls().float() - fused()[:, 0].float()).abs().max().item()
        profile = digest(profiled(fused)[1])
        return {"width": latent + rotary, "matmuls_ms": 1e3 * seconds["matmuls"], "sdpa_ms": 1e3 * seconds["sdpa"],
                "max_abs_diff": diff, "sdpa_ops": profile["sdpa"], "sdpa_kernels": profile["top_kernels"][:3]}
    except Exception as error:  # an out-of-memory, or no kernel for the shape: recorded, the crossover kept
        return {"error": f"{type(error).__name__}: {error}"[:300]}
    finally:
        _empty_cache()


def _probe_row(batch: int, context: int, probe: dict) -> tuple:
    label = (f"MLA fused-SDPA probe b{batch} x {context:,} + 1 new, one [latent, rotary] K/V head "
             f"(ms: matmuls / SDPA [op]; ratio: matmuls / SDPA)")
    if "error" in probe:
        return label, "", probe["error"][:80], ""
    return (label, "", f"{probe['matmuls_ms']:.3f} / {probe['sdpa_ms']:.3f} [{_sdpa_cell(probe['sdpa_ops'])}]",
            f"{probe['matmuls_ms'] / probe['sdpa_ms']:.2f}x")


def mla_chunked_prefill(bench: Bench) -> dict:
    """A batch of long prompts fed in chunks, each chunk against the cache: time and peak GPU memory (an
    out-of-memory is recorded, not fatal); the last position's greedy token compared."""
    theirs, ours = bench.pair("deepseek_v3")
    plan, result, rows = bench.plan, {}, []
    batch, tokens = plan.chunked
    ids = bench.ids(batch, tokens)
    for side, model in (("transformers", theirs), ("ours", ours)):  # warm-up
        chunked_prefill(model, side, ids[:1, : 2 * plan.chunks[0]], plan.chunks[0])
    for chunk in plan.chunks:
        entry, last = {}, {}
        for side, model in (("transformers", theirs), ("ours", ours)):
            _empty_cache()
            try:
                def prefill():
                    last[side] = chunked_prefill(model, side, ids, chunk)

                with cuda_peak() as peak:
                    seconds = wall(prefill)
                entry[side] = {"seconds": seconds, "peak_gib": peak.gib}
            except torch.OutOfMemoryError as error:
                entry[side] = {"oom": str(error)[:300]}
        if len(last) == 2:
            same = last["transformers"].argmax(-1) == last["ours"].argmax(-1)
            entry["greedy_agreement"] = same.float().mean().item()
        result[f"chunk{chunk}"] = entry
        cells = [_time_and_peak(entry[side]) for side in ("transformers", "ours")]
        both = all("seconds" in entry[s] for s in ("transformers", "ours"))
        speed = f"{entry['transformers']['seconds'] / entry['ours']['seconds']:.2f}x" if both else "fails"
        rows.append((f"MLA prefill {batch} x {tokens:,} in chunks of {chunk:,}: time, peak", *cells, speed))
    return result | {"rows": rows}


def _time_and_peak(entry: dict) -> str:
    if "oom" in entry:
        return "out of memory"
    peak = "" if entry["peak_gib"] is None else f", peak {entry['peak_gib']:.1f} GiB"
    return f"{entry['seconds']:.2f} s{peak}"


# --------------------------------------------------------------------------------------------------
# Training steps
# --------------------------------------------------------------------------------------------------


def _training_batches(bench: Bench) -> dict:
    """A right-padded batch (labels -100 on the padding) and packed documents in one row without padding
    (positions restart per document; no label across a document boundary)."""
    rows, length = bench.plan.train_batch
    ids = bench.ids(rows, length)
    mask = torch.ones_like(ids)
    for row in range(1, rows):
        mask[row, length - row * length // (2 * rows):] = 0
    padded = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    total = rows * length
    lengths = [total // 2, total // 4, total // 8, total - total // 2 - total // 4 - total // 8]
    packed_ids = bench.ids(1, total)
    positions = torch.cat([torch.arange(n) for n in lengths])[None].to(bench.device)
    labels = packed_ids.clone()
    labels[positions == 0] = -100
    packed = dict(input_ids=packed_ids, position_ids=positions, labels=labels)
    return {"padded": padded, "packed": packed}


def _lora(theirs, ours, family: str):
    """The same LoRA (r=8) on both sides; ours gets transformers' side's initial adapter weights by name."""
    from peft import LoraConfig, get_peft_model

    targets = LORA_TARGETS[family][0]  # the benchmarks' LoRA targets (same names on both sides for these two)
    models = [get_peft_model(m, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=targets))
              for m in (theirs, ours)]
    adapters = {k: v for k, v in models[0].state_dict().items() if "lora_" in k}
    missing = models[1].load_state_dict(adapters, strict=False).unexpected_keys
    if missing:
        raise RuntimeError(f"LoRA adapters named differently on the two sides: {missing[:3]}")
    return models


def _train_steps(pair: dict, optimizers: dict, batch: dict, repeats: int) -> dict:
    """Median step time of both sides and every step's loss (a warm-up step, then `repeats` alternating)."""
    losses = {side: [] for side in pair}
    side_of = {id(model): side for side, model in pair.items()}

    def step(model):
        side = side_of[id(model)]
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        optimizers[side].step()
        optimizers[side].zero_grad(set_to_none=True)
        losses[side].append(loss.item())

    seconds = timed(pair, step, repeats)
    diff = max(abs(a - b) / abs(a) for a, b in zip(losses["transformers"], losses["ours"]))
    return {"transformers_ms": 1e3 * seconds["transformers"], "ours_ms": 1e3 * seconds["ours"],
            "ratio": ratio(seconds), "losses": losses, "loss_max_rel_diff": diff}


def training(bench: Bench, family: str, method: str) -> dict:
    """Steps (forward, backward, AdamW) of a full fine-tune or a LoRA, on sdpa and flex, on a padded batch and on
    packed documents: median step time of both sides and the losses of every step (the same weights and data,
    so they agree to bf16 accuracy)."""
    theirs, ours = bench.pair(family, fresh=True)
    if method == "lora":
        theirs, ours = _lora(theirs, ours, family)
    pair = {"transformers": theirs, "ours": ours}
    optimizers = {side: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-5)
                  for side, m in pair.items()}
    trainable = {side: sum(p.numel() for p in m.parameters() if p.requires_grad) for side, m in pair.items()}
    result, rows, label = {}, [], "Llama" if family == "llama" else "DeepSeek-V3"
    try:
        for backend in ("sdpa", "flex_attention"):
            if backend == "flex_attention" and bench.device == "cpu":
                result[backend] = {"skipped": "FlexAttention has no backward on the CPU (torch: NotImplementedError)"}
                rows.append((f"train {method} {label} {backend}", "", "skipped on the CPU: no flex backward", ""))
                continue
            for model in pair.values():
                model.train()
                model.set_attn_implementation(backend)
            for kind, batch in _training_batches(bench).items():
                case = f"train {method} {label} {backend} {kind}"
                try:
                    result[f"{backend}_{kind}"] = run = _train_steps(pair, optimizers, batch, bench.plan.repeats)
                    rows.append((f"{case} (ms/step; loss rel. diff {run['loss_max_rel_diff']:.1e})",
                                 f"{run['transformers_ms']:.1f}", f"{run['ours_ms']:.1f}", f"{run['ratio']:.2f}x"))
                except Exception as error:  # one backend or batch failing keeps the others
                    result[f"{backend}_{kind}"] = {"error": f"{type(error).__name__}: {error}"[:400]}
                    rows.append((case, "", f"error: {type(error).__name__}", ""))
    except PartTimeout as error:  # keep the cases already measured
        result["timeout"] = str(error)
        rows.append((f"train {method} {label}: the rest", "", str(error), ""))
    finally:
        bench.models.clear()  # trained weights: the next user reloads
    return {"trainable": trainable, "train_batch": list(bench.plan.train_batch), **result, "rows": rows}


# --------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------

# name -> (function, time guard in seconds on the GPU plan); the order is the order of the run: the diagnostics of
# the eager-generate gap and the MLA crossover first, the training steps and the compiled decode (which the
# budget may cut) last. Within a family the parts share the loaded pair.
PARTS = {
    "llama_prefill": (llama_prefill, 60),  # makes, saves and converts the checkpoint first
    "generate_profile": (generate_profile, 60),
    "llama_generate": (llama_generate, 70),
    "llama_generate_dynamic_cache": (llama_generate_dynamic_cache, 70),
    "host_syncs": (host_syncs, 30),
    "flash_backends": (flash_backends, 40),
    "mla_step_crossover": (mla_step_crossover, 90),  # makes the DeepSeek-V3 checkpoint first
    "mla_decode_grid": (mla_decode_grid, 60),
    "mla_chunked_prefill": (mla_chunked_prefill, 100),
    "train_llama_full": (lambda b: training(b, "llama", "full"), 45),
    "train_llama_lora": (lambda b: training(b, "llama", "lora"), 40),
    "train_deepseek_v3_full": (lambda b: training(b, "deepseek_v3", "full"), 35),
    "train_deepseek_v3_lora": (lambda b: training(b, "deepseek_v3", "lora"), 35),
    "compiled_decode": (compiled_decode, 150),
}


def metadata(plan: Plan, device: str) -> dict:
    """What the run measured with (the machine, versions and commit are in the result's provenance)."""
    return {"device": device, "plan": plan.name, "dtype": str(plan.dtype).removeprefix("torch."),
            "attn_implementation": "sdpa"}


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser("gpu", __doc__, repeats=None, smoke="tiny shapes, fp32, on the CPU: the code paths only")
    parser.add_argument("--parts", nargs="+", choices=list(PARTS), help="run only these parts")
    parser.add_argument("--budget", type=float, help="seconds for the whole run (parts after it skip); default: "
                                                      "the plan's (420 on the GPU)")
    args = parser.parse_args(argv)
    run = harness.begin("gpu", argv, args)
    plan = SMOKE if args.smoke else FULL
    budget = args.budget or plan.budget_s
    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    results = {"meta": metadata(plan, device), "parts": {}}
    print(run.command, json.dumps(results["meta"]), flush=True)
    run_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        bench = Bench(plan, Path(folder), device)
        for name in args.parts or PARTS:
            function, guard = PARTS[name]
            left = budget - (time.perf_counter() - run_start)
            start = time.perf_counter()
            try:
                if left < 5:
                    raise Skip(f"out of time: the run's budget of {budget:.0f} s is spent")
                with part_guard(min(guard * plan.guard_scale, left)):
                    results["parts"][name] = function(bench)
            except Skip as reason:
                results["parts"][name] = {"skipped": str(reason)}
            except (Exception, PartTimeout) as error:  # one part failing keeps the rest
                results["parts"][name] = {"error": f"{type(error).__name__}: {error}"[:500],
                                          "traceback": traceback.format_exc()[-2000:]}
                bench.models.clear()
                _empty_cache()
            results["parts"][name]["elapsed_s"] = round(time.perf_counter() - start, 2)
            status = next((k for k in ("skipped", "error") if k in results["parts"][name]), "ok")
            print(f"[{time.perf_counter() - run_start:6.1f} s] {name}: {status} in "
                  f"{results['parts'][name]['elapsed_s']:.1f} s", flush=True)
            harness.write_result(args.out, results, run)  # after every part: a cut-short run keeps what it measured
    results["total_s"] = round(time.perf_counter() - run_start, 1)
    print("\n" + gpu_table(harness.write_result(args.out, results, run)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
