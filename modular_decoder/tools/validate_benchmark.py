"""`validate`'s last check, ``benchmark``: prefill and decode throughput and peak memory of the model
under validation (a measurement; it fails only on an error).

`ctx` is the checklist's context (`validate._Context`): the model, its config, its device and seeded
token ids.
"""

from __future__ import annotations

import resource
import sys
import time

import torch

from modular_decoder import compat


def check_benchmark(ctx, batch: int = 4, prompt: int = 32, new_tokens: int = 16) -> str:
    prompt = min(prompt, ctx.config.max_position_embeddings - new_tokens)
    ids = ctx.ids(batch, prompt)
    ctx.model.generation_config.pad_token_id = 0
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with torch.no_grad():
        ctx.model(ids[:, :4], use_cache=True)  # warm-up
        start = time.perf_counter()
        out = ctx.model(ids, use_cache=True)
        prefill = time.perf_counter() - start
        cache, token = compat.cache_of(out), out.logits[:, -1:].argmax(-1)
        start = time.perf_counter()
        for _ in range(new_tokens):
            token = ctx.model(token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        decode = time.perf_counter() - start
    if ctx.device.type == "cuda":
        peak = f"peak GPU {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB"
    else:  # ru_maxrss is KiB on Linux; torch's CPU tensors are invisible to tracemalloc
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        scale = 1 if sys.platform == "darwin" else 1024
        peak = f"peak RSS {rss * scale / 2**20:.0f} MiB (+{(rss - rss_before) * scale / 2**20:.0f})"
    return (f"prefill {batch * prompt / prefill:,.0f} tok/s (B={batch}, S={prompt}), "
            f"decode {batch * new_tokens / decode:,.0f} tok/s, {peak}")
