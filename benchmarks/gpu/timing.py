"""Guards, timing and sync counting for the GPU matrix (CUDA-aware, CPU-safe; the timer and the peak-memory
probe are `benchmarks.measure`'s)."""

from __future__ import annotations

import contextlib
import signal
import warnings
from collections.abc import Callable

import torch

from ..measure import median_seconds


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
