"""The run: `PARTS` in order, each under its time guard, the JSON rewritten after every part."""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
import traceback
from pathlib import Path

import torch

from .. import harness
from ..pages import gpu_table
from .bench import Bench, empty_cache
from .diagnostics import generate_profile, mla_step_crossover
from .llama_parts import (compiled_decode, flash_backends, host_syncs, llama_generate, llama_generate_dynamic_cache,
                          llama_prefill)
from .mla_parts import mla_chunked_prefill, mla_decode_grid
from .plan import FULL, SMOKE, Plan
from .timing import PartTimeout, Skip, part_guard
from .training import training


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
    "mla_step_crossover": (mla_step_crossover, 90),  # makes the MLA (DeepseekV3) checkpoint first
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


def run_part(bench: Bench, name: str, left: float, budget: float) -> dict:
    """One part under its guard (never past the run's budget): its result, a skip reason, or its error."""
    function, guard = PARTS[name]
    start = time.perf_counter()
    try:
        if left < 5:
            raise Skip(f"out of time: the run's budget of {budget:.0f} s is spent")
        with part_guard(min(guard * bench.plan.guard_scale, left)):
            result = function(bench)
    except Skip as reason:
        result = {"skipped": str(reason)}
    except (Exception, PartTimeout) as error:  # one part failing keeps the rest
        result = {"error": f"{type(error).__name__}: {error}"[:500], "traceback": traceback.format_exc()[-2000:]}
        bench.models.clear()
        empty_cache()
    return result | {"elapsed_s": round(time.perf_counter() - start, 2)}


def main(argv: list[str] | None = None) -> int:
    from . import __doc__ as overview

    parser = harness.parser("gpu", overview, repeats=None, smoke="tiny shapes, fp32, on the CPU: the code paths only")
    parser.add_argument("--repeats", type=int, help="timed repeats of each generate and training case (default: the "
                                                    "plan's, 2 on the GPU)")
    parser.add_argument("--parts", nargs="+", choices=list(PARTS), help="run only these parts")
    parser.add_argument("--budget", type=float, help="seconds for the whole run (parts after it skip); default: "
                                                      "the plan's (420 on the GPU)")
    args = parser.parse_args(argv)
    run = harness.begin("gpu", argv, args)
    plan = SMOKE if args.smoke else FULL
    if args.repeats:
        plan = dataclasses.replace(plan, repeats=args.repeats)
    budget = args.budget or plan.budget_s
    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    results = {"meta": metadata(plan, device), "parts": {}}
    print(run.command, json.dumps(results["meta"]), flush=True)
    run_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        bench = Bench(plan, Path(folder), device)
        for name in args.parts or PARTS:
            left = budget - (time.perf_counter() - run_start)
            results["parts"][name] = part = run_part(bench, name, left, budget)
            status = next((k for k in ("skipped", "error") if k in part), "ok")
            print(f"[{time.perf_counter() - run_start:6.1f} s] {name}: {status} in {part['elapsed_s']:.1f} s",
                  flush=True)
            harness.write_result(args.out, results, run)  # after every part: a cut-short run keeps what it measured
    results["total_s"] = round(time.perf_counter() - run_start, 1)
    print("\n" + gpu_table(harness.write_result(args.out, results, run)), flush=True)
    return 0
