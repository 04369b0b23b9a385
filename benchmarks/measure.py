"""Timing, memory and bandwidth measurements shared by the benchmarks.

- `alternating(cases, repeats)`: the one timing loop (a warm-up round, then repeats whose order alternates);
  `seconds(fn)` turns a call into a case that returns its wall time, the device's queue drained around it;
  `summary(values)` the median, spread and every value;
- `PeakMemory(device)`: the one peak-memory probe (the CUDA allocator's high-water mark on a GPU, the kernel's
  resident high-water mark on a CPU); `TensorBytes()` the bytes of the tensors one call allocates, alive at
  once (exact, any device: for a function inside a step, where a process-wide probe also sees the rest);
- `prefill`, `decode`, `train_step`: one measured call of a model; `interleaved_decode_steps`: models decoding
  step by step in turn; `copy_bandwidth` and the bytes a decode step reads, for rooflines.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
import weakref
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import LogitsProcessor, LogitsProcessorList

MB = 2**20


def sync() -> None:
    """Wait for the GPU's queue (nothing on a CPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def wall(run: Callable) -> float:
    """Seconds of `run()`, the device's queue drained before and after."""
    sync()
    start = time.perf_counter()
    run()
    sync()
    return time.perf_counter() - start


def seconds(run: Callable) -> Callable[[], float]:
    """A case for `alternating` that returns the wall seconds of `run()`."""
    return lambda: wall(run)


def alternating(cases: dict[str, Callable], repeats: int, warmup: int = 1, label: str | None = None) -> dict[str, list]:
    """{case: [its value per repeat]}. Every case runs `warmup` untimed rounds first (first-call allocations,
    lazy inits, compiles), then once per repeat, in the given order in even repeats and reversed in odd ones, so
    that machine noise hits all alike and no case always runs first. A case returns its measurement: the seconds
    of a call (`seconds(fn)`), a rate, or a dict of figures. With `label`, a line per repeat says how far it got
    (a long run on a busy machine shows its progress)."""
    for _ in range(warmup):
        for case in cases.values():
            case()
    values = {name: [] for name in cases}
    order = list(cases)
    for repeat in range(repeats):
        for name in order if repeat % 2 == 0 else reversed(order):
            values[name].append(cases[name]())
        if label:
            print(f"{label}: repeat {repeat + 1} of {repeats} done, load average {os.getloadavg()[0]:.1f}", flush=True)
    return values


def median_seconds(cases: dict[str, Callable], repeats: int, warmup: int = 1) -> dict[str, float]:
    """The median wall seconds of each call over `alternating` repeats."""
    times = alternating({name: seconds(run) for name, run in cases.items()}, repeats, warmup)
    return {name: statistics.median(values) for name, values in times.items()}


def summary(values: list[float]) -> dict:
    """Median, min, max, half the spread, and every value."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "half_spread": (max(values) - min(values)) / 2, "all": list(values)}


def _proc_status() -> dict:
    with open("/proc/self/status") as f:
        return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f
                if line.startswith(("VmHWM", "VmRSS", "RssAnon", "RssFile"))}


def _reset_rss_high_water_mark() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakMemory:
    """Peak memory over a `with` block: `peak_bytes` (absolute), `start_bytes` (at entry), `above_mb` (the peak
    above the entry level, MB) and `method`:

    - "cuda": `torch.cuda.max_memory_allocated` (reset at entry): tensors on the GPU, weights included;
    - "VmHWM": the kernel's high-water mark of this process's resident memory, reset at entry through
      /proc/self/clear_refs, so no short peak is missed and no thread runs beside the measured code;
    - "sampled": where that reset is refused, RSS sampled every millisecond by a thread.

    The CPU methods measure the whole process (every thread's allocations), the CUDA one the device."""

    def __init__(self, device: str | torch.device = "cpu"):
        device = torch.device(device)
        if device.type == "cuda":
            self.method = "cuda"
        else:
            self.method = "VmHWM" if _reset_rss_high_water_mark() else "sampled"

    def __enter__(self):
        if self.method == "cuda":
            sync()
            torch.cuda.reset_peak_memory_stats()
            self.start_bytes = self.peak_bytes = torch.cuda.memory_allocated()
            return self
        if self.method == "VmHWM":
            _reset_rss_high_water_mark()
        self.start_bytes = self.peak_bytes = _proc_status()["VmRSS"]
        if self.method == "sampled":
            self._running = True
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self):
        while self._running:
            self.peak_bytes = max(self.peak_bytes, _proc_status()["VmRSS"])
            time.sleep(0.001)

    def __exit__(self, *exc):
        if self.method == "cuda":
            sync()
            self.peak_bytes = torch.cuda.max_memory_allocated()
            return
        if self.method == "sampled":
            self._running = False
            self._thread.join()
        status = _proc_status()
        self.peak_bytes = max(self.peak_bytes, status["VmRSS"], status["VmHWM"] if self.method == "VmHWM" else 0)

    @property
    def above_mb(self) -> float:
        return (self.peak_bytes - self.start_bytes) / MB

    @property
    def peak_mb(self) -> float:
        return self.peak_bytes / MB

    @property
    def gib(self) -> float:
        return self.peak_bytes / 2**30

    @property
    def above_gib(self) -> float:
        return (self.peak_bytes - self.start_bytes) / 2**30


class TensorBytes(TorchDispatchMode):
    """`with TensorBytes() as probe: fn()`, then `probe.peak_bytes`: the most bytes that tensors allocated by the
    operations inside the block held at once (inputs made before it, and views of or writes into them, are not
    counted; a storage counts until its last tensor is gone). Exact and deterministic on any device, for a
    function inside a step (`MultiHeadLatentAttention.absorbed_attention`), where `PeakMemory` sees the whole
    process. Dispatch-level: it sees what torch allocates, not the allocator's caching or fragmentation."""

    def __init__(self):
        super().__init__()
        self.holders: dict[int, int] = {}  # storage address -> tensors alive on it
        self.sizes: dict[int, int] = {}
        self.live_bytes = self.peak_bytes = 0

    def _release(self, key: int) -> None:
        self.holders[key] -= 1
        if not self.holders[key]:
            del self.holders[key]
            self.live_bytes -= self.sizes.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key not in self.sizes:
                if key in inputs or not storage.nbytes():
                    continue  # a view of, or a write into, a tensor from before the block
                self.sizes[key], self.holders[key] = storage.nbytes(), 0
                self.live_bytes += storage.nbytes()
                self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            self.holders[key] += 1
            weakref.finalize(tensor, self._release, key)
        return out


def copy_bandwidth(megabytes: int = 256, repeats: int = 5) -> float:
    """Bytes/s of a STREAM-like copy (read + write counted) over arrays larger than the caches: best of `repeats`."""
    source = torch.ones(megabytes * 2**20 // 4)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - start)
    return 2 * source.numel() * source.element_size() / best


def bytes_read_per_step(model) -> int:
    """Weight bytes one decode step must read: every distinct parameter except input-side tables
    (token and learned-position embeddings are gathered a row at a time unless tied to the head)."""
    head = model.get_output_embeddings().weight
    gathered = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding) and m.weight is not head}
    seen, total = set(), 0
    for param in model.parameters():
        if id(param) in seen or id(param) in gathered:
            continue
        seen.add(id(param))
        total += param.numel() * param.element_size()
    return total


class _NoPeak:
    """Stands in for `PeakMemory` when a run is timed: nothing is measured beside the model."""

    above_mb = float("nan")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


class _StepClock(LogitsProcessor):
    """Records when each generation step's logits arrive (the first right after the prompt's forward)."""

    def __init__(self):
        self.stamps: list[float] = []

    def __call__(self, input_ids, scores):
        self.stamps.append(time.perf_counter())
        return scores


def prefill(model, prompt: torch.Tensor, sample_memory: bool = False) -> dict:
    """One no-cache forward over the prompt, logits for the last position only. `sample_memory=True` measures
    the peak memory above the start (`peak_mb`, `PeakMemory`; NaN otherwise): leave it off where the time counts."""
    with (PeakMemory(prompt.device) if sample_memory else _NoPeak()) as memory:
        start = time.perf_counter()
        model(prompt, use_cache=False, logits_to_keep=1)
        seconds = time.perf_counter() - start
    return {"tokens_per_s": prompt.numel() / seconds, "peak_mb": memory.above_mb}


def decode(model, prompt: torch.Tensor, new_tokens: int, window: int = 8, sample_memory: bool = False,
           **generate_kwargs) -> dict:
    """Greedy generate of exactly `new_tokens`; decode tokens/s from the steps after the prompt's
    forward, the median step time over all of them (`step_ms_median`: what a burst of other work on a shared machine,
    which stretches a few steps, moves least) and over the first and last `window` steps. `sample_memory=True`
    measures the peak memory above the start (`peak_mb`, `PeakMemory`; NaN otherwise): a separate, untimed run."""
    clock = _StepClock()
    with (PeakMemory(prompt.device) if sample_memory else _NoPeak()) as memory:
        model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                       logits_processor=LogitsProcessorList([clock]), **generate_kwargs)
    steps = [b - a for a, b in zip(clock.stamps, clock.stamps[1:])]
    window = max(1, min(window, len(steps) // 2))
    return {
        "tokens_per_s": prompt.shape[0] * len(steps) / sum(steps),
        "step_ms_median": 1e3 * statistics.median(steps),
        "step_ms_start": 1e3 * sorted(steps[:window])[window // 2],
        "step_ms_end": 1e3 * sorted(steps[-window:])[window // 2],
        "peak_mb": memory.above_mb,
    }


def interleaved_decode_steps(models: dict, prompt: torch.Tensor, steps: int) -> dict[str, list[float]]:
    """{name: the seconds of each of `steps` greedy decode steps}: every model prefills `prompt` into its own cache,
    then the models take one step each in turn (the order flipping every step), each forward on its own last token
    and cache. Adjacent steps share the machine's state of the moment, so the ratio of a pair of them is what a
    burst of other work moves least; generate's own loop is not in it (`decode` times that)."""
    from modular_decoder.compat import cache_of, with_cache

    state = {}
    for name, model in models.items():
        out = model(prompt, use_cache=True, logits_to_keep=1)
        state[name] = (cache_of(out), out.logits[:, -1:].argmax(-1))
    times = {name: [] for name in models}
    order = list(models)
    for step in range(steps):
        for name in order if step % 2 == 0 else reversed(order):
            cache, token = state[name]
            sync()
            start = time.perf_counter()
            out = models[name](token, use_cache=True, logits_to_keep=1, **with_cache(cache))
            token = out.logits[:, -1:].argmax(-1)
            sync()
            times[name].append(time.perf_counter() - start)
            state[name] = (cache, token)
    return times


def inactive_expert_bytes(model) -> int:
    """Bytes of routed experts a batch-1 decode step does not read: in every experts module (3-D
    `gate_up_proj` / `down_proj`, one slice per expert, and their per-expert biases where there are any, as
    gpt-oss's) all but the `num_experts_per_tok` chosen."""
    total = 0
    for module in model.modules():
        params = [getattr(module, name, None) for name in ("gate_up_proj", "down_proj")]
        if all(isinstance(p, torch.nn.Parameter) and p.dim() == 3 for p in params):
            top_k = model.config.get_text_config().num_experts_per_tok
            experts = params[0].shape[0]
            biases = [getattr(module, name, None) for name in ("gate_up_proj_bias", "down_proj_bias")]
            params += [b for b in biases if isinstance(b, torch.nn.Parameter)]
            per_expert = sum(p[0].numel() * p.element_size() for p in params)
            total += (experts - min(top_k, experts)) * per_expert
    return total


def active_bytes_read_per_step(model) -> int:
    """`bytes_read_per_step` less the experts a batch-1 step skips: the active weights of one token."""
    return bytes_read_per_step(model) - inactive_expert_bytes(model)


def train_step(model, batch: torch.Tensor, optimizer) -> float:
    """Seconds of one training step: forward with labels, backward, optimizer step, gradients cleared."""
    start = time.perf_counter()
    loss = model(input_ids=batch, labels=batch, use_cache=False).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start
