"""The family suite: ours vs transformers' own class, same weights, one process, fp32.

    python -m benchmarks run [--families llama gpt2 ...] [--repeats 3] [--out bench.json] [--smoke]

For each family (see benchmarks/families.py): prefill tokens/s at 1xP and 4xP (no cache, last
logits only), greedy decode tokens/s at batch 1 and batch B over N new tokens (steps after the
prompt's forward), the median step time over the first and last 8 steps, the median step time of
batch-1 decode steps that transformers' model and ours take in turn (each forward on its own cache,
no generate loop: every step of ours beside one of transformers' under the same load; one value per
repeat of N steps), and the peak resident memory added during a batch-B decode. The two models run alternately inside each repeat (their
order flipping every repeat) so machine noise hits both alike; the table shows the median over
repeats, the ratio ours / transformers, and the spread (min-max) over repeats. The batch-1 decode
roofline is the measured copy bandwidth divided by the weight bytes a step must read (for the
mixture-of-experts families the active weights only: every routed expert but the chosen top-k skipped).

Beyond speed (issue 13, item 7), each on by default unless said otherwise:

- memory (`--no-memory` skips): each model loaded in a fresh process (`benchmarks/memory.py`), peak
  resident memory during `from_pretrained` (memory-mapped weights not yet read count nothing), resident
  memory after every weight has been read once (what the weights really occupy, experts included), and
  the peak during load + a batch-B decode, MB above that process's pre-load baseline;
- training (`--no-train` skips): tokens/s of a full fine-tune step (forward + backward + AdamW step)
  and of a LoRA step (peft, r=8, the same linear maps on both sides: `families.LORA_TARGETS`;
  forward + backward + AdamW step on the adapters), `--train-batch` x `--train-seq` random tokens;
- largest batch (`--max-batch-mb MB`, off by default: the heaviest extra): the largest decode batch
  at `--max-batch-context` cached tokens whose peak memory (weights included) fits MB, by doubling and
  bisection over actual runs in the fresh process (see `benchmarks/memory.py`).

Mixture-of-experts families: both sides are treated alike. By default each model runs the experts
implementation (`experts_implementation`: "eager", the model's own forward, or transformers'
"grouped_mm" / "batched_mm") that the same short calibration finds fastest for that model, separately
for prefill and decode; the training steps use the prefill choice; "batched_mm" is tried for decode
only (`choose_experts`). `--experts-implementation NAME` runs NAME on both sides. The table names what
each side used and how it was chosen.

Timed runs never share the process with a memory-sampling thread: the "decode bB peak" row comes from
one separate, untimed batch-B run per model after the timed repeats.
`--smoke` runs tiny shapes with short sequences, one repeat: a smoke test, not a measurement.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

from modular_decoder.compat import attn_implementation
from modular_decoder.split_products import set_split_products, split_decisions, split_products_mode

from modular_decoder import parameter_count

from . import harness
from .families import CONFIGS, LORA_TARGETS, MOE_FAMILIES, build_pair
from .measure import (active_bytes_read_per_step, alternating, bytes_read_per_step, copy_bandwidth, decode,
                      interleaved_decode_steps, prefill, train_step)
from .memory import run_probes

# "ours" is the model as `from_pretrained` gives it (few-row products split across the cores by
# `modular_decoder.split_products` where this process's mode says: by default where timed to pay on this machine,
# computation only); "ours, no split products" is the same object with them switched off around its measurements
# (an ablation).
SPLIT_MODE = split_products_mode()
MODELS = ("transformers", "ours", "ours, no split products")
# metric key -> (row label, higher is better)
ROWS = {
    "prefill_1": ("prefill 1x{P} tok/s", True),
    "prefill_4": ("prefill 4x{P} tok/s", True),
    "decode_1": ("decode b1 tok/s", True),
    "step_start_1": ("b1 step ms, first 8", False),
    "step_end_1": ("b1 step ms, last 8", False),
    "step_turns_1": ("b1 step ms, the two taking steps in turn", False),
    "decode_B": ("decode b{B} tok/s", True),
    "peak_mb_B": ("decode b{B} peak +MB (separate untimed run, `measure.PeakMemory`)", False),
}
# Rows measured for transformers and ours only: the split products engage neither in training nor
# in loading, so the ablation column would repeat ours.
PAIR = MODELS[:2]


def timed_models() -> tuple[str, ...]:
    """The models the speed rows time: all three, or with one torch thread (`--threads 1`) transformers and ours only,
    since the split products then never engage (`split_products`) and the ablation would time ours twice."""
    return MODELS if torch.get_num_threads() > 1 else PAIR
TRAIN_ROWS = {
    "train_full": ("train full FT tok/s (fwd+bwd+AdamW, {TB}x{TS})", True),
    "train_lora": ("train LoRA tok/s (fwd+bwd+AdamW, r=8, {lora})", True),
}
MEMORY_ROWS = {
    "load_peak_mb": ("load peak +MB (fresh process; mapped weights not yet read)", False),
    "resident_mb": ("resident +MB after load, every weight read (fresh process)", False),
    "load_decode_peak_mb": ("load + decode b{B} peak +MB (fresh process)", False),
    "max_batch": ("max decode batch, {C} tok in {M:g} MB (measured)", True),
}
EXPERTS_CANDIDATES = ("eager", "grouped_mm", "batched_mm")
PREFILL_EXPERTS = ("eager", "grouped_mm")  # batched_mm: decode only (see choose_experts)


def _select_variant(models: dict, name: str, phase: str = "decode", experts: dict | None = None) -> None:
    """Split products on or off for `name`; with experts, every model runs its choice for `phase`
    (`experts`: {"transformers": {phase: implementation}, "ours": {...}})."""
    set_split_products("off" if name == "ours, no split products" else SPLIT_MODE)
    if experts:
        for side in PAIR:
            models[side].set_experts_implementation(experts[side][phase])


def choose_experts(model, long: torch.Tensor, short: torch.Tensor, args) -> dict:
    """The fastest experts implementation of `model` for prefill (1xP, no cache) and for batch-1 decode,
    each candidate timed over `args.calibration_rounds` interleaved rounds (median). `batched_mm` is a
    decode candidate only: it gathers every token's experts' weights (a copy per token), which took
    minutes per 512-token forward of the Mixtral layout."""
    if args.experts_implementation != "auto":
        return {"prefill": args.experts_implementation, "decode": args.experts_implementation,
                "train": args.experts_implementation, "calibration": None}
    def calibration_round(candidate: str) -> dict:
        model.set_experts_implementation(candidate)
        rates = {"decode_1": decode(model, short[:1], args.calibration_tokens)["tokens_per_s"]}
        if candidate in PREFILL_EXPERTS:
            rates["prefill_1"] = prefill(model, long[:1])["tokens_per_s"]
        return rates

    with torch.inference_mode():
        for candidate in EXPERTS_CANDIDATES:  # warm-up: first-call allocations and lazy inits of each
            model.set_experts_implementation(candidate)
            prefill(model, long[:1, :32])
            decode(model, short[:1], 2)
        rounds = alternating({c: partial(calibration_round, c) for c in EXPERTS_CANDIDATES}, args.calibration_rounds,
                             warmup=0)
    medians = {key: {c: statistics.median(r[key] for r in rates) for c, rates in rounds.items() if key in rates[0]}
               for key in ("prefill_1", "decode_1")}
    best = {phase: max(medians[key], key=medians[key].get) for phase, key in (("prefill", "prefill_1"),
                                                                             ("decode", "decode_1"))}
    return {**best, "train": best["prefill"], "calibration": medians}


def choose_experts_both(reference, ours, long: torch.Tensor, short: torch.Tensor, args) -> dict:
    """{"transformers": choice, "ours": choice}: the same rule for both sides, a calibration of each
    model per phase (`auto`), or the one implementation `--experts-implementation` names."""
    return {"transformers": choose_experts(reference, long, short, args), "ours": choose_experts(ours, long, short, args)}


def measure_family(reference, ours, args, experts: dict | None = None) -> dict:
    """{metric: {model: [value per repeat]}}, the models alternating (`measure.alternating`). Prefill forwards are
    short (0.2-5 s): `--prefill-samples` per repeat, interleaved across the models, their median the repeat's value,
    so that a burst of machine noise hits all alike. Timed runs have no memory probe; the batch-B peak comes from
    one separate run per model afterwards."""
    vocab = reference.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(1)
    long = torch.randint(0, vocab, (4, args.prefill), generator=generator)
    short = torch.randint(0, vocab, (args.decode_batch, args.prompt), generator=generator)
    models = {"transformers": reference, "ours": ours, "ours, no split products": ours}

    def prefill_round(name: str) -> dict:
        _select_variant(models, name, "prefill", experts)
        return {key: prefill(models[name], batch)["tokens_per_s"] for key, batch in (("prefill_1", long[:1]),
                                                                                      ("prefill_4", long))}

    def decode_round(name: str) -> dict:
        _select_variant(models, name, "decode", experts)
        one, many = (decode(models[name], prompts, args.new_tokens) for prompts in (short[:1], short))
        return {"decode_1": one["tokens_per_s"], "step_start_1": one["step_ms_start"],
                "step_end_1": one["step_ms_end"], "decode_B": many["tokens_per_s"]}

    with torch.inference_mode():
        for model in (reference, ours):  # warm-up: first-call allocations, lazy inits (short calls)
            prefill(model, long[:1, :32])
            decode(model, short[:1], 4)
        names = timed_models()
        samples = alternating({name: partial(prefill_round, name) for name in names},
                              args.repeats * args.prefill_samples, warmup=0, label="prefill")
        decodes = alternating({name: partial(decode_round, name) for name in names}, args.repeats, warmup=0,
                              label="decode")
        values = {key: {name: [] for name in names} for key in ROWS}
        for name in names:
            for repeat in range(args.repeats):
                chunk = samples[name][repeat * args.prefill_samples:(repeat + 1) * args.prefill_samples]
                for key in ("prefill_1", "prefill_4"):
                    values[key][name].append(statistics.median(sample[key] for sample in chunk))
            for figures in decodes[name]:
                for key, value in figures.items():
                    values[key][name].append(value)
            # memory: untimed, after the timed runs
            _select_variant(models, name, "decode", experts)
            values["peak_mb_B"][name].append(decode(models[name], short, args.new_tokens, sample_memory=True)["peak_mb"])
        values["step_turns_1"] = steps_in_turn(models, short[:1], args, experts)
    set_split_products(SPLIT_MODE)
    return values


def steps_in_turn(models: dict, prompt: torch.Tensor, args, experts: dict | None) -> dict:
    """{transformers / ours: the median step ms of each of `--repeats` runs of `--new-tokens` batch-1 decode steps},
    the two models taking their steps in turn, each on its own cache (`measure.interleaved_decode_steps`: the forward
    alone, every step of ours beside one of transformers' under the same load of a shared machine)."""
    _select_variant(models, "ours", "decode", experts)
    steps = interleaved_decode_steps({name: models[name] for name in PAIR}, prompt, args.repeats * args.new_tokens)
    return {name: [1e3 * statistics.median(times[start:start + args.new_tokens])
                   for start in range(0, len(times), args.new_tokens)] for name, times in steps.items()}


def _lora_config(model, targets: list[str]):
    from peft import LoraConfig
    from transformers.pytorch_utils import Conv1D

    conv1d = any(isinstance(m, Conv1D) and name.split(".")[-1] in targets for name, m in model.named_modules())
    return LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=targets, fan_in_fan_out=conv1d)


def measure_training(reference, ours, family: str, args, experts: dict | None = None) -> tuple[dict, dict]:
    """({metric: {model: [tokens/s per repeat]}}, details) for a full fine-tune step and a LoRA step,
    the two models alternating inside every repeat (each repeat's value: the median of
    `args.train_steps` steps, after one untimed warm-up step per model that allocates the optimizer
    state). Runs after the inference rows: the steps change the weights (lr 1e-5 / 1e-4)."""
    from peft import get_peft_model

    vocab = reference.config.get_text_config().vocab_size
    batch = torch.randint(0, vocab, (args.train_batch, args.train_seq), generator=torch.Generator().manual_seed(2))
    set_split_products(SPLIT_MODE)
    if experts:
        for side, model in (("transformers", reference), ("ours", ours)):
            model.set_experts_implementation(experts[side]["train"])
    values = {key: {name: [] for name in PAIR} for key in TRAIN_ROWS}
    details = {}

    def timed(key: str, models: dict, optimizers: dict) -> None:
        def steps(name: str) -> float:  # a repeat: the median of `--train-steps` steps, as tokens/s
            return batch.numel() / statistics.median(train_step(models[name], batch, optimizers[name])
                                                     for _ in range(args.train_steps))

        for name in PAIR:  # warm-up: one step each (allocates the optimizer state)
            train_step(models[name], batch, optimizers[name])
        values[key] = alternating({name: partial(steps, name) for name in PAIR}, args.repeats, warmup=0, label=key)

    models = {"transformers": reference.train(), "ours": ours.train()}
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-5) for name, m in models.items()}
    details["full_trainable"] = {name: sum(p.numel() for p in m.parameters() if p.requires_grad)
                                 for name, m in models.items()}
    timed("train_full", models, optimizers)
    del optimizers
    gc.collect()

    targets = dict(zip(PAIR, LORA_TARGETS[family]))
    peft_models = {name: get_peft_model(models[name], _lora_config(models[name], targets[name])) for name in PAIR}
    optimizers = {name: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4)
                  for name, m in peft_models.items()}
    details["lora_targets"] = targets
    details["lora_trainable"] = {name: sum(p.numel() for p in m.parameters() if p.requires_grad)
                                 for name, m in peft_models.items()}
    timed("train_lora", peft_models, optimizers)
    del optimizers
    for name, m in peft_models.items():
        m.unload()  # the plain model again (adapter layers removed, base weights kept)
    for m in (reference, ours):
        m.eval().requires_grad_(False)
        m.zero_grad(set_to_none=True)
    gc.collect()
    return values, details


def measure_memory(folder: Path, args, experts: dict | None) -> dict:
    """{model: probe result}: each checkpoint loaded in its own fresh process (benchmarks/memory.py)."""
    common = dict(batch=args.decode_batch, prompt=args.prompt, new_tokens=args.new_tokens, threads=args.threads,
                  budget_mb=args.max_batch_mb, context=args.max_batch_context, steps=args.max_batch_steps,
                  cap=args.max_batch_cap)
    return run_probes({
        side: dict(folder=folder / sub, experts_implementation=experts[side]["decode"] if experts else None, **common)
        for side, sub in (("transformers", "hf"), ("ours", "ours"))
    })


def memory_values(probes: dict) -> dict:
    """The probes as {metric: {model: [value]}} rows (one fresh-process measurement per model)."""
    values = {key: {name: [probes[name][key]] for name in PAIR}
              for key in ("load_peak_mb", "resident_mb", "load_decode_peak_mb")}
    if all("max_batch" in probes[name] for name in PAIR):
        values["max_batch"] = {name: [probes[name]["max_batch"]["batch"]] for name in PAIR}
    return values


def summarise(values: dict) -> dict:
    out = {}
    for key, per_model in values.items():
        row = {name: {"median": statistics.median(v), "min": min(v), "max": max(v), "all": v}
               for name, v in per_model.items()}
        ref = row["transformers"]["median"]
        row["ratio"] = {name: row[name]["median"] / ref if ref else float("nan") for name in per_model if
                        name != "transformers"}
        out[key] = row
    return out


def _cell(stats: dict | None, key: str = "") -> str:
    if stats is None:
        return "—"
    if key == "max_batch":
        return f"{stats['median']:.0f}"
    if len(stats["all"]) == 1 and key in MEMORY_ROWS:
        return f"{stats['median']:.1f}"
    spread = stats["max"] - stats["min"]
    return f"{stats['median']:.1f} ±{spread / 2:.1f}"


def _ratio(row: dict, name: str, key: str) -> str:
    ratio = row["ratio"].get(name)
    if ratio is None or math.isnan(ratio):  # nan: transformers measured 0 (e.g. no batch fits the budget)
        return "—"
    # a memory delta near zero (under 1 MB) makes a meaningless ratio
    if key.endswith("_mb") or key == "peak_mb_B":
        if row["transformers"]["median"] < 1:
            return "—"
    return f"{ratio:.2f}"


def _family_cell(family: str, result: dict) -> str:
    backends = "/".join(sorted(set(result["attn_implementation"].values())))
    size = f"{result['params_m']:.0f}M"
    if result.get("active_params_m") and result["active_params_m"] < result["params_m"]:
        size += f", {result['active_params_m']:.0f}M active"
    return f"**{family}** ({result['label']}, {size}, {backends})"


def table(results: dict, args) -> str:
    """The family table (docs/benchmarks.md, via benchmarks.pages): every family's rows, then its roofline."""
    lines = [
        "| family | metric | transformers | ours | ours, no split products | ratio | ratio, no split products |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for family, result in results["families"].items():
        first = True
        fields = dict(P=args.prefill, B=args.decode_batch, TB=args.train_batch, TS=args.train_seq,
                      C=args.max_batch_context, M=args.max_batch_mb,
                      lora=",".join(result.get("training", {}).get("lora_targets", {}).get("ours", [])))
        for key, (label, _) in {**ROWS, **TRAIN_ROWS, **MEMORY_ROWS}.items():
            row = result["metrics"].get(key)
            if row is None:
                continue
            name = _family_cell(family, result) if first else ""
            first = False
            cells = [_cell(row.get(model), key) for model in MODELS]
            if key == "max_batch":  # the bisection stopped at --max-batch-cap: a lower bound
                cells = [("≥" if result["memory"][model]["max_batch"]["capped"] else "") + cell if model in PAIR
                         else cell for model, cell in zip(MODELS, cells)]
            lines.append(f"| {name} | {label.format(**fields)} | " + " | ".join(cells) + " | "
                         + " | ".join(_ratio(row, model, key) for model in MODELS[1:]) + " |")
        experts = result.get("experts_implementation")
        if experts:
            how = ("each side calibrated per phase, same candidates and rounds" if experts["ours"].get("calibration")
                   else "fixed for both sides")
            used = "; ".join(f"{side} prefill `{experts[side]['prefill']}`, decode `{experts[side]['decode']}`, "
                             f"train `{experts[side]['train']}`" for side in PAIR)
            lines.append(f"| | experts_implementation ({how}): {used} | | | | | |")
        bound = result["roofline_b1_tok_s"]
        shares = " | ".join(f"{100 * result['metrics']['decode_1'][name]['median'] / bound:.0f}% of it"
                            if name in result["metrics"]["decode_1"] else "—" for name in MODELS)
        if result.get("moe"):
            what = (f"b1 roofline (read the active weights once: {result['step_mb']:.0f} of "
                    f"{result['weights_mb']:.0f} MB/step = {1e3 / bound:.1f} ms) {bound:.1f} tok/s")
        else:
            what = f"b1 roofline {bound:.1f} tok/s ({result['step_mb']:.0f} MB/step)"
        lines.append(f"| | {what} | {shares} | | |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = harness.parser("run", __doc__, smoke="tiny shapes, short sequences, 1 repeat: a smoke test")
    parser.add_argument("--families", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--prefill", type=int, default=512, help="prompt length P of the prefill rows")
    parser.add_argument("--prompt", type=int, default=32, help="prompt length before decoding")
    parser.add_argument("--prefill-samples", type=int, default=3,
                        help="prefill forwards per model and repeat; their median is the repeat's value")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--decode-batch", type=int, default=8)
    extra = parser.add_argument_group("memory, training, largest batch")
    extra.add_argument("--no-memory", action="store_true", help="skip the fresh-process memory probes")
    extra.add_argument("--no-train", action="store_true", help="skip the training throughput rows")
    extra.add_argument("--train-batch", type=int, default=2)
    extra.add_argument("--train-seq", type=int, default=128)
    extra.add_argument("--train-steps", type=int, default=2, help="timed steps per model, mode and repeat")
    extra.add_argument("--max-batch-mb", type=float, default=None,
                       help="memory budget (MB above the pre-load baseline, weights included): adds the "
                            "largest-decode-batch row (off by default; the heaviest extra)")
    extra.add_argument("--max-batch-context", type=int, default=1024, help="cached tokens per sequence")
    extra.add_argument("--max-batch-steps", type=int, default=2, help="decode steps per probe")
    extra.add_argument("--max-batch-cap", type=int, default=1024, help="largest batch tried")
    moe = parser.add_argument_group("mixture-of-experts families")
    moe.add_argument("--experts-implementation", default="auto", choices=("auto",) + EXPERTS_CANDIDATES,
                     help="both sides: auto = each model's fastest by the same short calibration, per phase; "
                          "a name = that implementation for both")
    moe.add_argument("--calibration-rounds", type=int, default=2)
    moe.add_argument("--calibration-tokens", type=int, default=16, help="decode steps per calibration round")
    args = parser.parse_args(argv)
    if args.smoke:
        args.repeats, args.prefill, args.prompt, args.new_tokens, args.decode_batch = 1, 32, 8, 8, 2
        args.prefill_samples = 1
        args.train_batch, args.train_seq, args.train_steps = 1, 16, 1
        args.max_batch_context, args.max_batch_cap = min(args.max_batch_context, 64), min(args.max_batch_cap, 16)
        args.calibration_rounds, args.calibration_tokens = 1, 4
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    run = harness.begin("run", argv, args)
    bandwidth = copy_bandwidth(64 if args.smoke else 256)
    results = {"copy_bandwidth_gb_s": bandwidth / 1e9, "families": {}}
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s, {torch.get_num_threads()} threads, "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    for family in args.families:
        start = time.perf_counter()
        entry = {}
        phases, clock = {}, time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            reference, ours, label = build_pair(family, Path(tmp), args.smoke)
            moe = family in MOE_FAMILIES
            weight_bytes = bytes_read_per_step(ours)
            step_bytes = active_bytes_read_per_step(ours)
            counts = parameter_count(ours.config)
            backends = {"transformers": attn_implementation(reference.config), "ours": attn_implementation(ours.config)}
            experts = None
            if moe:
                vocab = reference.config.get_text_config().vocab_size
                generator = torch.Generator().manual_seed(3)
                experts = choose_experts_both(reference, ours,
                                              torch.randint(0, vocab, (1, args.prefill), generator=generator),
                                              torch.randint(0, vocab, (1, args.prompt), generator=generator), args)
                entry["experts_implementation"] = experts
                print(f"{family}: experts_implementation " + ", ".join(
                    f"{side} prefill {experts[side]['prefill']}, decode {experts[side]['decode']}" for side in PAIR),
                    flush=True)
            phases["build_and_calibrate"], clock = time.perf_counter() - clock, time.perf_counter()
            values = measure_family(reference, ours, args, experts)
            phases["speed"], clock = time.perf_counter() - clock, time.perf_counter()
            if not args.no_train:
                train_values, entry["training"] = measure_training(reference, ours, family, args, experts)
                values.update(train_values)
                phases["training"], clock = time.perf_counter() - clock, time.perf_counter()
            del reference, ours
            gc.collect()
            if not args.no_memory:
                entry["memory"] = measure_memory(Path(tmp), args, experts)
                values.update(memory_values(entry["memory"]))
                phases["memory"] = time.perf_counter() - clock
            metrics = summarise(values)
            entry["phase_seconds"] = phases
        results["families"][family] = {
            "label": label, "attn_implementation": backends, "params_m": counts["total"] / 1e6,
            "active_params_m": counts["active"] / 1e6, "moe": moe, "weights_mb": weight_bytes / 1e6,
            "step_mb": step_bytes / 1e6, "roofline_b1_tok_s": bandwidth / step_bytes, "metrics": metrics, **entry,
            "seconds": time.perf_counter() - start, "load_average": os.getloadavg(),
        }
        print(f"{family}: {time.perf_counter() - start:.0f} s ("
              + ", ".join(f"{k} {v:.0f} s" for k, v in entry["phase_seconds"].items())
              + f"), load average {os.getloadavg()[0]:.2f}", flush=True)
    print(table(results, args))
    results["split_products"] = {"mode": SPLIT_MODE, "decisions": [  # what mode "auto" timed, per product shape
        {"out_in_rows_threads_slices_bias": list(key), **decision} for key, decision in split_decisions().items()]}
    harness.write_result(args.out, results, run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
