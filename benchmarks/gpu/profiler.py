"""`torch.profiler` summaries for `benchmarks.gpu`: per-name totals of a profiled call, their difference between
two calls (what the extra work adds, e.g. the decode steps of a longer `generate`), and a short digest of them
(kernels, self CPU time, CUDA runtime calls, the SDPA implementation). CPU-safe: without CUDA only CPU
activity is recorded, and the kernel and runtime-call figures are zero."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.autograd import DeviceType

from ..measure import wall

# CUDA runtime calls counted (by substring of the profiler's names: `cudaMalloc` also counts `cudaMallocAsync`):
# allocator traffic, host-device syncs, copies and launches.
RUNTIME_CALLS = ("cudaMalloc", "cudaFree", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync",
                 "cudaLaunchKernel")
SDPA_OPS = "_scaled_dot_product_"  # aten::_scaled_dot_product_{flash,efficient,cudnn}_attention, ..._math, ...
TOP = 8
NAME_CHARS = 80


def activities() -> list:
    from torch.profiler import ProfilerActivity

    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])


def profiled(run: Callable) -> tuple[float, dict]:
    """Wall seconds of `run()` under `torch.profiler.profile` and the profile's `totals`."""
    with torch.profiler.profile(activities=activities()) as profile:
        seconds = wall(run)
    return seconds, totals(profile.key_averages())


def totals(averages) -> dict[str, dict[str, list[float]]]:
    """{"kernels" | "copies" | "cpu": {name: [count, microseconds]}}: device kernels and device copies (memcpy,
    memset) with their device time, host-side events (aten ops, CUDA runtime calls) with their self CPU time."""
    result = {"kernels": {}, "copies": {}, "cpu": {}}
    for event in averages:
        if event.device_type == DeviceType.CPU:
            kind, micros = "cpu", event.self_cpu_time_total
        else:
            kind = "copies" if event.key.startswith(("Memcpy", "Memset")) else "kernels"
            micros = event.self_device_time_total
        count, total = result[kind].get(event.key, (0, 0.0))
        result[kind][event.key] = [count + event.count, total + micros]
    return result


def difference(more: dict, less: dict, per: int) -> dict:
    """(`more` - `less`) / `per`, name by name: what the extra work of the `more` call costs per unit."""
    return {kind: {name: [(count - less[kind].get(name, (0, 0))[0]) / per,
                          (micros - less[kind].get(name, (0, 0.0))[1]) / per]
                   for name, (count, micros) in names.items()}
            for kind, names in more.items()}


def digest(total: dict) -> dict:
    """The figures the GPU matrix records from one `totals` (or `difference`) result."""
    kernels, cpu = total["kernels"], total["cpu"]
    return {
        "kernels": sum(count for count, _ in kernels.values()),
        "kernel_ms": sum(micros for _, micros in kernels.values()) / 1e3,
        "device_copies": sum(count for count, _ in total["copies"].values()),
        "self_cpu_ms": sum(micros for _, micros in cpu.values()) / 1e3,
        "top_kernels": _top(kernels),
        "top_aten_self_cpu": _top({name: v for name, v in cpu.items() if name.startswith("aten::")}),
        "runtime_calls": {call: sum(count for name, (count, _) in cpu.items() if call in name)
                          for call in RUNTIME_CALLS},
        "sdpa": {name: count for name, (count, _) in cpu.items() if SDPA_OPS in name and count},
    }


def _top(names: dict) -> list[dict]:
    ranked = sorted(names.items(), key=lambda item: -item[1][1])[:TOP]
    return [{"name": name[:NAME_CHARS], "count": round(count, 2), "ms": round(micros / 1e3, 4)}
            for name, (count, micros) in ranked]
