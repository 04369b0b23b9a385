"""Parameter counts and KV-cache bytes, computed from the config alone.

A `"linear_attention"` layer caches no tokens: its state has a fixed size per sequence
(`state_bytes_per_sequence`), so `cache_bytes_per_token` counts the attention layers only and
`cache_bytes` adds the states once per sequence.

These follow the textbook formulas, written independently of the modules (each attention and
feed-forward kind states its own formula next to its module, without building it), so tests can
compare them with `model.num_parameters()` and with what a filled cache actually stores.
"""

from __future__ import annotations

import dataclasses

import torch

from .blocks import BLOCKS, block_class, layer_norm_position, layer_sublayers, mixing_layer_types
from .chunked_attention import CHUNKED_ATTENTION, layer_window
from .configuration_modular_decoder import ModularDecoderConfig
from .norms import NORMS, norm_parameters
from .kinds import HYBRID, LINEAR_ATTENTION
from .laurel import laurel_parameters
from .mtp import mtp_block_config
from .per_layer_embeddings import PER_LAYER_EMBEDDINGS
from .query_temperature import FIELDS as QUERY_TEMPERATURE_FIELDS
from .registries import ATTENTIONS, FEATURES, LINEAR_ATTENTIONS, MLPS, POSITIONS, RESIDUAL_STREAMS

BLOCK_NORMS = {"pre": 2, "post": 2, "sandwich": 4, "output": 2}


def attention_parameters(config: ModularDecoderConfig, layer_idx: int | None = None) -> int:
    """One layer's attention (the attention kind's formula: standard 2·d·H·d_h + 2·d·H_kv·d_h + ...); layer
    `layer_idx`'s where layers differ (a full layer's own heads, a layer reading another's keys and values)."""
    kind = config.attention_kind
    return kind.parameters(config) if layer_idx is None else kind.layer_parameters(config, layer_idx)


def attention_layers(config: ModularDecoderConfig) -> list[int]:
    """The layers that attend (alone or in a hybrid layer; not linear-attention or feed-forward-only layers)."""
    return [i for i, types in enumerate(mixing_layer_types(config)) if any(t != LINEAR_ATTENTION for t in types)]


def linear_attention_parameters(config: ModularDecoderConfig) -> int:
    """One linear-attention layer (the kind's formula; 0 where no layer is one)."""
    kind = config.linear_attention_kind
    return kind.parameters(config) if kind.in_use(config) else 0


def linear_layer_count(config: ModularDecoderConfig) -> int:
    """Layers that run a linear-attention mixer (alone or in a hybrid layer)."""
    return config.linear_attention_layer_count


def feed_forward_layers(config: ModularDecoderConfig) -> list[int]:
    """The layers that have a feed-forward (`block_types`: all but the mixer-only ones)."""
    return [i for i in range(config.num_hidden_layers) if "mlp" in layer_sublayers(config, i)]


def mlp_parameters(config: ModularDecoderConfig, layer_idx: int = 0) -> int:
    """One block's feed-forward (the kind's formula: dense 2·d·d_f, gated 3·d·d_f, + biases; MoE:
    router + every expert + shared experts)."""
    return config.mlp_kind.parameters(config, layer_idx)


def active_mlp_parameters(config: ModularDecoderConfig, layer_idx: int = 0) -> int:
    """The part of block `layer_idx`'s feed-forward one token uses (MoE: k of the E routed experts)."""
    return config.mlp_kind.active_parameters(config, layer_idx)


def block_norm_count(config: ModularDecoderConfig, layer_idx: int | None = None) -> int:
    """The norms of a block (of layer `layer_idx`, at its norm position: half of them where `block_types` gives it
    one sublayer; where no layer is named, an attention layer's)."""
    if config.parallel_block:
        return 2 if config.parallel_norms == "separate" else 1
    whole = BLOCK_NORMS[layer_norm_position(config, layer_idx)]
    return whole if layer_idx is None else whole * len(layer_sublayers(config, layer_idx)) // 2


def parameter_count(config: ModularDecoderConfig) -> dict[str, int]:
    """Parameters by component, tied weights counted once.

    `total` is their sum, `active` the parameters one token's forward uses (the total less the routed experts it is
    not sent to and the multi-token-prediction modules, which the forward does not run; the embedding table and head
    count whole, as published "active" counts do)."""
    d, v = config.hidden_size, config.vocab_size
    parts = {"embedding": v * d}
    if config.position_embedding_type == "learned":
        parts["positions"] = (config.max_position_embeddings + config.learned_position_offset) * d
    if config.embedding_norm:
        parts["embedding_norm"] = norm_parameters(config, d)
    layers = config.num_hidden_layers
    if config.attention_layer_count:
        parts["attention"] = sum(attention_parameters(config, i) for i in attention_layers(config))
    if linear_layer_count(config):
        parts["linear_attention"] = linear_layer_count(config) * linear_attention_parameters(config)
    parts["mlp"] = sum(mlp_parameters(config, i) for i in feed_forward_layers(config))
    parts["block_norms"] = sum(block_norm_count(config, i) for i in range(layers)) * norm_parameters(config, d)
    embeddings, branch = PER_LAYER_EMBEDDINGS.parameters(config)
    if embeddings:
        parts["per_layer_embeddings"] = embeddings + layers * branch
    if config.laurel_rank:  # beside each token mixer
        parts["laurel"] = sum(map(bool, mixing_layer_types(config))) * laurel_parameters(config)
    stream = RESIDUAL_STREAMS.of(config)
    if stream.model_parameters(config) or stream.layer_parameters(config):
        parts["residual_stream"] = stream.model_parameters(config) + layers * stream.layer_parameters(config)
    if config.final_norm:
        parts["final_norm"] = norm_parameters(config, d)
    lm_head = (0 if config.tie_word_embeddings else v * d) + (v if config.lm_head_bias else 0)
    if lm_head:
        parts["lm_head"] = lm_head
    if config.num_mtp_layers:
        parts["mtp"] = config.num_mtp_layers * mtp_module_parameters(config)
    parts["total"] = sum(parts.values())
    inactive = sum(mlp_parameters(config, i) - active_mlp_parameters(config, i) for i in feed_forward_layers(config))
    parts["active"] = parts["total"] - inactive - parts.get("mtp", 0)
    return parts


def mtp_module_parameters(config: ModularDecoderConfig) -> int:
    """One multi-token-prediction module: three norms (`enorm`, `hnorm`, `post_norm`), the 2d -> d projection and a
    block of the last layer's kinds (its embedding and head are the model's)."""
    d = config.hidden_size
    last = config.num_hidden_layers - 1
    block = (attention_parameters(mtp_block_config(config), 0)  # its layer, of the last layer's kinds
             + mlp_parameters(config, last) + block_norm_count(config, last) * norm_parameters(config, d))
    return 3 * norm_parameters(config, d) + 2 * d * d + block


def _dtype_bytes(dtype: torch.dtype | int) -> int:
    return dtype if isinstance(dtype, int) else torch.empty((), dtype=dtype).element_size()


def layer_bytes_per_token(config: ModularDecoderConfig, dtype: torch.dtype | int = torch.bfloat16,
                          quantization: str | None = None, layer_idx: int | None = None) -> int:
    """One layer's cached bytes per token: 2·H_kv·d_h·b for K/V, (d_c + d_R)·b for an MLA latent; layer
    `layer_idx`'s where layers differ (a full layer's own heads; nothing where it reads another layer's keys).

    `quantization="int8"`: 2·H_kv·(d_h + b), one int8 code per element plus one b-byte scale per
    head and token (b is then the scale's dtype).
    """
    if quantization not in (None, "int8"):
        raise ValueError(f"`quantization`={quantization!r} is not one of [None, 'int8'].")
    kind, element_bytes = config.attention_kind, _dtype_bytes(dtype)
    if layer_idx is None:
        return kind.bytes_per_token(config, element_bytes, quantization)
    return kind.layer_bytes_per_token(config, element_bytes, quantization, layer_idx)


def cache_bytes_per_token(config: ModularDecoderConfig, dtype: torch.dtype | int = torch.bfloat16,
                          quantization: str | None = None) -> int:
    """KV-cache bytes one token adds, summed over the attention layers.

    2·L·H_kv·d_h·b for K/V layers, L·(d_c + d_R)·b for MLA, L·(d_c + d_R + D_I)·b for DSA (its indexer's keys), each
    layer with its own heads where they differ (Gemma 4's full layers). Linear-attention layers add nothing per token
    (`state_bytes_per_sequence`), nor do layers that read another layer's keys and values (`num_kv_shared_layers`).

    Sliding-window layers count per token only until they hold their window; `cache_bytes` gives
    the exact total at a given context length.
    """
    return sum(layer_bytes_per_token(config, dtype, quantization, i) for i in attention_layers(config))


def state_bytes_per_sequence(config: ModularDecoderConfig, dtype: torch.dtype | int = torch.bfloat16) -> int:
    """Bytes the linear-attention layers cache per sequence, whatever its length.

    Per layer the convolution's window K·(2·H_k·d_k + H_v·d_v)·b and the fp32 recurrent state 4·H_v·d_k·d_v (Gated
    DeltaNet); 0 without them."""
    if not linear_layer_count(config):
        return 0
    return linear_layer_count(config) * config.linear_attention_kind.state_bytes(config, _dtype_bytes(dtype))


def cached_tokens(config: ModularDecoderConfig, layer_type: str, context: int) -> int:
    """Tokens a layer keeps between decode steps.

    All of them, the last `sliding_window - 1` for a sliding layer (`attention_chunk_size - 1` for a chunked one; the
    next query brings it back to a full window), none for a linear-attention layer (it keeps a state instead)."""
    if (window := layer_window(config, layer_type)) is not None:  # sliding, chunked (the chunk: `chunked_attention`)
        return min(context, window - 1)
    if layer_type == LINEAR_ATTENTION:
        return 0
    return context


def cache_bytes(config: ModularDecoderConfig, context: int, batch_size: int = 1,
                dtype: torch.dtype | int = torch.bfloat16, quantization: str | None = None) -> int:
    """Exact payload of a cache holding `context` tokens for `batch_size` sequences (linear-attention states
    included, once per sequence)."""
    kind, element = config.attention_kind, _dtype_bytes(dtype)
    payload = sum(kind.cached_bytes(config, i, layer_type, cached_tokens(config, layer_type, context), context, element,
                                    quantization)
                  for i, types in enumerate(mixing_layer_types(config)) for layer_type in types
                  if layer_type != LINEAR_ATTENTION)
    return batch_size * (payload + state_bytes_per_sequence(config, dtype))


def breakeven_context(config: ModularDecoderConfig, weight_bytes: int, dtype: torch.dtype | int = torch.bfloat16) -> float:
    """Context length at which one sequence's cache equals `weight_bytes` (full layers only)."""
    return weight_bytes / cache_bytes_per_token(config, dtype)


def contract_table(config: ModularDecoderConfig, dtype: torch.dtype = torch.bfloat16) -> str:
    """A markdown table of the config's fields that change the math, parameters by component and cache cost."""
    declared = list(vars(ModularDecoderConfig)["__annotations__"])  # the class's own fields, then its mixins'
    fields = sorted(dataclasses.fields(ModularDecoderConfig),
                    key=lambda f: declared.index(f.name) if f.name in declared else len(declared))
    names = [f.name for f in fields if f.name not in _NON_CONTRACT and _applies(config, f.name)]
    rows = ["| field | value |", "| --- | --- |"]
    rows += [f"| `{name}` | {_render(name, getattr(config, name))} |" for name in names]
    params = parameter_count(config)
    rows += ["", "| component | parameters |", "| --- | ---: |"]
    rows += [f"| {_PARAMETER_ROWS.get(name, name)} | {count:,} |" for name, count in params.items()]
    rows += ["", f"| KV cache ({dtype}) | bytes |", "| --- | ---: |",
             f"| per token (all layers) | {cache_bytes_per_token(config, dtype):,} |"]
    if linear_layer_count(config):
        rows.append(f"| linear-attention state per sequence (any length) | {state_bytes_per_sequence(config, dtype):,} |")
    for context in (4096, 32768, 131072):
        rows.append(f"| at {context // 1024}k context | {cache_bytes(config, context, 1, dtype):,} |")
    return "\n".join(rows)


_PARAMETER_ROWS = {"active": "active per token", "linear_attention": "linear attention", "mtp": "MTP modules",
                   "per_layer_embeddings": "per-layer embeddings", "residual_stream": "residual streams"}


def _applies(config: ModularDecoderConfig, name: str) -> bool:
    """Whether field `name` is read by this config: a field that belongs to variants of one axis
    (MLA's ranks, the MoE fields, ...) applies only when one of them is chosen, and a field some
    entries of an axis say they read (`reads`: `norm_bias` for LayerNorm, `head_dim` for per-head
    attention, ...) only when the chosen entry reads it. The MTP loss weight, draft count and draft vocabulary apply
    with MTP modules, the query temperature's fields where it is on."""
    if name in ("mtp_loss_scaling_factor", "mtp_draft_tokens", "mtp_draft_vocab_size"):
        return bool(config.num_mtp_layers)
    if name in QUERY_TEMPERATURE_FIELDS:  # shown where the queries are scaled
        return bool(config.attn_temperature_tuning)
    if name in (LINEAR_ATTENTIONS.field, "linear_attention_norm_position"):
        return config.linear_attention_kind.in_use(config)
    for registry in (ATTENTIONS, LINEAR_ATTENTIONS, MLPS, POSITIONS, RESIDUAL_STREAMS):
        owners = [entry for entry in registry.values() if name in getattr(entry, "fields", ())]
        if owners:
            chosen = registry.of(config)
            return chosen in owners and getattr(chosen, "in_use", lambda _: True)(config)
    features = [feature for feature in FEATURES if name in feature.fields]
    if features:
        return any(feature.in_use(config) or name == feature.switch for feature in features)
    return name not in _unread(config)


def _unread(config: ModularDecoderConfig) -> set[str]:
    """Fields that some entry of an axis reads and the chosen entry does not."""
    axes = [(ATTENTIONS.values(), config.attention_kind), (MLPS.values(), config.mlp_kind),
            (POSITIONS.values(), POSITIONS.of(config)), (NORMS.values(), NORMS[config.norm_type]),
            (BLOCKS.values(), block_class(config))]
    unread = set()
    for entries, chosen in axes:
        declared = {name for entry in entries for name in entry.reads}
        reads = chosen.reads_for(config) if hasattr(chosen, "reads_for") else chosen.reads
        unread |= declared - set(reads)
    return unread


# per-layer lists shown as counts and a one-letter pattern
_PATTERNS = {
    "layer_types": {"sliding_attention": "S", "full_attention": "F", CHUNKED_ATTENTION: "C", LINEAR_ATTENTION: "L",
                    HYBRID: "H", "compressed_sparse_attention": "A", "heavily_compressed_attention": "X"},
    "block_types": {"mixer_mlp": "B", "mixer": "M", "mlp": "F"},
    "mlp_layer_types": {"sparse": "S", "dense": "D"},
    "no_rope_layers": {1: "R", 0: "N"},
}


def _render(name: str, value) -> str:
    """A table cell; per-layer lists (`layer_types`, `mlp_layer_types`, `no_rope_layers`, `block_types`) as counts or
    a one-letter pattern."""
    letters = _PATTERNS.get(name)
    if letters is not None and isinstance(value, list):
        if len(set(value)) == 1:
            return f"{len(value)} × `{value[0]}`"
        pattern = "".join(letters[t] for t in value)
        legend = ", ".join(f"{letter}: {kind}" for kind, letter in letters.items() if kind in value)
        return f"`{pattern}` ({legend})"
    return f"`{value!r}`"


_NON_CONTRACT = {
    "transformers_version", "architectures", "output_hidden_states", "return_dict", "dtype",
    "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id", "problem_type", "use_cache",
    "pad_token_id", "bos_token_id", "eos_token_id", "initializer_range",
}
