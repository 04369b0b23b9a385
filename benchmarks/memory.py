"""Resident memory of one model, measured in a fresh process: load, decode, largest batch in a budget.

    python -m benchmarks.memory FOLDER [--batch 8 --prompt 32 --new-tokens 128]
                                [--budget-mb 2048 --context 1024] [--experts-implementation eager]

The parent (`benchmarks.run`) starts one such process per model so that neither load pollutes the
other's numbers. Every number is MB of resident memory (RSS) above the process's level right after its
imports, before `from_pretrained`: the *pre-load baseline*. Peaks are the kernel's high-water mark
(`measure.PeakMemory`: `VmHWM` in /proc/self/status, reset between phases by writing 5 to
/proc/self/clear_refs), so no short peak is missed; where that reset is refused, a thread samples RSS every
millisecond instead (`method` in the output says which).

- load: peak during `AutoModelForCausalLM.from_pretrained(FOLDER, dtype=float32)`, and RSS after it.
  Small for an fp32 safetensors checkpoint on both sides: the weights stay memory-mapped and enter RSS
  (as file pages, `after_decode_mb`) when the first forward reads them, so the decode peak includes them;
- resident (`resident_mb`): RSS after every parameter has been read once (a sum over each, so every
  page of every expert is resident whichever experts routing would pick): the memory the weights
  occupy once used, the fair comparison of a loader that maps the file with one that copies it;
- decode: peak during a greedy `generate()` of batch x (prompt + new tokens), the suite's decode shape;
- largest batch (`--budget-mb`): the largest B whose decode at CONTEXT tokens keeps the peak within the
  budget (weights included, since the baseline is pre-load), found by doubling then bisection, each
  probe an actual run: a batch-1 forward over CONTEXT - STEPS prompt tokens fills the model's own cache,
  `cache.batch_repeat_interleave(B)` turns it into B sequences, then STEPS decode steps run at batch B
  (the first step already holds the largest transient: a layer's cache while it grows by one token).
  The batch-B prefill is not part of a probe (a server prefills requests a few at a time and decodes
  them together); the cache, its growth over the steps and the decode activations are.

Prints one JSON object as its last line.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from .measure import MB, PeakMemory, _proc_status
ROOT = Path(__file__).resolve().parents[1]
# Large blocks straight from mmap and back to the kernel when freed (glibc otherwise raises its mmap
# threshold after the first free and keeps freed blocks resident): the probes of a bisection then do
# not inherit each other's freed memory. The same setting for both models.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(256 * 1024), "MALLOC_TRIM_THRESHOLD_": str(1024 * 1024)}


def _status() -> dict:
    return _proc_status()


def _split(baseline: dict) -> dict:
    """RSS now above `baseline`, MB, split into anonymous memory and file-backed pages (mapped weights)."""
    now = _status()
    return {kind: (now[key] - baseline[key]) / MB for kind, key in (("anon", "RssAnon"), ("file", "RssFile"))}


def _fits(model, context: int, steps: int, batch: int, vocab: int, baseline: int) -> tuple[float, float]:
    """(peak MB above baseline of one probe at `batch`, RSS MB above baseline after it is freed)."""
    import torch

    from modular_decoder.compat import cache_of

    generator = torch.Generator().manual_seed(batch)
    prompt = torch.randint(0, vocab, (1, context - steps), generator=generator)
    with PeakMemory("cpu") as peak, torch.inference_mode():
        cache = cache_of(model(prompt, use_cache=True, logits_to_keep=1))
        cache.batch_repeat_interleave(batch)
        for _ in range(steps):
            ids = torch.randint(0, vocab, (batch, 1), generator=generator)
            model(ids, cache=cache, use_cache=True, logits_to_keep=1)
        del cache
    gc.collect()
    return (peak.peak_bytes - baseline) / MB, (_status()["VmRSS"] - baseline) / MB


def cache_mb(model, context: int, vocab: int) -> float:
    """MB the model's own cache allocates for one sequence of `context` tokens: the bytes of every distinct
    storage behind its layers' tensors (pre-allocated room included), measured from the cache after a forward."""
    import torch

    from modular_decoder.compat import cache_of

    prompt = torch.randint(0, vocab, (1, context), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        cache = cache_of(model(prompt, use_cache=True, logits_to_keep=1))
    storages = {}
    for layer in cache.layers:
        for tensor in vars(layer).values():
            if isinstance(tensor, torch.Tensor) and tensor.numel():
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values()) / MB


def largest_batch(probe, budget_mb: float, cap: int) -> tuple[int, dict]:
    """Largest b in [0, cap] with probe(b) <= budget_mb, probe increasing in b: doubling, then bisection.
    Returns (b, {b: peak MB} of every probe run)."""
    peaks: dict[int, float] = {}

    def ok(b: int) -> bool:
        peaks[b] = probe(b)
        return peaks[b] <= budget_mb

    if not ok(1):
        return 0, peaks
    good, bad = 1, None
    while bad is None:
        b = min(2 * good, cap)
        if b == good:
            return good, peaks
        if ok(b):
            good = b
        else:
            bad = b
    while bad - good > 1:
        mid = (good + bad) // 2
        if ok(mid):
            good = mid
        else:
            bad = mid
    return good, peaks


def _has_experts(model) -> bool:
    return any(name.endswith(".experts") for name, _ in model.named_modules())


def measure(args) -> dict:
    import torch
    import transformers

    import modular_decoder  # noqa: F401  (registers the family)
    from modular_decoder.compat import experts_implementation

    if args.threads:
        torch.set_num_threads(args.threads)
    gc.collect()
    before = _status()
    baseline = before["VmRSS"]
    kwargs = {"experts_implementation": args.experts_implementation} if args.experts_implementation else {}
    with PeakMemory("cpu") as load:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.folder, dtype=torch.float32, **kwargs).eval()
    gc.collect()
    after_load = _status()["VmRSS"]
    loaded_split = _split(before)
    with torch.inference_mode():
        for parameter in model.parameters():  # read every page: all experts, not only those routed to
            parameter.sum()
    gc.collect()
    resident = _status()["VmRSS"]
    vocab = model.config.get_text_config().vocab_size
    prompt = torch.randint(0, vocab, (args.batch, args.prompt), generator=torch.Generator().manual_seed(0))
    with PeakMemory("cpu") as decode, torch.inference_mode():
        model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=args.new_tokens,
                       min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
    gc.collect()
    decoded_split = _split(before)
    result = {
        "method": load.method, "baseline_mb": baseline / MB,
        "load_peak_mb": (load.peak_bytes - baseline) / MB, "loaded_mb": (after_load - baseline) / MB,
        "resident_mb": (resident - baseline) / MB,
        "decode_peak_mb": (decode.peak_bytes - baseline) / MB,
        "load_decode_peak_mb": (max(load.peak_bytes, decode.peak_bytes) - baseline) / MB,
        "decode_shape": [args.batch, args.prompt, args.new_tokens],
        # where the resident memory is: safetensors weights stay memory-mapped (file pages, entering RSS
        # when first read) unless a load converts them
        "after_load_mb": loaded_split, "after_decode_mb": decoded_split,
        "experts_implementation": experts_implementation(model.config) if _has_experts(model) else None,
    }
    if args.budget_mb:
        residue = {}

        def probe(b: int) -> float:
            peak, left = _fits(model, args.context, args.steps, b, vocab, baseline)
            residue[b] = left
            return peak

        start = time.perf_counter()
        best, peaks = largest_batch(probe, args.budget_mb, args.cap)
        result["max_batch"] = {
            "budget_mb": args.budget_mb, "context": args.context, "steps": args.steps, "batch": best,
            "capped": best == args.cap, "peaks_mb": {str(b): p for b, p in sorted(peaks.items())},
            "rss_after_probe_mb": {str(b): r for b, r in sorted(residue.items())},
            "cache_mb_per_sequence": cache_mb(model, args.context, vocab),
            "seconds": time.perf_counter() - start,
        }
    return result


def start_probe(folder: Path, *, batch: int, prompt: int, new_tokens: int, threads: int | None = None,
                experts_implementation: str | None = None, budget_mb: float | None = None, context: int = 1024,
                steps: int = 2, cap: int = 1024) -> subprocess.Popen:
    """Start `measure` for the checkpoint in `folder` in a fresh Python process (`finish_probe` reads it)."""
    command = [sys.executable, "-m", "benchmarks.memory", str(folder), "--batch", str(batch), "--prompt", str(prompt),
               "--new-tokens", str(new_tokens), "--context", str(context), "--steps", str(steps), "--cap", str(cap)]
    if threads:
        command += ["--threads", str(threads)]
    if experts_implementation:
        command += ["--experts-implementation", experts_implementation]
    if budget_mb:
        command += ["--budget-mb", str(budget_mb)]
    env = dict(os.environ, **MALLOC_ENV)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish_probe(process: subprocess.Popen, timeout: float = 3600) -> dict:
    """The JSON result of a probe started by `start_probe`."""
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise
    if process.returncode != 0:
        raise RuntimeError(f"memory probe {' '.join(process.args[3:4])} failed:\n{err[-4000:]}")
    return json.loads(out.strip().splitlines()[-1])


def run_probes(specs: dict[str, dict], timeout: float = 3600) -> dict[str, dict]:
    """{name: probe result} for {name: `start_probe` keyword arguments}, the processes run side by side
    (each measures its own RSS, so they do not disturb each other's numbers, only each other's time)."""
    processes = {name: start_probe(**spec) for name, spec in specs.items()}
    return {name: finish_probe(process, timeout) for name, process in processes.items()}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--experts-implementation", default=None)
    parser.add_argument("--budget-mb", type=float, default=None, help="find the largest batch within this budget")
    parser.add_argument("--context", type=int, default=1024, help="cached tokens per sequence of the batch probes")
    parser.add_argument("--steps", type=int, default=2, help="decode steps per batch probe")
    parser.add_argument("--cap", type=int, default=1024, help="largest batch tried")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    print(json.dumps(measure(parse_args(argv))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
