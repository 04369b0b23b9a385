"""Documents packed in one row, for layers that carry a state: each document starts from an empty state.

Packed as transformers' `DataCollatorWithFlattening` packs them: `position_ids` restarting, no `attention_mask`,
no cache.

Attention layers keep documents apart with transformers' packed-sequence masks (`find_packed_sequence_indices`:
a document starts wherever a position is not the previous one plus one). A linear-attention layer carries a
state along the row instead, so it needs the document boundaries themselves: `packed_documents` finds them by the
same rule, once per forward (one host read, only for such inputs), over the rows flattened end to end (a row's
start always starts a document), as the varlen kernels take them (`cu_seqlens`, batch 1).

With them the layer computes each document exactly as it computes that document alone:

* its short convolution runs over the flattened row with K - 1 zero columns inserted before every document
  (`convolve_documents`): each document's first outputs see zeros before it, as a lone sequence sees the
  convolution's zero padding; one call of the module, so hooks and adapters on it run;
* its delta rule starts every document from a zero state (`delta_rule.Kernels.chunked_documents`: fla's kernel
  with `cu_seqlens` on the GPU, document by document in PyTorch otherwise).

transformers' Qwen3-Next / Qwen3.5 classes (5.16.1 to 5.25) pass `cu_seq_lens_q` (flash-attention kwargs) to fla's
delta rule only: their PyTorch path and their convolution carry the state from one document into the next.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PackedDocuments:
    """Document boundaries over a (B, T) input flattened to one row of B·T tokens.

    `cu_seqlens` (N + 1,) long on the input's device and `bounds` (the same, on the host): document n is tokens
    `bounds[n]:bounds[n + 1]` of the flattened row; `index` (B·T,) the document of each token; `last` (B,) the
    last document of each row (whose state a cache keeps)."""

    cu_seqlens: torch.Tensor
    bounds: tuple[int, ...]
    index: torch.Tensor
    last: torch.Tensor

    @property
    def count(self) -> int:
        return len(self.bounds) - 1


def packed_documents(position_ids: torch.Tensor, batch: int) -> PackedDocuments | None:
    """The documents of `position_ids` (B or 1, T) for a batch of `batch` rows, or `None` where every row holds
    one document (nothing to reset)."""
    positions = position_ids.expand(batch, -1)
    rows, seq = positions.shape
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions.diff(dim=-1) != 1  # transformers' rule (find_packed_sequence_indices)
    starts = starts.reshape(-1)
    first = starts.nonzero().squeeze(-1)
    cu_seqlens = torch.cat((first, first.new_tensor([rows * seq])))
    bounds = tuple(cu_seqlens.tolist())  # the one host read
    if len(bounds) - 1 == rows:
        return None
    index = starts.long().cumsum(0) - 1
    return PackedDocuments(cu_seqlens, bounds, index, index.view(rows, seq)[:, -1])


def convolve_documents(x: torch.Tensor, documents: PackedDocuments, kernel_size: int, convolve) -> torch.Tensor:
    """A causal convolution applied to each document of x (B, C, T) on its own.

    `convolve` (a causal convolution of (1, C, L), zero-padded on the left), one call over the flattened row with
    `kernel_size - 1` zeros before every document, read back at the documents' columns. Returns (B, C, T)."""
    batch, channels, seq = x.shape
    gap = kernel_size - 1
    flat = x.transpose(0, 1).reshape(1, channels, batch * seq)
    columns = torch.arange(batch * seq, device=x.device) + gap * (documents.index + 1)  # (B·T,) in the gapped row
    gapped = flat.new_zeros(1, channels, batch * seq + gap * documents.count).index_copy(-1, columns, flat)
    out = convolve(gapped).index_select(-1, columns)  # (1, C, B·T)
    return out.reshape(channels, batch, seq).transpose(0, 1)


def last_document_only(x: torch.Tensor, documents: PackedDocuments) -> torch.Tensor:
    """x (B, C, T) with every column before each row's last document zeroed: a cache's convolution window then
    holds what that document alone would leave there."""
    batch, _, seq = x.shape
    keep = documents.index.view(batch, seq) == documents.last[:, None]  # (B, T)
    return x * keep[:, None, :].to(x.dtype)


__all__ = ["PackedDocuments", "convolve_documents", "last_document_only", "packed_documents"]
