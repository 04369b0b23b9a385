"""Worker of `test_ecosystem.test_parallel_engines_on_two_processes`: transformers' tensor parallelism, FSDP2
(`fully_shard` and transformers' `DistributedConfig(fsdp_size=2)`) and DeepSpeed ZeRO-3 on two CPU processes
(gloo), each on transformers' own class and on ours with the same weights, each against one process.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/eco_parallel_worker.py ROOT OUT

ROOT/<case>/src is a transformers checkpoint, ROOT/<case>/ours the same weights converted; both load with
`AutoModelForCausalLM.from_pretrained(folder)`. Rank 0 writes OUT: for every (case, side, engine) the largest
differences from one process (logits, every gradient, a one-token no-grad step: the few-row product path)
and whether greedy `generate` is equal, or the error; for the tensor-parallel runs also ours against
transformers' class under the same engine. The no-grad evaluation (the step, `generate`) runs with two threads
per process, where the split products engage (`split_products.py`): the engine's model against the one-process
reference, whose ours side records that the split ran (`split_products`).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")
torch.set_num_threads(1)  # two processes on two cores
import modular_decoder  # noqa: E402,F401  (registers the Auto classes: the default load path)
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.distributed import DistributedConfig  # noqa: E402

from modular_decoder import split_products  # noqa: E402
from modular_decoder.tuning import set_tuning  # noqa: E402

set_tuning(min_split_weight=0)  # the tiny test weights split too: the engines are held to the split path
split_products.set_split_products("always")  # whatever a timing would say on this machine

ROOT, OUT = Path(sys.argv[1]), Path(sys.argv[2])
TP_CASES = ("llama", "olmo2", "deepseek_v2", "mixtral")  # standard, qk_norm="full", MLA + MoE, MoE
SIDES = ("src", "ours")
IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
RANK = int(os.environ["RANK"])
results: dict[str, dict] = {}
outputs: dict[tuple[str, str, str], torch.Tensor] = {}  # (case, engine, side) -> logits (ZeRO-3: the loss)


@contextlib.contextmanager
def two_threads():
    """No-grad evaluation with two threads, counting the products the split ran (the few-row path needs
    more than one thread; training stays on one thread per process, two processes on two cores)."""
    split, real = [], split_products._splits
    split_products._splits = lambda *args: _record(split, real, *args)
    torch.set_num_threads(2)
    try:
        with torch.no_grad():
            yield split
    finally:
        torch.set_num_threads(1)
        split_products._splits = real


def _record(split: list, real, *args) -> int:
    parts = real(*args)
    if parts > 1:
        split.append(parts)
    return parts


def load(case: str, side: str, **kwargs):
    return AutoModelForCausalLM.from_pretrained(ROOT / case / side, **kwargs)


def full(tensor):
    """The whole tensor of a DTensor (parameters, gradients, outputs), else the tensor."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def reference(case: str, side: str):
    model = load(case, side).eval()
    out = model(IDS, labels=IDS)
    out.loss.backward()
    grads = {name: param.grad.clone() for name, param in model.named_parameters()}
    return model, out.logits.detach(), grads


def compare(case: str, side: str, engine: str, build) -> None:
    """`build()` gives the distributed model; record how it differs from one process."""
    key, start = f"{case}/{side}/{engine}", time.perf_counter()
    try:
        ref, ref_logits, ref_grads = reference(case, side)
        model = build().eval()
        out = model(IDS, labels=IDS)
        logits = full(out.logits).detach()
        out.loss.backward()
        grads = max((full(p.grad) - ref_grads[n]).abs().max().item() for n, p in model.named_parameters())
        with two_threads() as reference_split:
            expected_step = ref(IDS[:, :1]).logits
            expected = ref.generate(IDS, max_new_tokens=4, do_sample=False)
        with two_threads():
            step = (full(model(IDS[:, :1]).logits) - expected_step).abs().max().item()
            generated = model.generate(IDS, max_new_tokens=4, do_sample=False)
        results[key] = {"logits": (logits - ref_logits).abs().max().item(), "grads": grads, "step": step,
                        "generate": torch.equal(generated, expected), "reference_split": len(reference_split),
                        "parameter_types": sorted({type(p).__name__ for p in model.parameters()}), "error": None}
        outputs[case, engine, side] = logits
        results[key]["seconds"] = round(time.perf_counter() - start, 1)
    except Exception as error:  # recorded, so that one failure does not hide the others
        results[key] = {"error": f"{type(error).__name__}: {error}".splitlines()[0][:500],
                        "where": traceback.format_exc()[-1500:]}


def fully_sharded(case: str, side: str):
    from torch.distributed.fsdp import fully_shard

    model = load(case, side)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def zero3(case: str, side: str, mode: str) -> None:
    """DeepSpeed ZeRO-3 on its CPU accelerator: `wrap` (load, then `deepspeed.initialize`) or `zero_init`
    (load while transformers' `HfDeepSpeedConfig` is alive, so parameters are partitioned as they load). The
    loss equals one process's, and one optimizer step runs."""
    key, start = f"{case}/{side}/deepspeed_{mode}", time.perf_counter()
    try:
        import deepspeed
        from transformers.integrations import HfDeepSpeedConfig

        expected = load(case, side)(IDS, labels=IDS).loss.item()
        ds_config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                     "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True}
        keep = HfDeepSpeedConfig(ds_config) if mode == "zero_init" else None
        model = load(case, side)
        partitioned = all(p.numel() == 0 for p in model.parameters()) if mode == "zero_init" else None
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config,
                                          optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
        del keep
        with two_threads() as reference_split:  # evaluation: a one-token step beside the one-process model's
            expected_step = load(case, side)(IDS[:, :1]).logits
        with two_threads():
            step = (engine.module(IDS[:, :1]).logits - expected_step).abs().max().item()
        loss = engine(IDS, labels=IDS).loss
        engine.backward(loss)
        engine.step()
        outputs[case, f"deepspeed_{mode}", side] = loss.detach()
        results[key] = {"loss": abs(loss.item() - expected), "value": loss.item(), "partitioned": partitioned,
                        "step": step, "reference_split": len(reference_split), "error": None, "seconds": round(time.perf_counter() - start, 1)}
    except Exception as error:
        results[key] = {"error": f"{type(error).__name__}: {error}".splitlines()[0][:500],
                        "where": traceback.format_exc()[-1500:]}


STARTED = time.perf_counter()
dist.init_process_group("gloo")
for case in TP_CASES:
    for side in SIDES:
        compare(case, side, "tp_plan_auto", lambda: load(case, side, tp_plan="auto"))
for side in SIDES:
    compare("llama", side, "fsdp_distributed_config",
            lambda: load("llama", side, distributed_config=DistributedConfig(fsdp_size=2)))
    compare("llama", side, "fully_shard", lambda: fully_sharded("llama", side))
for mode in ("wrap", "zero_init"):
    for side in SIDES:
        zero3("llama", side, mode)
# ours against transformers' class under the same engine (same weights)
for case, engine in sorted({(case, engine) for case, engine, _ in outputs}):
    if (case, engine, "src") in outputs and (case, engine, "ours") in outputs:
        difference = (outputs[case, engine, "ours"] - outputs[case, engine, "src"]).abs().max().item()
        results[f"{case}/ours_vs_src/{engine}"] = {"difference": difference, "error": None}
results["seconds"] = {"all": round(time.perf_counter() - STARTED, 1)}
if RANK == 0:
    OUT.write_text(json.dumps(results, indent=1))
dist.barrier()
dist.destroy_process_group()  # a live gloo group at interpreter exit can abort the process
