"""DeepSeek-V3.2 (`DeepseekV32ForCausalLM`): DeepSeek-V3 with DeepSeek Sparse Attention, a lightning indexer in
every attention layer (`self_attn.indexer.{wq_b, wk, k_norm, weights_proj}`, the same names on both sides) that
chooses the `index_topk` keys each query attends to: `attention_type="dsa"`.

Its MLA always rotates interleaved pairs and its indexer halves (the config has no `rope_interleave`). Every
layer's type is transformers' sparse-attention type, whose name differs between releases; the export leaves
`layer_types` for the installed release to fill in. The published checkpoints' multi-token-prediction layer
(`model.layers.{num_hidden_layers}`, config.json's `num_nextn_predict_layers`, which transformers' config class keeps
as an extra field and its model skips) converts as DeepSeek-V3's does (`deepseek_v3.mtp_rules`; its block a DSA
layer with its indexer, as the model's last).
"""

from __future__ import annotations

from transformers import DeepseekV32Config

from ..core import Family, refuse
from .common import expert_stacks, linear, norm
from .deepseek_v2 import mla_rules
from .deepseek_v3 import MTP_LAYER, mtp_rules, v3_contract, v3_source_fields

INDEXER = "model.layers.{layer}.self_attn.indexer"


def to_contract(src) -> dict:
    dense = min(src.first_k_dense_replace, src.num_hidden_layers)
    mlp_layer_types = getattr(src, "mlp_layer_types", None)
    refuse({
        "no query latent (`q_lora_rank=None`; the indexer's queries are made from it)": src.q_lora_rank is None,
        "`mlp_layer_types` other than `first_k_dense_replace` dense layers, then sparse":
            mlp_layer_types is not None and list(mlp_layer_types) != ["dense"] * dense + ["sparse"] * (
                src.num_hidden_layers - dense),
        "`layer_types` of more than one kind": len(set(src.layer_types or [None])) > 1,
    }, "deepseek_v32")
    return dict(v3_contract(src, "deepseek_v32", rope_interleaved=True), attention_type="dsa",
                index_n_heads=src.index_n_heads, index_head_dim=src.index_head_dim, index_topk=src.index_topk)


def from_contract(cfg) -> DeepseekV32Config:
    if not cfg.rope_interleaved:
        raise ValueError("DeepSeek-V3.2 rotates adjacent pairs only: it cannot express `rope_interleaved=False`.")
    # the MTP modules' count under the Hub config.json's name (the config class has no field for it)
    mtp = {"num_nextn_predict_layers": cfg.num_mtp_layers} if cfg.num_mtp_layers else {}
    return DeepseekV32Config(**v3_source_fields(cfg, "dsa", "DeepSeek-V3.2"), index_n_heads=cfg.index_n_heads,
                             index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk, **mtp)


def rules(src):
    """DeepSeek-V3's map, plus each layer's indexer; the MTP modules' blocks by the same layer rules."""
    indexer = [r for proj in ("wq_b", "wk", "weights_proj") for r in linear(f"{INDEXER}.{proj}", f"{INDEXER}.{proj}")]
    layer_rules = mla_rules(src, correction_bias=True) + indexer + norm(f"{INDEXER}.k_norm", f"{INDEXER}.k_norm")
    return layer_rules + mtp_rules(layer_rules, bool(getattr(src, "tie_word_embeddings", False)))


FAMILY = Family("deepseek_v32", to_contract, from_contract, rules, config_class=DeepseekV32Config,
                experts=expert_stacks(), mtp_layers=MTP_LAYER,
                description="DeepSeek-V3.2: V3 with DeepSeek Sparse Attention (a lightning indexer picks each "
                            "query's keys)",
                refusals=("rms_norm_eps other than 1e-6", "no query latent (`q_lora_rank=None`)",
                          "dense and sparse layers other than `first_k_dense_replace`", "an MLP bias"))
