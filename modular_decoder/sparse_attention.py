"""DeepSeek Sparse Attention (DSA, DeepSeek-V3.2-Exp, `attention_type="dsa"`): MLA over a few keys per query.

Multi-head latent attention whose every query attends only to the `index_topk` keys its lightning indexer ranks
highest (`lightning_indexer.py`).

The cache holds what MLA's does, the latent and the rotary key of every token, plus one indexer key per token
(`latent_cache.DynamicIndexedLatentLayer` / `StaticIndexedLatentLayer`): selection saves attention work, not cache.
A query that sees at most `index_topk` keys attends to all of them, so while the context is that short a DSA layer
is MLA, and the indexer only caches its keys.

The same function on every path, chosen as MLA's `scoring_path` chooses (a decode step of a few new tokens
against a plain `kv_b_proj` is absorbed, everything else expanded):

* gathered (absorbed steps, every backend but eager): each query's chosen latents and rotary keys are gathered,
  (t, k, d_c + d_R) per block of `tuning().absorbed_query_block` queries, and scored in latent space. The main
  attention reads k keys per query, not the S cached ones: this is what DSA saves at decode time. (A fused kernel
  that reads the chosen keys in place, as DeepSeek's FlashMLA sparse kernels do on Hopper GPUs, would not copy
  them; none is used here.)
* gathered and expanded (a decode step that must call `kv_b_proj`: an adapter or hook on it; or on flex): the
  chosen latents go through `kv_b_proj` (T·k rows, not S) and the backend scores each query against its own keys.
* masked (longer expanded steps, and eager's every step): the selection becomes a boolean mask, the model's mask
  AND the chosen keys, which eager and SDPA take as a tensor and FlexAttention as a `BlockMask`. Long steps run
  in query blocks whose (B, 1, t, S) selection stays within `SELECTION_MASK_BYTES`; the backend's fused kernel
  scores each block, so no (query x key) score matrix is built (eager, the reference, scores all queries at once).
  The flash backends take no such mask: a DSA config refuses them at load (`backend_features`), as vLLM.

The indexer's own scores are (query x key) by design; `LightningIndexer.select` bounds them per pass.
"""

from __future__ import annotations

import functools

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, create_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .backend_features import canonical_backend
from .eager_attention import eager_attention, explicit_mask
from .kinds import require_int
from .latent_cache import indexed_latent_layer
from .lightning_indexer import LightningIndexer
from .mla import LatentKind, MultiHeadLatentAttention
from .positions import apply_rotary
from .split_products import is_fx_proxy, project
from .tuning import tuning

# A long step's queries are selected and scored in blocks whose boolean selection, (B, 1, t, S), stays within
# this many bytes (at least one query per block): 64 MiB is 2,048 queries against 32k keys.
SELECTION_MASK_BYTES = 1 << 26

INDEX_FIELDS = ("index_n_heads", "index_head_dim", "index_topk")


def restrict(mask: torch.Tensor | None, selected: torch.Tensor) -> torch.Tensor:
    """`mask` (boolean keep-mask or additive) narrowed to the `selected` keys (boolean, True = chosen)."""
    if mask is None:
        return selected
    if mask.dtype == torch.bool:
        return mask & selected
    return mask.masked_fill(~selected, torch.finfo(mask.dtype).min)


def gather_rows(cache: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Each query's chosen rows of a cache: cache (B, S, D), indices (B, T, k) -> (B, T, k, D).

    One `index_select` over the rows
    of the cache's storage (a copy per row, not an index computed per element as advanced indexing does) where its
    rows are laid out one after another, as every cache layer here stores them."""
    batch, length, width = cache.shape
    if cache.stride(2) != 1 or cache.stride(1) != width or cache.stride(0) % width:
        return cache[torch.arange(batch, device=indices.device)[:, None, None], indices]
    rows_per_batch = cache.stride(0) // width  # a growing layer's capacity, a static layer's length
    rows = cache.as_strided(((batch - 1) * rows_per_batch + length, width), (width, 1))
    offsets = torch.arange(batch, device=indices.device).mul_(rows_per_batch).view(batch, 1, 1)
    return rows.index_select(0, (indices + offsets).flatten()).view(*indices.shape, width)


def selection_mask(indices: torch.Tensor, kv_len: int) -> torch.Tensor:
    """Indices (B, T, k) -> a boolean (B, 1, T, S) mask, True at each query's chosen keys."""
    selected = indices.new_zeros((*indices.shape[:2], kv_len), dtype=torch.bool)
    return selected.scatter_(-1, indices, True).unsqueeze(1)


class SparseLatentAttention(MultiHeadLatentAttention):
    """MLA (`mla.MultiHeadLatentAttention`) whose queries attend to the keys `self.indexer` selects."""

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.indexer = LightningIndexer(config)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | BlockMask | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        position_bias: torch.Tensor | None = None,
        cache=None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """MLA's projections, the indexer's keys cached beside the latent, then the selected keys scored.

        The projections are `MultiHeadLatentAttention.forward`'s (which vLLM rewrites and this kind does not run
        there); the scoring: the module docstring."""
        del position_bias  # config validation rules out ALiBi with MLA
        batch, seq = hidden_states.shape[:2]
        q_latent = self.q_a_layernorm(self.q_a_proj(hidden_states))  # the indexer's queries start here too
        latents, k_rot = self.kv_a_proj_with_mqa(hidden_states).split([self.latent_dim, self.rope_dim], dim=-1)
        q_nope, q_rot = (self.q_b_proj(q_latent).unflatten(-1, (-1, self.qk_dim)).transpose(1, 2)
                         .split([self.nope_dim, self.rope_dim], dim=-1))
        cos, sin = position_embeddings
        q_rot = apply_rotary(q_rot, cos, sin, self.interleaved)
        k_rot = apply_rotary(k_rot.unsqueeze(1), cos, sin, self.interleaved)  # (B, 1, T, d_R)
        latents = self.kv_a_layernorm(latents).unsqueeze(1)  # (B, 1, T, d_c)
        index_keys = self.indexer.keys(hidden_states, position_embeddings)  # (B, T, D_I)
        path = "expanded"
        if cache is not None and not is_fx_proxy(cache):
            latents, k_rot = cache.update(latents, k_rot, self.layer_idx)
            index_keys = cache.update_indexer(index_keys, self.layer_idx)
            path = self.scoring_path(seq, latents.shape[-2], attention_mask)
        select = None  # every key is kept while there are at most `index_topk`: MLA's attention as it is
        if latents.shape[-2] > self.indexer.top_k:
            select = functools.partial(self._select, q_latent, hidden_states, position_embeddings, index_keys)
        attend = self.sparse_absorbed if path == "absorbed" else self.sparse_expanded
        out, weights = attend(q_nope, q_rot, latents, k_rot, attention_mask, select, kwargs)
        return project(self.o_proj, out.reshape(batch, seq, -1)), weights

    def _select(self, q_latent, hidden_states, position_embeddings, index_keys, rows: slice, mask) -> torch.Tensor:
        """The indexer's choice (B, t, k) for the new tokens in `rows`, `mask` their rows of `visible_keys`."""
        tables = tuple(table[:, :, rows] for table in position_embeddings)
        return self.indexer.select(q_latent[:, rows], hidden_states[:, rows], tables, index_keys, mask)

    def visible_keys(self, attention_mask, q_len: int, kv_len: int, batch: int) -> torch.Tensor | None:
        """The mask this layer received, made explicit and (B, 1, T, S): boolean (True = may attend) or additive,
        or None (one query that may see every key). A FlexAttention `BlockMask` is evaluated to booleans."""
        if isinstance(attention_mask, BlockMask):
            device = attention_mask.kv_num_blocks.device
            mask = create_mask(attention_mask.mask_mod, batch, 1, q_len, kv_len, device=device)
        else:
            mask = explicit_mask(attention_mask, q_len, kv_len, None, self.config._attn_implementation)
        return None if mask is None else mask.expand(batch, 1, q_len, kv_len)

    def backend_mask(self, keep: torch.Tensor):
        """A boolean (B, 1, t, S) keep-mask as the backend takes it: a `BlockMask` for FlexAttention (whose tensor
        masks are additive), the tensor itself for eager and SDPA."""
        if canonical_backend(self.config._attn_implementation) != "flex_attention":
            return keep
        batch, _, q_len, kv_len = keep.shape
        return create_block_mask(lambda b, h, q, kv: keep[b, 0, q, kv], batch, None, q_len, kv_len, device=keep.device)

    def sparse_absorbed(self, q_nope, q_rot, latents, k_rot, attention_mask, select, kwargs):
        """A decode step: MLA's absorbed scores over every key while all are kept; otherwise the chosen keys
        gathered (`gathered_attention`), or, on the eager reference, masked."""
        if select is None:
            return self.absorbed_attention(q_nope, q_rot, latents, k_rot, attention_mask)
        batch, _, q_len, _ = q_nope.shape
        mask = self.visible_keys(attention_mask, q_len, latents.shape[-2], batch)
        indices = select(slice(None), mask)  # (B, T, k)
        if self.config._attn_implementation == "eager":
            keep = restrict(mask, selection_mask(indices, latents.shape[-2]))
            return self.absorbed_attention(q_nope, q_rot, latents, k_rot, keep)
        return self.gathered_attention(q_nope, q_rot, latents, k_rot, indices, mask), None

    def sparse_expanded(self, q_nope, q_rot, latents, k_rot, attention_mask, select, kwargs):
        """Attention over per-head keys and values made by `kv_b_proj` (adapters and hooks apply).

        Scored by the backend. A step whose queries choose fewer keys in all than the cache holds (a decode step
        under an adapter, or on flex) expands only the chosen ones (`gathered_expanded`); otherwise every cached key
        is expanded, as on MLA's expanded path, and the selection is a mask, `SELECTION_MASK_BYTES` of it per block
        of queries (eager, the reference, in one block)."""
        batch, _, q_len, _ = q_nope.shape
        kv_len = latents.shape[-2]
        queries = torch.cat((q_nope, q_rot), dim=-1)  # (B, H, T, d_qk)
        eager = self.config._attn_implementation == "eager"
        if select is None:
            return self.scored(queries, *self.expanded(latents, k_rot), attention_mask, kwargs)
        mask = self.visible_keys(attention_mask, q_len, kv_len, batch)
        if not eager and q_len * self.indexer.top_k < kv_len:
            return self.gathered_expanded(queries, latents, k_rot, select(slice(None), mask), mask, kwargs), None
        keys, values = self.expanded(latents, k_rot)
        block = q_len if eager else max(1, SELECTION_MASK_BYTES // (batch * kv_len))
        outs, weights = [], []
        for start in range(0, q_len, block):
            rows = slice(start, min(start + block, q_len))
            rows_mask = None if mask is None else mask[:, :, rows]
            keep = self.backend_mask(restrict(rows_mask, selection_mask(select(rows, rows_mask), kv_len)))
            out, probs = self.scored(queries[:, :, rows], keys, values, keep, kwargs)
            outs.append(out)
            weights.append(probs)
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)  # (B, T, H, d_v)
        return out, weights[0] if len(weights) == 1 or weights[0] is None else torch.cat(weights, dim=2)

    def gathered_expanded(self, queries, latents, k_rot, indices, mask, kwargs) -> torch.Tensor:
        """Each query's chosen keys gathered, up-projected through `kv_b_proj` and scored by the backend.

        Each query is its own batch row: queries (B, H, T, d_qk), latents (B, 1, S, d_c), k_rot (B, 1, S, d_R),
        indices (B, T, k), mask (B, 1, T, S) or None -> (B, T, H, d_v). Expands T·k latents instead of the S cached
        ones."""
        batch, heads, q_len, _ = queries.shape
        chosen_latents = gather_rows(latents[:, 0], indices).flatten(0, 1).unsqueeze(1)  # (B·T, 1, k, d_c)
        chosen_rot = gather_rows(k_rot[:, 0], indices).flatten(0, 1).unsqueeze(1)  # (B·T, 1, k, d_R)
        keys, values = self.expanded(chosen_latents, chosen_rot)  # (B·T, H, k, d_qk), (B·T, H, k, d_v)
        chosen_mask = None if mask is None else mask[:, 0].gather(-1, indices).flatten(0, 1)[:, None, None]
        if chosen_mask is not None:
            chosen_mask = self.backend_mask(chosen_mask)
        rows = queries.transpose(1, 2).flatten(0, 1).unsqueeze(2)  # (B·T, H, 1, d_qk)
        out, _ = self.scored(rows, keys, values, chosen_mask, kwargs)  # (B·T, 1, H, d_v)
        return out.view(batch, q_len, heads, -1)

    def expanded(self, latents, k_rot) -> tuple[torch.Tensor, torch.Tensor]:
        """`expand_kv`'s per-head keys and values, V zero-padded to the q/k width for CPU SDPA (its flash kernel
        then applies, as in MLA's forward; `scored` crops the output)."""
        keys, values = self.expand_kv(latents, k_rot)
        if self.config._attn_implementation == "sdpa" and self.v_dim < self.qk_dim and values.device.type == "cpu":
            values = torch.nn.functional.pad(values, [0, self.qk_dim - self.v_dim])
        return keys, values

    def scored(self, queries, keys, values, mask, kwargs):
        """The model's attention backend on per-head q/k/v (B, H, ·, ·) -> ((B, T, H, d_v), weights or None)."""
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention)
        attention_interface = self.scores_through(attention_interface, kwargs)  # sinks
        out, probs = attention_interface(self, queries, keys, values, mask, scaling=self.scaling, s_aux=self.sinks,
                                         **self.score_kwargs(kwargs))
        return out[..., : self.v_dim], probs

    def gathered_attention(self, q_nope, q_rot, latents, k_rot, indices, mask):
        """Absorbed scores against each query's chosen keys only.

        q_nope (B, H, T, d_n), q_rot (B, H, T, d_R), latents (B, 1, S, d_c), k_rot (B, 1, S, d_R), indices (B, T, k),
        mask (B, 1, T, S) or None -> (B, T, H, d_v). Per block of `tuning().absorbed_query_block` queries, the
        chosen latents and rotary keys, (B·t, k, d_c + d_R), are gathered and each query scores its own k: the work
        and the explicit scores, (B·t, H, k), grow with k, not with the cache. Reads `kv_b_proj.weight` as MLA's
        absorbed path does (`scoring_path` engages it only for a plain module).
        """
        batch, heads, q_len, _ = q_nope.shape
        w_uk, w_uv = self.kv_b_proj.weight.view(heads, -1, self.latent_dim).split([self.nope_dim, self.v_dim], dim=1)
        q_latent = torch.einsum("bhtn,hnc->bthc", q_nope, w_uk)  # (B, T, H, d_c)
        q_rot = q_rot.transpose(1, 2)  # (B, T, H, d_R)
        cache_latents, cache_rot = latents[:, 0], k_rot[:, 0]  # (B, S, d_c), (B, S, d_R)
        outs, block = [], tuning().absorbed_query_block
        for start in range(0, q_len, block):
            rows = slice(start, min(start + block, q_len))
            chosen_latents = chosen_rot = probs = None  # the previous block's, freed before this block's exist
            chosen = indices[:, rows]  # (B, t, k)
            chosen_latents = gather_rows(cache_latents, chosen).flatten(0, 1)  # (B·t, k, d_c)
            chosen_rot = gather_rows(cache_rot, chosen).flatten(0, 1)  # (B·t, k, d_R)
            chosen_mask = None if mask is None else mask[:, 0, rows].gather(-1, chosen).flatten(0, 1)[:, None, None]
            probs = self._latent_probs(q_latent[:, rows].flatten(0, 1).unsqueeze(2),
                                       q_rot[:, rows].flatten(0, 1).unsqueeze(2), chosen_latents, chosen_rot,
                                       chosen_mask)  # (B·t, H, 1, k)
            outs.append((probs.squeeze(2) @ chosen_latents).view(batch, -1, heads, self.latent_dim))
        out_latent = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)  # (B, T, H, d_c)
        return torch.einsum("bthc,hvc->bthv", out_latent, w_uv)  # (B, T, H, d_v)


class SparseLatentKind(LatentKind):
    """`attention_type="dsa"`: MLA with a lightning indexer choosing each query's keys (DeepSeek-V3.2)."""

    name = "dsa"
    module = SparseLatentAttention
    fields = LatentKind.fields + INDEX_FIELDS
    positions = ("rope",)  # the indexer rotates its keys and queries

    def validate(self, config) -> None:
        super().validate(config)
        for name in INDEX_FIELDS:
            if getattr(config, name) is None:
                raise ValueError(f"`attention_type='dsa'` needs `{name}`.")
            require_int(name, getattr(config, name), minimum=1)
        if config.q_lora_rank is None:
            raise ValueError("`attention_type='dsa'` needs `q_lora_rank`: the indexer's queries are made from the "
                             "query latent (`wq_b` reads `q_a_layernorm`'s output), as in DeepSeek-V3.2.")
        if config.index_head_dim < config.qk_rope_head_dim:
            raise ValueError(f"`index_head_dim`={config.index_head_dim} must be at least `qk_rope_head_dim`="
                             f"{config.qk_rope_head_dim}: the indexer rotates that many of its features.")
        if "sliding_attention" in config.layer_types:
            raise ValueError("`attention_type='dsa'` chooses each query's keys from the whole context: it takes no "
                             "`sliding_window` layers (`layer_types` with 'sliding_attention').")

    def backend_features(self, config) -> set[str]:
        return super().backend_features(config) | {"key_selection"}

    def cache_layer(self, config, layer_type: str, implementation: str, max_cache_len: int | None):
        return indexed_latent_layer(implementation, max_cache_len)

    def parameters(self, config) -> int:
        """MLA's, plus the indexer: its query projection from the query latent, its key projection and key
        LayerNorm (weight and bias), and the per-head weights."""
        heads, width, d = config.index_n_heads, config.index_head_dim, config.hidden_size
        return super().parameters(config) + config.q_lora_rank * heads * width + d * width + 2 * width + d * heads

    def bytes_per_token(self, config, element_bytes: int, quantization: str | None = None) -> int:
        """(d_c + d_R + D_I)·b: the latent, the shared rotary key and the indexer's key."""
        return super().bytes_per_token(config, element_bytes, quantization) + config.index_head_dim * element_bytes

    def fp32_modules(self, config) -> tuple[str, ...]:
        """The indexer's head weights stay fp32 when the model loads in fp16 (transformers' `DeepseekV32` keeps
        `indexer.weights_proj` so)."""
        return ("indexer.weights_proj",)


SPARSE_LATENT_ATTENTION = SparseLatentKind()

__all__ = ["SparseLatentAttention", "SPARSE_LATENT_ATTENTION", "SELECTION_MASK_BYTES", "restrict", "selection_mask",
           "gather_rows"]
