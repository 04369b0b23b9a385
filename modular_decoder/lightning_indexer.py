"""DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2-Exp, https://github.com/deepseek-ai/DeepSeek-V3.2-Exp):
which cached keys each query of a DSA layer attends to.

Per query t and key s, with H_I small heads of width D_I:

    I[t, s] = Σ_h w[t, h] · ReLU(q_I[t, h] · k_I[s] / sqrt(D_I)),    w[t] = weights_proj(x_t) / sqrt(H_I)

where q_I = wq_b(c_q) comes from the query latent c_q = q_a_layernorm(q_a_proj(x)) the main attention makes, and
k_I = LayerNorm(wk(x)) is one D_I-wide key per token, cached beside the latent. The first `qk_rope_head_dim`
features of q_I and k_I are rotated, in the halves layout. A query keeps the `index_topk` keys of highest I among
those its mask lets it see (`select`), equal scores earliest key first (`top_k_earliest`). The formula and names
are transformers' `DeepseekV32Indexer` (which computes in fp32 what DeepSeek's kernels compute in FP8 after a
Hadamard rotation: an orthogonal rotation leaves every q_I·k_I unchanged).

The indexer runs without autograd, as transformers' does: the indices it returns carry no gradient, so the language
model loss never reaches its projections (DeepSeek trains it with its own distillation loss, not implemented here).

Memory: the scores are (query x key) by design, but never for a whole long query at once. `select` scores
`query_block(...)` queries per pass, as many as keep the per-head scores, (B, t, H_I, S) in fp32, within
`INDEX_SCORE_BYTES`, and keeps only each pass's (B, t, k) indices.
"""

from __future__ import annotations

import torch
from torch import nn

from .norms import LayerNorm
from .positions import apply_rotary

# The per-head scores of one pass, (B, t, H_I, S) in fp32, stay within this many bytes (at least one query per
# pass): 64 MiB is 8 queries of DeepSeek-V3.2's 64 heads against 32k cached keys.
INDEX_SCORE_BYTES = 1 << 26


def query_block(batch: int, heads: int, keys: int, budget: int = INDEX_SCORE_BYTES) -> int:
    """Queries per scoring pass: as many as keep (batch, t, heads, keys) fp32 scores within `budget` bytes."""
    return max(1, budget // (4 * batch * heads * keys))


def halves_layout(table: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """A cos/sin table (..., rot) in the halves layout, which the indexer rotates by.

    The halves layout is [f_0 .. f_{rot/2-1}, f_0 .. f_{rot/2-1}]. The model's
    table is in the pair layout when `rope_interleaved` (f_0, f_0, f_1, f_1, ...); the indexer rotates halves."""
    if not interleaved:
        return table
    half = table[..., 0::2]
    return torch.cat((half, half), dim=-1)


class LightningIndexer(nn.Module):
    """Scores every cached key for each query with a few ReLU heads, and keeps each query's top-k keys."""

    def __init__(self, config):
        super().__init__()
        self.num_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.top_k = config.index_topk
        self.interleaved = config.rope_interleaved
        self.wq_b = nn.Linear(config.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = LayerNorm(self.head_dim, eps=config.norm_eps, bias=True)
        self.weights_proj = nn.Linear(config.hidden_size, self.num_heads, bias=False)
        self.scaling = self.head_dim**-0.5

    def _rotate(self, x: torch.Tensor, position_embeddings) -> torch.Tensor:
        """Rotate the first `qk_rope_head_dim` features of x (B, H, T, D_I) in the halves layout."""
        cos, sin = (halves_layout(table, self.interleaved) for table in position_embeddings)
        return apply_rotary(x, cos, sin, interleaved=False)

    @torch.no_grad()
    def keys(self, hidden_states: torch.Tensor, position_embeddings) -> torch.Tensor:
        """Each token's indexer key, (B, T, D_I): what the cache stores beside the latent."""
        keys = self.k_norm(self.wk(hidden_states)).unsqueeze(1)  # (B, 1, T, D_I)
        return self._rotate(keys, position_embeddings)[:, 0]

    @torch.no_grad()
    def select(self, q_latent: torch.Tensor, hidden_states: torch.Tensor, position_embeddings, keys: torch.Tensor,
               visible: torch.Tensor | None) -> torch.Tensor:
        """The indices (B, T, k) of the keys each query keeps, k = min(`index_topk`, S).

        q_latent (B, T, q_lora_rank) and hidden_states (B, T, d) of the new tokens; keys (B, S, D_I), every cached
        indexer key; visible: the (B or 1, 1, T, S) mask of the keys each query may see, boolean or additive (None:
        all). A query
        that sees fewer than k keys also gets some it may not see, as transformers' indexer does: the attention
        masks those, so they change nothing.
        """
        queries = self.wq_b(q_latent).unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)
        queries = self._rotate(queries, position_embeddings).transpose(1, 2)  # (B, T, H_I, D_I)
        weights = index_head_weights(self.weights_proj, hidden_states, self.scaling)
        return rank_keys(queries, weights, keys, lambda rows: None if visible is None else visible[:, 0, rows],
                         self.top_k)


def index_head_weights(weights_proj: nn.Module, hidden_states: torch.Tensor, scaling: float) -> torch.Tensor:
    """w[t] = weights_proj(x_t) / sqrt(H_I), times the score scale `scaling` (D_I^-1/2): (B, T, H_I) fp32.
    ReLU(x·s) = ReLU(x)·s for the positive scale s: it rides in the head weights (one pass fewer over the scores)."""
    dtype = getattr(weights_proj, "weight", hidden_states).dtype  # kept in fp32 under fp16
    heads = weights_proj.out_features
    return weights_proj(hidden_states.to(dtype)).float() * (heads**-0.5 * scaling)


def rank_keys(queries: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, visible_rows, top_k: int
              ) -> torch.Tensor:
    """The indices (B, T, k) of the keys of highest indexer score I[t, s] = Σ_h w[t, h] · ReLU(q[t, h] · k[s])
    each query keeps, k = min(`top_k`, S), equal scores earliest key first (`top_k_earliest`).

    queries (B, T, H, D) rotated as the keys are, weights (B, T, H) (`index_head_weights`), keys (B, S, D);
    `visible_rows(rows)`: for the queries `rows` (a slice), the (B, t, S) mask of the keys they may see, boolean
    (True = may see) or additive, or None (all). A query that sees fewer than k keys also gets some it may not
    see (the attention masks those, as transformers' indexers leave them). Scored `query_block` queries per pass,
    so the (B, t, H, S) per-head scores stay within `INDEX_SCORE_BYTES`.
    """
    batch, q_len, heads, _ = queries.shape
    queries = queries.float()
    keys_t = keys.float().transpose(1, 2).unsqueeze(1)  # (B, 1, D, S)
    top_k = min(top_k, keys.shape[1])
    block = query_block(batch, heads, keys.shape[1])
    indices = []
    for start in range(0, q_len, block):
        rows = slice(start, min(start + block, q_len))
        scores = (queries[:, rows] @ keys_t).relu_()  # (B, t, H, S)
        scores = (weights[:, rows].unsqueeze(-2) @ scores).squeeze(-2)  # (B, t, S)
        mask = visible_rows(rows)
        if mask is not None:  # a boolean mask (True = may see) or an additive one, as transformers applies it
            scores = scores.masked_fill_(~mask, float("-inf")) if mask.dtype == torch.bool else scores.add_(mask)
        indices.append(top_k_earliest(scores, top_k))
    return indices[0] if len(indices) == 1 else torch.cat(indices, dim=1)


def top_k_earliest(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of the k highest scores along the last dim, equal scores taken earliest key first.

    `torch.topk` leaves the order of equal values to its kernel, which picks differently for a row and the same
    row with masked keys after it (a decode step and the prefill it continues): a tie at the k-th place (keys
    whose every indexer head is cut to 0 by the ReLU score exactly 0) would let a cached step choose other keys
    than the uncached forward. Without a tie at the k-th place this is `topk`'s choice (in another order).
    """
    kth = scores.topk(k, dim=-1).values[..., -1:]  # (..., 1)
    above, at = scores > kth, scores == kth
    keep = above | (at & (at.cumsum(-1) <= k - above.sum(-1, keepdim=True)))  # exactly k per row
    positions = torch.arange(scores.shape[-1], 0, -1, device=scores.device, dtype=torch.int32)  # earlier: larger
    return (keep * positions).topk(k, dim=-1).indices


__all__ = ["LightningIndexer", "INDEX_SCORE_BYTES", "index_head_weights", "query_block", "halves_layout", "rank_keys",
           "top_k_earliest"]
