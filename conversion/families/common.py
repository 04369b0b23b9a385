"""Pieces most family modules share: the size fields every config has, and the Llama-style map."""

from __future__ import annotations

from modular_decoder.configuration_modular_decoder import ATTENTION_LAYER_TYPES

from ..core import ExpertStack, Rule, rule

# Fields that differ in name only between a transformers config and the contract.
SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "max_position_embeddings")
TOKEN_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def sizes(src, **overrides) -> dict:
    """The size and special-token fields, read from a transformers config with standard names
    (`overrides` for those a family names differently)."""
    out = {name: getattr(src, name, None) for name in SIZE_FIELDS}
    out["num_key_value_heads"] = getattr(src, "num_key_value_heads", None) or src.num_attention_heads
    out["head_dim"] = getattr(src, "head_dim", None) or src.hidden_size // src.num_attention_heads
    out["tie_word_embeddings"] = bool(getattr(src, "tie_word_embeddings", False))
    out.update(tokens(src))
    out.update(overrides)
    return out


def tokens(src) -> dict:
    return {name: getattr(src, name, None) for name in TOKEN_FIELDS}


def source_sizes(cfg) -> dict:
    """The inverse of `sizes`: standard transformers size fields from a contract."""
    out = {name: getattr(cfg, name) for name in SIZE_FIELDS}
    out.update(num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
               tie_word_embeddings=cfg.tie_word_embeddings)
    out.update({name: getattr(cfg, name) for name in TOKEN_FIELDS})
    return out


def linear(src: str, dst: str, transform: str = "copy") -> list[Rule]:
    """A weight and its optional bias."""
    return [rule(f"{src}.weight", f"{dst}.weight", transform), rule(f"{src}.bias", f"{dst}.bias", transform, True)]


def norm(src: str, dst: str) -> list[Rule]:
    return [rule(f"{src}.weight", f"{dst}.weight"), rule(f"{src}.bias", f"{dst}.bias", optional=True)]


def llama_rules(norms: dict[str, str], qk_norm: bool = False, attention: list[Rule] | None = None,
                moe: list[Rule] | None = None, mlp: str = "mlp") -> list[Rule]:
    """The `model.layers.{layer}.self_attn.q_proj` layout shared by Llama, Mistral, Qwen, Gemma, OLMo 2
    and (with its own `attention` rules) DeepSeek.

    `norms` maps each source block norm to the contract's norm named by where it sits. The gated MLP
    (the source's `model.layers.{layer}.<mlp>`: Llama 4 names it `feed_forward`) maps the contract's dense layers;
    `moe` (see `moe_rules`) its sparse ones.
    """
    src, dst = "model.layers.{layer}", "model.layers.{layer}"
    rules = [rule("model.embed_tokens.weight", "model.embed_tokens.weight")]
    if attention is None:
        attention = []
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            attention += linear(f"{src}.self_attn.{proj}", f"{dst}.self_attn.{proj}")
        if qk_norm:
            attention += norm(f"{src}.self_attn.q_norm", f"{dst}.self_attn.qk_norm.q_norm")
            attention += norm(f"{src}.self_attn.k_norm", f"{dst}.self_attn.qk_norm.k_norm")
    rules += attention
    for proj in ("gate_proj", "up_proj", "down_proj"):
        rules += [Rule(r.src, r.dst, r.transform, r.optional, "dense")
                  for r in linear(f"{src}.{mlp}.{proj}", f"{dst}.mlp.{proj}")]
    rules += moe or []
    for name, ours in norms.items():
        rules += norm(f"{src}.{name}", f"{dst}.{ours}")
    rules += norm("model.norm", "model.final_norm")
    rules.append(rule("lm_head.weight", "lm_head.weight", optional=True))
    return rules


def gated_mlp(names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"), module: str = "mlp") -> list[Rule]:
    """A layer's gated MLP whose gate, up and down projections the source names `names` in `module`."""
    layer = "model.layers.{layer}"
    return [r for theirs, ours in zip(names, ("gate_proj", "up_proj", "down_proj"))
            for r in linear(f"{layer}.{module}.{theirs}", f"{layer}.mlp.{ours}")]


PRE_NORMS = {"input_layernorm": "pre_attn_norm", "post_attention_layernorm": "pre_mlp_norm"}


def rope(src) -> dict:
    """RoPE fields: transformers v5 keeps theta, type and scaling in `rope_parameters`."""
    params = dict(src.rope_parameters) if getattr(src, "rope_parameters", None) else {"rope_type": "default"}
    if any(isinstance(value, dict) for value in params.values()):  # nested per layer type
        # only the per-type tables: transformers 5.16-5.17 leave a flat `rope_type` / `rope_theta: None` beside them
        nested = {key: dict(value) for key, value in params.items() if key in ATTENTION_LAYER_TYPES}
        return {"position_embedding_type": "rope", "rope_parameters": nested}
    factor = params.pop("partial_rotary_factor", None) or getattr(src, "partial_rotary_factor", None) or 1.0
    return {"position_embedding_type": "rope", "rope_parameters": params, "partial_rotary_factor": factor}


def source_rope(cfg) -> dict:
    params = cfg.rope_parameters
    if cfg.rope_is_nested:  # (a table's own factor kept: proportional RoPE's, Gemma 4)
        return {k: {kk: vv for kk, vv in v.items() if kk != "partial_rotary_factor" or vv != cfg.partial_rotary_factor}
                for k, v in params.items()}
    out = {k: v for k, v in params.items() if k != "partial_rotary_factor"}
    if cfg.partial_rotary_factor != 1.0:
        out["partial_rotary_factor"] = cfg.partial_rotary_factor
    return out


# ---------------------------------------------------------------------------------------------
# Mixture of experts: transformers v5 holds every MoE family's experts as `mlp.experts.gate_up_proj`
# (E, 2f, d) = [gate; up] and `mlp.experts.down_proj` (E, d, f), its router as `mlp.gate.weight` (E, d):
# the contract's own names. Files store one tensor per expert.


def expert_stacks(gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj",
                  layers: str = "model.layers") -> tuple[ExpertStack, ...]:
    """Per-expert files `model.layers.{layer}.mlp.experts.{expert}.<gate|up|down>.weight` -> the fused tensors
    (`layers`: where the files keep the layers, e.g. "mtp.layers" for Qwen3-Next's MTP layer)."""
    experts = layers + ".{layer}.mlp.experts"
    return (
        ExpertStack((f"{experts}.{{expert}}.{gate}.weight", f"{experts}.{{expert}}.{up}.weight"),
                    f"{experts}.gate_up_proj"),
        ExpertStack((f"{experts}.{{expert}}.{down}.weight",), f"{experts}.down_proj"),
    )


def moe_rules(shared: str | None = None, shared_gate: bool = False, correction_bias: bool = False) -> list[Rule]:
    """A sparse layer's router and experts (same names on both sides); `shared` names the family's
    shared-experts MLP (`shared_expert` in Qwen2-MoE, `shared_experts` in DeepSeek)."""
    mlp = "model.layers.{layer}.mlp"
    names = ["gate.weight", "experts.gate_up_proj", "experts.down_proj"]
    names += ["gate.e_score_correction_bias"] if correction_bias else []
    names += ["shared_expert_gate.weight"] if shared_gate else []
    rules = [rule(f"{mlp}.{name}", f"{mlp}.{name}", layers="sparse") for name in names]
    if shared is not None:
        rules += [rule(f"{mlp}.{shared}.{proj}.weight", f"{mlp}.shared_experts.{proj}.weight", layers="sparse")
                  for proj in ("gate_proj", "up_proj", "down_proj")]
    return rules


def router_training(src) -> dict:
    """The router-loss fields every MoE family shares (they change the training loss, not the logits)."""
    return {"router_aux_loss_coef": src.router_aux_loss_coef, "output_router_logits": bool(src.output_router_logits)}


def source_router_training(cfg) -> dict:
    return {"router_aux_loss_coef": cfg.router_aux_loss_coef, "output_router_logits": cfg.output_router_logits}


def sparse_layers(num_layers: int, is_sparse) -> list[str]:
    """`mlp_layer_types` from a per-layer predicate."""
    return ["sparse" if is_sparse(i) else "dense" for i in range(num_layers)]


def dense_layer_indices(cfg) -> list[int]:
    return [i for i, kind in enumerate(cfg.mlp_layer_types or []) if kind == "dense"]
