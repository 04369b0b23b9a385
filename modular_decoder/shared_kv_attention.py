"""Shared key = value attention (`attention_type="shared_kv"`, DeepSeek-V4's report §2.3): every query head
attends to one head whose key is also its value, over a window on every layer but the full ones, plus the
compressed entries of its CSA / HCA layers (`compressed_attention.py`).

    c_q = q_a_norm(x W_qa)            q_h = RMS(c_q W_qb)_h         (one query per head, RMS-normed without weight)
    kv  = kv_norm(x W_kv)                                           (one head: the key and the value)
    q, kv rotated on their last rotary features (`partial_rotary_factor` of `head_dim`)
    o_h = softmax(q_h · [kv_window; entries]ᵀ / sqrt(d_h), sinks) · [kv_window; entries]
    o_h rotated back (-θ at the query's position): a value carries its key's rotation, and this leaves each
        token's contribution a function of its distance to the query
    out = o_b_proj(o_a_proj_g(o_g))   (`o_groups` groups of heads, each projected to `o_lora_rank`, then mixed;
                                        or one `o_proj` without `o_groups`)

The scores go through transformers' attention interface (eager, the reference, in one call; SDPA in blocks of
queries, whose mask of window, entries and (CSA) the indexer's choice stays within `ATTENTION_MASK_BYTES`); a CSA
decode step gathers each query's chosen entries instead of masking all of them. Flash kernels and FlexAttention
take no such mask (and flash-attn no head of 512): the kind refuses them at load (`backend_features`), as
transformers' DeepSeek-V4 runs eager only.

`SHARED_KV_ATTENTION` is the kind's registry entry; its fields live in `SharedKVFields`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .attention import linear_parameters
from .attention_layer import AttentionLayer
from .compressed_attention import COMPRESSED_LAYER_TYPES, COMPRESSED_SPARSE, WindowCompression, real_tokens
from .compressed_cache import ROLLBACK_ERROR, CompressedLayer, KeyValueLayer, KeyValueSlidingLayer
from .eager_attention import eager_attention, explicit_mask
from .kinds import AttentionKind, require_int
from .norms import build_norm, norm_parameters, rms_unweighted
from .positions import apply_rotary
from .sinks import sink_parameters
from .split_products import project

# A block of queries and its mask over the window's keys and the entries, (B, 1, t, keys) booleans, stays within
# this many bytes (at least one query per block): 64 MiB is 2,048 queries against 32k keys
ATTENTION_MASK_BYTES = 1 << 26


@dataclass(kw_only=True)
class SharedKVFields:
    """Args:
        o_groups (`int`, *optional*): Groups g of the grouped low-rank output projection (transformers' DeepSeek-V4
            field): the heads' outputs split into g groups of H / g heads, each projected to `o_lora_rank` by its
            own matrix (`o_a_proj`), the g results mixed to d by `o_b_proj`. `None`: one `o_proj`.
            `attention_type="shared_kv"` only.
        o_lora_rank (`int`, *optional*): Width of each group's projection (transformers' field); set with `o_groups`.
        compress_rates (`dict`, *optional*): Tokens per pooled entry of each compressed layer type
            (transformers' field and form): `{"compressed_sparse_attention": m, "heavily_compressed_attention": m'}`
            (DeepSeek-V4: 4 and 128). A `"heavily_compressed_attention"` layer pools each window of m' tokens into
            one entry; a `"compressed_sparse_attention"` layer pools windows of m tokens overlapping the one before
            (2m slots) and keeps, per query, the `index_topk` entries its indexer (`index_n_heads`,
            `index_head_dim`) scores highest. Both attend to their entries after the window of `sliding_window`
            keys. Required for the compressed types `layer_types` has. `attention_type="shared_kv"` only.
    """

    o_groups: int | None = None
    o_lora_rank: int | None = None
    compress_rates: dict | None = None


class GroupedLinear(nn.Module):
    """g independent products, one per group of features: (..., g, n) -> (..., g, m / g), `weight` (m, n) holding
    each group's (m / g, n) block one after another (transformers' `DeepseekV4GroupedLinear`). Not an `nn.Linear`:
    PEFT's `all-linear` would wrap it as one."""

    def __init__(self, in_features_per_group: int, out_features: int, groups: int):
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(out_features, in_features_per_group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width = x.shape[-1]
        w = self.weight.view(self.groups, -1, width).transpose(1, 2)  # (g, n, m / g)
        y = torch.bmm(x.reshape(-1, self.groups, width).transpose(0, 1), w).transpose(0, 1)  # (N, g, m / g)
        return y.reshape(*x.shape[:-1], -1)

    def init_own_weights(self, init, std: float) -> None:
        init.normal_(self.weight, mean=0.0, std=std)


def as_keep(mask: torch.Tensor | None) -> torch.Tensor | None:
    """A 4-D mask as booleans, True where a key may be seen (an additive mask keeps its zeros)."""
    if mask is None or mask.dtype == torch.bool:
        return mask
    return mask == 0


class SharedKVAttention(AttentionLayer):
    """DeepSeek-V4's attention (module docstring): one key = value head, a window, compressed entries."""

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx, scaling=(config.query_pre_attn_scalar or config.head_dim) ** -0.5)
        self.sliding_window = config.sliding_window if self.layer_type != "full_attention" else None
        self.head_dim, self.num_heads = config.head_dim, config.num_attention_heads
        self.num_key_value_groups = self.num_heads  # one key = value head serves every query head
        self.eps = config.norm_eps
        d, width = config.hidden_size, self.num_heads * config.head_dim
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(d, width, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, config.q_lora_rank, bias=False)
            self.q_a_norm = build_norm(config, config.q_lora_rank)
            self.q_b_proj = nn.Linear(config.q_lora_rank, width, bias=False)
        self.kv_proj = nn.Linear(d, config.head_dim, bias=False)
        self.kv_norm = build_norm(config, config.head_dim)
        if config.o_groups:
            self.o_a_proj = GroupedLinear(width // config.o_groups, config.o_groups * config.o_lora_rank,
                                          config.o_groups)
            self.o_b_proj = nn.Linear(config.o_groups * config.o_lora_rank, d, bias=False)
        else:
            self.o_proj = nn.Linear(width, d, bias=False)
        compressed = self.layer_type in COMPRESSED_LAYER_TYPES
        self.compressor = WindowCompression(config, self.layer_type) if compressed else None

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        position_bias: torch.Tensor | None = None,
        cache=None,
        position_ids: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        del position_bias  # the kind refuses ALiBi
        batch, seq = hidden_states.shape[:2]
        q_latent, q = self._queries(hidden_states)  # (B, T, q_lora_rank) or None, (B, H, T, D)
        kv = self.kv_norm(self.kv_proj(hidden_states)).unsqueeze(1)  # (B, 1, T, D): key and value
        if position_embeddings is not None:
            q, kv = (apply_rotary(t, *position_embeddings, self.interleaved, trailing=True) for t in (q, kv))
        if cache is not None:
            kv, _ = cache.update(kv, kv, self.layer_idx)  # (B, 1, cached + T, D)
        positions = self._positions(position_ids, batch, seq, cache, hidden_states.device)
        entries = None
        if self.compressor is not None:
            real = real_tokens(attention_mask, seq, batch, hidden_states.device)
            layer = cache.layers[self.layer_idx] if cache is not None else None
            entries = self.compressor(hidden_states, real, positions, layer, position_embeddings is not None)
        out, weights = self._attend(q, kv, attention_mask, entries, q_latent, hidden_states, positions,
                                    position_embeddings, kwargs)  # (B, T, H, D)
        if position_embeddings is not None:  # the values' rotation undone at the query's position
            cos, sin = position_embeddings
            out = apply_rotary(out.transpose(1, 2), cos, -sin, self.interleaved, trailing=True).transpose(1, 2)
        return self._output(out.reshape(batch, seq, -1)), weights

    def _queries(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The query latent (for CSA's indexer; None without `q_lora_rank`) and the per-head queries (B, H, T, D),
        each head RMS-normed without weight."""
        if self.config.q_lora_rank is None:
            q_latent, q = None, self.q_proj(hidden_states)
        else:
            q_latent = self.q_a_norm(self.q_a_proj(hidden_states))
            q = self.q_b_proj(q_latent)
        return q_latent, rms_unweighted(q.unflatten(-1, (-1, self.head_dim)).transpose(1, 2), self.eps)

    def _output(self, out: torch.Tensor) -> torch.Tensor:
        """(B, T, H·D) -> (B, T, d): the grouped low-rank projection, or `o_proj`."""
        if self.config.o_groups is None:
            return project(self.o_proj, out)
        grouped = self.o_a_proj(out.unflatten(-1, (self.config.o_groups, -1)))  # (B, T, g, o_lora_rank)
        return self.o_b_proj(grouped.flatten(-2))

    @staticmethod
    def _positions(position_ids, batch: int, seq: int, cache, device) -> torch.Tensor:
        """(B, T) positions of the new tokens (the cache's count onwards where none were given)."""
        if position_ids is None:
            past = cache.get_seq_length(0) if cache is not None else 0
            position_ids = (torch.arange(seq, device=device) + past).unsqueeze(0)
        return position_ids.expand(batch, seq)

    def _attend(self, q, kv, attention_mask, entries, q_latent, hidden_states, positions, position_embeddings,
                kwargs):
        """softmax over the window's keys and the visible (CSA: chosen) entries, with the sinks: q (B, H, T, D),
        kv (B, 1, L, D) -> ((B, T, H, D), weights or None). Eager in one call; otherwise in query blocks."""
        batch, _, q_len, _ = q.shape
        kv_len = kv.shape[2]
        implementation = self.config._attn_implementation
        window = as_keep(explicit_mask(attention_mask, q_len, kv_len, self.sliding_window, implementation))
        eager = implementation == "eager"
        if entries is not None and not eager and q_len == 1 and self._ranks(entries):
            return self._gathered_step(q, kv, window, entries, q_latent, hidden_states, positions,
                                       position_embeddings, kwargs)
        block = q_len if eager else self._query_block(batch, kv_len, entries)
        outs, weights = [], []
        for start in range(0, q_len, block):
            rows = slice(start, min(start + block, q_len))
            keys, mask = self._window_keys(kv, window, rows, q_len)
            if entries is not None:
                keep = self._entry_keep(entries, rows, q_latent, hidden_states, positions, position_embeddings)
                keys = torch.cat((keys, entries.values.unsqueeze(1).to(keys.dtype)), dim=2)
                mask = torch.cat((mask.expand(batch, -1, -1, -1), keep.unsqueeze(1)), dim=-1)
            out, probs = self._scored(q[:, :, rows], keys, mask, kwargs)
            outs.append(out)
            weights.append(probs)
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        return out, weights[0] if len(weights) == 1 else None

    def _query_block(self, batch: int, kv_len: int, entries) -> int:
        """Queries per block: as many as keep a block's (B, 1, t, keys) boolean mask within `ATTENTION_MASK_BYTES`."""
        keys = (self.sliding_window or kv_len) + (0 if entries is None else entries.values.shape[1])
        return max(1, ATTENTION_MASK_BYTES // (batch * (keys + 64)))

    def _window_keys(self, kv, window, rows: slice, q_len: int):
        """The keys of the window that the queries `rows` can reach, and their (B or 1, 1, t, keys) keep-mask."""
        kv_len = kv.shape[2]
        offset = kv_len - q_len  # cached keys before the new tokens
        start = 0 if self.sliding_window is None else max(0, offset + rows.start - self.sliding_window + 1)
        stop = offset + rows.stop
        keys = kv[:, :, start:stop]
        if window is None:
            mask = torch.ones(1, 1, rows.stop - rows.start, stop - start, dtype=torch.bool, device=kv.device)
        else:
            mask = window[:, :, rows, start:stop]
        return keys, mask

    def _entry_keep(self, entries, rows: slice, q_latent, hidden_states, positions, position_embeddings):
        """(B, t, E): the entries the queries `rows` attend to, the visible ones (CSA: those of them chosen)."""
        visible = entries.visible(positions[:, rows], rows)
        if not self._ranks(entries):
            return visible
        chosen = self._chosen(entries, rows, visible, q_latent, hidden_states, position_embeddings)
        selected = torch.zeros_like(visible).scatter_(-1, chosen, True)
        return visible & selected

    def _ranks(self, entries) -> bool:
        """Whether CSA's indexer has a choice to make: it keeps `index_topk` entries, so with no more entry slots
        than that it keeps every visible one, and the attention reads the visible entries as HCA does."""
        return entries.index_keys is not None and entries.values.shape[1] > self.compressor.indexer.top_k

    def _chosen(self, entries, rows, visible, q_latent, hidden_states, position_embeddings) -> torch.Tensor:
        """The indexer's picks (B, t, k) for the queries `rows` among the visible entries."""
        tables = None if position_embeddings is None else tuple(t[:, :, rows] for t in position_embeddings)
        return self.compressor.indexer.select(q_latent[:, rows], hidden_states[:, rows], tables, entries.index_keys,
                                              lambda block: visible[:, block], self.interleaved)

    def _gathered_step(self, q, kv, window, entries, q_latent, hidden_states, positions, position_embeddings,
                       kwargs):
        """A one-token CSA step: the window's keys and only each row's chosen entries, gathered (k of them, not
        every entry the cache holds)."""
        batch = q.shape[0]
        rows = slice(0, 1)
        keys, mask = self._window_keys(kv, window, rows, 1)
        visible = entries.visible(positions, rows)  # (B, 1, E)
        chosen = self._chosen(entries, rows, visible, q_latent, hidden_states, position_embeddings)  # (B, 1, k)
        picked = entries.values.gather(1, chosen[:, 0].unsqueeze(-1).expand(-1, -1, entries.values.shape[-1]))
        keys = torch.cat((keys, picked.unsqueeze(1).to(keys.dtype)), dim=2)
        mask = torch.cat((mask.expand(batch, -1, -1, -1), visible.gather(-1, chosen).unsqueeze(1)), dim=-1)
        out, _ = self._scored(q, keys, mask, kwargs)
        return out, None

    def _scored(self, q, keys, mask, kwargs):
        """The backend's attention with the sinks: q (B, H, t, D), keys = values (B, 1, S, D), mask (B, 1, t, S)."""
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention)
        attention_interface = self.scores_through(attention_interface, kwargs)  # sinks
        score_kwargs = self.score_kwargs(kwargs)
        score_kwargs["sliding_window"] = None  # the mask holds the window
        return attention_interface(self, q, keys, keys, mask, scaling=self.scaling, s_aux=self.sinks, **score_kwargs)


class SharedKVKind(AttentionKind):
    """`attention_type="shared_kv"`: DeepSeek-V4's shared key = value attention, with compressed layers."""

    name = "shared_kv"
    module = SharedKVAttention
    fields = ("q_lora_rank", "o_groups", "o_lora_rank", "compress_rates", "index_n_heads", "index_head_dim",
              "index_topk")
    layer_types = ("full_attention", "sliding_attention", *COMPRESSED_LAYER_TYPES)
    cache_implementations = ("dynamic",)

    def validate(self, config) -> None:
        if config.num_key_value_heads != 1:
            raise ValueError(f"`attention_type='shared_kv'` attends to one key = value head: set "
                             f"`num_key_value_heads`=1, got {config.num_key_value_heads}.")
        if config.position_embedding_type in ("alibi",):
            raise ValueError("`attention_type='shared_kv'` takes no ALiBi (its scores are masked in blocks, without "
                             "a bias): use 'rope', 'none' or absolute positions.")
        for name in ("attention_bias", "attn_logit_softcapping"):
            if getattr(config, name):
                raise ValueError(f"`{name}` does not apply to `attention_type='shared_kv'` (no biases, no cap).")
        require_int("q_lora_rank", config.q_lora_rank, minimum=1, optional=True)
        self._validate_output(config)
        self._validate_compressed(config)

    @staticmethod
    def _validate_output(config) -> None:
        if (config.o_groups is None) != (config.o_lora_rank is None):
            raise ValueError("`o_groups` and `o_lora_rank` make the grouped output projection together: set both or "
                             "neither.")
        if config.o_groups is not None:
            require_int("o_groups", config.o_groups, minimum=1)
            require_int("o_lora_rank", config.o_lora_rank, minimum=1)
            if config.num_attention_heads % config.o_groups:
                raise ValueError(f"`num_attention_heads`={config.num_attention_heads} must be divisible by "
                                 f"`o_groups`={config.o_groups} (each group holds whole heads).")

    @staticmethod
    def _validate_compressed(config) -> None:
        present = [t for t in COMPRESSED_LAYER_TYPES if t in config.layer_types]
        rates = config.compress_rates
        if present and config.sliding_window is None:
            raise ValueError(f"`layer_types` has {present} layers, which attend to a window of `sliding_window` "
                             "keys before their entries: set `sliding_window`.")
        if rates is not None:
            if not isinstance(rates, dict) or set(rates) - set(COMPRESSED_LAYER_TYPES):
                raise ValueError(f"`compress_rates` maps {list(COMPRESSED_LAYER_TYPES)} to tokens per entry, got "
                                 f"{rates!r}.")
            for layer_type, rate in rates.items():
                require_int(f"compress_rates[{layer_type!r}]", rate, minimum=1)
        missing = [t for t in present if not rates or t not in rates]
        if missing:
            raise ValueError(f"`layer_types` has {missing} layers: set their rate in `compress_rates`.")
        index_fields = ("index_n_heads", "index_head_dim", "index_topk")
        sparse = COMPRESSED_SPARSE in config.layer_types
        for name in index_fields:
            value = getattr(config, name)
            if sparse and value is None:
                raise ValueError(f"'{COMPRESSED_SPARSE}' layers choose their entries with an indexer: set `{name}`.")
            if not sparse and value is not None:
                raise ValueError(f"`{name}` sizes the indexer of '{COMPRESSED_SPARSE}' layers, which `layer_types` "
                                 "has none of: leave it unset.")
            require_int(name, value, minimum=1, optional=True)
        if sparse and config.q_lora_rank is None:
            raise ValueError(f"'{COMPRESSED_SPARSE}' layers make their indexer's queries from the query latent: set "
                             "`q_lora_rank`.")
        if sparse and config.uses_rope and config.index_head_dim < config.rotary_dim:
            raise ValueError(f"`index_head_dim`={config.index_head_dim} must be at least the rotated width "
                             f"{config.rotary_dim}: the indexer rotates that many of its last features.")

    def rope_head_dim(self, config, layer_type: str | None = None) -> int:
        return config.head_dim

    def backend_features(self, config) -> set[str]:
        return {"shared_kv"}

    def cache_layer(self, config, layer_type: str, implementation: str, max_cache_len: int | None):
        if layer_type in COMPRESSED_LAYER_TYPES:
            rate = config.compress_rates[layer_type]
            tail = (2 if layer_type == COMPRESSED_SPARSE else 1) * rate - 1
            return CompressedLayer(sliding_window=config.sliding_window, rate=rate, tail_length=tail)
        if layer_type == "sliding_attention":
            return KeyValueSlidingLayer(sliding_window=config.sliding_window)
        return KeyValueLayer()

    def rollback_error(self, config) -> str | None:
        return ROLLBACK_ERROR if any(t in COMPRESSED_LAYER_TYPES for t in config.layer_types) else None

    def parameters(self, config) -> int:
        """Queries (direct, or through `q_lora_rank` with its norm), the key = value head and its norm, the output
        (grouped or `o_proj`), the sinks; a compressed layer adds its compressor (`layer_parameters`)."""
        d, width, hd = config.hidden_size, config.num_attention_heads * config.head_dim, config.head_dim
        if config.q_lora_rank:
            q = d * config.q_lora_rank + norm_parameters(config, config.q_lora_rank) + config.q_lora_rank * width
        else:
            q = d * width
        if config.o_groups:
            rank = config.o_groups * config.o_lora_rank
            out = width // config.o_groups * rank + rank * d
        else:
            out = linear_parameters(width, d, False)
        return q + d * hd + norm_parameters(config, hd) + out + sink_parameters(config)

    def layer_parameters(self, config, layer_idx: int | None) -> int:
        """`parameters`, plus a compressed layer's compressor: C and Z projections (2·D wide with overlap), a
        position bias per slot and the entries' norm; CSA's indexer the same at `index_head_dim`, its query
        projection from the query latent and its per-head weights."""
        total = self.parameters(config)
        layer_type = None if layer_idx is None else config.layer_types[layer_idx]
        if layer_type not in COMPRESSED_LAYER_TYPES:
            return total
        rate, d = config.compress_rates[layer_type], config.hidden_size
        sparse = layer_type == COMPRESSED_SPARSE

        def compressor(width: int) -> int:
            projected = (2 if sparse else 1) * width
            return 2 * d * projected + rate * projected + norm_parameters(config, width)

        total += compressor(config.head_dim)
        if sparse:
            heads, width = config.index_n_heads, config.index_head_dim
            total += compressor(width) + config.q_lora_rank * heads * width + d * heads
        return total

    def bytes_per_token(self, config, element_bytes: int, quantization: str | None = None) -> int:
        """d_h·b: one key = value per token (each window holds `sliding_window` - 1 of them; `cached_bytes`)."""
        if quantization is not None:
            raise ValueError(f"`quantization={quantization!r}` applies to per-head K/V, not to a shared key = value.")
        return config.head_dim * element_bytes

    def cached_bytes(self, config, layer_idx: int, layer_type: str, kept_tokens: int, context: int,
                     element_bytes: int, quantization: str | None = None) -> int:
        """One sequence's bytes in a layer of `layer_type` after `context` tokens: the key = value of the tokens
        its window keeps (all of them on a full layer; a compressed layer's window is `sliding_window`), and a
        compressed layer's entries of the windows completed, d_h·b each (+ D_I·b for CSA's indexer)."""
        per_token = self.bytes_per_token(config, element_bytes, quantization)
        if layer_type not in COMPRESSED_LAYER_TYPES:
            return per_token * kept_tokens
        total = per_token * min(context, config.sliding_window - 1)
        width = config.head_dim + (config.index_head_dim if layer_type == COMPRESSED_SPARSE else 0)
        return total + context // config.compress_rates[layer_type] * width * element_bytes

    def describe(self, config) -> str:
        return "shared-kv"

    def fp32_modules(self, config) -> tuple[str, ...]:
        """The compressors' position biases stay fp32 under fp16 (transformers keeps them fp32)."""
        return ("position_bias",)


SHARED_KV_ATTENTION = SharedKVKind()

__all__ = ["ATTENTION_MASK_BYTES", "GroupedLinear", "SHARED_KV_ATTENTION", "SharedKVAttention", "SharedKVFields",
           "SharedKVKind", "rms"]
