"""A pairwise-covering matrix of contract variants: every value of every axis appears, and every
pair of values of two axes appears together in at least one config (where the pair is valid)."""

from __future__ import annotations

import itertools
import random

from modular_decoder import ModularDecoderConfig

_ROPE = {"rope_type": "default", "rope_theta": 10000.0}

AXES: dict[str, dict[str, dict]] = {
    "norm": {
        "layernorm": dict(norm_type="layernorm"),
        "layernorm_nobias": dict(norm_type="layernorm", norm_bias=False),
        "rmsnorm": dict(norm_type="rmsnorm"),
        "rmsnorm_offset": dict(norm_type="rmsnorm", norm_unit_offset=True),
    },
    "placement": {
        "post": dict(norm_position="post"),
        "pre": dict(norm_position="pre"),
        "sandwich": dict(norm_position="sandwich"),
        "output": dict(norm_position="output"),
        "parallel_shared": dict(norm_position="pre", parallel_block=True, parallel_norms="shared"),
        "parallel_separate": dict(norm_position="pre", parallel_block=True, parallel_norms="separate"),
    },
    "ffn": {
        "dense_gelu": dict(mlp_type="dense", hidden_act="gelu"),
        "dense_relu": dict(mlp_type="dense", hidden_act="relu"),
        "glu": dict(mlp_type="gated", hidden_act="sigmoid"),
        "reglu": dict(mlp_type="gated", hidden_act="relu"),
        "geglu": dict(mlp_type="gated", hidden_act="gelu_pytorch_tanh"),
        "swiglu": dict(mlp_type="gated", hidden_act="silu"),
        # mixtures of experts (narrow experts, more of them than a token uses): Qwen2-MoE-like, DeepSeek-V3-like
        "moe_shared_gate_dense": dict(mlp_type="moe", hidden_act="gelu_pytorch_tanh", mlp_layer_types=["dense", "sparse"],
                                      num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
                                      shared_expert_gate=True, norm_topk_prob=False),
        # gpt-oss: a biased router with softmax over the kept logits, experts with biases and the clamped SwiGLU
        "moe_gpt_oss": dict(mlp_type="moe", hidden_act="silu", num_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=16, router_type="topk_softmax", router_bias=True, mlp_bias=True,
                            swiglu_limit=1.0),
        # Llama 4: a sigmoid of the one kept logit scaling the expert's input, a shared expert, a dense layer first
        "moe_llama4": dict(mlp_type="moe", mlp_layer_types=["dense", "sparse"], num_experts=4, num_experts_per_tok=1,
                           moe_intermediate_size=16, n_shared_experts=1, router_type="topk_sigmoid",
                           norm_topk_prob=False, apply_router_weight_on_input=True),
        "moe_sigmoid_grouped": dict(mlp_type="moe", mlp_layer_types=["sparse", "dense"], num_experts=8,
                                    num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=2,
                                    router_type="sigmoid_topk", n_group=4, topk_group=2, routed_scaling_factor=2.5),
        # DeepSeek-V4: √softplus scores, the first layer routed by token id, SiLU(g)·u clamped (shared expert too)
        "moe_dsv4": dict(mlp_type="moe", hidden_act="silu", num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=16, n_shared_experts=1, router_type="sqrtsoftplus_topk",
                         num_hash_layers=1, swiglu_limit=1.0, swiglu_alpha=1.0, swiglu_up_offset=0.0),
    },
    "positions": {
        "learned": dict(position_embedding_type="learned"),
        "learned_offset": dict(position_embedding_type="learned", learned_position_offset=2),
        "sinusoidal": dict(position_embedding_type="sinusoidal"),
        "none": dict(position_embedding_type="none"),
        "alibi": dict(position_embedding_type="alibi"),
        "rope": dict(position_embedding_type="rope", rope_parameters=dict(_ROPE)),
        "rope_partial": dict(position_embedding_type="rope", partial_rotary_factor=0.5, rope_parameters=dict(_ROPE)),
        "rope_nope": dict(position_embedding_type="rope", no_rope_layers=[1, 0], rope_parameters=dict(_ROPE)),  # SmolLM3
        "rope_interleaved": dict(position_embedding_type="rope", partial_rotary_factor=0.5, rope_interleaved=True,
                                 rope_parameters=dict(_ROPE)),
        "rope_linear": dict(position_embedding_type="rope",
                            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
        "rope_dynamic": dict(position_embedding_type="rope",
                             rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}),
        "rope_yarn": dict(position_embedding_type="rope",
                          rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                           "original_max_position_embeddings": 16}),
        "rope_llama3": dict(position_embedding_type="rope",
                            rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0,
                                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 16}),
        "rope_longrope": dict(position_embedding_type="rope", max_position_embeddings=64,
                              rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                               "short_factor": [1.0, 1.1, 1.2, 1.3],
                                               "long_factor": [2.0, 2.1, 2.2, 2.3],
                                               "original_max_position_embeddings": 16}),
    },
    "heads": {
        "mha": dict(num_key_value_heads=4),
        "gqa": dict(num_key_value_heads=2),
        "mqa": dict(num_key_value_heads=1),
    },
    "bias": {
        "none": dict(attention_bias=False, mlp_bias=False),
        "qkv_only": dict(attention_bias=True, attention_output_bias=False),
        "all": dict(attention_bias=True, mlp_bias=True, lm_head_bias=True),
    },
    "qk_norm": {"none": dict(qk_norm="none"), "head": dict(qk_norm="head"), "full": dict(qk_norm="full"),
                "weightless": dict(qk_norm="weightless")},  # Llama 4: of the rotated heads, on the layers that rotate
    "softcap": {
        "none": {},
        "attn": dict(attn_logit_softcapping=5.0),
        "final": dict(final_logit_softcapping=3.0),
        "both_scaled": dict(attn_logit_softcapping=5.0, final_logit_softcapping=3.0, query_pre_attn_scalar=12),
        "sinks": dict(attention_sinks=True),  # a learned logit per head in every softmax's denominator (gpt-oss)
    },
    "window": {
        "full": {},
        "sliding": dict(sliding_window=4),
        "mixed": dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
        "mixed_local_base": dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                                 local_rope_theta=100.0),
        "chunked": dict(attention_chunk_size=3, layer_types=["chunked_attention", "full_attention"]),  # Llama 4
    },
    # the token mixer of the second layer: attention, attention with the output gate, Gated DeltaNet (its
    # sizes derived, or explicit with grouped value heads and a 3-tap convolution), Mamba-2, KDA or a short
    # convolution after an attention layer
    "mixer": {
        "attention": {},
        "gated_attention": dict(attn_output_gate=True),
        "linear": dict(second_layer="linear_attention"),
        "linear_gva_gated": dict(second_layer="linear_attention", attn_output_gate=True, linear_num_key_heads=2,
                                 linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
                                 linear_conv_kernel_dim=3),
        # Mamba-2 (grouped B and C, chunks shorter than the test's sequences, its dt clamp)
        "mamba2": dict(second_layer="linear_attention", linear_attention_type="mamba2", mamba_n_heads=4,
                       mamba_d_head=8, mamba_n_groups=2, mamba_d_state=8, mamba_chunk_size=4,
                       time_step_limit=[0.0, 5.0]),
        # DeepSeek-V4's attention: one key = value head, grouped output, a compressed (CSA) second layer
        "shared_kv_compressed": dict(attention_type="shared_kv", num_key_value_heads=1, q_lora_rank=12, o_groups=2,
                                     o_lora_rank=8, second_layer="compressed_sparse_attention", sliding_window=4,
                                     compress_rates={"compressed_sparse_attention": 2}, index_n_heads=4,
                                     index_head_dim=8, index_topk=2),
        # Kimi Delta Attention (a decay per key channel, negative eigenvalues) and LFM2's short convolution (biased)
        "kda": dict(second_layer="linear_attention", linear_attention_type="kda", linear_num_key_heads=2,
                    linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                    linear_allow_neg_eigval=True),
        "short_conv": dict(second_layer="linear_attention", linear_attention_type="short_conv", conv_bias=True),
    },
    # Gemma 3n / Gemma 4 on any layout: the second (full) layer reading the first's keys and values, whose values come
    # from its keys (one K/V head) and are normed; per-layer embeddings with a scalar per layer; the residual
    # stream's entries (AltUp, DeepSeek-V4's hyper-connections)
    "topology": {
        "plain": {},
        "shared_kv": dict(num_kv_shared_layers=1, attention_k_eq_v=True, num_global_key_value_heads=1,
                          value_norm=True),
        "per_layer_embeddings": dict(hidden_size_per_layer_input=8, layer_scalar=True),
        "altup": dict(residual_stream="altup", altup_num_inputs=3, hidden_size_per_layer_input=4),  # Gemma 3n
        "laurel": dict(laurel_rank=4),
        "hyper_connections": dict(residual_stream="hyper_connections", hc_mult=2, hc_sinkhorn_iters=3),
    },
    "ends": {
        "tied": dict(tie_word_embeddings=True),
        "untied": dict(tie_word_embeddings=False),
        "multiplier": dict(embedding_multiplier=4.0),
        "embed_norm": dict(embedding_norm=True, tie_word_embeddings=False),
        "dropout_cfg": dict(attention_dropout=0.1, hidden_dropout=0.1),
        "mup_scales": dict(embedding_multiplier=3.0, residual_multiplier=0.5, logits_scaling=2.0),  # Granite
        "mup_sublayers": dict(attention_in_multiplier=0.5, key_multiplier=1.5, attention_out_multiplier=2.0),  # Falcon-H1
    },
}

BASE = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64)


def valid(choice: dict[str, str]) -> bool:
    positions = choice.get("positions", "rope")
    # hyper-connections mix streams around each branch of a serial block whose residual adds it
    if choice.get("topology") == "hyper_connections" and (
            choice.get("placement", "pre").startswith(("post", "parallel")) or choice.get("ends") == "mup_scales"):
        return False
    # shared key = value attention: no biases, no QK-norm, no ALiBi, no score cap, no chunks (its fields' rules); its
    # layers read no other layer's keys
    if choice.get("mixer") == "shared_kv_compressed" and (
            choice.get("bias", "none") == "qkv_only" or choice.get("bias") == "all" or choice.get("qk_norm", "none") != "none"
            or positions == "alibi" or choice.get("softcap") in ("attn", "both_scaled")
            or choice.get("window") in ("mixed_local_base", "chunked") or choice.get("topology") == "shared_kv"
            or choice.get("ends") == "mup_sublayers"):  # (μP's attention multipliers: standard attention's)
        return False
    if choice.get("qk_norm") == "weightless" and not positions.startswith("rope"):  # it norms the rotated heads
        return False
    if choice.get("topology") == "laurel" and choice.get("placement", "pre") not in ("pre", "sandwich"):
        return False  # (a branch of the attention's normed input)
    # the sharing layer reads the first layer of its type: both full attention
    recurrent = AXES["mixer"][choice.get("mixer", "attention")].get("second_layer") == "linear_attention"
    if choice.get("topology") == "shared_kv" and (choice.get("window", "full") != "full" or recurrent):
        return False
    if choice.get("window") == "mixed_local_base" and not positions.startswith("rope"):
        return False
    # dynamic/longrope rescale with the longest position seen, so per-layer-type tables are not
    # combined with them here; the combination is covered by plain RoPE.
    if choice.get("window") == "mixed_local_base" and positions in ("rope_dynamic", "rope_longrope"):
        return False
    return True


def build(choice: dict[str, str]) -> ModularDecoderConfig:
    fields = dict(BASE)
    for axis, value in choice.items():
        fields.update(AXES[axis][value])
    second = fields.pop("second_layer", None)
    if second is not None:
        window = "sliding_attention" if fields.get("sliding_window") else "full_attention"
        fields["layer_types"] = [(fields.get("layer_types") or [window] * 2)[0], second]
    theta = fields.pop("local_rope_theta", None)
    if theta is not None:
        global_params = fields["rope_parameters"]
        fields["rope_parameters"] = {"full_attention": dict(global_params),
                                     "sliding_attention": dict(global_params, rope_theta=theta)}
    return ModularDecoderConfig(**fields)


def pairwise_choices(seed: int = 0, minimum: int = 40) -> list[dict[str, str]]:
    rng = random.Random(seed)
    axes = list(AXES)
    uncovered = set()
    for a, b in itertools.combinations(axes, 2):
        for va in AXES[a]:
            for vb in AXES[b]:
                if valid({a: va, b: vb}):
                    uncovered.add(((a, va), (b, vb)))
    chosen: list[dict[str, str]] = []
    while uncovered or len(chosen) < minimum:
        best, best_gain, tries = None, -1, 0
        while tries < 200 or best is None:  # 200 candidates, more where none of them was valid
            tries += 1
            if tries > 100_000:
                raise AssertionError(f"no valid config holds the uncovered pairs {sorted(uncovered)[:3]}")
            cand = {axis: rng.choice(list(AXES[axis])) for axis in axes}
            # seed the candidate with one uncovered pair so progress is guaranteed
            if uncovered:
                (a, va), (b, vb) = rng.choice(sorted(uncovered))
                cand[a], cand[b] = va, vb
            if not valid(cand):
                continue
            gain = sum(1 for p in itertools.combinations(sorted(cand.items(), key=lambda kv: axes.index(kv[0])), 2)
                       if p in uncovered)
            if gain > best_gain:
                best, best_gain = cand, gain
        chosen.append(best)
        for p in itertools.combinations(sorted(best.items(), key=lambda kv: axes.index(kv[0])), 2):
            uncovered.discard(p)
    return chosen


CHOICES = pairwise_choices()


def variant_id(choice: dict[str, str]) -> str:
    return "-".join(choice[a] for a in AXES)
