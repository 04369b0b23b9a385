"""`draft_vocab=N`: the MTP modules draft among the N token ids the model itself predicts most often (FR-Spec,
arXiv 2502.14856; `modular_decoder/draft_vocab.py`).

The ranking is by how often the model's own argmax prediction is each token on the calibration text (teacher-forced:
the tokens greedy decoding emits), ties broken by the text's own token counts, then by id. What it covers is measured
on held-out text: the share of the model's argmax predictions there that lie among the N ids (a draft outside them is
never proposed, so coverage bounds what the modules can still get accepted).
"""

from __future__ import annotations

import torch

from modular_decoder.draft_vocab import set_draft_vocab


def check_draft_vocab_option(config, draft_vocab: int, add_mtp) -> None:
    """Refuse, naming the option, a draft vocabulary the model cannot take."""
    if isinstance(draft_vocab, bool) or not isinstance(draft_vocab, int) or draft_vocab < 1:
        raise ValueError(f"`draft_vocab` must be an integer >= 1, got {draft_vocab!r}.")
    if not (add_mtp or config.num_mtp_layers):
        raise ValueError("`draft_vocab` restricts the drafts of MTP modules, and this model has "
                         "none: add some (`add_mtp`, `--add-mtp K`).")
    if draft_vocab > config.vocab_size:
        raise ValueError(f"`draft_vocab`={draft_vocab} is larger than the vocabulary "
                         f"(`vocab_size`={config.vocab_size}).")


@torch.no_grad()
def predicted_counts(model, token_ids: torch.LongTensor) -> torch.LongTensor:
    """(vocab_size,) how often each token is the model's argmax prediction over the text `token_ids` (sequences, T),
    one sequence at a time (a sequence's logits are the largest tensor held)."""
    counts = torch.zeros(model.config.vocab_size, dtype=torch.int64)
    for row in token_ids.split(1):
        logits = model(input_ids=row.to(model.device), use_cache=False).logits
        counts += torch.bincount(logits.argmax(-1).flatten().cpu(), minlength=model.config.vocab_size)
    return counts


def rank_by_prediction(model, token_ids: torch.LongTensor) -> torch.LongTensor:
    """Every token id of the vocabulary, most frequent first: by how often the model's argmax prediction is that
    token on the text `token_ids` (sequences, T), then by how often the text holds it, then by id."""
    vocab_size = model.config.vocab_size
    predicted = predicted_counts(model, token_ids)
    seen = torch.bincount(token_ids.flatten().cpu(), minlength=vocab_size)
    order = torch.arange(vocab_size)
    for key in (seen, predicted):  # stable sorts, the last key first in the result
        order = order[torch.sort(key[order], descending=True, stable=True).indices]
    return order


def coverage(model, token_ids: torch.LongTensor, draft_ids: torch.LongTensor) -> float:
    """The share of the model's argmax predictions over `token_ids` that lie among `draft_ids`."""
    counts = predicted_counts(model, token_ids)
    return counts[draft_ids.cpu()].sum().item() / max(counts.sum().item(), 1)


def with_draft_vocab(model, size: int, calibration_ids: torch.LongTensor, held_out: torch.LongTensor) -> dict:
    """Rank on `calibration_ids`, set the `size` first ids as `model`'s draft vocabulary, and return what it covers
    on `held_out` (the report's `draft_vocab` section)."""
    ranking = rank_by_prediction(model, calibration_ids)[:size]
    set_draft_vocab(model, ranking)
    return {"size": size, "vocab_size": model.config.vocab_size, "ranked_on_tokens": calibration_ids.numel(),
            "held_out_tokens": held_out.numel(), "coverage": coverage(model, held_out, ranking)}
