"""Diagnostic parts: where the big-batch eager-generate gap goes (`generate_profile`) and where MLA's absorbed step
stops paying on this device (`mla_step_crossover`)."""

from __future__ import annotations

import torch

from modular_decoder.compat import with_cache
from modular_decoder.mla import ABSORBED_MAX_NEW_TOKENS, set_decode_mode

from ..measure import PeakMemory, wall
from .bench import Bench, dynamic_cache, empty_cache, generate, no_extra
from .mla_parts import filled_cache
from .profiler import difference, digest, profiled
from .timing import PartTimeout, timed


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
        return lambda: generate(model, prompt, tokens, **extra(model))

    call(new)()  # warm-up
    plain_one = wall(call(1))
    with PeakMemory(model.device) as peak:
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
                caches = [filled_cache(model, batch, context, side, bench.device)
                          for side, model in zip(("transformers", "ours"), pair)]
                for new in plan.crossover_new_tokens:
                    point[f"new{new}"] = cell = _crossover_cell(bench, pair, caches, batch, context, new)
                    rows.append(_crossover_row(batch, context, new, cell))
            except torch.OutOfMemoryError as error:  # filling the caches
                point["oom"] = str(error)[:300]
                rows.append((f"MLA step b{batch} x {context:,}", "", "out of memory filling the caches", ""))
            finally:
                caches = None
                empty_cache()
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
        with PeakMemory(model.device) as peak:
            run(model)
        return {"ms": 1e3 * seconds, "peak_gib": peak.above_gib}
    except torch.OutOfMemoryError as error:
        empty_cache()
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
        empty_cache()


def _probe_row(batch: int, context: int, probe: dict) -> tuple:
    label = (f"MLA fused-SDPA probe b{batch} x {context:,} + 1 new, one [latent, rotary] K/V head "
             f"(ms: matmuls / SDPA [op]; ratio: matmuls / SDPA)")
    if "error" in probe:
        return label, "", probe["error"][:80], ""
    return (label, "", f"{probe['matmuls_ms']:.3f} / {probe['sdpa_ms']:.3f} [{_sdpa_cell(probe['sdpa_ops'])}]",
            f"{probe['matmuls_ms'] / probe['sdpa_ms']:.2f}x")

