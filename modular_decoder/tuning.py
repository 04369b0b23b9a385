"""Thresholds chosen from measurements, as settings a deployment may change: `set_tuning`, `tuned`, or an
environment variable read at import (a saved folder's remote code reads them too).

    absorbed_max_new_tokens  MODULAR_DECODER_ABSORBED_MAX_NEW_TOKENS  (default 64)
        The longest step (new tokens) that MLA scores absorbed, against the latent cache; longer steps expand
        the cache to per-head K/V and run the backend's fused kernel (`mla.MultiHeadLatentAttention.scoring_path`).
        0: never absorbed. Measured: the "crossover" and "static_prefill" rows of
        `benchmarks/results_mla_crossover.json` (`python -m benchmarks mla_crossover`).
    absorbed_query_block     MODULAR_DECODER_ABSORBED_QUERY_BLOCK     (default 8)
        New tokens an absorbed step scores per pass (every backend but the eager reference): its explicit scores
        hold at most (batch, heads, block, cached tokens) values at a time, two such blocks at the scoring's
        peak. Measured: the "query_blocks" rows of the same file (time, the step's peak, the scoring's own peak).
    min_split_weight         MODULAR_DECODER_MIN_SPLIT_WEIGHT         (default 65536)
        The fewest weight elements over which a few-row product may be split across the CPU cores
        (`split_products`): a floor below which nothing is split nor timed; above it, mode "auto" (the default)
        splits a product shape only where timing it on this machine says the split pays, mode "always" splits
        every one. 0: no floor. Measured: `benchmarks/results_split_threshold.json` and
        `benchmarks/results_split_auto.json` (`python -m benchmarks split_threshold`: decode steps with the split
        off, from each threshold, and timed per shape, on two CPUs).
    split_slice_bytes        MODULAR_DECODER_SPLIT_SLICE_BYTES        (default 262144)
        The smallest slice (bytes of weight) a split product of 2 or more rows is cut into: more slices than threads
        while each keeps this size, so that the rows re-read a slice from the cache (`split_products._cache_sized`);
        0: as many slices as threads. Measured: `benchmarks/results_split_slices.json` (`python -m benchmarks
        split_slices`: forwards of 1 to 16 new tokens, a speculative verify step or a small batch, at each size).

Each is an integer, validated where it is set (a `ValueError` naming the setting or the variable). On a GPU
the measurements of `benchmarks/` decide them for that GPU: docs/benchmarks.md.

Part of the remote-code files: standard library only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class Tuning:
    """The current thresholds (module docstring); replace them with `set_tuning` or `tuned`."""

    absorbed_max_new_tokens: int = 64
    absorbed_query_block: int = 8
    min_split_weight: int = 1 << 16
    split_slice_bytes: int = 1 << 18


MINIMUM = {"absorbed_max_new_tokens": 0, "absorbed_query_block": 1, "min_split_weight": 0, "split_slice_bytes": 0}
ENVIRONMENT = {name: f"MODULAR_DECODER_{name.upper()}" for name in MINIMUM}


def _checked(name: str, value, source: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < MINIMUM[name]:
        raise ValueError(f"{source} must be an integer of at least {MINIMUM[name]}, got {value!r}.")
    return value


def _from_environment() -> Tuning:
    values = {}
    for name, variable in ENVIRONMENT.items():
        text = os.environ.get(variable, "").strip()
        if text:
            try:
                values[name] = int(text)
            except ValueError:
                values[name] = text
            _checked(name, values[name], f"`{variable}`")
    return Tuning(**values)


_current = _from_environment()


def tuning() -> Tuning:
    """The thresholds in force."""
    return _current


def set_tuning(**values) -> Tuning:
    """Replace the named thresholds for this process (each validated, named in the error); returns the previous
    ones, which `set_tuning(**dataclasses.asdict(previous))` restores."""
    global _current
    for name, value in values.items():
        if name not in MINIMUM:
            raise ValueError(f"`{name}` is not a tuning setting; the settings are {sorted(MINIMUM)}.")
        _checked(name, value, f"`{name}`")
    previous, _current = _current, dataclasses.replace(_current, **values)
    return previous


@contextlib.contextmanager
def tuned(**values):
    """The named thresholds inside the block only."""
    previous = set_tuning(**values)
    try:
        yield tuning()
    finally:
        set_tuning(**dataclasses.asdict(previous))


__all__ = ["Tuning", "tuning", "set_tuning", "tuned", "ENVIRONMENT"]
