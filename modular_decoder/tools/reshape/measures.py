"""What a reshape run measures: how far a transformation moved the logits (what decides "exact" in a
report), held-out perplexity, and the KV-cache bytes a model actually stores per token."""

from __future__ import annotations

import math

import torch

from modular_decoder.compat import cache_of

from .calibration import start_token

BATCH = 1  # sequences per forward: the (T, vocab) logits of one sequence at a time stay small
ROUNDING = 1e-5  # float32: a logit change within this share of the largest logit is rounding, not a change
LOGIT_SEQUENCES = 4  # calibration sequences the logit change is measured on
PERPLEXITY_ROUNDING = 1e-4  # a relative change of float32 perplexity within this is rounding, not a gap


@torch.no_grad()
def logit_change(before, after, ids: torch.LongTensor) -> dict:
    """The largest |logit difference| between two models over the first `LOGIT_SEQUENCES` rows of `ids`
    (no cache), and whether it is rounding: at most `ROUNDING` times the largest |logit| (at least 1).
    A report calls a transformation exact only on this measurement."""
    change, scale = 0.0, 1.0
    for batch in ids[:LOGIT_SEQUENCES].split(BATCH):
        reference = before(input_ids=batch, use_cache=False).logits.float()
        result = after(input_ids=batch, use_cache=False).logits.float()
        change = max(change, (reference - result).abs().max().item())
        scale = max(scale, reference.abs().max().item())
    return {"max_logit_change": change, "exact": change <= ROUNDING * scale,
            "tokens": ids[:LOGIT_SEQUENCES].numel()}


def perplexity_gap(before: float, after: float, healed: float, changes: list[dict]) -> dict:
    """The perplexity gap a transformation opened and the share of it healing closed (`closed`), or, where there
    is no gap to close, why (`no_gap`): every transformation was measured exact, the gap is within float32
    rounding of the perplexity (`PERPLEXITY_ROUNDING`), or the transformation lowered perplexity: a share of
    rounding noise is no figure."""
    gap = after - before
    if changes and all((change.get("measured") or {}).get("exact") for change in changes):
        reason = "every transformation was measured exact"
    elif abs(gap) <= PERPLEXITY_ROUNDING * before:
        reason = f"the change of perplexity, {gap:+.2g}, is within rounding"
    elif gap < 0:
        reason = f"the transformation lowered perplexity ({gap:+.3g})"
    else:
        return {"gap": gap, "closed": (after - healed) / gap}
    return {"gap": gap, "closed": None, "no_gap": reason}


@torch.no_grad()
def perplexity(model, ids: torch.LongTensor) -> float:
    """exp of the mean next-token negative log-likelihood over every predicted token of `ids`."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for batch in ids.split(BATCH):
        logits = model(input_ids=batch, use_cache=False).logits[:, :-1].float()
        total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum").item()
        count += batch[:, 1:].numel()
    model.train(was_training)
    return math.exp(total / count)


@torch.no_grad()
def measured_cache_bytes_per_token(model, tokens: int = 8) -> int:
    """Bytes the model's cache holds per token after a forward over `tokens` tokens, counted from the cache's
    tensors (`payload_bytes`), not from the config."""
    config = model.config
    if config.sliding_window:
        tokens = min(tokens, config.sliding_window - 1)  # a sliding layer holds every token up to its window
    ids = torch.full((1, tokens), start_token(config), dtype=torch.long, device=model.device)
    cache = cache_of(model(input_ids=ids, use_cache=True))
    return cache.payload_bytes() // tokens
