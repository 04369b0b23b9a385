"""DeepSeek-V4: shared key = value attention over a window on every layer, with compressed layers (CSA pooling
overlapping windows and keeping an indexer's top entries, HCA pooling without overlap), attention sinks, a grouped
low-rank output projection, partial interleaved RoPE on each head's last features (the compressed layers with
their own base and scaling: transformers' `rope_parameters["compress"]`), manifold-constrained hyper-connections,
and experts in every layer scored by √softplus, the first `num_hash_layers` routed by token id, with clamped
SwiGLU experts and one shared expert.

Each of those is a contract axis: `attention_type="shared_kv"` with `compress_rates` and the `index_*` fields,
`attention_sinks`, `o_groups` / `o_lora_rank`, `rope_interleaved` with a table per layer type,
`residual_stream="hyper_connections"`, `router_type="sqrtsoftplus_topk"`, `num_hash_layers`, `swiglu_limit` with
`swiglu_alpha`=1 and `swiglu_up_offset`=0.

Files: transformers renames DeepSeek's names on load (`conversion_mapping.py`: `attn.wq_a` -> `self_attn.q_a_proj`,
per-expert `w1` / `w3` / `w2`, `hc_attn_fn` -> `attn_hc.fn`, ...) and back on save, which writes them under the
model's `model.` prefix; the release's own files have none (`embed.weight`, `layers.N.*`, `hc_head_fn`), read through
`aliases`. Its multi-token-prediction module (`mtp.*`) is not converted: transformers' `DeepseekV4ForCausalLM`
loads without it and cannot draft with it (`dropped`).
"""

from __future__ import annotations

from transformers import DeepseekV4Config

from ..core import Family, Rule, in_layers, refuse, rule
from .common import expert_stacks, norm, router_training, source_router_training, source_sizes, sizes

COMPRESSED = ("compressed_sparse_attention", "heavily_compressed_attention")
# transformers' rotary tables of DeepSeek-V4: the window-only layers' ("main") and the compressed ones'
ROPE_TABLES = {"sliding_attention": "main", **dict.fromkeys(COMPRESSED, "compress")}
SCORING = {"sqrtsoftplus": "sqrtsoftplus_topk", "sigmoid": "sigmoid_topk"}

L, SA, MLP = "model.layers.{layer}.", "model.layers.{layer}.self_attn.", "model.layers.{layer}.mlp."
# file names (as transformers' save_pretrained writes them) -> transformers' model names
_ATTENTION_FILES = {
    "wq_a.": "q_a_proj.", "q_norm.": "q_a_norm.", "wq_b.": "q_b_proj.", "wkv.": "kv_proj.", "norm.": "kv_norm.",
    "wo_a.": "o_a_proj.", "wo_b.": "o_b_proj.", "attn_sink": "sinks",
    "compressor.wkv.": "compressor.kv_proj.", "compressor.wgate.": "compressor.gate_proj.",
    "compressor.ape": "compressor.position_bias", "compressor.norm.": "compressor.kv_norm.",
    "indexer.compressor.wkv.": "compressor.indexer.kv_proj.", "indexer.compressor.wgate.": "compressor.indexer.gate_proj.",
    "indexer.compressor.ape": "compressor.indexer.position_bias",
    "indexer.compressor.norm.": "compressor.indexer.kv_norm.", "indexer.wq_b.": "compressor.indexer.q_b_proj.",
    "indexer.weights_proj.": "compressor.indexer.scorer.weights_proj.",
}
_FEED_FORWARD_FILES = {"gate.bias": "gate.e_score_correction_bias", "gate.": "gate.", "experts.": "experts.",
                       "shared_experts.w1.": "shared_experts.gate_proj.", "shared_experts.w3.": "shared_experts.up_proj.",
                       "shared_experts.w2.": "shared_experts.down_proj."}
_HC_FILES = {f"hc_{site}_{part}": f"{site}_hc.{part}" for site in ("attn", "ffn") for part in ("fn", "base", "scale")}
RENAMES = {
    **{f"{L}attn.{old}": f"{SA}{new}" for old, new in _ATTENTION_FILES.items()},
    **{f"{L}ffn.{old}": f"{MLP}{new}" for old, new in _FEED_FORWARD_FILES.items()},
    f"{L}attn_norm.": f"{L}input_layernorm.", f"{L}ffn_norm.": f"{L}post_attention_layernorm.",
    **{f"{L}{old}": f"{L}{new}" for old, new in _HC_FILES.items()},
    "head.": "lm_head.",
}
# the release's own names (DeepSeek's, without the `model.` prefix) -> those transformers' save_pretrained writes
ALIASES = {"embed.": "model.embed_tokens.", "layers.": "model.layers.", "norm.": "model.norm.",
           **{f"hc_head_{part}": f"model.hc_head.hc_{part}" for part in ("fn", "base", "scale")}}


def to_contract(src) -> dict:
    types = list(src.layer_types)
    refuse({f"`scoring_func`={src.scoring_func!r} (transformers' class scores it through its activation table; "
            f"the contract's routers score {sorted(SCORING)})": src.scoring_func not in SCORING,
            "`hidden_act` other than 'silu' (the clamped SwiGLU is SiLU's)": src.hidden_act != "silu",
            "`mlp_layer_types` whose 'hash_moe' layers are not the first ones": _hash_layers(src) is None}, "deepseek_v4")
    sparse = "compressed_sparse_attention" in types
    fields = sizes(src, intermediate_size=src.moe_intermediate_size, num_key_value_heads=1, head_dim=src.head_dim)
    return dict(
        fields, norm_type="rmsnorm", norm_eps=src.rms_norm_eps, norm_position="pre", hidden_act=src.hidden_act,
        attention_type="shared_kv", attention_sinks=True, q_lora_rank=src.q_lora_rank, o_groups=src.o_groups,
        o_lora_rank=src.o_lora_rank, sliding_window=src.sliding_window, layer_types=types,
        compress_rates={t: src.compress_rates[t] for t in COMPRESSED if t in types} or None,
        index_n_heads=src.index_n_heads if sparse else None, index_head_dim=src.index_head_dim if sparse else None,
        index_topk=src.index_topk if sparse else None, attention_dropout=src.attention_dropout,
        position_embedding_type="rope", rope_interleaved=True, partial_rotary_factor=src.partial_rotary_factor,
        rope_parameters={t: _table(src.rope_parameters[ROPE_TABLES[t]]) for t in dict.fromkeys(types)},
        residual_stream="hyper_connections", hc_mult=src.hc_mult, hc_sinkhorn_iters=src.hc_sinkhorn_iters,
        hc_eps=src.hc_eps,
        # every layer's experts (transformers builds one shared expert of `moe_intermediate_size` whatever
        # `n_shared_experts` says, and always renormalises the kept weights)
        mlp_type="moe", num_experts=src.n_routed_experts, num_experts_per_tok=src.num_experts_per_tok,
        moe_intermediate_size=src.moe_intermediate_size, n_shared_experts=1, router_type=SCORING[src.scoring_func],
        norm_topk_prob=True, routed_scaling_factor=src.routed_scaling_factor, num_hash_layers=_hash_layers(src),
        swiglu_limit=src.swiglu_limit, swiglu_alpha=1.0, swiglu_up_offset=0.0, **router_training(src),
    )


def _table(params: dict) -> dict:
    """One of transformers' rotary tables as the contract's per-layer-type entry (the rotated fraction is the
    config's own `partial_rotary_factor`)."""
    return {key: value for key, value in params.items() if key != "partial_rotary_factor"}


def _hash_layers(src) -> int | None:
    """How many leading layers route by token id; None where the `hash_moe` layers are not a prefix."""
    kinds = list(src.mlp_layer_types)
    count = next((i for i, kind in enumerate(kinds) if kind != "hash_moe"), len(kinds))
    return count if "hash_moe" not in kinds[count:] else None


def from_contract(cfg) -> DeepseekV4Config:
    _check_exportable(cfg)
    types = list(cfg.layer_types)
    main = next((cfg.rope_parameters[t] for t in types if ROPE_TABLES[t] == "main"), None)
    compress = next((cfg.rope_parameters[t] for t in types if ROPE_TABLES[t] == "compress"), None)
    main, compress = main or compress, compress or main  # a table no layer reads: the other's
    fields = source_sizes(cfg)
    for name in ("intermediate_size", "num_key_value_heads", "tie_word_embeddings"):
        fields.pop(name)
    sparse = "compressed_sparse_attention" in types
    index = {name: getattr(cfg, name) for name in ("index_n_heads", "index_head_dim", "index_topk") if sparse}
    return DeepseekV4Config(
        **fields, tie_word_embeddings=cfg.tie_word_embeddings, rms_norm_eps=cfg.norm_eps, q_lora_rank=cfg.q_lora_rank,
        o_groups=cfg.o_groups, o_lora_rank=cfg.o_lora_rank, sliding_window=cfg.sliding_window, layer_types=types,
        compress_rates={**DeepseekV4Config.default_compress_rates, **(cfg.compress_rates or {})}, **index,
        attention_dropout=cfg.attention_dropout, partial_rotary_factor=cfg.partial_rotary_factor,
        rope_parameters={"main": {**main, "partial_rotary_factor": cfg.partial_rotary_factor},
                         "compress": {**compress, "partial_rotary_factor": cfg.partial_rotary_factor}},
        hc_mult=cfg.hc_mult, hc_sinkhorn_iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps,
        n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
        moe_intermediate_size=cfg.moe_intermediate_size, n_shared_experts=1,
        scoring_func=next(k for k, v in SCORING.items() if v == cfg.router_type), norm_topk_prob=True,
        routed_scaling_factor=cfg.routed_scaling_factor, swiglu_limit=cfg.swiglu_limit,
        mlp_layer_types=["hash_moe"] * cfg.num_hash_layers + ["moe"] * (cfg.num_hidden_layers - cfg.num_hash_layers),
        **source_router_training(cfg),
    )


def _check_exportable(cfg) -> None:
    """What DeepSeek-V4's format cannot express, named."""
    checks = {
        "attention_type": cfg.attention_type == "shared_kv",
        "residual_stream": cfg.residual_stream == "hyper_connections",
        "mlp_type": cfg.mlp_type == "moe" and "dense" not in cfg.mlp_layer_types,
        "router_type": cfg.router_type in SCORING.values() and cfg.n_group == 1 and cfg.norm_topk_prob,
        "n_shared_experts": cfg.n_shared_experts == 1 and cfg.shared_expert_intermediate_size == cfg.moe_intermediate_size
        and not cfg.shared_expert_gate,
        "swiglu_limit": cfg.swiglu_limit is not None and cfg.swiglu_alpha == 1.0 and cfg.swiglu_up_offset == 0.0,
        "layer_types": all(t in ROPE_TABLES for t in cfg.layer_types),
        "attention_sinks": cfg.attention_sinks,
        "rope_interleaved": cfg.uses_rope and cfg.rope_interleaved and cfg.rope_is_nested and cfg.no_rope_layers is None,
        "q_lora_rank": cfg.q_lora_rank is not None and cfg.o_groups is not None,
        "mlp_bias": not cfg.mlp_bias and not cfg.router_bias and cfg.hidden_act == "silu",
        "norm_type": cfg.norm_type == "rmsnorm" and cfg.norm_position == "pre" and cfg.final_norm,
        "lm_head_bias": not cfg.lm_head_bias and cfg.embedding_multiplier == 1.0 and cfg.logits_scaling == 1.0,
    }
    bad = [name for name, holds in checks.items() if not holds]
    if bad:
        raise ValueError(f"DeepSeek-V4's format cannot express this model's {', '.join(f'`{n}`' for n in bad)} "
                         "(it has shared key = value attention with sinks and grouped output, hyper-connections, "
                         "√softplus or sigmoid experts in every layer with one shared expert and the clamped SwiGLU).")
    _check_main_table(cfg)


def _check_main_table(cfg) -> None:
    """transformers' class reads one table for every window-only layer and one for every compressed layer."""
    for label in ("main", "compress"):
        tables = [cfg.rope_parameters[t] for t in dict.fromkeys(cfg.layer_types) if ROPE_TABLES[t] == label]
        if any(table != tables[0] for table in tables):
            raise ValueError(f"DeepSeek-V4's format holds one rotary table for its compressed layers: "
                             f"`rope_parameters` differ between {[t for t in COMPRESSED if t in cfg.layer_types]}.")


def rules(src) -> list[Rule]:
    """transformers' DeepSeek-V4 names -> the contract's (the attention's mostly alike; the compressor's projections
    under `compressor.compressor`, the indexer's under `compressor.indexer.compressor`; norms by where they sit,
    hyper-connections' head as the residual stream's part)."""
    attention = [rule(f"{SA}{name}", f"{SA}{name}") for name in
                 ("q_a_proj.weight", "q_a_norm.weight", "q_b_proj.weight", "kv_proj.weight", "kv_norm.weight",
                  "o_a_proj.weight", "o_b_proj.weight", "sinks")]
    pooled = ("kv_proj.weight", "gate_proj.weight", "position_bias", "kv_norm.weight")
    compressed = in_layers([rule(f"{SA}compressor.{name}", f"{SA}compressor.compressor.{name}") for name in pooled],
                           "compressed")
    indexer = f"{SA}compressor.indexer."
    sparse = in_layers([rule(f"{indexer}{name}", f"{indexer}compressor.{name}") for name in pooled]
                       + [rule(f"{indexer}q_b_proj.weight", f"{indexer}q_b_proj.weight"),
                          rule(f"{indexer}scorer.weights_proj.weight", f"{indexer}weights_proj.weight")],
                       "compressed_sparse")
    moe = [rule(f"{MLP}{name}", f"{MLP}{name}") for name in
           ("gate.weight", "experts.gate_up_proj", "experts.down_proj", "shared_experts.gate_proj.weight",
            "shared_experts.up_proj.weight", "shared_experts.down_proj.weight")]
    # a hash layer's router holds its token table and no correction bias; the others the bias
    moe += [rule(f"{MLP}gate.tid2eid", f"{MLP}gate.tid2eid", optional=True),
            rule(f"{MLP}gate.e_score_correction_bias", f"{MLP}gate.e_score_correction_bias", optional=True)]
    hyper = [rule(f"{L}{site}_hc.{part}", f"{L}{site}_hc.{part}") for site in ("attn", "ffn")
             for part in ("fn", "base", "scale")]
    return [
        rule("model.embed_tokens.weight", "model.embed_tokens.weight"), *attention, *compressed, *sparse, *moe,
        *hyper, *norm(f"{L}input_layernorm", f"{L}pre_attn_norm"), *norm(f"{L}post_attention_layernorm", f"{L}pre_mlp_norm"),
        *norm("model.norm", "model.final_norm"),
        *[rule(f"model.hc_head.hc_{part}", f"model.residual_stream.{part}") for part in ("fn", "base", "scale")],
        rule("lm_head.weight", "lm_head.weight", optional=True),
    ]


FAMILY = Family("deepseek_v4", to_contract, from_contract, rules, config_class=DeepseekV4Config,
                renames=RENAMES, aliases=ALIASES, experts=expert_stacks("w1", "w3", "w2"),
                dropped={"mtp.": "its multi-token-prediction module (transformers' DeepseekV4ForCausalLM loads without "
                                 "it and cannot draft with it)"},
                description="DeepSeek-V4: shared key = value attention with compressed (CSA / HCA) layers, "
                            "hyper-connections, √softplus and hash-routed experts (FP8 / FP4 releases read)",
                refusals=("a `scoring_func` other than sqrtsoftplus or sigmoid", "a `hidden_act` other than silu",
                          "hash-routed layers that are not the first ones"))
