"""DeepSeek-V2 (dense layers): multi-head latent attention, pre-norm RMSNorm, SwiGLU, YaRN.

The attention modules keep DeepSeek's names, so the map is the identity apart from the block
norms. DeepSeek-V2 rotates adjacent pairs (a complex product), hence `rope_interleaved=True`;
its YaRN softmax adjustment (`mscale_all_dim`) travels in `rope_parameters`, which the MLA module
reads. Mixture-of-experts layers have no contract field and are refused.
"""

from __future__ import annotations

from transformers import DeepseekV2Config

from ..core import Family, Rule, refuse
from .common import PRE_NORMS, linear, llama_rules, norm, rope, source_rope, source_sizes, sizes

# transformers builds DeepSeek's latent norms (q_a_layernorm, kv_a_layernorm) with this fixed eps,
# whereas the contract has one `norm_eps` for every norm.
LATENT_NORM_EPS = 1e-6


def refuse_unsupported(src, family: str) -> None:
    refuse(
        {
            "mixture-of-experts layers (first_k_dense_replace < num_hidden_layers)":
                bool(getattr(src, "n_routed_experts", 0)) and src.first_k_dense_replace < src.num_hidden_layers,
            f"rms_norm_eps != {LATENT_NORM_EPS} (its latent norms always use {LATENT_NORM_EPS})":
                src.rms_norm_eps != LATENT_NORM_EPS,
            "pretraining_tp > 1": getattr(src, "pretraining_tp", 1) not in (None, 1),
        },
        family,
    )


def mla_contract(src, rope_interleaved: bool) -> dict:
    """Contract fields shared by DeepSeek-V2 and V3 (dense layers)."""
    fields = sizes(src)
    fields.pop("head_dim")  # DeepSeek sets head_dim = qk_rope_head_dim; MLA widths are explicit below
    fields["num_key_value_heads"] = src.num_attention_heads
    return dict(
        fields, **rope(src), rope_interleaved=rope_interleaved, norm_type="rmsnorm", norm_eps=src.rms_norm_eps,
        norm_position="pre", mlp_type="gated", hidden_act=src.hidden_act, mlp_bias=getattr(src, "mlp_bias", False),
        attention_type="mla", q_lora_rank=src.q_lora_rank, kv_lora_rank=src.kv_lora_rank,
        qk_nope_head_dim=src.qk_nope_head_dim, qk_rope_head_dim=src.qk_rope_head_dim, v_head_dim=src.v_head_dim,
        attention_bias=src.attention_bias, attention_output_bias=src.attention_bias,
    )


def mla_source_fields(cfg) -> dict:
    """The inverse of `mla_contract` (all layers dense)."""
    if cfg.attention_type != "mla":
        raise ValueError("Only `attention_type='mla'` exports to a DeepSeek family.")
    fields = source_sizes(cfg)
    fields.pop("head_dim")
    return dict(
        fields, rms_norm_eps=cfg.norm_eps, hidden_act=cfg.hidden_act, attention_bias=cfg.attention_bias,
        rope_parameters=source_rope(cfg), q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
        first_k_dense_replace=cfg.num_hidden_layers,
    )


def mla_rules(src) -> list[Rule]:
    """`model.layers.{layer}.self_attn.kv_a_proj_with_mqa` etc.: the same names on both sides, in
    the Llama-style layout for everything else."""
    attn = "model.layers.{layer}.self_attn"
    q_parts = ["q_proj"] if src.q_lora_rank is None else ["q_a_proj", "q_b_proj"]
    attention = []
    for proj in q_parts + ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]:
        attention += linear(f"{attn}.{proj}", f"{attn}.{proj}")
    if src.q_lora_rank is not None:
        attention += norm(f"{attn}.q_a_layernorm", f"{attn}.q_a_layernorm")
    attention += norm(f"{attn}.kv_a_layernorm", f"{attn}.kv_a_layernorm")
    return llama_rules(PRE_NORMS, attention=attention)


def to_contract(src) -> dict:
    refuse_unsupported(src, "deepseek_v2")
    return mla_contract(src, rope_interleaved=True)


def from_contract(cfg) -> DeepseekV2Config:
    if not cfg.rope_interleaved:
        raise ValueError("DeepSeek-V2 rotates adjacent pairs only: it cannot express `rope_interleaved=False`.")
    return DeepseekV2Config(**mla_source_fields(cfg), mlp_bias=cfg.mlp_bias)


FAMILY = Family("deepseek_v2", to_contract, from_contract, mla_rules, config_class=DeepseekV2Config)
