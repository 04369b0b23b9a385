"""DeepSeek-V3: DeepSeek-V2's MLA with a choice of rotary layout (`rope_interleave`) and experts routed
by sigmoid scores plus a load-balancing correction bias, within the best `topk_group` of `n_group`
groups, renormalised and scaled by `routed_scaling_factor`.

Its multi-token-prediction modules (`num_nextn_predict_layers`, transformers' `num_mtp_layers`) follow the model's
layers in the Hub files (DeepSeek-V3's layer 61): `enorm`, `hnorm`, `eh_proj`, a decoder layer's tensors,
`shared_head.norm`, and copies of the embedding and the head (`embed_tokens`, `shared_head.head`). transformers'
model class skips them and its `MtpModel` loads them for `generate(use_mtp=True)`; they convert to the contract's
`mtp.layers.{k}` (`mtp_rules`, which deepseek_v32 reuses) when the files hold them, and a folder without them
converts with `num_mtp_layers=0`.

The copies of the embedding and the head are checked equal to the model's own where the files hold them, and not
needed where they do not (transformers' `MtpModel` uses the main ones too). Export writes them: DeepSeek's published
layout has them, and vLLM's and SGLang's DeepSeek MTP loaders read each module's head from `shared_head.head`.
"""

from __future__ import annotations

from transformers import DeepseekV3Config

from ..core import Family, Rule, mtp_block_rules, refuse, rule
from .common import expert_stacks, norm
from .deepseek_v2 import mla_contract, mla_rules, mla_source_fields, moe_contract, refuse_unsupported

# Where DeepSeek's files keep MTP module k: the layer after the model's last (`{mtp_layer}` = num_hidden_layers + k)
MTP_LAYER = "model.layers.{mtp_layer}."


def to_contract(src) -> dict:
    # V3 lays the rotary pairs out interleaved (x0, x1), (x2, x3), ... unless `rope_interleave=False`.
    return v3_contract(src, "deepseek_v3", rope_interleaved=bool(src.rope_interleave))


def declared_mtp_layers(src) -> int:
    """The MTP modules config.json declares (transformers' `num_mtp_layers`, or DeepSeek's `num_nextn_predict_layers`
    where the config class has no field for it: DeepSeek-V3.2's keeps it as an extra); `convert` keeps those the
    files hold (none: 0)."""
    return getattr(src, "num_mtp_layers", None) or getattr(src, "num_nextn_predict_layers", None) or 0


def v3_contract(src, family: str, rope_interleaved: bool) -> dict:
    """DeepSeek-V3's contract fields (and DeepSeek-V3.2's, which adds the indexer to them)."""
    refuse_unsupported(src, family)
    refuse({"an MLP bias": bool(getattr(src, "mlp_bias", False))}, family)
    fields = dict(mla_contract(src, rope_interleaved=rope_interleaved), **moe_contract(src, family))
    if fields["mlp_type"] == "moe":
        n_group = src.n_group or 1
        fields.update(router_type="sigmoid_topk", norm_topk_prob=bool(src.norm_topk_prob), n_group=n_group,
                      topk_group=src.topk_group or n_group,
                      # the α of its sequence-wise balance loss: the Hub config.json's `aux_loss_alpha` where the
                      # source config kept it (transformers' class drops it), else the paper's 0.0001
                      router_aux_loss_coef=getattr(src, "aux_loss_alpha", None))
    fields["num_mtp_layers"] = declared_mtp_layers(src)
    return fields


def from_contract(cfg) -> DeepseekV3Config:
    return DeepseekV3Config(**v3_source_fields(cfg), rope_interleave=cfg.rope_interleaved,
                            num_mtp_layers=cfg.num_mtp_layers)


def v3_source_fields(cfg, attention_type: str = "mla", family: str = "DeepSeek-V3") -> dict:
    """The inverse of `v3_contract` (the rotary layout aside)."""
    if cfg.mlp_bias:
        raise ValueError(f"{family} cannot express `mlp_bias=True`.")
    router = {}
    if cfg.mlp_type == "moe":
        router = dict(norm_topk_prob=cfg.norm_topk_prob, n_group=cfg.n_group, topk_group=cfg.topk_group,
                      aux_loss_alpha=cfg.router_aux_loss_coef)
    return dict(mla_source_fields(cfg, attention_type), **router)


def mtp_rules(layer_rules: list[Rule], tied: bool) -> list[Rule]:
    """DeepSeek's MTP module k (`model.layers.{num_hidden_layers + k}`) -> `mtp.layers.{k}`: its block by the
    family's own layer rules, the parts transformers' `MtpLayer` names alike, `shared_head.norm` as `post_norm`,
    and the copies of the embedding and the head checked and dropped, where the files hold them (written on export)."""
    src, dst = MTP_LAYER.rstrip("."), "mtp.layers.{mtp}"
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    return [
        *mtp_block_rules(layer_rules, "model.layers.{layer}.", MTP_LAYER),
        *norm(f"{src}.enorm", f"{dst}.enorm"),
        *norm(f"{src}.hnorm", f"{dst}.hnorm"),
        rule(f"{src}.eh_proj.weight", f"{dst}.eh_proj.weight"),
        *norm(f"{src}.shared_head.norm", f"{dst}.post_norm"),
        rule(f"{src}.embed_tokens.weight", "model.embed_tokens.weight", "duplicate"),
        rule(f"{src}.shared_head.head.weight", head, "duplicate"),
    ]


def rules(src) -> list[Rule]:
    layer_rules = mla_rules(src, correction_bias=True)
    return layer_rules + mtp_rules(layer_rules, bool(getattr(src, "tie_word_embeddings", False)))


FAMILY = Family("deepseek_v3", to_contract, from_contract, rules, config_class=DeepseekV3Config,
                experts=expert_stacks(), mtp_layers=MTP_LAYER,
                description="DeepSeek-V3 / V3.1, Kimi K2: MLA, sigmoid routing in groups with a correction bias, "
                            "MTP layer",
                refusals=("rms_norm_eps other than 1e-6", "pretraining_tp > 1", "moe_layer_freq != 1",
                          "no shared experts", "an MLP bias"))
