"""Granite 4.0-H (IBM, `GraniteMoeHybridForCausalLM`): Mamba-2 layers with attention at the layers `layer_types`
marks, routed experts (the k largest router logits, softmaxed) beside an always-on shared MLP in every layer (or the
shared MLP alone where `num_local_experts` is 0), Granite's μP scalings (`embedding_multiplier`,
`residual_multiplier`, `logits_scaling`, the attention's `attention_multiplier`) and attention without positions
(`position_embedding_type` None, Granite 4.0-H's) or with RoPE.

Its files keep Granite-MoE's names (`block_sparse_moe.input_linear`, `output_linear`, `router.layer`: transformers
renames them on load, as `renames` does here) and the shared MLP's gate and up products in one `input_linear`
([gate; up], split into the contract's `gate_proj` and `up_proj`, exact both ways).
"""

from __future__ import annotations

from transformers import GraniteMoeHybridConfig

from ..core import Family, Rule, refuse, rule
from .common import norm, rope, router_training, source_rope, source_router_training, source_sizes, sizes
from .mamba2 import attention_rules, mamba_expand, mamba_fields, mamba_rules, source_mamba_fields

MOE = "model.layers.{layer}.block_sparse_moe"
SHARED = "model.layers.{layer}.shared_mlp"
# The legacy `layer_types` values Granite 4.0's config.json files hold (transformers remaps them on some releases)
LEGACY_LAYER_TYPES = {"mamba": "linear_attention", "attention": "full_attention"}


def to_contract(src) -> dict:
    layer_types = [LEGACY_LAYER_TYPES.get(kind, kind) for kind in src.layer_types]
    refuse({f"position_embedding_type={src.position_embedding_type!r}":
            src.position_embedding_type not in (None, "rope", "nope")}, "granitemoehybrid")
    positions = rope(src) if src.position_embedding_type == "rope" else {"position_embedding_type": "none"}
    fields = dict(
        sizes(src), **positions, norm_type="rmsnorm", norm_eps=src.rms_norm_eps, norm_position="pre",
        hidden_act=src.hidden_act, attention_bias=src.attention_bias, layer_types=layer_types,
        # the scores' scale is `attention_multiplier` itself: q·k · s^-1/2 with s = multiplier^-2
        query_pre_attn_scalar=src.attention_multiplier ** -2, embedding_multiplier=src.embedding_multiplier,
        residual_multiplier=src.residual_multiplier, logits_scaling=src.logits_scaling, **mamba_fields(src),
    )
    if not src.num_local_experts:  # the shared MLP alone: a dense gated MLP
        return dict(fields, mlp_type="gated", intermediate_size=src.shared_intermediate_size)
    return dict(fields, mlp_type="moe", num_experts=src.num_local_experts, num_experts_per_tok=src.num_experts_per_tok,
                moe_intermediate_size=src.intermediate_size, router_type="topk_softmax", n_shared_experts=1,
                shared_expert_intermediate_size=src.shared_intermediate_size, **router_training(src))


def from_contract(cfg) -> GraniteMoeHybridConfig:
    refuse({f"a Mamba-2 activation ({cfg.mamba_hidden_act!r}) other than `hidden_act` ({cfg.hidden_act!r})":
            cfg.mamba_hidden_act != cfg.hidden_act}, "granitemoehybrid")
    if cfg.mlp_type == "moe":
        experts = dict(intermediate_size=cfg.moe_intermediate_size, num_local_experts=cfg.num_experts,
                       num_experts_per_tok=cfg.num_experts_per_tok,
                       shared_intermediate_size=cfg.shared_expert_intermediate_size, **source_router_training(cfg))
    else:
        experts = dict(num_local_experts=0, shared_intermediate_size=cfg.intermediate_size)
    positions = (dict(position_embedding_type="rope", rope_parameters=source_rope(cfg)) if cfg.uses_rope
                 else dict(position_embedding_type=None))
    scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
    return GraniteMoeHybridConfig(
        **{**source_sizes(cfg), **experts}, rms_norm_eps=cfg.norm_eps, hidden_act=cfg.hidden_act,
        attention_bias=cfg.attention_bias, layer_types=list(cfg.layer_types), attention_multiplier=scale,
        embedding_multiplier=cfg.embedding_multiplier, residual_multiplier=cfg.residual_multiplier,
        logits_scaling=cfg.logits_scaling, mamba_expand=mamba_expand(cfg), **positions, **source_mamba_fields(cfg),
    )


def _sparse(rules: list[Rule]) -> list[Rule]:
    return [Rule(r.src, r.dst, r.transform, r.optional, "sparse") for r in rules]


def rules(src) -> list:
    layer, mlp = "model.layers.{layer}", "model.layers.{layer}.mlp"
    out = [rule("model.embed_tokens.weight", "model.embed_tokens.weight")]
    out += attention_rules(f"{layer}.self_attn") + mamba_rules(f"{layer}.mamba")
    shared = f"{mlp}.shared_experts" if src.num_local_experts else mlp
    feed_forward = [rule(f"{SHARED}.input_linear.weight", (f"{shared}.gate_proj.weight", f"{shared}.up_proj.weight"),
                         "split_gate_up"),
                    rule(f"{SHARED}.output_linear.weight", f"{shared}.down_proj.weight")]
    if src.num_local_experts:
        feed_forward = _sparse(feed_forward + [
            rule(f"{MOE}.router.weight", f"{mlp}.gate.weight"),
            rule(f"{MOE}.experts.gate_up_proj", f"{mlp}.experts.gate_up_proj"),
            rule(f"{MOE}.experts.down_proj", f"{mlp}.experts.down_proj")])
    out += feed_forward
    out += norm(f"{layer}.input_layernorm", f"{layer}.pre_attn_norm") + norm(f"{layer}.post_attention_layernorm",
                                                                             f"{layer}.pre_mlp_norm")
    out += norm("model.norm", "model.final_norm")
    return out + [rule("lm_head.weight", "lm_head.weight", optional=True)]


FAMILY = Family(
    "granitemoehybrid", to_contract, from_contract, rules, "model.", GraniteMoeHybridConfig,
    description="Granite 4.0-H: Mamba-2 and NoPE attention, experts beside a shared MLP (or it alone), μP",
    refusals=("positions other than none or RoPE",), renames={
    f"{MOE}.input_linear.weight": f"{MOE}.experts.gate_up_proj",
    f"{MOE}.output_linear.weight": f"{MOE}.experts.down_proj",
    f"{MOE}.router.layer.weight": f"{MOE}.router.weight",
})
