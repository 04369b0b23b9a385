"""Standard multi-head attention: MHA, GQA and MQA are one integer (`num_key_value_heads`).

The scores go through transformers' attention interface, one call in `forward` (see
`attention_layer.AttentionLayer`), so `attn_implementation` picks the backend and vLLM's Transformers backend
finds it; `eager_attention.eager_attention` is the readable reference every backend is tested against.
`STANDARD_ATTENTION` is this kind's registry entry.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .attention_layer import AttentionLayer
from .attention_shapes import SHAPE_FIELDS, keys_are_values, layer_head_dim, layer_kv_heads, validate_shapes
from .chunked_attention import layer_window
from .compat import DynamicSlidingWindowLayer
from .eager_attention import eager_attention
from .growing_cache import GrowingLayer
from .int8_cache import Int8Layer, Int8SlidingWindowLayer
from .kv_sharing import SharedKVLayer, kv_sources, validate_kv_sharing
from .kinds import AttentionKind
from .mup import ATTENTION_MULTIPLIERS, validate_attention_multipliers
from .split_products import project, takes_split_branch
from .norms import build_norm, norm_parameters, rms_unweighted
from .positions import apply_rotary, rotary_layers
from .query_temperature import FIELDS as QUERY_TEMPERATURE_FIELDS
from .query_temperature import query_temperature, scale_queries, validate_query_temperature
from .sinks import sink_parameters


QK_NORMS = ("none", "head", "full", "weightless")


class QKNorm(nn.Module):
    """Norms q and k, per head (`"head"`: over d_h, Qwen 3 / Gemma 3) or over the whole projection
    (`"full"`: over H·d_h, OLMo 2). Applied before the heads are split into (B, H, T, D). A layer that reads
    another layer's keys (`num_kv_shared_layers`) norms its queries only."""

    def __init__(self, config, per_head: bool, head_dim: int, kv_heads: int, keys: bool = True):
        super().__init__()
        q_dim = head_dim if per_head else config.num_attention_heads * head_dim
        k_dim = head_dim if per_head else kv_heads * head_dim
        self.per_head = per_head
        self.q_norm = build_norm(config, q_dim)
        self.k_norm = build_norm(config, k_dim) if keys else None

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.per_head:
            q = self.q_norm(q.unflatten(-1, (-1, head_dim))).flatten(-2)
            k = None if k is None else self.k_norm(k.unflatten(-1, (-1, head_dim))).flatten(-2)
            return q, k
        return self.q_norm(q), None if k is None else self.k_norm(k)


def weightless_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, in fp32, cast back (Llama 4's L2 norm of q and k: no weight)."""
    if x.dtype is torch.float32:  # the same in one call (`rms_unweighted` differs only where it casts)
        return rms_unweighted(x, eps)
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


class StandardAttention(AttentionLayer):
    """softmax(q·kᵀ·scaling + mask [+ ALiBi bias]) · v per head, then `o_proj`.

    q = x·W_qᵀ (H heads), k = x·W_kᵀ and v = x·W_vᵀ (H_kv heads, each shared by H / H_kv query heads), with
    optional biases; q and k QK-normed, then rotated (RoPE) where configured (`qk_norm="weightless"`: normed after
    the rotation, on the layers that rotate, as Llama 4); on a NoPE layer with `attn_temperature_tuning` the queries
    scaled by their positions' temperature; k and v appended to the cache. A full-attention layer may have its own
    head width and K/V heads and take its values from `k_proj` (`attention_shapes.py`); a layer among the last
    `num_kv_shared_layers` attends to its source layer's keys and values instead of its own (`kv_sharing.py`).
    scaling = `query_pre_attn_scalar`^-1/2 (default d_h^-1/2). The scores go through transformers' attention
    interface, so `attn_implementation` picks the kernel. With `attn_output_gate`, `q_proj` also yields a gate
    per head and channel (each head's [query | gate], transformers' Qwen3-Next layout) and the heads' output is
    multiplied by its sigmoid before `o_proj`.
    """

    def __init__(self, config, layer_idx: int):
        layer_type = config.layer_types[layer_idx]
        hd = layer_head_dim(config, layer_type)
        super().__init__(config, layer_idx, scaling=(config.query_pre_attn_scalar or hd) ** -0.5)
        self.head_dim = hd
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = layer_kv_heads(config, layer_type)
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.kv_source = kv_sources(config)[layer_idx]  # the layer whose keys and values this one reads, if any
        own_kv = self.kv_source is None
        d, kv_width = config.hidden_size, self.num_key_value_heads * hd
        self.gated = config.attn_output_gate
        self.q_proj = nn.Linear(d, self.num_heads * hd * (2 if self.gated else 1), bias=config.attention_bias)
        self.k_proj = nn.Linear(d, kv_width, bias=config.attention_bias) if own_kv else None
        values = own_kv and not keys_are_values(config, layer_type)
        self.v_proj = nn.Linear(d, kv_width, bias=config.attention_bias) if values else None
        self.o_proj = nn.Linear(self.num_heads * hd, d, bias=config.attention_output_bias)
        self.qk_norm = (QKNorm(config, config.qk_norm == "head", hd, self.num_key_value_heads, keys=own_kv)
                        if config.qk_norm in ("head", "full") else None)
        self.norm_rotated = config.qk_norm == "weightless"
        self.value_norm = config.value_norm
        self.eps = config.norm_eps
        # the query temperature on every layer, or on the NoPE layers only (Llama 4)
        self.temperature = config.attn_temperature_tuning and (config.attn_temperature_layers == "all"
                                                               or not rotary_layers(config)[layer_idx])
        # μP (mup.py): 1 unless the config sets them (Falcon-H1)
        self.in_multiplier, self.key_multiplier = config.attention_in_multiplier, config.key_multiplier
        self.out_multiplier = config.attention_out_multiplier

    def _split_qkv(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """The q, k, v projections (a method of its own: `forward` then calls each projection once, vLLM note there);
        the key projection's output as the values where there is no `v_proj`, no keys or values where the layer
        reads another layer's."""
        q = project(self.q_proj, hidden_states)
        k = project(self.k_proj, hidden_states) if self.k_proj is not None else None
        return q, k, project(self.v_proj, hidden_states) if self.v_proj is not None else k

    def _query_and_gate(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """q_proj's output as the queries and, with `attn_output_gate`, the gate (each head's [query | gate]),
        both (B, T, H·D)."""
        if not self.gated:
            return q, None
        batch, seq = q.shape[:2]
        q, gate = q.view(batch, seq, -1, 2 * self.head_dim).chunk(2, dim=-1)
        return q.reshape(batch, seq, -1), gate.reshape(batch, seq, -1)

    def _heads(self, q, k, v, position_embeddings, position_ids=None) -> tuple[torch.Tensor, ...]:
        """q (B, H, T, D), k and v (B, H_kv, T, D) from the projections, normed and rotated as configured (k and v
        `None` in a layer that reads another layer's; the queries then scaled by their position's temperature,
        `query_temperature.py`)."""
        batch, seq = q.shape[:2]
        if self.qk_norm is not None:
            q, k = self.qk_norm(q, k, self.head_dim)
        q = q.view(batch, seq, -1, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        if k is not None:
            k = k.view(batch, seq, -1, self.head_dim).transpose(1, 2)  # (B, H_kv, T, D)
            v = v.view(batch, seq, -1, self.head_dim).transpose(1, 2)  # (B, H_kv, T, D)
            if self.value_norm:
                v = weightless_rms_norm(v, self.eps)
        if position_embeddings is not None:
            cos, sin = position_embeddings
            q = apply_rotary(q, cos, sin, self.interleaved)
            k = apply_rotary(k, cos, sin, self.interleaved) if k is not None else None
            if self.norm_rotated:
                q = weightless_rms_norm(q, self.eps)
                k = weightless_rms_norm(k, self.eps) if k is not None else None
        if self.temperature:
            q = scale_queries(q, query_temperature(self.config, position_ids))
        return q, k, v

    def _keys_and_values(self, k, v, cache, shared_kv: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values this layer attends to: its own, appended to its cache, or those its source layer
        attended to in this forward (`kv_sharing.py`); a layer given the forward's dict hands its own over in it (a
        source to its readers, a drafter's layer to the drafter: `kv_assistant.py`)."""
        if self.kv_source is not None:
            return shared_kv[self.kv_source]
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)  # (B, H_kv, cached + T, D)
        if shared_kv is not None:
            shared_kv[self.layer_idx] = (k, v)
        return k, v

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        position_bias: torch.Tensor | None = None,
        cache=None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        batch, seq = hidden_states.shape[:2]
        shared_kv = kwargs.pop("shared_kv", None)
        if self.in_multiplier != 1.0:
            hidden_states = hidden_states * self.in_multiplier
        if takes_split_branch(self.o_proj, hidden_states) or self.v_proj is None:  # few-row products on all cores
            q, k, v = self._split_qkv(hidden_states)
        else:
            # vLLM note: its fuser merges these three calls into one q/k/v product only where they are
            # plain module calls bound to names no other statement binds (hence not `q`, bound above)
            query, key, value = self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)
            q, k, v = query, key, value
        q, gate = self._query_and_gate(q)
        if self.key_multiplier != 1.0 and k is not None:
            k = k * self.key_multiplier
        q, k, v = self._heads(q, k, v, position_embeddings, kwargs.get("position_ids"))  # (B, H[_kv], T, D)
        k, v = self._keys_and_values(k, v, cache, shared_kv)
        if position_bias is not None:  # ALiBi as a bias (eager, sdpa)
            kwargs["position_bias"] = position_bias

        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention)
        attention_interface = self.scores_through(attention_interface, kwargs)  # ALiBi slopes, sinks
        out, weights = attention_interface(
            self, q, k, v, attention_mask, scaling=self.scaling, s_aux=self.sinks, **self.score_kwargs(kwargs)
        )
        out = out.reshape(batch, seq, -1).contiguous()  # (B, T, H·D)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        out = project(self.o_proj, out)
        return (out * self.out_multiplier if self.out_multiplier != 1.0 else out), weights


class StandardKind(AttentionKind):
    """`attention_type="standard"`: MHA, GQA or MQA by `num_key_value_heads`; per-head K/V cached."""

    name = "standard"
    module = StandardAttention
    fields = ("qk_norm", "attn_output_gate", *QUERY_TEMPERATURE_FIELDS, *ATTENTION_MULTIPLIERS, *SHAPE_FIELDS,
              "num_kv_shared_layers")
    cache_implementations = ("dynamic", "static", "int8")

    def validate(self, config) -> None:
        if config.qk_norm not in QK_NORMS:
            raise ValueError(f"`qk_norm`={config.qk_norm!r} is not one of the allowed values {list(QK_NORMS)}.")
        if config.qk_norm == "weightless" and not config.uses_rope:
            raise ValueError("`qk_norm='weightless'` norms the rotated queries and keys of the layers that rotate, and "
                             f"`position_embedding_type`={config.position_embedding_type!r} rotates none.")
        validate_query_temperature(config)
        validate_attention_multipliers(config)
        validate_shapes(config)
        validate_kv_sharing(config)

    def rope_head_dim(self, config, layer_type: str | None = None) -> int:
        return config.head_dim if layer_type is None else layer_head_dim(config, layer_type)

    def cache_layer(self, config, layer_type: str, implementation: str, max_cache_len: int | None):
        window = layer_window(config, layer_type)  # sliding and chunked layers keep a window (chunked: the chunk)
        if implementation == "dynamic":  # full layers grow into storage 1/64 longer (no torch.cat per step)
            return DynamicSlidingWindowLayer(sliding_window=window) if window else GrowingLayer()
        if implementation == "static":
            if window:
                return StaticSlidingWindowLayer(max_cache_len=max_cache_len, sliding_window=window)
            return StaticLayer(max_cache_len=max_cache_len)
        return Int8SlidingWindowLayer(sliding_window=window) if window else Int8Layer()

    def parameters(self, config) -> int:
        """2·d·H·d_h + 2·d·H_kv·d_h (+ biases, + QK-norms, + H sinks; + d·H·d_h for the output gate)."""
        return self.layer_parameters(config, None)

    def bytes_per_token(self, config, element_bytes: int, quantization: str | None = None) -> int:
        """2·H_kv·d_h·b; int8: 2·H_kv·(d_h + b), one code per element and one b-byte scale per head."""
        return self.layer_bytes_per_token(config, element_bytes, quantization, None)

    def layer_parameters(self, config, layer_idx: int | None) -> int:
        """`parameters` with the layer's own head width and K/V heads; no `v_proj` where keys are values, no `k_proj`,
        `v_proj` or key norm where the layer reads another layer's keys and values (`None`: a layer of `head_dim` x
        `num_key_value_heads` with its own)."""
        d, h, hd, kv = config.hidden_size, config.num_attention_heads, *self._shape(config, layer_idx)
        own = layer_idx is None or kv_sources(config)[layer_idx] is None
        kv_projections = (2 - keys_are_values(config, self._type(config, layer_idx))) if own else 0
        total = linear_parameters(d, h * hd * (2 if config.attn_output_gate else 1), config.attention_bias)
        total += kv_projections * linear_parameters(d, kv * hd, config.attention_bias)
        total += linear_parameters(h * hd, d, config.attention_output_bias)
        if config.qk_norm == "head":
            total += (2 if own else 1) * norm_parameters(config, hd)
        elif config.qk_norm == "full":
            total += norm_parameters(config, h * hd) + (norm_parameters(config, kv * hd) if own else 0)
        return total + sink_parameters(config)

    def layer_bytes_per_token(self, config, element_bytes: int, quantization: str | None,
                              layer_idx: int | None) -> int:
        """`bytes_per_token` with the layer's own heads; nothing for a layer that reads another layer's keys and
        values."""
        if layer_idx is not None and kv_sources(config)[layer_idx] is not None:
            return 0
        hd, kv = self._shape(config, layer_idx)
        if quantization == "int8":
            return 2 * kv * (hd + element_bytes)
        return 2 * kv * hd * element_bytes

    @staticmethod
    def _type(config, layer_idx: int | None) -> str | None:
        return None if layer_idx is None else config.layer_types[layer_idx]

    def _shape(self, config, layer_idx: int | None) -> tuple[int, int]:
        """(head width, K/V heads) of layer `layer_idx` (`None`: `head_dim`, `num_key_value_heads`)."""
        if layer_idx is None:
            return config.head_dim, config.num_key_value_heads
        layer_type = config.layer_types[layer_idx]
        return layer_head_dim(config, layer_type), layer_kv_heads(config, layer_type)

    def describe(self, config) -> str:
        if config.num_key_value_heads == config.num_attention_heads:
            return "mha"
        return "mqa" if config.num_key_value_heads == 1 else "gqa"

    def tp_plan(self, config) -> dict[str, str]:
        """The tensor-parallel plan: heads split across ranks.

        q/k/v column-parallel, o row-parallel. A norm over the whole q / k
        projection (`qk_norm="full"`) needs all heads, so q/k/v then gather and o splits its input, as
        transformers plans OLMo 2 and OLMoE. With attention sinks, none: every rank holds the whole attention."""
        if config.qk_norm == "full":
            styles = {"q_proj": "colwise_gather_output", "k_proj": "colwise_gather_output",
                      "v_proj": "colwise_gather_output", "o_proj": "rowwise_split_input"}
        else:
            styles = {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "o_proj": "rowwise"}
        if config.attention_sinks:  # the per-head sinks are no module a style splits: attention stays whole, as
            return {}               # transformers plans gpt-oss's (vLLM splits them itself)
        own = [i for i, source in enumerate(kv_sources(config)) if source is None]  # (k_proj, v_proj where held)
        if not own:
            styles.pop("k_proj")
        if all(keys_are_values(config, config.layer_types[i]) for i in own):
            styles.pop("v_proj")
        return {f"self_attn.{name}": style for name, style in styles.items()}


def linear_parameters(n_in: int, n_out: int, bias: bool) -> int:
    return n_in * n_out + (n_out if bias else 0)


STANDARD_ATTENTION = StandardKind()
