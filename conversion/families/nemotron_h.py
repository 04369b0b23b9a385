"""Nemotron-H and Nemotron 3 (NVIDIA, `NemotronHForCausalLM`): every layer is one sublayer after its RMSNorm, a
Mamba-2 mixer, attention without positions, a relu² MLP or a mixture of relu² experts (`layers_block_type`; the
contract's `block_types` with `layer_types` and `mlp_layer_types`). The experts are ungated (`moe_mlp_type="dense"`),
routed by sigmoid scores with a correction bias (DeepSeek-V3's router), optionally in a latent width
(`moe_latent_size`), beside one shared relu² MLP.

Its files keep the names of NVIDIA's release: the `backbone.` prefix (transformers renames it `model.` on load, as
`renames` does here) and one tensor per expert (`mixer.experts.{e}.up_proj`, stacked here as transformers does).
Multi-token-prediction layers (`mtp.*`, which transformers' class does not load) are refused, not dropped.
"""

from __future__ import annotations

from transformers import NemotronHConfig

from ..core import ExpertStack, Family, in_layers, refuse, rule
from .common import linear, norm, sizes, source_sizes
from .mamba2 import mamba_fields, mamba_rules

# Its `layers_block_type` -> (the contract's `block_types`, `layer_types`, `mlp_layer_types`) entries; the entries
# of the sublayer a layer does not have are the unread placeholders the contract asks for
LAYERS = {"linear_attention": ("mixer", "linear_attention", "dense"),
          "full_attention": ("mixer", "full_attention", "dense"),
          "moe": ("mlp", "full_attention", "sparse"),
          "mlp": ("mlp", "full_attention", "dense")}
MAMBA_NAMES = {"mamba_n_heads": "mamba_num_heads", "mamba_d_head": "mamba_head_dim", "mamba_n_groups": "n_groups",
               "mamba_d_state": "ssm_state_size", "mamba_d_conv": "conv_kernel", "mamba_chunk_size": "chunk_size",
               "mamba_conv_bias": "use_conv_bias", "mamba_proj_bias": "use_bias"}
MIXER = "model.layers.{layer}.mixer"


def to_contract(src) -> dict:
    kinds = list(src.layers_block_type)
    refuse({"attention biases (`attention_bias`; transformers' class builds none)": bool(src.attention_bias),
            "sliding-window attention (`sliding_window`; transformers' class attends fully)":
                src.sliding_window is not None},
           "nemotron_h")
    blocks, layer_types, mlp_layer_types = (list(column) for column in zip(*(LAYERS[kind] for kind in kinds)))
    fields = dict(
        sizes(src, num_hidden_layers=len(kinds)), position_embedding_type="none", norm_type="rmsnorm",
        norm_eps=src.layer_norm_epsilon, norm_position="pre", hidden_act=src.mlp_hidden_act, mlp_bias=src.mlp_bias,
        attention_bias=False, block_types=blocks, layer_types=layer_types,
        tie_word_embeddings=False,  # its class never ties the head (`_tied_weights_keys` is empty), whatever it says
        **mamba_fields(src, MAMBA_NAMES, activation="mamba_hidden_act"),
    )
    if "moe" not in kinds:
        return dict(fields, mlp_type="dense")
    return dict(fields, mlp_type="moe", mlp_layer_types=mlp_layer_types, moe_mlp_type="dense",
                num_experts=src.n_routed_experts, num_experts_per_tok=src.num_experts_per_tok,
                moe_intermediate_size=src.moe_intermediate_size, moe_latent_size=src.moe_latent_size,
                n_shared_experts=1, shared_expert_intermediate_size=src.moe_shared_expert_intermediate_size,
                router_type="sigmoid_topk", n_group=src.n_group, topk_group=src.topk_group,
                norm_topk_prob=src.norm_topk_prob, routed_scaling_factor=float(src.routed_scaling_factor),
                # its class adds no router loss to the LM loss
                router_aux_loss_coef=0.0, output_router_logits=bool(getattr(src, "output_router_logits", False)))


def from_contract(cfg) -> NemotronHConfig:
    blocks = cfg.block_types or ["mixer_mlp"] * cfg.num_hidden_layers
    refuse({"a layer of both a token mixer and a feed-forward (`block_types` 'mixer_mlp')": "mixer_mlp" in blocks,
            "positions (`position_embedding_type`)": cfg.position_embedding_type != "none",
            "a `mlp_type` other than 'dense' or 'moe'": cfg.mlp_type not in ("dense", "moe")}, "nemotron_h")
    mlp_kinds = cfg.mlp_layer_types or ["dense"] * cfg.num_hidden_layers
    kinds = [cfg.layer_types[i] if block == "mixer" else ("moe" if mlp_kinds[i] == "sparse" else "mlp")
             for i, block in enumerate(blocks)]
    experts = {}
    if cfg.mlp_type == "moe":
        experts = dict(n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                       moe_intermediate_size=cfg.moe_intermediate_size, moe_latent_size=cfg.moe_latent_size,
                       n_shared_experts=1, moe_shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
                       n_group=cfg.n_group, topk_group=cfg.topk_group, norm_topk_prob=cfg.norm_topk_prob,
                       routed_scaling_factor=cfg.routed_scaling_factor,
                       # (a field of its config from transformers 5.17 on)
                       **({"output_router_logits": True} if cfg.output_router_logits else {}))
    sizes = {k: v for k, v in source_sizes(cfg).items() if k != "num_hidden_layers"}  # its layer list says it
    mamba = {theirs: getattr(cfg, ours) for ours, theirs in MAMBA_NAMES.items()}
    return NemotronHConfig(
        **sizes, **experts, **mamba, layers_block_type=kinds, layer_norm_epsilon=cfg.norm_eps,
        mlp_hidden_act=cfg.hidden_act, mlp_bias=cfg.mlp_bias, mamba_hidden_act=cfg.mamba_hidden_act,
        mamba_proj_bias=cfg.mamba_proj_bias, time_step_limit=tuple(cfg.time_step_limit or (0.0, float("inf"))),
        attention_bias=cfg.attention_bias,
    )


def rules(src) -> list:
    layer, mlp = "model.layers.{layer}", "model.layers.{layer}.mlp"
    out = [rule("model.embeddings.weight", "model.embed_tokens.weight")]
    out += mamba_rules(MIXER)
    attention = []
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        attention += linear(f"{MIXER}.{proj}", f"{layer}.self_attn.{proj}")
    out += in_layers(attention, "attention")
    for mixer in ("attention", "linear_attention"):  # the norm before a mixer
        out += in_layers(norm(f"{layer}.norm", f"{layer}.pre_attn_norm"), mixer)
    dense = [r for proj in ("up_proj", "down_proj") for r in linear(f"{MIXER}.{proj}", f"{mlp}.{proj}")]
    sparse = [rule(f"{MIXER}.gate.weight", f"{mlp}.gate.weight"),
              rule(f"{MIXER}.gate.e_score_correction_bias", f"{mlp}.gate.e_score_correction_bias"),
              rule(f"{MIXER}.experts.up_proj", f"{mlp}.experts.up_proj"),
              rule(f"{MIXER}.experts.down_proj", f"{mlp}.experts.down_proj")]
    sparse += [r for proj in ("up_proj", "down_proj")
               for r in linear(f"{MIXER}.shared_experts.{proj}", f"{mlp}.shared_experts.{proj}")]
    sparse += [r for proj in ("fc1_latent_proj", "fc2_latent_proj") for r in linear(f"{MIXER}.{proj}", f"{mlp}.{proj}")]
    for kind, group in (("dense", dense), ("sparse", sparse)):  # the feed-forward and the norm before it
        out += [rule(r.src, r.dst, r.transform, r.optional, layers=kind)
                for r in group + norm(f"{layer}.norm", f"{layer}.pre_mlp_norm")]
    out += norm("model.norm_f", "model.final_norm")
    return out + [rule("lm_head.weight", "lm_head.weight", optional=True)]


FAMILY = Family(
    "nemotron_h", to_contract, from_contract, rules, "model.", NemotronHConfig, renames={"backbone.": "model."},
    experts=tuple(ExpertStack((f"{MIXER}.experts.{{expert}}.{proj}.weight",), f"{MIXER}.experts.{proj}")
                  for proj in ("up_proj", "down_proj")),
    refused={prefix: "multi-token-prediction layers" for prefix in ("mtp.", "backbone.mtp.", "model.mtp.")},
    description="Nemotron-H, Nemotron 3: one sublayer per layer (Mamba-2, NoPE attention, relu² MLP or latent experts)",
    refusals=("attention biases", "sliding-window attention"),
)
