"""What a reshape run measures on a model: held-out perplexity and the KV-cache bytes it actually stores
per token."""

from __future__ import annotations

import math

import torch

from modular_decoder.compat import cache_of

from .calibration import start_token

BATCH = 1  # sequences per perplexity forward: the (T, vocab) logits of one sequence at a time stay small


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
