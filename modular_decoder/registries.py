"""Every axis of the design space and its entries, in one place.

    ATTENTIONS  `attention_type`           standard (MHA / GQA / MQA), mla, dsa (MLA + lightning indexer),
                                           shared_kv (one key = value head, CSA / HCA layers: DeepSeek-V4)
    LINEAR_ATTENTIONS  `linear_attention_type`  gated_deltanet, kda, short_conv, mamba2 (the `"linear_attention"`
                                           layers of `layer_types`)
    MLPS        `mlp_type`                 dense, gated, moe
    RESIDUAL_STREAMS  `residual_stream`    single, altup, hyper_connections
    POSITIONS   `position_embedding_type`  learned, sinusoidal, rope, alibi, none
    NORMS       `norm_type`                rmsnorm, layernorm
    FEATURES    (their own fields)         chunked_attention (`attention_chunk_size`), per_layer_embeddings
                                           (`hidden_size_per_layer_input`)

Each registry's keys are the values its config field allows; `FEATURES` are mechanisms a config switches on through
their own fields (`kinds.Feature`), each checked like a registry's chosen entry. The blocks (`blocks.BLOCKS`: `norm_position`
and `parallel_block`) are built from these registries, so they import this module, never the reverse. A
new attention or feed-forward kind is one `register_attention(kind)` / `register_mlp(kind)` call with an
`AttentionKind` / `FeedForwardKind` (see kinds.py) before the config is built.
"""

from __future__ import annotations

from .altup import ALTUP, AltUpFields
from .attention import STANDARD_ATTENTION
from .attention_shapes import AttentionShapeFields
from .chunked_attention import CHUNKED_ATTENTION_FEATURE, ChunkedAttentionFields
from .experts import ClampedSwiGLUFields
from .gated_deltanet import GATED_DELTANET
from .hyper_connections import HYPER_CONNECTIONS, HyperConnectionFields
from .kda import KDA
from .kinds import AttentionKind, FeatureSet, FeedForwardKind, LinearAttentionKind, Registry
from .kv_sharing import KVSharingFields
from .mamba2 import MAMBA2
from .mla import LATENT_ATTENTION
from .mlp import DENSE_MLP, GATED_MLP, MlpLayerFields
from .moe import MIXTURE_OF_EXPERTS, RoutingInputFields
from .norms import NORMS
from .per_layer_embeddings import PER_LAYER_EMBEDDINGS, PerLayerEmbeddingFields
from .positions import POSITIONS
from .short_conv import SHORT_CONV
from .residual_streams import SINGLE_STREAM, ResidualStreamFields, ResidualStreamKind
from .routers import HashRoutingFields
from .shared_kv_attention import SHARED_KV_ATTENTION, SharedKVFields
from .sparse_attention import SPARSE_LATENT_ATTENTION

ATTENTIONS: Registry[AttentionKind] = Registry("attention_type", [STANDARD_ATTENTION, LATENT_ATTENTION,
                                                                         SPARSE_LATENT_ATTENTION, SHARED_KV_ATTENTION])
MLPS: Registry[FeedForwardKind] = Registry("mlp_type", [DENSE_MLP, GATED_MLP, MIXTURE_OF_EXPERTS])
LINEAR_ATTENTIONS: Registry[LinearAttentionKind] = Registry("linear_attention_type", [GATED_DELTANET, KDA, SHORT_CONV,
                                                                                    MAMBA2])
RESIDUAL_STREAMS: Registry[ResidualStreamKind] = Registry("residual_stream", [SINGLE_STREAM, ALTUP,
                                                                                     HYPER_CONNECTIONS])
FEATURES = FeatureSet([CHUNKED_ATTENTION_FEATURE, PER_LAYER_EMBEDDINGS])
# The config fields that live beside their mechanisms (`@dataclass(kw_only=True)` classes, each documenting its
# fields), bases of `ModularDecoderConfig` beside those it names itself
FIELD_MIXINS = (ChunkedAttentionFields, RoutingInputFields, AttentionShapeFields, KVSharingFields,
                PerLayerEmbeddingFields, ResidualStreamFields, MlpLayerFields, AltUpFields, HashRoutingFields,
                ClampedSwiGLUFields, SharedKVFields, HyperConnectionFields)


def register_attention(kind: AttentionKind, replace: bool = False) -> AttentionKind:
    """Add an attention kind: configs may then use `attention_type=kind.name`."""
    return ATTENTIONS.register(kind, replace=replace)


def register_mlp(kind: FeedForwardKind, replace: bool = False) -> FeedForwardKind:
    """Add a feed-forward kind: configs may then use `mlp_type=kind.name`."""
    return MLPS.register(kind, replace=replace)


def register_linear_attention(kind: LinearAttentionKind, replace: bool = False) -> LinearAttentionKind:
    """Add a linear-attention kind: configs may then use `linear_attention_type=kind.name`."""
    return LINEAR_ATTENTIONS.register(kind, replace=replace)


__all__ = ["ATTENTIONS", "FEATURES", "FIELD_MIXINS", "RESIDUAL_STREAMS", "LINEAR_ATTENTIONS", "MLPS", "POSITIONS",
           "NORMS", "register_attention", "register_linear_attention", "register_mlp"]
