"""Timing, memory and bandwidth measurements shared by the suite."""

from __future__ import annotations

import os
import threading
import time

import torch
from transformers import LogitsProcessor, LogitsProcessorList


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


class _RssPeak:
    """Peak resident memory above the level at entry, sampled every millisecond (CPU)."""

    def __init__(self):
        import psutil

        self.process = psutil.Process(os.getpid())

    def __enter__(self):
        self.base = self.peak = self.process.memory_info().rss
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while self.running:
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.001)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)
        self.extra = self.peak - self.base


class _NoPeak:
    """Stands in for `_RssPeak` when a run is timed: no sampling thread competes with the model."""

    peak = extra = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.extra = float("nan")


class _StepClock(LogitsProcessor):
    """Records when each generation step's logits arrive (the first right after the prompt's forward)."""

    def __init__(self):
        self.stamps: list[float] = []

    def __call__(self, input_ids, scores):
        self.stamps.append(time.perf_counter())
        return scores


def prefill(model, prompt: torch.Tensor, sample_memory: bool = False) -> dict:
    """One no-cache forward over the prompt, logits for the last position only. `sample_memory=True` samples
    RSS every millisecond in a thread (`peak_mb`); leave it off where the time is measured."""
    with (_RssPeak() if sample_memory else _NoPeak()) as memory:
        start = time.perf_counter()
        model(prompt, use_cache=False, logits_to_keep=1)
        seconds = time.perf_counter() - start
    return {"tokens_per_s": prompt.numel() / seconds, "peak_mb": memory.extra / 2**20}


def decode(model, prompt: torch.Tensor, new_tokens: int, window: int = 8, sample_memory: bool = False,
           **generate_kwargs) -> dict:
    """Greedy generate of exactly `new_tokens`; decode tokens/s from the steps after the prompt's
    forward, and the median step time over the first and last `window` steps. `sample_memory=True` samples
    RSS every millisecond in a thread (`peak_mb`, NaN otherwise): a separate, untimed run."""
    clock = _StepClock()
    with (_RssPeak() if sample_memory else _NoPeak()) as memory:
        model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                       logits_processor=LogitsProcessorList([clock]), **generate_kwargs)
    steps = [b - a for a, b in zip(clock.stamps, clock.stamps[1:])]
    window = max(1, min(window, len(steps) // 2))
    return {
        "tokens_per_s": prompt.shape[0] * len(steps) / sum(steps),
        "step_ms_start": 1e3 * sorted(steps[:window])[window // 2],
        "step_ms_end": 1e3 * sorted(steps[-window:])[window // 2],
        "peak_mb": memory.extra / 2**20,
    }


def inactive_expert_bytes(model) -> int:
    """Bytes of routed experts a batch-1 decode step does not read: in every experts module (3-D
    `gate_up_proj` / `down_proj`, one slice per expert) all but the `num_experts_per_tok` chosen."""
    total = 0
    for module in model.modules():
        params = [getattr(module, name, None) for name in ("gate_up_proj", "down_proj")]
        if all(isinstance(p, torch.nn.Parameter) and p.dim() == 3 for p in params):
            top_k = model.config.get_text_config().num_experts_per_tok
            experts = params[0].shape[0]
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
