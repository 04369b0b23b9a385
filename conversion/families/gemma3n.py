"""Gemma 3n (text, `Gemma3nForCausalLM`): Gemma 4's attention (per-head q / k norms, a weightless value norm, scores
unscaled, local / global layers, the last `num_kv_shared_layers` layers reading earlier layers' keys and values) in
sandwich blocks whose attention has a LAUREL branch beside it (`laurel_rank`), around which AltUp keeps
`altup_num_inputs` residual streams (predict / correct each layer, `residual_stream="altup"`); per-layer embeddings
added to the streams after the first; a Gaussian top-k of the gate's output on the layers `activation_sparsity_pattern`
marks; a soft-capped head.
"""

from __future__ import annotations

import math

from transformers import Gemma3nTextConfig

from ..core import Family, rule
from .common import llama_rules, rope, source_rope, source_sizes, sizes
from .gemma2 import SANDWICH_NORMS
from .gemma4 import LAYER, gemma_attention_rules, per_layer_embedding_rules

ALTUP_FIELDS = ("altup_num_inputs", "altup_active_idx", "altup_coef_clip", "altup_correct_scale")


def to_contract(src) -> dict:
    layers = src.num_hidden_layers
    widths = list(src.intermediate_size)[:layers]
    sparsity = list(src.activation_sparsity_pattern)[:layers]
    return dict(
        sizes(src, intermediate_size=widths[0]), **rope(src), norm_type="rmsnorm", norm_eps=src.rms_norm_eps,
        norm_position="sandwich", hidden_act=src.hidden_activation, attention_bias=src.attention_bias,
        attention_output_bias=src.attention_bias, embedding_multiplier=math.sqrt(src.hidden_size), qk_norm="head",
        value_norm=True, query_pre_attn_scalar=1.0, final_logit_softcapping=src.final_logit_softcapping,
        sliding_window=src.sliding_window, layer_types=list(src.layer_types[:layers]),
        num_kv_shared_layers=src.num_kv_shared_layers, hidden_size_per_layer_input=src.hidden_size_per_layer_input,
        vocab_size_per_layer_input=src.vocab_size_per_layer_input, residual_stream="altup",
        **{name: getattr(src, name) for name in ALTUP_FIELDS}, laurel_rank=src.laurel_rank,
        layer_intermediate_sizes=None if len(set(widths)) == 1 else widths,
        activation_sparsity_pattern=sparsity if any(sparsity) else None,
    )


def from_contract(cfg) -> Gemma3nTextConfig:
    layers = cfg.num_hidden_layers
    return Gemma3nTextConfig(
        **dict(source_sizes(cfg), intermediate_size=cfg.layer_intermediate_sizes or [cfg.intermediate_size] * layers),
        rms_norm_eps=cfg.norm_eps, hidden_activation=cfg.hidden_act, attention_bias=cfg.attention_bias,
        final_logit_softcapping=cfg.final_logit_softcapping, sliding_window=cfg.sliding_window,
        layer_types=list(cfg.layer_types), rope_parameters=source_rope(cfg),
        num_kv_shared_layers=cfg.num_kv_shared_layers, hidden_size_per_layer_input=cfg.hidden_size_per_layer_input,
        vocab_size_per_layer_input=cfg.vocab_size_per_layer_input, laurel_rank=cfg.laurel_rank,
        activation_sparsity_pattern=cfg.activation_sparsity_pattern or [0.0] * layers,
        **{name: getattr(cfg, name) for name in ALTUP_FIELDS},
    )


def rules(src) -> list:
    altup = [rule(f"{LAYER}.altup.{name}", f"{LAYER}.altup.{name}")
             for name in ("correct_output_scale", "correction_coefs.weight", "prediction_coefs.weight",
                          "modality_router.weight", "router_norm.weight")]
    laurel = [rule(f"{LAYER}.laurel.{theirs}.weight", f"{LAYER}.laurel.{mine}.weight")
              for theirs, mine in (("linear_left", "linear_left"), ("linear_right", "linear_right"),
                                   ("post_laurel_norm", "post_norm"))]
    streams = [rule(f"model.{theirs}.{j}.weight", f"model.residual_stream.{mine}.{j}.weight")
               for j in range(src.altup_num_inputs - 1)
               for theirs, mine in (("altup_projections", "projections"),
                                    ("altup_unembed_projections", "unembed_projections"))]
    return (llama_rules(SANDWICH_NORMS, attention=gemma_attention_rules()) + altup + laurel + streams
            + per_layer_embedding_rules())


FAMILY = Family("gemma3n_text", to_contract, from_contract, rules, "model.", Gemma3nTextConfig,
                description="Gemma 3n text model: AltUp residual streams, LAUREL, per-layer embeddings, keys and "
                            "values shared across layers, activation sparsity")
