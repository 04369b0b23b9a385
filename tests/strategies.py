"""Hypothesis strategies over the whole `ModularDecoderConfig` space, valid and broken.

`config_kwargs()` draws the keyword arguments of a valid config: every value of every registry axis
(`modular_decoder/registries.py`), MHA / GQA / MQA, explicit head widths, partial rotary widths,
every rope type with the keys it needs (flat or nested per layer type), NoPE layers, sliding windows and
local/global mixes, QK-norm, soft-caps, attention sinks, the score scale, the embedding ends, biases, learned
offsets, MLA's widths and multi-token-prediction modules. Sizes stay tiny (hidden <= 48, 1-3 layers, vocabulary
<= 64) so a model builds and runs in milliseconds.

`broken_config_kwargs()` takes such a draw and breaks exactly one field; it returns the broken
kwargs and the name the `ValueError` must carry.

Kwargs are plain dicts (the config mutates the rope dicts it is given: build it from a deep copy,
`make_config`).
"""

from __future__ import annotations

import copy
import math

from hypothesis import strategies as st
from transformers.activations import ACT2FN

from modular_decoder import ModularDecoderConfig
from modular_decoder.attention import QK_NORMS
from modular_decoder.blocks import NORM_POSITIONS, PARALLEL_NORMS
from modular_decoder.norms import NORMS
from modular_decoder.positions import ROPE_TYPES
from modular_decoder.registries import ATTENTIONS, LINEAR_ATTENTIONS, MLPS, POSITIONS

# The longest sequence (padding included) any property feeds a drawn model: every drawn
# `max_position_embeddings` (learned tables, dynamic RoPE's rescaling point) and every longrope
# `original_max_position_embeddings` (its short/long switch) is at least this, because a cache cannot
# follow tables that change with the length of the call (transformers' own models neither).
MAX_SEQ = 10
MAX_HIDDEN = 48
MAX_VOCAB = 64
LAYER_TYPES = ("full_attention", "sliding_attention")  # the attending layers (a rope table each)
LINEAR = "linear_attention"

# What the strategy knows how to draw for each registry; `test_strategies_cover_every_registry_entry`
# fails when an entry is added to a registry and not here.
ATTENTION_TYPES = ("standard", "mla", "dsa", "shared_kv")
MLP_TYPES = ("dense", "gated", "moe")
LINEAR_ATTENTION_TYPES = ("gated_deltanet", "mamba2", "kda", "short_conv")
LINEAR_FIELDS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                 "linear_conv_kernel_dim")
POSITION_TYPES = ("learned", "sinusoidal", "rope", "alibi", "none")
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
INDEX_FIELDS = ("index_n_heads", "index_head_dim", "index_topk")  # DSA's lightning indexer
LATENT_TYPES = ("mla", "dsa")
COMPRESSED = ("compressed_sparse_attention", "heavily_compressed_attention")  # shared_kv's CSA / HCA layers
REGISTRIES = {"attention_type": (ATTENTIONS, ATTENTION_TYPES), "mlp_type": (MLPS, MLP_TYPES),
              "position_embedding_type": (POSITIONS, POSITION_TYPES), "norm_type": (NORMS, tuple(NORMS)),
              "linear_attention_type": (LINEAR_ATTENTIONS, LINEAR_ATTENTION_TYPES)}

_THETAS = st.sampled_from([10.0, 100.0, 10_000.0, 500_000.0]) | st.floats(2.0, 1e6)
_FACTORS = st.floats(1.0, 16.0)


def make_config(kwargs: dict) -> ModularDecoderConfig:
    return ModularDecoderConfig(**copy.deepcopy(kwargs))


# ---------------------------------------------------------------------------------------------
# valid configs


@st.composite
def rope_dict(draw, rotary: int, max_positions: int, rope_types=ROPE_TYPES) -> dict:
    """One rope dict of a type in `rope_types` with the keys that type needs (and some optional ones)."""
    types = [t for t in rope_types if not (t == "dynamic" and rotary <= 2)]  # dynamic divides by width - 2
    rope_type = draw(st.sampled_from(types))
    params = {"rope_type": rope_type, "rope_theta": draw(_THETAS)}
    if rope_type in ("linear", "dynamic"):
        params["factor"] = draw(_FACTORS)
    elif rope_type == "yarn":
        params["factor"] = draw(_FACTORS)
        params["original_max_position_embeddings"] = draw(st.integers(2, max_positions))
        for key, values in (("beta_fast", st.floats(8.0, 64.0)), ("beta_slow", st.floats(0.5, 2.0)),
                            ("mscale", st.floats(0.5, 1.5)), ("mscale_all_dim", st.floats(0.0, 1.5)),
                            ("attention_factor", st.floats(0.5, 2.0)), ("truncate", st.booleans())):
            if draw(st.booleans()):
                params[key] = draw(values)
    elif rope_type == "llama3":
        low = draw(st.floats(0.5, 2.0))
        params.update(factor=draw(_FACTORS), low_freq_factor=low, high_freq_factor=low + draw(st.floats(0.5, 4.0)),
                      original_max_position_embeddings=draw(st.integers(2, max_positions)))
    elif rope_type == "longrope":
        pairs = rotary // 2
        params["short_factor"] = draw(st.lists(st.floats(0.5, 4.0), min_size=pairs, max_size=pairs))
        params["long_factor"] = draw(st.lists(st.floats(0.5, 8.0), min_size=pairs, max_size=pairs))
        params["original_max_position_embeddings"] = draw(st.integers(MAX_SEQ, max_positions))
        if draw(st.booleans()):
            params["factor"] = draw(_FACTORS)
        if draw(st.booleans()):
            params["attention_factor"] = draw(st.floats(0.5, 2.0))
    elif rope_type == "proportional" and draw(st.booleans()):
        params["factor"] = draw(_FACTORS)
    return params


@st.composite
def _heads(draw, attention_type: str) -> dict:
    """Heads, K/V heads, hidden size and head width: MHA / GQA / MQA, derived or explicit d_h."""
    heads = draw(st.integers(1, 4))
    out = {"num_attention_heads": heads}
    if attention_type == "standard":
        divisors = [k for k in range(1, heads + 1) if heads % k == 0]
        kv = draw(st.sampled_from(divisors + [None]))  # None: MHA by default
        if kv is not None:
            out["num_key_value_heads"] = kv
    elif attention_type == "shared_kv":  # DeepSeek-V4: one key = value head
        out["num_key_value_heads"] = 1
    if draw(st.booleans()):  # d_h derived from the hidden size
        out["hidden_size"] = heads * draw(st.integers(1, MAX_HIDDEN // heads))
    else:
        out["hidden_size"] = draw(st.integers(2, MAX_HIDDEN))
        out["head_dim"] = draw(st.integers(1, 16))
    return out


def _head_dim(kwargs: dict) -> int:
    return kwargs.get("head_dim") or kwargs["hidden_size"] // kwargs["num_attention_heads"]


@st.composite
def config_kwargs(draw) -> dict:
    """Keyword arguments of a valid `ModularDecoderConfig`, anywhere in the design space."""
    attention_type = draw(st.sampled_from(ATTENTION_TYPES))
    kw: dict = {"attention_type": attention_type} if attention_type != "standard" or draw(st.booleans()) else {}
    kw.update(draw(_heads(attention_type)))
    vocab = draw(st.integers(16, MAX_VOCAB))
    layers = draw(st.integers(1, 3))
    max_positions = draw(st.integers(MAX_SEQ, 64))
    kw.update(vocab_size=vocab, num_hidden_layers=layers, max_position_embeddings=max_positions)
    if draw(st.booleans()):
        kw["intermediate_size"] = draw(st.integers(1, 64))

    # norms and block
    kw["norm_type"] = draw(st.sampled_from(sorted(NORMS)))
    kw["norm_eps"] = draw(st.sampled_from([1e-6, 1e-5]) | st.floats(1e-8, 1e-2))
    kw["norm_bias"] = draw(st.booleans())
    kw["norm_unit_offset"] = draw(st.booleans())
    placement = draw(st.sampled_from([*NORM_POSITIONS, "parallel"]))  # each block kind equally often
    if placement == "parallel":
        kw["parallel_block"] = True
        kw["norm_position"] = "pre"
        kw["parallel_norms"] = draw(st.sampled_from(PARALLEL_NORMS))
    else:
        kw["norm_position"] = placement
    kw["final_norm"] = draw(st.sampled_from([None, True, False]))

    # feed-forward
    kw["mlp_type"] = draw(st.sampled_from(MLP_TYPES))
    kw["hidden_act"] = draw(st.sampled_from(sorted(ACT2FN)))
    if kw["mlp_type"] == "moe":
        kw.update(draw(moe_fields(layers)))
        if "swiglu_limit" in kw:  # gpt-oss's clamped SwiGLU replaces the activation
            kw["hidden_act"] = "silu"
    else:
        kw["mlp_bias"] = draw(st.booleans())

    # windows: none, all sliding, or a per-layer mix (a window with only full layers is allowed too); DSA chooses
    # its keys from the whole context (no sliding layers)
    window = draw(st.none() | st.integers(2, MAX_SEQ)) if attention_type != "dsa" else None
    if window is not None:
        kw["sliding_window"] = window
        if draw(st.integers(0, 2)):  # mostly an explicit per-layer list (local/global mixes)
            kw["layer_types"] = draw(st.lists(st.sampled_from(LAYER_TYPES), min_size=layers, max_size=layers))
    elif draw(st.integers(0, 3)) == 0 and attention_type in ("standard", "mla"):  # Llama 4's chunks (not beside
        # sliding layers)
        kw["attention_chunk_size"] = draw(st.integers(2, MAX_SEQ))
        kw["layer_types"] = draw(st.lists(st.sampled_from(["chunked_attention", "full_attention"]), min_size=layers,
                                          max_size=layers))
        kw["layer_types"][draw(st.integers(0, layers - 1))] = "chunked_attention"
    elif draw(st.booleans()):
        kw["layer_types"] = ["full_attention"] * layers
    layer_types = kw.get("layer_types") or ["sliding_attention" if window else "full_attention"] * layers
    if attention_type == "shared_kv" and window is not None and draw(st.booleans()):  # DeepSeek-V4's CSA / HCA
        compressed = draw(st.lists(st.sampled_from((None, *COMPRESSED)), min_size=layers, max_size=layers))
        layer_types = kw["layer_types"] = [c or t for c, t in zip(compressed, layer_types)]
        kw["compress_rates"] = {t: draw(st.integers(1, 4)) for t in COMPRESSED if t in layer_types}
    # a hybrid: some layers (all, without MLA / DSA, whose rotary key needs an attention layer) linear attention
    if draw(st.integers(0, 2)) == 0 and (attention_type not in LATENT_TYPES or layers > 1):
        linear = draw(st.lists(st.booleans(), min_size=layers, max_size=layers))
        linear[draw(st.integers(0, layers - 1))] = True
        if attention_type in LATENT_TYPES and all(linear):
            linear[linear.index(True)] = False
        layer_types = kw["layer_types"] = [LINEAR if lin else t for lin, t in zip(linear, layer_types)]
        kw["linear_attention_type"] = draw(st.sampled_from(LINEAR_ATTENTION_TYPES))
        kw.update(draw(LINEAR_KIND_FIELDS[kw["linear_attention_type"]]()))
    if "chunked_attention" not in layer_types:  # every chunked layer made linear: no chunk size to set
        kw.pop("attention_chunk_size", None)
    attending = sorted(set(layer_types) - {LINEAR})

    # attention kind
    if attention_type in LATENT_TYPES:
        kw.update(kv_lora_rank=draw(st.integers(1, 16)), qk_nope_head_dim=draw(st.integers(1, 8)),
                  qk_rope_head_dim=2 * draw(st.integers(1, 4)), v_head_dim=draw(st.integers(1, 8)))
        q_lora_rank = draw(st.none() | st.integers(1, 16)) if attention_type == "mla" else draw(st.integers(1, 16))
        if q_lora_rank is not None or draw(st.booleans()):
            kw["q_lora_rank"] = q_lora_rank
        if attention_type == "dsa":  # the indexer: from one head keeping one key to more keys than any input has
            kw.update(index_n_heads=draw(st.integers(1, 4)),
                      index_head_dim=kw["qk_rope_head_dim"] + draw(st.integers(0, 6)),
                      index_topk=draw(st.integers(1, MAX_SEQ + 1)))
        if draw(st.booleans()):
            kw["kv_latent_norm"] = False  # the linear latent of a converted standard attention
        position = "rope"
        rope_width, rotary = kw["qk_rope_head_dim"], kw["qk_rope_head_dim"]
    elif attention_type == "shared_kv":  # a query latent, a grouped output projection (each optional); no ALiBi
        sparse = COMPRESSED[0] in layer_types
        q_lora_rank = draw(st.integers(1, 16)) if sparse else draw(st.none() | st.integers(1, 16))
        if q_lora_rank is not None:
            kw["q_lora_rank"] = q_lora_rank
        if draw(st.booleans()):
            heads = kw["num_attention_heads"]
            kw.update(o_groups=draw(st.sampled_from([g for g in range(1, heads + 1) if heads % g == 0])),
                      o_lora_rank=draw(st.integers(1, 16)))
        position = draw(st.sampled_from([p for p in POSITION_TYPES if p != "alibi"] if attending
                                        else ("learned", "sinusoidal", "none")))
        rope_width = _head_dim(kw)
        rotary = None
    else:
        kw["qk_norm"] = draw(st.sampled_from(QK_NORMS))
        if draw(st.booleans()):
            kw["attn_output_gate"] = draw(st.booleans())
        # rotary or ALiBi positions act on attention scores: with linear layers only, none is read
        position = draw(st.sampled_from(POSITION_TYPES if attending else ("learned", "sinusoidal", "none")))
        rope_width = _head_dim(kw)
        rotary = None
    kw["position_embedding_type"] = position
    if kw.get("qk_norm") == "weightless" and position != "rope":  # (Llama 4's norm of the rotated heads)
        kw["qk_norm"] = "none"

    # positions
    if position == "learned" and draw(st.booleans()):
        kw["learned_position_offset"] = draw(st.integers(0, 3))
    if position == "rope":
        if rotary is None:  # standard attention: an even rotated width of the head, via the factor
            if rope_width < 2:
                kw["head_dim"] = rope_width = 2 * draw(st.integers(1, 8))
            rotary = 2 * draw(st.integers(1, rope_width // 2))
            factor = rotary / rope_width
            if int(rope_width * factor) != rotary:  # a width the float cannot name exactly: rotate it all
                if rope_width % 2:
                    kw["head_dim"] = rope_width = rope_width + 1
                factor, rotary = 1.0, rope_width
            if factor != 1.0 or draw(st.booleans()):
                kw["partial_rotary_factor"] = factor
        kw["rope_interleaved"] = draw(st.booleans())
        if attention_type == "standard" and draw(st.booleans()):  # SmolLM3's NoPE layers: at least one rotates
            flags = draw(st.lists(st.sampled_from([0, 1]), min_size=layers, max_size=layers))
            flags[draw(st.sampled_from([i for i, t in enumerate(layer_types) if t != LINEAR]))] = 1
            kw["no_rope_layers"] = flags
        if attention_type == "standard" and draw(st.booleans()):  # the query temperature (Llama 4: NoPE layers, p + 1)
            nope = not all(kw.get("no_rope_layers") or [1])
            kw.update(attn_temperature_tuning=True, floor_scale=draw(st.integers(1, 8)),
                      attn_scale=draw(st.floats(0.0, 1.0)), attn_temperature_offset=draw(st.integers(0, 1)),
                      attn_temperature_layers=draw(st.sampled_from(["all", "nope"] if nope else ["all"])))
        if draw(st.booleans()):  # nested per layer type, each with its own type and base
            kw["rope_parameters"] = {t: draw(rope_dict(rotary, max_positions)) for t in attending}
            if draw(st.booleans()):  # a table for a layer type no layer uses is allowed too
                kw["rope_parameters"].update({t: draw(rope_dict(rotary, max_positions)) for t in LAYER_TYPES})
        elif draw(st.booleans()):
            kw["rope_parameters"] = draw(rope_dict(rotary, max_positions))
        # else: no dict, the default rope with the default base

    # attention details
    if attention_type != "shared_kv":  # (no biases and no cap on shared key = value attention)
        kw["attention_bias"] = draw(st.booleans())
        kw["attention_output_bias"] = draw(st.sampled_from([None, True, False]))
        kw["attn_logit_softcapping"] = draw(st.none() | st.floats(1.0, 50.0))
    elif COMPRESSED[0] in layer_types:  # CSA's indexer, wide enough for the rotated features it rotates
        kw.update(index_n_heads=draw(st.integers(1, 4)), index_topk=draw(st.integers(1, MAX_SEQ + 1)),
                  index_head_dim=(rotary if position == "rope" else 1) + draw(st.integers(0, 6)))
    kw["attention_sinks"] = draw(st.booleans())
    kw["final_logit_softcapping"] = draw(st.none() | st.floats(1.0, 50.0))
    kw["query_pre_attn_scalar"] = draw(st.none() | st.floats(1.0, 64.0))
    kw["attention_dropout"] = draw(st.sampled_from([0.0, 0.1]))  # eval mode: no effect on the properties
    kw["hidden_dropout"] = draw(st.sampled_from([0.0, 0.1]))

    # ends
    kw["tie_word_embeddings"] = draw(st.booleans())
    kw["embedding_multiplier"] = draw(st.sampled_from([1.0]) | st.floats(0.25, 8.0))
    kw["embedding_norm"] = draw(st.booleans())
    kw["lm_head_bias"] = draw(st.booleans())
    kw["initializer_range"] = draw(st.floats(0.0, 0.1))
    kw["pad_token_id"] = draw(st.none() | st.integers(0, vocab - 1))
    kw["bos_token_id"] = draw(st.none() | st.integers(0, vocab - 1))
    kw["eos_token_id"] = draw(st.none() | st.integers(0, vocab - 1)
                              | st.lists(st.integers(0, vocab - 1), min_size=1, max_size=2))

    # Gemma 3n / Gemma 4: per-layer embeddings, a scalar per layer; with standard attention, normed values, the last
    # layers reading earlier layers' keys and values, the full layers' values from their keys and their own K/V heads
    topology = {}
    if draw(st.integers(0, 3)) == 0:
        topology["hidden_size_per_layer_input"] = draw(st.integers(1, 8))
    if draw(st.integers(0, 3)) == 0:
        topology["layer_scalar"] = True
    if draw(st.integers(0, 3)) == 0:  # AltUp's streams
        topology.update(residual_stream="altup", altup_num_inputs=draw(st.integers(2, 4)))
        topology["altup_active_idx"] = draw(st.integers(0, topology["altup_num_inputs"] - 1))
        topology["altup_correct_scale"] = draw(st.booleans())
    if kw["norm_position"] in ("pre", "sandwich") and not kw.get("parallel_block") and draw(st.integers(0, 3)) == 0:
        topology["laurel_rank"] = draw(st.integers(1, 8))
    if attention_type == "standard":
        topology["value_norm"] = draw(st.booleans())
        if "full_attention" in layer_types and draw(st.integers(0, 2)) == 0:
            topology["attention_k_eq_v"] = True
            heads = [h for h in range(1, kw["num_attention_heads"] + 1) if kw["num_attention_heads"] % h == 0]
            topology["num_global_key_value_heads"] = draw(st.sampled_from(heads))
        shareable = [n for n in range(1, layers) if LINEAR not in layer_types[layers - n:]
                     and set(layer_types[layers - n:]) <= set(layer_types[:layers - n])]
        if shareable and draw(st.integers(0, 2)) == 0:
            topology["num_kv_shared_layers"] = draw(st.sampled_from(shareable))
    kw.update(topology)

    # multi-token prediction (the modules are built from the last layer's kinds; none beside per-layer embeddings or
    # shared keys and values)
    kw["num_mtp_layers"] = 0 if {"hidden_size_per_layer_input", "num_kv_shared_layers", "residual_stream"} & set(
        topology) else draw(
        st.sampled_from([0, 0, 1, 2]))
    if kw["num_mtp_layers"] and draw(st.booleans()):
        kw["mtp_loss_scaling_factor"] = draw(st.floats(0.0, 1.0))
    if kw["num_mtp_layers"] and draw(st.booleans()):
        kw["mtp_draft_tokens"] = draw(st.integers(1, 3))
    return kw


@st.composite
def moe_fields(draw, layers: int) -> dict:
    """The mixture-of-experts fields: experts, routing (softmax, gpt-oss's softmax over the kept logits,
    DeepSeek-V3's sigmoid with groups or Llama 4's sigmoid of the kept logits, weighing outputs or inputs; a router
    bias), shared experts (optionally Qwen2-MoE's gate), gpt-oss's
    expert biases and clamped SwiGLU, and which layers are sparse."""
    experts = draw(st.sampled_from([2, 4, 6, 8]))
    kw = dict(num_experts=experts, num_experts_per_tok=draw(st.integers(1, min(3, experts))),
              moe_intermediate_size=draw(st.integers(1, 16)), norm_topk_prob=draw(st.booleans()))
    kinds = draw(st.lists(st.sampled_from(["sparse", "dense"]), min_size=layers, max_size=layers))
    kinds[draw(st.integers(0, layers - 1))] = "sparse"  # an MoE model has at least one sparse layer
    kw["mlp_layer_types"] = kinds
    if draw(st.booleans()):
        kw["n_shared_experts"] = draw(st.integers(1, 2))
        kw["shared_expert_gate"] = draw(st.booleans())
    kw["mlp_bias"] = draw(st.booleans())  # experts with biases (gpt-oss)
    kw["router_bias"] = draw(st.booleans())
    if draw(st.booleans()):  # gpt-oss's clamped SwiGLU (a low limit, so that it clamps), its gain or the default
        kw["swiglu_limit"] = draw(st.floats(0.1, 8.0))
        if draw(st.booleans()):
            kw["swiglu_alpha"] = draw(st.floats(0.5, 2.0))
    router = draw(st.integers(0, 3))
    kw["apply_router_weight_on_input"] = draw(st.booleans())  # Llama 4: the weight scales the expert's input
    if router == 3:  # Llama 4: a sigmoid of each kept logit (no groups)
        kw["router_type"] = "topk_sigmoid"
    elif router == 1:  # gpt-oss: softmax over the kept logits (no groups, always normalised)
        kw.update(router_type="topk_softmax", norm_topk_prob=True)
    elif router == 2:  # sigmoid scores, a correction bias, group-limited top-k, a routed scale
        groups = draw(st.sampled_from([g for g in (1, 2) if experts % g == 0 and experts // g >= 2]))
        kw.update(router_type="sigmoid_topk", n_group=groups, topk_group=draw(st.integers(1, groups)),
                  routed_scaling_factor=draw(st.floats(0.5, 3.0)))
        kw["num_experts_per_tok"] = min(kw["num_experts_per_tok"], kw["topk_group"] * experts // groups)
    return kw


@st.composite
def linear_fields(draw, one_value_head_per_key_head: bool = False) -> dict:
    """The delta-rule layers' sizes (each unset one takes its default from the attention's) and options (OLMo
    hybrid's negative eigenvalues); KDA has one value head per key head."""
    kw = {}
    key_heads = draw(st.integers(1, 2))
    if draw(st.booleans()):
        kw["linear_num_key_heads"] = key_heads
        kw["linear_num_value_heads"] = key_heads * (1 if one_value_head_per_key_head else draw(st.integers(1, 2)))
    elif one_value_head_per_key_head:  # the defaults (from the attention's heads) may differ
        kw["linear_num_key_heads"] = kw["linear_num_value_heads"] = key_heads
    for name, values in (("linear_key_head_dim", st.integers(1, 8)), ("linear_value_head_dim", st.integers(1, 8)),
                         ("linear_conv_kernel_dim", st.integers(1, 4)), ("linear_allow_neg_eigval", st.booleans())):
        if draw(st.booleans()):
            kw[name] = draw(values)
    return kw


@st.composite
def short_conv_fields(draw) -> dict:
    """LFM2's gated short convolution: its window and biases."""
    return dict(linear_conv_kernel_dim=draw(st.integers(1, 4)), conv_bias=draw(st.booleans()))


@st.composite
def mamba2_fields(draw) -> dict:
    """The Mamba-2 layers' sizes, chunked scan (chunks shorter than a sequence), norm, gate and step clamp."""
    groups = draw(st.integers(1, 2))
    kw = dict(mamba_n_groups=groups, mamba_n_heads=groups * draw(st.integers(1, 2)),
              mamba_d_head=draw(st.integers(1, 6)), mamba_d_state=draw(st.integers(1, 6)), mamba_d_conv=draw(st.integers(1, 4)),
              mamba_chunk_size=draw(st.integers(1, MAX_SEQ)), mamba_conv_bias=draw(st.booleans()),
              mamba_proj_bias=draw(st.booleans()), mamba_rms_norm=draw(st.booleans()))
    kw["mamba_norm_before_gate"] = kw["mamba_rms_norm"] and draw(st.booleans())
    if draw(st.booleans()):
        low = draw(st.floats(0.0, 0.5))
        kw["time_step_limit"] = [low, low + draw(st.floats(0.1, 10.0))]
    return kw


# The fields each linear-attention kind draws
LINEAR_KIND_FIELDS = {"gated_deltanet": linear_fields, "kda": lambda: linear_fields(one_value_head_per_key_head=True),
                      "short_conv": short_conv_fields, "mamba2": mamba2_fields}


def configs() -> st.SearchStrategy[ModularDecoderConfig]:
    return config_kwargs().map(make_config)


# ---------------------------------------------------------------------------------------------
# broken configs: one field made invalid


_NOT_FINITE = [math.nan, math.inf, -math.inf]
_NOT_INT = ["8", 2.0, 2.5, True, [2]]
_NOT_BOOL = ["no", "true", 1, 0, 1.0, None]
_NOT_CHOICE = ["bogus", "", 3, None, True]

SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "max_position_embeddings")
BOOL_FIELDS = ("norm_bias", "norm_unit_offset", "parallel_block", "mlp_bias", "attention_bias", "attn_output_gate",
               "tie_word_embeddings", "embedding_norm", "lm_head_bias", "use_cache", "attention_sinks")
OPTIONAL_BOOL_FIELDS = ("final_norm", "attention_output_bias")
# name -> (values out of range, whether None is allowed)
NUMBER_FIELDS = {
    "norm_eps": ([0.0, -1e-5], False),
    "attn_logit_softcapping": ([0.0, -5.0], True),
    "final_logit_softcapping": ([0.0, -5.0], True),
    "query_pre_attn_scalar": ([0.0, -1.0], True),
    "attention_dropout": ([1.0, 1.5, -0.1], False),
    "hidden_dropout": ([1.0, 1.5, -0.1], False),
    "embedding_multiplier": ([0.0, -2.0], False),
    "initializer_range": ([-0.02], False),
}
CHOICE_FIELDS = ("attention_type", "mlp_type", "position_embedding_type", "norm_type", "norm_position",
                 "parallel_norms", "hidden_act")


def _bad_number(out_of_range, optional: bool):
    bad = _NOT_FINITE + out_of_range + ["0.5", True, [0.5]]
    return st.sampled_from(bad if optional else bad + [None])


@st.composite
def _break_rope(draw, kw: dict) -> tuple[dict, str]:
    """A rope dict missing a key its type needs, of an unknown type, with a bad value, or not a dict."""
    params = kw.get("rope_parameters")
    nested = isinstance(params, dict) and set(params) <= {*LAYER_TYPES, "chunked_attention", *COMPRESSED} and params
    if nested:  # any table, also one for a layer type no layer has
        key = draw(st.sampled_from(sorted(params)))
        target = params[key]
    else:
        key, target = None, params if isinstance(params, dict) else {"rope_type": "default", "rope_theta": 10000.0}
    needs = {"linear": ["factor"], "dynamic": ["factor"], "yarn": ["factor"],
             "llama3": ["factor", "low_freq_factor", "high_freq_factor"], "longrope": ["short_factor", "long_factor"]}
    choices = ["type", "theta", "value", "not_dict"]
    if needs.get(target.get("rope_type")):
        choices.append("missing")
    if target.get("rope_type") == "longrope":
        choices.append("length")
    how = draw(st.sampled_from(choices))
    target = dict(target)
    if how == "missing":
        del target[draw(st.sampled_from(needs[target["rope_type"]]))]
    elif how == "type":
        target["rope_type"] = draw(st.sampled_from(["bogus", "", "ntk", 3, None]))
    elif how == "theta":
        target["rope_theta"] = draw(st.sampled_from(_NOT_FINITE + [0.0, -10_000.0, "abc", None, True]))
    elif how == "value":
        numeric = [k for k, v in target.items() if k not in ("rope_type", "rope_theta", "truncate")
                   and isinstance(v, (int, float))]
        if not numeric:
            target["rope_theta"] = math.nan
        else:
            target[draw(st.sampled_from(numeric))] = draw(st.sampled_from(_NOT_FINITE + ["2.0"]))
    elif how == "length":
        name = draw(st.sampled_from(["short_factor", "long_factor"]))
        target[name] = target[name] + [1.0]
    else:
        target = draw(st.sampled_from(["default", [1.0], 10000.0]))
    broken = dict(kw)
    broken["rope_parameters"] = {**params, key: target} if nested else target
    return broken, "rope_parameters"


@st.composite
def broken_config_kwargs(draw) -> tuple[dict, str]:
    """(kwargs with exactly one field made invalid, the field name the `ValueError` must carry)."""
    kw = draw(config_kwargs())
    kinds = ["size", "bool", "optional_bool", "number", "choice", "window", "pad", "token_ids", "layer_types",
             "heads", "other_kind", "offset", "integer_type", "mtp"]
    if kw.get("position_embedding_type") == "rope":
        kinds += ["rope", "rope", "rotary_factor", "interleaved", "no_rope_layers"]
    else:
        kinds += ["rope_only"]
    if kw.get("attention_type") in LATENT_TYPES:
        kinds += ["mla_field", "mla_position"]
    if kw.get("attention_type") == "dsa":
        kinds += ["dsa_field", "dsa_field", "dsa_window"]
    if kw.get("norm_position", "pre") != "pre":
        kinds += ["parallel"]
    kinds += ["linear_field"]
    kind = draw(st.sampled_from(kinds))
    broken = dict(kw)
    if kind == "size":
        field = draw(st.sampled_from(SIZE_FIELDS))
        broken[field] = draw(st.sampled_from(_NOT_INT + [0, -1, -8, math.nan]))
    elif kind == "bool":
        field = draw(st.sampled_from(BOOL_FIELDS))
        broken[field] = draw(st.sampled_from(_NOT_BOOL))
    elif kind == "optional_bool":
        field = draw(st.sampled_from(OPTIONAL_BOOL_FIELDS))
        broken[field] = draw(st.sampled_from([v for v in _NOT_BOOL if v is not None]))
    elif kind == "number":
        field = draw(st.sampled_from(sorted(NUMBER_FIELDS)))
        broken[field] = draw(_bad_number(*NUMBER_FIELDS[field]))
    elif kind == "choice":
        field = draw(st.sampled_from(CHOICE_FIELDS))
        broken[field] = draw(st.sampled_from(_NOT_CHOICE))
    elif kind == "window":
        field = "sliding_window"
        broken[field] = draw(st.sampled_from([1, 0, -3, 2.5, "4", True, math.inf]))
    elif kind == "pad":
        field = "pad_token_id"
        broken[field] = draw(st.sampled_from([kw["vocab_size"], kw["vocab_size"] + 5, -1, "0", 1.5, True]))
    elif kind == "token_ids":
        field = draw(st.sampled_from(["bos_token_id", "eos_token_id"]))
        broken[field] = draw(st.sampled_from([-1, "1", 1.5, True, [1, -1], [1, "2"]]))
    elif kind == "layer_types":
        field = "layer_types"
        layers = kw["num_hidden_layers"]
        broken[field] = draw(st.sampled_from([
            ["full_attention"] * (layers + 1),  # one entry too many
            ["full_attention"] * (layers - 1),  # one too few
            ["global"] + ["full_attention"] * (layers - 1),  # an unknown kind
            [3] + ["full_attention"] * (layers - 1),  # not a string
            "full_attention",  # not a list
        ]))
        if kw.get("sliding_window") is None and draw(st.booleans()):  # sliding layers with no window
            broken[field] = ["sliding_attention"] * layers
    elif kind == "heads":
        heads = kw["num_attention_heads"]
        non_divisors = [k for k in range(2, 9) if heads % k]
        field = "num_key_value_heads"
        broken[field] = draw(st.sampled_from(non_divisors))
    elif kind == "other_kind":  # a field that only another attention kind reads
        attention_type = kw.get("attention_type", "standard")
        field = draw(st.sampled_from({"mla": ("qk_norm", "attn_output_gate") + INDEX_FIELDS,
                                      "dsa": ("qk_norm", "attn_output_gate")}.get(
            attention_type, MLA_FIELDS + INDEX_FIELDS)))
        broken[field] = draw(st.sampled_from(["head", "full"] if field == "qk_norm" else
                                             [True] if field == "attn_output_gate" else [8, 1, 0, -1]))
    elif kind == "integer_type":  # any integer field, read by this config's kinds or not
        field = draw(st.sampled_from(ModularDecoderConfig.integer_fields()))
        broken[field] = draw(st.sampled_from(["16", 4.5, 16.0, True]))
    elif kind == "offset":
        field = "learned_position_offset"
        if kw.get("position_embedding_type") == "learned":
            broken[field] = draw(st.sampled_from([-1, 2.5, "2", True, None]))
        else:  # only learned positions read it
            broken[field] = draw(st.sampled_from([1, 2, -1]))
    elif kind == "rope":
        return draw(_break_rope(kw))
    elif kind == "rotary_factor":
        field = "partial_rotary_factor"
        broken[field] = draw(st.sampled_from(_NOT_FINITE + [0.0, -0.5, 1.5, "0.5", True, None]))
    elif kind == "interleaved":
        field = "rope_interleaved"
        broken[field] = draw(st.sampled_from(_NOT_BOOL))
    elif kind == "no_rope_layers":
        field = "no_rope_layers"
        layers = kw["num_hidden_layers"]
        broken[field] = draw(st.sampled_from([
            [1] * (layers + 1), [1] * (layers - 1), [2] + [1] * (layers - 1), [True] + [1] * (layers - 1),
            ["1"] + [1] * (layers - 1), [0] * layers, 1,
        ]))
        if kw.get("attention_type") == "mla" and layers > 1 and draw(st.booleans()):
            broken[field] = [0] + [1] * (layers - 1)  # MLA has no NoPE layers
    elif kind == "rope_only":  # rope fields under another position type
        field = draw(st.sampled_from(["partial_rotary_factor", "rope_interleaved", "no_rope_layers"]))
        broken[field] = {"partial_rotary_factor": 0.5, "rope_interleaved": True}.get(field, [1] * kw["num_hidden_layers"])
    elif kind == "mla_field":
        field = draw(st.sampled_from(MLA_FIELDS))
        bad = [0, -1, "8", 2.5, True]
        if field != "q_lora_rank" or kw["attention_type"] == "dsa":  # DSA's indexer reads the query latent
            bad.append(None)
        if field == "qk_rope_head_dim":
            bad += [1, 3, 5]
        broken[field] = draw(st.sampled_from(bad))
    elif kind == "mla_position":
        field = "position_embedding_type"
        # (MLA without positions is Kimi Linear's NoPE latent attention; DSA's indexer rotates)
        broken[field] = draw(st.sampled_from(["learned", "sinusoidal", "alibi"]
                                             + (["none"] if kw["attention_type"] == "dsa" else [])))
        broken.pop("rope_parameters", None)
        broken.pop("rope_interleaved", None)
        broken.pop("partial_rotary_factor", None)
    elif kind == "dsa_field":
        field = draw(st.sampled_from(INDEX_FIELDS))
        bad = [0, -1, "8", 2.5, True, None]
        if field == "index_head_dim" and kw["qk_rope_head_dim"] > 1:
            bad.append(kw["qk_rope_head_dim"] - 1)  # narrower than the rotary features it rotates
        broken[field] = draw(st.sampled_from(bad))
    elif kind == "dsa_window":
        field = "sliding_window"
        broken.update(sliding_window=draw(st.integers(2, MAX_SEQ)),
                      layer_types=draw(st.lists(st.sampled_from(LAYER_TYPES), min_size=kw["num_hidden_layers"],
                                                max_size=kw["num_hidden_layers"]).filter(
                          lambda types: "sliding_attention" in types)))
    elif kind == "parallel":
        field = "parallel_block"
        broken[field] = True
    elif kind == "mtp":
        field = draw(st.sampled_from(["num_mtp_layers", "mtp_loss_scaling_factor", "mtp_draft_tokens"]))
        if field == "num_mtp_layers":
            broken[field] = draw(st.sampled_from(_NOT_INT + [-1]))
        elif field == "mtp_draft_tokens":  # not a positive int, or drafts with no modules
            broken[field] = draw(st.sampled_from(_NOT_INT + [0, -1] + ([] if kw["num_mtp_layers"] else [1, 3])))
        elif kw["num_mtp_layers"]:
            broken[field] = draw(st.sampled_from(_NOT_FINITE + [-0.1, "0.3", True, [0.3]]))
        else:  # a weight for modules there are none of
            broken[field] = draw(st.sampled_from([0.3, 1.0]))
    elif kind == "linear_field":
        field = draw(st.sampled_from(LINEAR_FIELDS))
        reads = LINEAR_ATTENTIONS[kw.get("linear_attention_type", "gated_deltanet")].fields
        if LINEAR in (kw.get("layer_types") or ()) and field in reads:
            broken[field] = draw(st.sampled_from([0, -1, "4", 2.5, True]))
            if field == "linear_num_value_heads":  # not a multiple of the key heads
                key_heads = broken.setdefault("linear_num_key_heads", 2)
                broken[field] = draw(st.sampled_from([0, -1, "4", key_heads + 1] if key_heads > 1 else [0, -1, "4"]))
        else:  # only linear-attention layers of a kind that reads it read it
            broken[field] = draw(st.sampled_from([1, 4, 16]))
    else:  # pragma: no cover
        raise AssertionError(kind)
    return broken, field
