"""What the Mamba-2 hybrids (Bamba, Granite 4.0-H, Nemotron-H, Falcon-H1) share: their mixer's tensors and the
config fields that size it, under the names each transformers config gives them."""

from __future__ import annotations

import math

from ..core import Rule, in_layers, rule
from .common import linear, norm

# The contract's `Mamba2Fields` -> Bamba's, Granite 4.0-H's and Falcon-H1's names for them (Nemotron-H's differ)
MAMBA_NAMES = {name: name for name in ("mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state",
                                       "mamba_d_conv", "mamba_chunk_size", "mamba_conv_bias", "mamba_proj_bias")}
# The step-size clamp the transformers configs default to: (0, ∞), no clamp (the contract's `None`)
NO_LIMIT = (0.0, math.inf)


def mamba_fields(src, names: dict[str, str] = MAMBA_NAMES, activation: str = "hidden_act") -> dict:
    """The mixer's contract fields, read from `src`'s fields `names` (contract name -> source name) and its
    activation field; `time_step_limit` (0, ∞) is the contract's `None`."""
    fields = {ours: getattr(src, theirs) for ours, theirs in names.items()}
    limit = getattr(src, "time_step_limit", None)
    fields["time_step_limit"] = None if limit is None or tuple(limit) == NO_LIMIT else [float(v) for v in limit]
    return dict(fields, linear_attention_type="mamba2", mamba_hidden_act=getattr(src, activation))


def source_mamba_fields(cfg, names: dict[str, str] = MAMBA_NAMES) -> dict:
    """The inverse of `mamba_fields` (without the activation, which each family places itself), and the
    transformers configs' `mamba_expand` (the inner width over d) where it is a whole number."""
    fields = {theirs: getattr(cfg, ours) for ours, theirs in names.items()}
    fields["time_step_limit"] = tuple(cfg.time_step_limit) if cfg.time_step_limit is not None else NO_LIMIT
    return fields


def mamba_expand(cfg) -> int:
    """transformers' `mamba_expand`: the mixer's inner width H·P over d, which its configs hold as a whole number."""
    inner = cfg.mamba_n_heads * cfg.mamba_d_head
    if inner % cfg.hidden_size:
        raise ValueError(f"A Mamba-2 inner width of {inner} (`mamba_n_heads` x `mamba_d_head`) is not a whole multiple "
                         f"of `hidden_size`={cfg.hidden_size}, which this family's `mamba_expand` must be.")
    return inner // cfg.hidden_size


def mamba_rules(src: str, norm: bool = True, out_bias: bool = True) -> list[Rule]:
    """The mixer at `src` (with `{layer}`) -> the contract's `model.layers.{layer}.linear_attn`, in the layers
    `layer_types` marks `"linear_attention"`. Biases are optional on both sides (the config says which exist)."""
    dst = "model.layers.{layer}.linear_attn"
    rules = linear(f"{src}.in_proj", f"{dst}.in_proj") + linear(f"{src}.conv1d", f"{dst}.conv1d")
    rules += [rule(f"{src}.{name}", f"{dst}.{name}") for name in ("dt_bias", "A_log", "D")]
    rules += [rule(f"{src}.norm.weight", f"{dst}.norm.weight")] if norm else []
    rules += linear(f"{src}.out_proj", f"{dst}.out_proj") if out_bias else [rule(f"{src}.out_proj.weight",
                                                                                 f"{dst}.out_proj.weight")]
    return in_layers(rules, "linear_attention")


def attention_rules(src: str) -> list[Rule]:
    """Llama's q/k/v/o projections at `src` (with `{layer}`) -> `model.layers.{layer}.self_attn`, in the attention
    layers."""
    rules = []
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        rules += linear(f"{src}.{proj}", f"model.layers.{{layer}}.self_attn.{proj}")
    return in_layers(rules, "attention")


def bamba_layout_rules(mamba_norm: bool = True) -> list[Rule]:
    """Bamba's and Falcon-H1's map: `model.layers.{layer}` holding `self_attn` and / or `mamba` after
    `input_layernorm`, a SwiGLU `feed_forward` after `pre_ff_layernorm`, `final_layernorm`; the Mamba-2 mixer's gated
    norm where it has one (`mamba_norm`)."""
    layer = "model.layers.{layer}"
    out = [rule("model.embed_tokens.weight", "model.embed_tokens.weight")]
    out += attention_rules(f"{layer}.self_attn") + mamba_rules(f"{layer}.mamba", norm=mamba_norm)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        out += linear(f"{layer}.feed_forward.{proj}", f"{layer}.mlp.{proj}")
    out += norm(f"{layer}.input_layernorm", f"{layer}.pre_attn_norm") + norm(f"{layer}.pre_ff_layernorm",
                                                                             f"{layer}.pre_mlp_norm")
    out += norm("model.final_layernorm", "model.final_norm")
    return out + [rule("lm_head.weight", "lm_head.weight", optional=True)]
