"""Parts on the MLA pair (DeepSeek-V2-Lite's attention widths with a q_lora, dense layers): the decode-step grid
and the chunked prefill."""

from __future__ import annotations

import torch

from modular_decoder.compat import with_cache

from ..measure import PeakMemory, wall
from ..mla_prefill import chunked_prefill, new_cache
from .bench import Bench, empty_cache
from .timing import PartTimeout, ratio, timed


def filled_cache(model, batch: int, context: int, side: str, device: str):
    """A cache holding `context` random tokens (latent and rotary key per layer), filled without a prefill."""
    config, dtype, cache = model.config, model.dtype, new_cache(model, side)
    for layer in range(config.num_hidden_layers):
        latent = torch.randn(batch, 1, context, config.kv_lora_rank, device=device, dtype=dtype)
        cache.update(latent, torch.randn(batch, 1, context, config.qk_rope_head_dim, device=device, dtype=dtype),
                     layer)
    return cache


@torch.inference_mode()
def mla_decode_grid(bench: Bench) -> dict:
    """One decode step against a cache of each (batch, context): median time, caches filled directly."""
    theirs, ours = bench.pair("deepseek_v3")
    plan, points, rows = bench.plan, {}, []
    grid = [(b, c) for b in plan.grid_batches for c in plan.grid_contexts] + list(plan.grid_extra)
    for batch, context in grid:
        key = f"b{batch}_ctx{context}"
        try:
            caches = {m: filled_cache(m, batch, context, side, bench.device)
                      for side, m in (("transformers", theirs), ("ours", ours))}
            step = bench.ids(batch, 1)
            position = torch.full((batch, 1), context, device=bench.device)

            def run(model):
                model(step, **with_cache(caches[model]), position_ids=position, use_cache=True)
                caches[model].crop(-1)  # back to `context` tokens (a positive length is refused)

            seconds = timed({"transformers": theirs, "ours": ours}, run, plan.step_repeats)
            points[key] = {"transformers_ms": 1e3 * seconds["transformers"], "ours_ms": 1e3 * seconds["ours"],
                           "ratio": ratio(seconds)}
            rows.append((f"MLA decode step b{batch} x {context:,} context (ms)", f"{1e3 * seconds['transformers']:.2f}",
                         f"{1e3 * seconds['ours']:.2f}", f"{ratio(seconds):.2f}x"))
        except torch.OutOfMemoryError as error:
            points[key] = {"oom": str(error)[:300]}
            rows.append((f"MLA decode step b{batch} x {context:,} context", "", "out of memory", ""))
        except PartTimeout as error:  # keep the points already measured
            points[key] = {"timeout": str(error)}
            rows.append((f"MLA decode step b{batch} x {context:,} context", "", str(error), ""))
            break
        finally:
            caches = None
            empty_cache()
    return {"points": points, "rows": rows}




def mla_chunked_prefill(bench: Bench) -> dict:
    """A batch of long prompts fed in chunks, each chunk against the cache: time and peak GPU memory (an
    out-of-memory is recorded, not fatal); the last position's greedy token compared."""
    theirs, ours = bench.pair("deepseek_v3")
    plan, result, rows = bench.plan, {}, []
    batch, tokens = plan.chunked
    ids = bench.ids(batch, tokens)
    for side, model in (("transformers", theirs), ("ours", ours)):  # warm-up
        chunked_prefill(model, side, ids[:1, : 2 * plan.chunks[0]], plan.chunks[0])
    for chunk in plan.chunks:
        entry, last = {}, {}
        for side, model in (("transformers", theirs), ("ours", ours)):
            empty_cache()
            try:
                def prefill():
                    last[side] = chunked_prefill(model, side, ids, chunk)

                with PeakMemory(bench.device) as peak:
                    seconds = wall(prefill)
                entry[side] = {"seconds": seconds, "peak_gib": peak.gib}
            except torch.OutOfMemoryError as error:
                entry[side] = {"oom": str(error)[:300]}
        if len(last) == 2:
            same = last["transformers"].argmax(-1) == last["ours"].argmax(-1)
            entry["greedy_agreement"] = same.float().mean().item()
        result[f"chunk{chunk}"] = entry
        cells = [_time_and_peak(entry[side]) for side in ("transformers", "ours")]
        both = all("seconds" in entry[s] for s in ("transformers", "ours"))
        speed = f"{entry['transformers']['seconds'] / entry['ours']['seconds']:.2f}x" if both else "fails"
        rows.append((f"MLA prefill {batch} x {tokens:,} in chunks of {chunk:,}: time, peak", *cells, speed))
    return result | {"rows": rows}


def _time_and_peak(entry: dict) -> str:
    if "oom" in entry:
        return "out of memory"
    peak = "" if entry["peak_gib"] is None else f", peak {entry['peak_gib']:.1f} GiB"
    return f"{entry['seconds']:.2f} s{peak}"

