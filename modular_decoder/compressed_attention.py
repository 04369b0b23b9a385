"""Compressed attention (DeepSeek-V4's CSA and HCA layers): the past pooled into one entry per window of tokens,
entries the attention reads after its window's keys.

A layer whose `layer_types` entry is `"heavily_compressed_attention"` (HCA) pools every window of m' tokens
(`compress_rates`) into one entry; `"compressed_sparse_attention"` (CSA) pools windows of m tokens that overlap
the window before them (2m slots, stride m) and keeps, per query, the `index_topk` entries a lightning indexer
scores highest. Per window w of token positions [w·m, (w + 1)·m):

    HCA:  C_w = Norm(Σ_{j ∈ window w} softmax_j(Z_j + B_j) ⊙ C_j)                  C = x·W_kv, Z = x·W_gate
    CSA:  C_w = Norm(Σ over [window w-1: the first half of C, Z | window w: the second half] softmax(Z + B) ⊙ C)

(B the learned `position_bias` of each slot, softmax over the slots per feature, Norm an RMSNorm), then RoPE at
position w·m on its last rotary features. A query at position p sees entry w once its window is complete,
w < (p + 1) // m (paper §2.3; transformers' `DeepseekV4HCACompressor` / `DeepseekV4CSACompressor`).

Windows follow each row's positions, over its real tokens only: a left-padded row pools what it pools alone,
and packed documents (positions restarting at 0) never pool or see across a boundary. (transformers' class pools
by column index, padding included, so a padded row of its batch differs from the row alone: docs/using.md.)
`WindowPlan` finds the windows a forward completes (the tokens whose position closes one), from the tokens of
this forward and the last ones of the cache (`compressed_cache.CompressedLayer` keeps them); `Compressor.pool`
pools them. The indexer (`CompressedIndexer`) pools its own narrower entries over the same windows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .lightning_indexer import index_head_weights, rank_keys
from .norms import build_norm
from .positions import RotaryEmbedding, apply_rotary

COMPRESSED_SPARSE = "compressed_sparse_attention"  # transformers' `layer_types` values
HEAVILY_COMPRESSED = "heavily_compressed_attention"
COMPRESSED_LAYER_TYPES = (COMPRESSED_SPARSE, HEAVILY_COMPRESSED)
# A window index no query reaches: the entry slot that takes the pooled windows a forward did not complete
NEVER = torch.iinfo(torch.int64).max // 2


def real_tokens(attention_mask, q_len: int, batch: int, device) -> torch.Tensor | None:
    """(B, T) bool: which of the T new tokens are real, read off the diagonal of the 4-D mask the layer received
    (a real token always sees itself; a padding query sees nothing). No mask, or another form: None, all real."""
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 4:
        return None
    kv_len = attention_mask.shape[-1]
    rows = torch.arange(q_len, device=attention_mask.device)
    diagonal = attention_mask[:, 0, rows, kv_len - q_len + rows]  # (B or 1, T)
    keep = diagonal if diagonal.dtype == torch.bool else diagonal == 0
    return keep.expand(batch, q_len).to(device)


def documents(positions: torch.Tensor) -> torch.Tensor:
    """(B, T) document index of each token: a new one wherever the position does not count on by one (packed
    documents restart at 0; a left-padded row's first real token follows its padding's positions)."""
    step = positions[:, 1:] != positions[:, :-1] + 1
    return torch.cat((torch.zeros_like(positions[:, :1]), step.long().cumsum(-1)), dim=1)


@dataclass
class WindowPlan:
    """The windows one forward completes, at most `K` per row (K = T // m + 1 bounds the tokens of T consecutive
    positions that close one), over X = [the cache's last tokens; this forward's], its real tokens moved to the
    end in order (`order`): `closing` (B, K) the index in X of each window's last token, `valid` (B, K) whether it
    closes a window, `windows` (B, K) that window's index w, `overlap` (B, K) whether window w - 1 exists (CSA),
    `documents` (B, K) the document the window lies in."""

    order: torch.Tensor
    closing: torch.Tensor
    valid: torch.Tensor
    windows: torch.Tensor
    overlap: torch.Tensor
    documents: torch.Tensor

    @classmethod
    def of(cls, real: torch.Tensor, positions: torch.Tensor, docs: torch.Tensor, tail: int, rate: int):
        """real, positions, docs (B, T) of the new tokens; `tail`: how many cached tokens precede them in X."""
        batch, seq = real.shape
        before = real.new_ones(batch, tail)
        real_x = torch.cat((before, real), dim=1)
        order = torch.sort(real_x.to(torch.int8), dim=1, stable=True).indices  # padding first, order kept
        fresh = order >= tail
        positions_x = torch.cat((positions.new_full((batch, tail), -1), positions), dim=1).gather(1, order)
        docs_x = torch.cat((docs.new_zeros(batch, tail), docs), dim=1).gather(1, order)
        closes = real_x.gather(1, order) & fresh & ((positions_x + 1) % rate == 0)
        length = tail + seq
        first = closes * torch.arange(length, 0, -1, device=real.device)  # earliest closing token first
        closing = first.topk(min(seq, seq // rate + 1), dim=1).indices  # (B, K)
        valid = closes.gather(1, closing) & (closing >= rate - 1)
        position = positions_x.gather(1, closing)
        overlap = valid & (position >= 2 * rate - 1) & (closing >= 2 * rate - 1)
        return cls(order, closing, valid, position // rate, overlap, docs_x.gather(1, closing))


class Compressor(nn.Module):
    """Pools windows of `rate` tokens into entries of width `width`: `kv_proj` / `gate_proj` (2·width with
    `overlap`: the halves Ca, read by the next window, and Cb, by its own), a `position_bias` per slot, `kv_norm`
    (transformers' names)."""

    def __init__(self, config, width: int, rate: int, overlap: bool):
        super().__init__()
        projected = 2 * width if overlap else width
        self.width, self.rate, self.overlap = width, rate, overlap
        self.kv_proj = nn.Linear(config.hidden_size, projected, bias=False)
        self.gate_proj = nn.Linear(config.hidden_size, projected, bias=False)
        self.position_bias = nn.Parameter(torch.empty(rate, projected))
        self.kv_norm = build_norm(config, width)

    def init_own_weights(self, init, std: float) -> None:
        init.zeros_(self.position_bias)  # as transformers' DeepSeek-V4

    @property
    def tail_length(self) -> int:
        """Tokens a cache keeps for the windows a later forward completes: the rest of the current window, and
        the window before it where windows overlap."""
        return (2 if self.overlap else 1) * self.rate - 1

    def project(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(C, Z): each token's contribution and gate, (B, T, width or 2·width)."""
        return self.kv_proj(hidden_states), self.gate_proj(hidden_states)

    def pool(self, kv: torch.Tensor, gate: torch.Tensor, plan: WindowPlan) -> torch.Tensor:
        """The entries (B, K, width) of the windows `plan` names, from C and Z over X (B, N, ·), normed, before
        RoPE. A slot K that closes no window pools something finite (never read)."""
        rate, width = self.rate, self.width
        slots = 2 * rate if self.overlap else rate
        order = plan.order.unsqueeze(-1)
        kv, gate = kv.gather(1, order.expand_as(kv)), gate.gather(1, order.expand_as(gate))
        index = plan.closing.unsqueeze(-1) - slots + 1 + torch.arange(slots, device=kv.device)  # (B, K, S)
        present = index >= 0
        flat = index.clamp(min=0).flatten(1).unsqueeze(-1)
        kv = kv.gather(1, flat.expand(-1, -1, kv.shape[-1])).unflatten(1, index.shape[1:])  # (B, K, S, ·)
        gate = gate.gather(1, flat.expand(-1, -1, gate.shape[-1])).unflatten(1, index.shape[1:])
        gate = gate + self.position_bias.repeat(slots // rate, 1)
        if self.overlap:  # window w-1's first half, then window w's second half: 2m slots of `width`
            kv = torch.cat((kv[:, :, :rate, :width], kv[:, :, rate:, width:]), dim=2)
            gate = torch.cat((gate[:, :, :rate, :width], gate[:, :, rate:, width:]), dim=2)
            present = torch.cat((plan.overlap.unsqueeze(-1).expand(-1, -1, rate), present[:, :, rate:]), dim=2)
        gate = gate.masked_fill(~present.unsqueeze(-1), float("-inf"))
        gate = gate.masked_fill(~plan.valid[..., None, None], 0.0)  # a slot K closing no window: finite, never read
        # softmax over the slots in fp32 (transformers' class: bf16 gates would merge close weights)
        weights = gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)
        return self.kv_norm((kv * weights).sum(dim=2))


class CompressedIndexer(nn.Module):
    """CSA's lightning indexer: its own `Compressor` of `index_head_dim` over the same windows, queries
    `q_b_proj`(query latent) in `index_n_heads` heads and per-head weights `weights_proj`(x); a query's score for
    entry s is Σ_h w_h · ReLU(q_h · k_s) / sqrt(D_I) (`lightning_indexer.rank_keys`, DSA's), and it keeps the
    `index_topk` visible entries of highest score."""

    def __init__(self, config, rate: int):
        super().__init__()
        self.num_heads, self.head_dim, self.top_k = config.index_n_heads, config.index_head_dim, config.index_topk
        self.compressor = Compressor(config, self.head_dim, rate, overlap=True)
        self.q_b_proj = nn.Linear(config.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(config.hidden_size, self.num_heads, bias=False)
        self.scaling = self.head_dim**-0.5

    @torch.no_grad()
    def select(self, q_latent, hidden_states, position_embeddings, keys, visible_rows, interleaved: bool):
        """The indices (B, T, k) of each query's chosen entries among `keys` (B, E, D_I) (`rank_keys`)."""
        queries = self.q_b_proj(q_latent).unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)
        if position_embeddings is not None:
            queries = apply_rotary(queries, *position_embeddings, interleaved, trailing=True)
        weights = index_head_weights(self.weights_proj, hidden_states, self.scaling)
        return rank_keys(queries.transpose(1, 2), weights, keys, visible_rows, self.top_k)


@dataclass
class Entries:
    """A layer's compressed entries and what says which query sees which: `values` (B, E, D) (keys and values
    alike), `index_keys` (B, E, D_I) for CSA's indexer, `windows` (B, E) each entry's window, `rate`; without a
    cache, `documents` (B, E) and `query_documents` (B, T) (one document with a cache: None)."""

    values: torch.Tensor
    index_keys: torch.Tensor | None
    windows: torch.Tensor
    rate: int
    documents: torch.Tensor | None = None
    query_documents: torch.Tensor | None = None

    def visible(self, positions: torch.Tensor, rows: slice) -> torch.Tensor:
        """(B, t, E) bool for the queries `rows` at `positions` (B, t): entry e is visible to the query at position
        p once complete, w < (p + 1) // m, and in its document."""
        seen = self.windows.unsqueeze(1) < ((positions + 1) // self.rate).unsqueeze(-1)
        if self.documents is not None:
            seen = seen & (self.documents.unsqueeze(1) == self.query_documents[:, rows].unsqueeze(-1))
        return seen


class WindowCompression(nn.Module):
    """The compressed entries of one CSA or HCA layer (`compressor`, CSA's `indexer`), pooled as its windows
    complete, kept in its cache layer between forwards (`compressed_cache.CompressedLayer`)."""

    def __init__(self, config, layer_type: str):
        super().__init__()
        self.rate = config.compress_rates[layer_type]
        self.layer_type = layer_type
        sparse = layer_type == COMPRESSED_SPARSE
        self.compressor = Compressor(config, config.head_dim, self.rate, overlap=sparse)
        self.indexer = CompressedIndexer(config, self.rate) if sparse else None
        self.interleaved = config.rope_interleaved
        # RoPE at each entry's window start (the layer's table, as transformers' compressors own one)
        self.rotary_emb = RotaryEmbedding(config) if config.uses_rope else None

    def forward(self, hidden_states, real, positions, cache_layer, rotary: bool) -> Entries:
        """This layer's entries for the new tokens: real (B, T) (None: all real), positions (B, T). The first
        forward (no cache, or a cache holding nothing yet) attends to the windows its own tokens complete, each query
        to its document's (packed documents); a cache keeps each row's last document, which a later forward
        continues (slots)."""
        streams = self._projected(hidden_states)
        first = cache_layer is None or not cache_layer.tails
        if not first and not self._completes_a_window(real, positions):  # a decode step between window ends
            for name, (_, kv, gate) in streams.items():
                cache_layer.push(name, kv, gate, real)
            return self._held(cache_layer)
        if real is None:
            real = torch.ones(positions.shape, dtype=torch.bool, device=positions.device)
        tail = cache_layer.tail_length if cache_layer is not None else 0
        docs = documents(positions)
        plan = WindowPlan.of(real, positions, docs, tail, self.rate)
        last_document = docs.masked_fill(~real, -1).amax(dim=1, keepdim=True)  # (B, 1): each row's last real token's
        local = {}
        for name, (compressor, kv, gate) in streams.items():
            if cache_layer is not None:
                kv, gate = cache_layer.with_tail(name, kv, gate, tail)
            local[name] = self._rotated(compressor.pool(kv, gate, plan), plan.windows, rotary)
            if cache_layer is not None:
                cache_layer.store(name, kv, gate, plan.order, local[name], plan,
                                  plan.valid & (plan.documents == last_document))
        if not first:
            return self._held(cache_layer)
        windows = plan.windows.masked_fill(~plan.valid, NEVER)
        return Entries(local["compressor"], local.get("indexer"), windows, self.rate, plan.documents, docs)

    def _projected(self, hidden_states) -> dict:
        """{stream name: (its compressor, C, Z)} of the new tokens: the compressor's, and CSA's indexer's."""
        streams = {"compressor": (self.compressor, *self.compressor.project(hidden_states))}
        if self.indexer is not None:
            streams["indexer"] = (self.indexer.compressor, *self.indexer.compressor.project(hidden_states))
        return streams

    def _completes_a_window(self, real, positions) -> bool:
        """Whether a real new token closes a window in some row. A one-token step that closes none pools nothing:
        it only joins the cache's last tokens (transformers' compressors likewise pool once a window is full).
        Positions off the CPU take the general path, which pools what closes: reading them would stall an
        accelerator's queue once a layer each step (and the meta device holds no values)."""
        if positions.shape[1] != 1 or positions.device.type != "cpu":
            return True
        closes = (positions + 1) % self.rate == 0
        return bool((closes if real is None else closes & real).any())

    def _held(self, cache_layer) -> Entries:
        """The entries the cache holds, one slot per window index."""
        entries = cache_layer.entries
        return Entries(entries["compressor"], entries.get("indexer"), cache_layer.entry_windows(), self.rate)

    def _rotated(self, entries: torch.Tensor, windows: torch.Tensor, rotary: bool) -> torch.Tensor:
        """RoPE on each entry's last rotary features at its window's first position w·m (the layer's table)."""
        if not rotary or self.rotary_emb is None:
            return entries
        layer_type = self.layer_type if self.rotary_emb.nested else None
        cos, sin = self.rotary_emb(entries, (windows * self.rate).clamp(min=0), layer_type)  # (B, K, rot)
        rotated = apply_rotary(entries.unsqueeze(1), cos.unsqueeze(1), sin.unsqueeze(1), self.interleaved,
                               trailing=True)
        return rotated.squeeze(1)


__all__ = ["COMPRESSED_LAYER_TYPES", "COMPRESSED_SPARSE", "HEAVILY_COMPRESSED", "CompressedIndexer", "Compressor",
           "Entries", "NEVER", "WindowCompression", "WindowPlan", "documents", "real_tokens"]
