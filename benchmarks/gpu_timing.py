"""Timing, guards, sync counting and peak memory for `benchmarks.gpu` (CUDA-aware, CPU-safe)."""

from __future__ import annotations

import contextlib
import signal
import warnings
from collections.abc import Callable

import torch

from .measure import median_seconds, wall  # noqa: F401  (wall: the parts' timer)


class Skip(Exception):
    """A part that cannot run here; its message is the reason written to the JSON."""


class PartTimeout(BaseException):
    """A part ran past its time guard (a BaseException, so the part's own `except Exception` does not eat it)."""


@contextlib.contextmanager
def part_guard(seconds: float):
    """Raise `PartTimeout` in the main thread after `seconds` (SIGALRM; checked whenever Python runs)."""
    def expire(signum, frame):
        raise PartTimeout(f"past its time guard of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def timed(models: dict, run: Callable, repeats: int) -> dict[str, float]:
    """Median seconds of `run(model)` per side (`measure.median_seconds`: a warm-up each, the order alternating)."""
    return median_seconds({side: (lambda model=model: run(model)) for side, model in models.items()}, repeats)


def ratio(seconds: dict[str, float]) -> float:
    """Ours relative to transformers: transformers' time over ours (above 1: ours faster)."""
    return seconds["transformers"] / seconds["ours"]


def agreement(theirs: torch.Tensor, ours: torch.Tensor, prompt_len: int) -> dict:
    """Greedy tokens compared: all equal, the fraction of equal new tokens, the first step where a row differs."""
    new_theirs, new_ours = theirs[:, prompt_len:], ours[:, prompt_len:]
    if new_theirs.shape != new_ours.shape:
        return {"equal": False, "fraction": 0.0, "first_difference": 0, "note": "different lengths"}
    same = new_theirs == new_ours
    differing = (~same).any(0).nonzero()
    return {"equal": bool(same.all()), "fraction": round(same.float().mean().item(), 4),
            "first_difference": int(differing[0]) if len(differing) else None}


def count_syncs(run: Callable) -> int:
    """Device-to-host syncs during `run()`: the warnings of `torch.cuda.set_sync_debug_mode("warn")`."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message).lower() for w in caught)


class _Peak:
    gib: float | None = None  # the peak of all allocated memory (weights included)
    above_gib: float | None = None  # the peak above what was allocated when the block began


@contextlib.contextmanager
def cuda_peak():
    """`torch.cuda.max_memory_allocated` over the block in GiB, absolute and above the allocation at its start
    (`None` on the CPU: no device allocator to ask)."""
    peak = _Peak()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
    yield peak
    if torch.cuda.is_available():
        peak.gib = torch.cuda.max_memory_allocated() / 2**30
        peak.above_gib = (torch.cuda.max_memory_allocated() - start) / 2**30
