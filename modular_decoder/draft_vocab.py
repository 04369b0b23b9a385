"""Drafting over a frequency-ranked part of the vocabulary (FR-Spec, Zhao et al. 2025, arXiv 2502.14856).

With `mtp_draft_vocab_size` = N > 0 the MTP modules draft among the first N token ids of the buffer
`mtp.draft_vocab` (int64, ranked most frequent first, saved and loaded with the model): the shared head runs over
those N rows only. The model still verifies every draft over its whole vocabulary, so `generate(use_mtp=True)`
returns the tokens of plain decoding; the draft logits handed to transformers are the whole vocabulary's with -inf
outside the subset, so that its speculative sampling sees the distribution the draft was sampled from.

Call the module, do not read its weight: the head's rows are gathered (once, and again whenever the weight, its
bias or the ranking changes) only for a head that `weight_is_readable` (a bare `nn.Linear` with plain tensors, no
hooks, no adapter); any other head is called (`model._logits`) and the subset's columns taken, which drafts the same.
"""

from __future__ import annotations

import torch

from .split_products import linear, weight_is_readable


def check_draft_vocab(token_ids, vocab_size: int) -> torch.LongTensor:
    """`token_ids` as a 1-D int64 tensor of distinct ids in [0, `vocab_size`), else a `ValueError` naming
    `draft_vocab`."""
    ids = torch.as_tensor(token_ids)
    if ids.dim() != 1 or not ids.numel() or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"`draft_vocab` must be a non-empty 1-D list of integer token ids, got shape "
                         f"{tuple(ids.shape)} of {ids.dtype}.")
    ids = ids.to(torch.int64)
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"`draft_vocab` holds ids outside [0, vocab_size={vocab_size}): "
                         f"{ids[(ids < 0) | (ids >= vocab_size)][:5].tolist()}.")
    if ids.unique().numel() != ids.numel():
        raise ValueError("`draft_vocab` holds an id more than once.")
    return ids


def set_draft_vocab(model, token_ids) -> None:
    """Make `model`'s MTP modules draft among `token_ids` only (`None`: the whole vocabulary again).

    `token_ids` are ranked most frequent first, e.g. by
    `modular_decoder.tools.reshape.draft_vocab.rank_by_prediction`. Sets
    `config.mtp_draft_vocab_size` and the buffer `mtp.draft_vocab`, which `save_pretrained` then writes.
    A PEFT-wrapped model is set through its base model."""
    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = model.config
    if not config.num_mtp_layers:
        raise ValueError("`draft_vocab` restricts the drafts of MTP modules, and this model has none "
                         "(`num_mtp_layers`=0).")
    model.mtp._draft_rows = None  # the rows gathered for the ranking before
    if token_ids is None:
        config.mtp_draft_vocab_size = 0
        model.mtp.draft_vocab = None
        return
    ids = check_draft_vocab(token_ids, config.vocab_size)
    config.mtp_draft_vocab_size = ids.numel()
    model.mtp.draft_vocab = ids.to(model.lm_head.weight.device)


def draft_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """The logits (B, V) a module drafts from, for its last hidden states `hidden` (B, d): the head's, or with a
    draft vocabulary the head's over it and -inf elsewhere (see the module docstring)."""
    ids = model.mtp.draft_vocab
    if ids is None:
        return model._logits(hidden[:, None])[:, -1]
    subset = subset_logits(model, hidden, ids)
    full = subset.new_full((hidden.shape[0], model.config.vocab_size), float("-inf"))
    return full.index_copy_(1, ids.to(full.device), subset)


def subset_logits(model, hidden: torch.Tensor, ids: torch.LongTensor) -> torch.Tensor:
    """The head's logits over the token ids `ids` (B, N): from its gathered rows where its weight is readable, else
    the whole head called and its columns `ids` taken."""
    head = model.lm_head
    if not weight_is_readable(head):
        return model._logits(hidden)[..., ids.to(hidden.device)]
    rows, bias = _gathered_rows(model.mtp, head, ids)
    return model._finish_logits(linear(hidden, rows, bias))


def _gathered_rows(mtp, head, ids: torch.LongTensor):
    """The head's weight and bias rows `ids`, kept on `mtp` while the weight, bias and ids stay the same tensors
    at the same version (an optimizer step, `load_state_dict` or `.to()` makes them again)."""
    key = tuple(_identity(t) for t in (head.weight, head.bias, ids))
    cached = getattr(mtp, "_draft_rows", None)
    if cached is not None and None not in key and cached[0] == key:
        return cached[1], cached[2]
    with torch.no_grad():
        index = ids.to(head.weight.device)
        rows = head.weight.index_select(0, index)
        bias = None if head.bias is None else head.bias.index_select(0, index)
    mtp._draft_rows = (key, rows, bias)
    return rows, bias


def _identity(tensor: torch.Tensor | None):
    """What changes when `tensor` is replaced or written in place; None for an inference tensor (no version)."""
    if tensor is None:
        return ()
    try:
        return tensor.data_ptr(), tensor._version, tensor.device, tensor.dtype, tuple(tensor.shape)
    except RuntimeError:
        return None
