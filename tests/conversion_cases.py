"""Tiny random configs of every convertible family, built with transformers' own config classes."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers as tf

V, D, F, L, H, P = 96, 32, 64, 2, 4, 64
COMMON = dict(vocab_size=V, hidden_size=D, intermediate_size=F, num_hidden_layers=L, num_attention_heads=H,
              max_position_embeddings=P)
GPT = dict(vocab_size=V, n_embd=D, n_layer=L, n_head=H, n_positions=P)
MLA = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
SMOLLM3_IDS = dict(pad_token_id=None, bos_token_id=1, eos_token_id=2)  # for families whose default ids lie past V
SMOLLM3 = dict(num_key_value_heads=2, **SMOLLM3_IDS)

# name -> (family model_type, config builder); several cases may exercise one family's variants
CASES: dict[str, tuple[str, callable]] = {
    "openai-gpt": ("openai-gpt", lambda: tf.OpenAIGPTConfig(**GPT)),
    "gpt2": ("gpt2", lambda: tf.GPT2Config(**GPT, n_inner=F)),
    "opt": ("opt", lambda: tf.OPTConfig(vocab_size=V, hidden_size=D, word_embed_proj_dim=D, ffn_dim=F,
                                        num_hidden_layers=L, num_attention_heads=H, max_position_embeddings=P)),
    "gptj": ("gptj", lambda: tf.GPTJConfig(**GPT, n_inner=F, rotary_dim=4)),
    "gpt_neox": ("gpt_neox", lambda: tf.GPTNeoXConfig(
        **COMMON, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
    "gpt_neox-serial": ("gpt_neox", lambda: tf.GPTNeoXConfig(**COMMON, use_parallel_residual=False)),
    "falcon-mqa": ("falcon", lambda: tf.FalconConfig(**COMMON, ffn_hidden_size=F, multi_query=True)),
    "falcon-mha-serial": ("falcon", lambda: tf.FalconConfig(**COMMON, ffn_hidden_size=F, multi_query=False,
                                                            parallel_attn=False, bias=True)),
    "falcon-new": ("falcon", lambda: tf.FalconConfig(**COMMON, ffn_hidden_size=F, new_decoder_architecture=True,
                                                     num_kv_heads=2)),
    "bloom": ("bloom", lambda: tf.BloomConfig(vocab_size=V, hidden_size=D, n_layer=L, n_head=H)),
    "llama": ("llama", lambda: tf.LlamaConfig(**COMMON, num_key_value_heads=2)),
    "mistral": ("mistral", lambda: tf.MistralConfig(**COMMON, num_key_value_heads=2, sliding_window=8)),
    "qwen2": ("qwen2", lambda: tf.Qwen2Config(**COMMON, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3": ("qwen3", lambda: tf.Qwen3Config(**COMMON, num_key_value_heads=2, head_dim=16)),
    "gemma": ("gemma", lambda: tf.GemmaConfig(**COMMON, num_key_value_heads=1, head_dim=8)),
    "gemma2": ("gemma2", lambda: tf.Gemma2Config(**COMMON, num_key_value_heads=2, head_dim=8, sliding_window=8,
                                                 query_pre_attn_scalar=16)),
    "gemma3": ("gemma3_text", lambda: tf.Gemma3TextConfig(**COMMON, num_key_value_heads=2, head_dim=8,
                                                           sliding_window=8, query_pre_attn_scalar=16)),
    "olmo2": ("olmo2", lambda: tf.Olmo2Config(**COMMON)),
    "phi": ("phi", lambda: tf.PhiConfig(**COMMON)),
    # mixtures of experts: experts narrower than d, more experts than chosen, so routing matters
    "mixtral": ("mixtral", lambda: tf.MixtralConfig(**{**COMMON, "intermediate_size": 24}, num_key_value_heads=2,
                                                    num_local_experts=4, num_experts_per_tok=2)),
    "mixtral-sliding": ("mixtral", lambda: tf.MixtralConfig(**{**COMMON, "intermediate_size": 24}, num_key_value_heads=2,
                                                            num_local_experts=6, num_experts_per_tok=3, sliding_window=8)),
    "qwen2_moe": ("qwen2_moe", lambda: tf.Qwen2MoeConfig(
        **COMMON, num_key_value_heads=2, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24,
        shared_expert_intermediate_size=40, mlp_only_layers=[1], norm_topk_prob=False)),
    "qwen3_moe": ("qwen3_moe", lambda: tf.Qwen3MoeConfig(
        **COMMON, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=24,
        norm_topk_prob=True)),
    "qwen3_moe-sparse-step": ("qwen3_moe", lambda: tf.Qwen3MoeConfig(
        **COMMON, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=1, moe_intermediate_size=24,
        decoder_sparse_step=2, norm_topk_prob=False)),
    "olmoe": ("olmoe", lambda: tf.OlmoeConfig(**{**COMMON, "intermediate_size": 24}, num_experts=8,
                                               num_experts_per_tok=2, eos_token_id=2)),
    "granitemoe": ("granitemoe", lambda: tf.GraniteMoeConfig(
        **{**COMMON, "intermediate_size": 24}, num_key_value_heads=2, num_local_experts=6, num_experts_per_tok=2,
        embedding_multiplier=3.0, residual_multiplier=0.4, logits_scaling=2.5, attention_multiplier=0.3)),
    # DeepSeek: a dense first layer, then MLA with routed + shared experts
    "deepseek_v2-moe": ("deepseek_v2", lambda: tf.DeepseekV2Config(
        **COMMON, **MLA, q_lora_rank=None, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=2, moe_intermediate_size=12, routed_scaling_factor=1.5)),
    "deepseek_v2-moe-grouped": ("deepseek_v2", lambda: tf.DeepseekV2Config(
        **COMMON, **MLA, q_lora_rank=12, first_k_dense_replace=1, n_routed_experts=16, num_experts_per_tok=3,
        n_shared_experts=1, moe_intermediate_size=12, topk_method="group_limited_greedy", n_group=4, topk_group=2)),
    "deepseek_v3-moe": ("deepseek_v3", lambda: tf.DeepseekV3Config(
        **COMMON, **MLA, q_lora_rank=12, first_k_dense_replace=1, n_routed_experts=16, num_experts_per_tok=4,
        n_shared_experts=1, moe_intermediate_size=12, n_group=4, topk_group=2, routed_scaling_factor=2.5)),
    # DeepSeek-V3.2: V3 with a lightning indexer in every layer keeping 5 of the prompt's 12 keys per query
    "deepseek_v32-moe": ("deepseek_v32", lambda: tf.DeepseekV32Config(
        **COMMON, **MLA, num_key_value_heads=H, q_lora_rank=12, index_n_heads=8, index_head_dim=8, index_topk=5,
        first_k_dense_replace=1, n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1,
        moe_intermediate_size=12, n_group=4, topk_group=2, routed_scaling_factor=2.5)),
    # gpt-oss: sinks, alternating windows, YaRN; a biased router, experts with biases and the clamped SwiGLU
    # stored interleaved and transposed (a limit low enough to clamp these perturbed weights)
    "gpt_oss": ("gpt_oss", lambda: tf.GptOssConfig(
        **{**COMMON, "intermediate_size": 24}, num_key_value_heads=2, head_dim=8, num_local_experts=6,
        num_experts_per_tok=2, sliding_window=8, swiglu_limit=0.5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16})),
    # SmolLM3: NoPE every fourth layer (here layer 3 of 4), and NoPE sliding layers where windows are on
    "smollm3": ("smollm3", lambda: tf.SmolLM3Config(**{**COMMON, "num_hidden_layers": 4}, **SMOLLM3)),
    "smollm3-sliding": ("smollm3", lambda: tf.SmolLM3Config(
        **{**COMMON, "num_hidden_layers": 4}, **SMOLLM3, no_rope_layers=[1, 0, 1, 0],
        use_sliding_window=True, sliding_window=8, attention_bias=True, mlp_bias=True, tie_word_embeddings=False)),
}

# DeepSeek-V4: a window-only layer and the compressed ones (CSA every 2 tokens keeping 3 entries per query of its
# 8-head indexer, HCA every 4), hash routing in the first layer, 3 hyper-connection streams, a clamp low enough to bite
DSV4 = dict(vocab_size=V, hidden_size=D, moe_intermediate_size=16, num_hidden_layers=4, num_attention_heads=H,
            head_dim=16, q_lora_rank=12, o_groups=2, o_lora_rank=8, sliding_window=5, partial_rotary_factor=0.5,
            layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                         "compressed_sparse_attention"],
            compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4}, index_n_heads=8,
            index_head_dim=8, index_topk=3, n_routed_experts=4, num_experts_per_tok=2, hc_mult=3, hc_sinkhorn_iters=5,
            mlp_layer_types=["hash_moe", "moe", "moe", "moe"], swiglu_limit=0.5, max_position_embeddings=P)
if hasattr(tf, "DeepseekV4Config"):
    CASES["deepseek_v4"] = ("deepseek_v4", lambda: tf.DeepseekV4Config(**DSV4))

# The 2025-26 dense and MoE families. Phi-3 / Phi-4: fused q/k/v and gate/up, a window on every layer; with
# LongRoPE and partial RoPE past an original length of 16, which a prompt of 12 and 20 new tokens crosses
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 1.5], "long_factor": [2.0, 6.0]}
# OLMo 3's long-context releases: YaRN on the full layers only
OLMO3_ROPE = {"full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0, "beta_fast": 32.0,
                                 "beta_slow": 1.0, "original_max_position_embeddings": 16},
              "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0}}
# Ministral 3: YaRN and the query temperature, here stepping every 4 positions
MINISTRAL3_ROPE = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0, "original_max_position_embeddings": 4,
                   "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                   "llama_4_scaling_beta": 0.5, "max_position_embeddings": P}
GLM4_MOE = dict(num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=12,
                n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, attention_bias=True)
CASES.update({
    "phi3": ("phi3", lambda: tf.Phi3Config(**COMMON, num_key_value_heads=2, sliding_window=8, **SMOLLM3_IDS)),
    "phi3-longrope": ("phi3", lambda: tf.Phi3Config(
        **COMMON, num_key_value_heads=2, original_max_position_embeddings=16, rope_parameters=dict(LONGROPE),
        tie_word_embeddings=True, **SMOLLM3_IDS)),
    "olmo3": ("olmo3", lambda: tf.Olmo3Config(**{**COMMON, "num_hidden_layers": 4}, sliding_window=8,
                                               rope_parameters={k: dict(v) for k, v in OLMO3_ROPE.items()})),
    "olmo3-one-table": ("olmo3", lambda: tf.Olmo3Config(**{**COMMON, "num_hidden_layers": 4}, num_key_value_heads=2,
                                                         sliding_window=8)),
    "ministral3": ("ministral3", lambda: tf.Ministral3Config(**COMMON, num_key_value_heads=2, head_dim=8,
                                                             rope_parameters=dict(MINISTRAL3_ROPE))),
    "minimax_m2": ("minimax_m2", lambda: tf.MiniMaxM2Config(
        **{**COMMON, "intermediate_size": 24}, num_key_value_heads=2, head_dim=8, num_local_experts=6,
        num_experts_per_tok=2, rotary_dim=4, **SMOLLM3_IDS)),
    # GLM-4.5: QK-norm, grouped routing; GLM-4.5-Air: neither (a head_dim other than d / H in both)
    "glm4_moe": ("glm4_moe", lambda: tf.Glm4MoeConfig(**COMMON, **GLM4_MOE, n_group=4, topk_group=2, use_qk_norm=True)),
    "glm4_moe-air": ("glm4_moe", lambda: tf.Glm4MoeConfig(**COMMON, **GLM4_MOE, tie_word_embeddings=True)),
})

# Llama 4: 4 layers, NoPE on the fourth (its temperature floor Llama 4's 8,192), chunks of 4 on the RoPE layers,
# experts (top-1 sigmoid scaling the input, a shared expert) on every other layer and dense MLPs on the others; then
# a temperature floor of 4 tokens (these prompts reach it), every layer sparse, biases, Llama 3 RoPE scaling, no
# QK-norm
LLAMA4 = dict(**{**COMMON, "num_hidden_layers": 4, "intermediate_size": 24}, num_key_value_heads=2, head_dim=8,
              intermediate_size_mlp=48, num_local_experts=4, attention_chunk_size=4, pad_token_id=None)
CASES.update({
    "llama4_text": ("llama4_text", lambda: tf.Llama4TextConfig(**LLAMA4, interleave_moe_layer_step=2)),
    "llama4_text-tuned": ("llama4_text", lambda: tf.Llama4TextConfig(
        **LLAMA4, interleave_moe_layer_step=1, floor_scale=4, attn_scale=0.5, use_qk_norm=False, attention_bias=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "high_freq_factor": 4.0,
                         "low_freq_factor": 1.0, "original_max_position_embeddings": 16})),
})

# Gemma 4: local / global layers (windows of 4), the global ones with heads twice as wide, one K/V head and their values
# from the key projection, proportional RoPE on a quarter of their pairs; the last two layers reading the keys and
# values of layers 3 and 2 with MLPs twice as wide; per-layer embeddings of width 8; a soft-capped head. Then experts
# beside the dense MLP in every layer (4 experts, top-2, a normed router with a scale per expert), no sharing
GEMMA4 = dict(**{**COMMON, "num_hidden_layers": 6}, num_key_value_heads=2, head_dim=8, global_head_dim=16,
              sliding_window=4, hidden_size_per_layer_input=8, vocab_size_per_layer_input=V,
              layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                           "sliding_attention", "full_attention"])
CASES.update({
    "gemma4_text": ("gemma4_text", lambda: tf.Gemma4TextConfig(
        **GEMMA4, attention_k_eq_v=True, num_global_key_value_heads=1, num_kv_shared_layers=2, use_double_wide_mlp=True,
        final_logit_softcapping=30.0)),
    "gemma4_text-moe": ("gemma4_text", lambda: tf.Gemma4TextConfig(
        **{**GEMMA4, "num_hidden_layers": 4, "layer_types": ["sliding_attention", "full_attention"] * 2,
           "hidden_size_per_layer_input": 0}, enable_moe_block=True, num_experts=4, top_k_experts=2,
        moe_intermediate_size=16)),
})

# Gemma 3n: AltUp's 3 streams around every layer, LAUREL beside attention (rank 4), per-layer embeddings of width 8,
# local / global layers (windows of 4), the last two layers reading layers 1 and 2's keys and values, the Gaussian
# top-k on the first two layers' gates, a soft-capped head. Then 4 streams and the second of them active, no
# sparsity, MLPs of their own widths, and a per-layer table smaller than the vocabulary (ids past it look up row 0, as
# transformers does from 5.17; 5.16.1's class fails on them with an IndexError)
GEMMA3N = dict(**{**COMMON, "num_hidden_layers": 4}, num_key_value_heads=2, head_dim=8, sliding_window=4,
               hidden_size_per_layer_input=8, vocab_size_per_layer_input=V, laurel_rank=4,
               layer_types=["sliding_attention", "full_attention"] * 2)
CASES.update({
    "gemma3n_text": ("gemma3n_text", lambda: tf.Gemma3nTextConfig(
        **GEMMA3N, altup_num_inputs=3, num_kv_shared_layers=2, activation_sparsity_pattern=[0.95, 0.8, 0.0, 0.0])),
    "gemma3n_text-four-streams": ("gemma3n_text", lambda: tf.Gemma3nTextConfig(
        **{**GEMMA3N, "intermediate_size": [64, 48, 64, 32], "vocab_size_per_layer_input": 80}, altup_num_inputs=4,
        altup_active_idx=1, num_kv_shared_layers=0, activation_sparsity_pattern=[0.0] * 4)),
})

# Hybrid linear attention: Gated DeltaNet layers (2 key heads, 4 value heads: each key head serves two) beside
# gated full attention; Qwen3-Next with experts in every other layer and a dense one
HYBRID = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
              linear_conv_kernel_dim=4, num_key_value_heads=2, head_dim=16,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
HYBRID_LAYERS = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
CASES.update({
    "qwen3_next": ("qwen3_next", lambda: tf.Qwen3NextConfig(
        **{**COMMON, "num_hidden_layers": 4}, **HYBRID, layer_types=HYBRID_LAYERS, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40, mlp_only_layers=[2],
        decoder_sparse_step=1, norm_topk_prob=True)),
    "qwen3_next-dense": ("qwen3_next", lambda: tf.Qwen3NextConfig(
        **{**COMMON, "num_hidden_layers": 4}, **HYBRID, layer_types=HYBRID_LAYERS[::-1], num_experts=0,
        tie_word_embeddings=True)),
    "qwen3_5_text": ("qwen3_5_text", lambda: tf.Qwen3_5TextConfig(
        **{**COMMON, "num_hidden_layers": 4}, **HYBRID, layer_types=HYBRID_LAYERS)),
    # Qwen3.5-MoE: experts in every layer beside a sigmoid-gated shared expert
    "qwen3_5_moe_text": ("qwen3_5_moe_text", lambda: tf.Qwen3_5MoeTextConfig(
        **{**COMMON, "num_hidden_layers": 4}, **HYBRID, layer_types=HYBRID_LAYERS, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=24, shared_expert_intermediate_size=40)),
})

# Mamba-2 hybrids: 4 scan heads of 16 (2 groups of B / C where the case says so), a state of 8, chunks of 8 tokens so
# that a 12-token prompt crosses chunk boundaries; attention at the second layer
MAMBA = dict(mamba_n_heads=4, mamba_d_state=8, mamba_chunk_size=8, num_key_value_heads=2)
CASES.update({
    # Bamba-9B's one group (transformers 5.16.1's class normalises the whole inner width at once, which only one
    # group makes equal to the grouped norm of Mamba-2 and of transformers 5.25)
    "bamba": ("bamba", lambda: tf.BambaConfig(**{**COMMON, "num_hidden_layers": 3}, **MAMBA, attn_layer_indices=[1])),
    "bamba-grouped": ("bamba", lambda: tf.BambaConfig(
        **{**COMMON, "num_hidden_layers": 3}, **MAMBA, mamba_n_groups=2, attn_layer_indices=[1], mamba_conv_bias=False,
        tie_word_embeddings=True)),
    # Granite 4.0-H: no positions, experts narrower than d beside a shared MLP, μP scalings, one group (as Bamba's
    # case: transformers 5.16.1's class normalises the whole inner width); the dense variant (no experts: the shared
    # MLP alone) with RoPE and two groups
    "granitemoehybrid": ("granitemoehybrid", lambda: tf.GraniteMoeHybridConfig(
        **{**COMMON, "intermediate_size": 24, "num_hidden_layers": 3}, **MAMBA,
        layer_types=["mamba", "attention", "mamba"], num_local_experts=4, num_experts_per_tok=2,
        shared_intermediate_size=40, embedding_multiplier=3.0, residual_multiplier=0.4, logits_scaling=2.5,
        attention_multiplier=0.3, tie_word_embeddings=True)),
    "granitemoehybrid-dense": ("granitemoehybrid", lambda: tf.GraniteMoeHybridConfig(
        **{**COMMON, "num_hidden_layers": 3}, **MAMBA, mamba_n_groups=2, layer_types=["mamba", "attention", "mamba"],
        num_local_experts=0, shared_intermediate_size=48, position_embedding_type="rope")),
    # Nemotron-H: one sublayer per layer; ungated relu² experts (a latent width, grouped sigmoid routing, a shared
    # expert) beside a relu² MLP layer; Nemotron-H-8B's layout (no experts) with biases in the Mamba-2 projections
    "nemotron_h": ("nemotron_h", lambda: tf.NemotronHConfig(
        vocab_size=V, hidden_size=D, max_position_embeddings=P, num_attention_heads=H, num_key_value_heads=2,
        head_dim=8,
        layers_block_type=["linear_attention", "moe", "full_attention", "mlp", "linear_attention", "moe"],
        intermediate_size=48, mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8, n_groups=2, chunk_size=8,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, moe_shared_expert_intermediate_size=40,
        moe_latent_size=16, n_group=4, topk_group=2, routed_scaling_factor=2.5)),
    "nemotron_h-dense": ("nemotron_h", lambda: tf.NemotronHConfig(
        vocab_size=V, hidden_size=D, max_position_embeddings=P, num_attention_heads=H, num_key_value_heads=2,
        head_dim=8,
        layers_block_type=["linear_attention", "mlp", "full_attention", "mlp"], intermediate_size=48,
        mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8, n_groups=1, chunk_size=8, use_bias=True,
        tie_word_embeddings=True)),
    # Falcon-H1: attention and Mamba-2 side by side in every layer, its μP multipliers all set, a Mamba-2 width of
    # its own (`mamba_d_ssm`), the gated norm before the gate (its default); and without the gated norm
    "falcon_h1": ("falcon_h1", lambda: tf.FalconH1Config(
        **{**COMMON, "num_hidden_layers": 3}, **MAMBA, mamba_d_ssm=48, mamba_n_groups=2, mamba_rms_norm=True,
        head_dim=8, lm_head_multiplier=0.25, embedding_multiplier=3.0, mlp_multipliers=[0.7, 1.3], key_multiplier=0.6,
        attention_in_multiplier=1.5, attention_out_multiplier=0.8, ssm_in_multiplier=1.2, ssm_out_multiplier=0.9,
        ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 0.9])),
    "falcon_h1-no-norm": ("falcon_h1", lambda: tf.FalconH1Config(
        **{**COMMON, "num_hidden_layers": 2}, **MAMBA, mamba_expand=2, mamba_d_ssm=None, tie_word_embeddings=True)),
})

# LFM2: gated short convolutions beside GQA attention with QK-norm (its feed-forward width derived as the released
# models derive it, 2/3 of 96 rounded up to 16: 64); with biases on the convolutions, untied and the width as given
LFM2_LAYERS = ["conv", "full_attention", "conv", "conv"]
CASES.update({
    "lfm2": ("lfm2", lambda: tf.Lfm2Config(**{**COMMON, "num_hidden_layers": 4, "intermediate_size": 96},
                                           num_key_value_heads=2, layer_types=LFM2_LAYERS, block_multiple_of=16)),
    "lfm2-bias": ("lfm2", lambda: tf.Lfm2Config(
        **{**COMMON, "num_hidden_layers": 4}, num_key_value_heads=2, layer_types=LFM2_LAYERS[::-1], conv_bias=True,
        conv_L_cache=4, block_auto_adjust_ff_dim=False, tie_word_embeddings=False)),
})

# OLMo hybrid: Gated DeltaNet (β in (0, 2), values twice as wide as keys) in pre-norm layers beside output-norm
# attention with QK-norm over the whole projection; NoPE as released, and with RoPE on the full layer
OLMO_HYBRID = dict(**{**COMMON, "num_hidden_layers": 4}, layer_types=HYBRID_LAYERS, linear_num_key_heads=2,
                   linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=16, pad_token_id=None,
                   eos_token_id=None)
CASES.update({
    "olmo_hybrid": ("olmo_hybrid", lambda: tf.OlmoHybridConfig(
        **OLMO_HYBRID, rope_parameters={"rope_type": "default", "rope_theta": None})),
    "olmo_hybrid-rope": ("olmo_hybrid", lambda: tf.OlmoHybridConfig(
        **OLMO_HYBRID, num_key_value_heads=2, linear_allow_neg_eigval=False, tie_word_embeddings=True)),
})

# Kimi Linear (transformers 5.17 onwards): KDA layers beside NoPE latent attention, a dense first layer then DeepSeek-V3's
# experts (grouped sigmoid routing, a shared expert); block norms of 1e-5 beside latent norms of 1e-6
KIMI = dict(**{**COMMON, "num_hidden_layers": 4}, **MLA, num_key_value_heads=H, layer_types=HYBRID_LAYERS,
            linear_num_heads=2, linear_head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=12,
            n_shared_experts=1, pad_token_id=None, bos_token_id=None, eos_token_id=None)
CASES.update({
    "kimi_linear": ("kimi_linear", lambda: tf.KimiLinearConfig(**KIMI, q_lora_rank=None, n_group=4, topk_group=2)),
    "kimi_linear-q-lora": ("kimi_linear", lambda: tf.KimiLinearConfig(
        **{**KIMI, "layer_types": HYBRID_LAYERS[::-1]}, q_lora_rank=12, routed_scaling_factor=1.5,
        tie_word_embeddings=True)),
})
# Families whose transformers class came after the oldest supported release: their cases skip where it lacks it
FAMILY_CLASSES = {"kimi_linear": "KimiLinearConfig"}


def skip_without_class(case: str) -> None:
    """`pytest.skip` naming the release where transformers has no class for `case`'s family."""
    import pytest

    family = CASES[case][0]
    if family in FAMILY_CLASSES and not hasattr(tf, FAMILY_CLASSES[family]):
        pytest.skip(f"transformers {tf.__version__} has no {FAMILY_CLASSES[family]} ({family})")


# The families whose layers hold routed experts (and the cases of each; Llama 4's where its NoPE temperature is 1 at
# these positions: transformers' class counts a left-padded row's temperature from its cache's slots, test_llama4.py;
# not Gemma 4's, whose class records router probabilities, not logits: test_gemma4.py)
MOE_CASES = [name for name in CASES if name.split("-")[0] in
             ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "gpt_oss", "minimax_m2", "glm4_moe",
              "qwen3_5_moe_text", "kimi_linear", "deepseek_v4")
             or name == "qwen3_next"
             or name.endswith(("-moe", "-moe-grouped")) and not name.startswith("gemma4") or name == "llama4_text"]


def reference_generate(source, ids, **kwargs) -> torch.Tensor:
    """transformers' `generate` of a source model; with LongRoPE, each step its forward over the whole text
    (`use_cache=False`): past the switch to the long factors, transformers 5.16's Phi-3 generates tokens through its
    cache that its own forward does not give (from the fifth step past it, on phi3-longrope), 5.25's are its
    forward's."""
    rope = getattr(source.config, "rope_parameters", None) or {}
    if rope.get("rope_type") == "longrope":
        kwargs["use_cache"] = False
    return source.generate(ids, **kwargs)


def perturbed(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with every parameter and every saved floating-point buffer moved by N(0, 0.1²), in place:
    fresh norms are ones and fresh biases zeros (DeepSeek-V3's correction bias too), so a map that swapped
    two norms or dropped a bias would still convert to the same logits."""
    saved = model.state_dict()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
        for name, buffer in model.named_buffers():
            if name in saved and buffer.is_floating_point():
                buffer.add_(torch.randn_like(buffer) * 0.1)
            elif name.endswith("tid2eid"):  # DeepSeek-V4's hash routing: fresh, every token's experts are 0
                buffer.copy_(torch.randint(0, model.config.n_routed_experts, buffer.shape))
    return model


def saved_source(config, path):
    """A tiny random source checkpoint saved by transformers' own class, every parameter perturbed
    (`--verify`, exports and conversions compare it), in the layout the family publishes (`save_published`)."""
    config.architectures = None
    torch.manual_seed(0)
    save_published(perturbed(tf.AutoModelForCausalLM.from_config(config)), path)
    return path


def save_published(model, path):
    """`model.save_pretrained(path)`, then the files moved to the layout the family's released checkpoints have where
    transformers' `save_pretrained` writes another (OLMo hybrid, Kimi Linear: see their modules in
    conversion/families/). transformers' class loads either."""
    from safetensors.torch import load_file, save_file

    model.save_pretrained(path)
    published = PUBLISHED_LAYOUTS.get(model.config.model_type)
    if published is not None:
        files = Path(path) / "model.safetensors"
        save_file(published(load_file(str(files)), model.config), str(files), metadata={"format": "pt"})
    return path


def _olmo_hybrid_published(tensors: dict, config) -> dict:
    """The three convolutions of H_k·d_k, H_k·d_k and H_v·d_v rows; an attention layer's first norm by its own name."""
    key = config.linear_num_key_heads * config.linear_key_head_dim
    widths = [key, key, config.linear_num_value_heads * config.linear_value_head_dim]
    for i, layer_type in enumerate(config.layer_types):
        layer = f"model.layers.{i}."
        if layer_type == "linear_attention":
            names = [f"{layer}linear_attn.{x}_conv1d.weight" for x in "qkv"]
            stacked = torch.cat([tensors.pop(name) for name in names])
            tensors.update(zip(names, (t.contiguous() for t in stacked.split(widths))))
        else:
            tensors[f"{layer}post_attention_layernorm.weight"] = tensors.pop(f"{layer}feedforward_layer_norm.weight")
    return tensors


def _kimi_linear_published(tensors: dict, config) -> dict:
    """A dense layer's MLP as `mlp` (transformers writes `block_sparse_moe` in every layer)."""
    for i, kind in enumerate(config.mlp_layer_types):
        if kind == "dense":
            old = f"model.layers.{i}.block_sparse_moe."
            for name in [n for n in tensors if n.startswith(old)]:
                tensors[f"model.layers.{i}.mlp." + name[len(old):]] = tensors.pop(name)
    return tensors


PUBLISHED_LAYOUTS = {"olmo_hybrid": _olmo_hybrid_published, "kimi_linear": _kimi_linear_published}


def converted_pair(case: str, path, attn_implementation=None):
    """(transformers' model of conversion case `case` (with `attn_implementation` where given), ours converted from its
    checkpoint, the folder `path` holding both), every parameter perturbed, fp32, eval."""
    from modular_decoder import ModularDecoderForCausalLM
    from modular_decoder.conversion import convert

    saved_source(CASES[case][1](), path / "theirs")
    implementation = {"attn_implementation": attn_implementation} if attn_implementation else {}
    theirs = tf.AutoModelForCausalLM.from_pretrained(path / "theirs", **implementation).eval()
    convert(path / "theirs", path / "ours", progress=False)
    return theirs, ModularDecoderForCausalLM.from_pretrained(path / "ours").eval(), path


def preset_parameter_counts(name: str, family: str, tiny: bool) -> tuple[int, int, int]:
    """Preset `name` exported to `family`'s config: the parameters of transformers' class built from it on the meta
    device, the contract's formula, ours on meta."""
    from modular_decoder import ModularDecoderForCausalLM, parameter_count, preset_config
    from modular_decoder.conversion import get_family

    config = preset_config(name, tiny=tiny)
    with torch.device("meta"):
        theirs = tf.AutoModelForCausalLM.from_config(get_family(family).from_contract(config))
        ours = ModularDecoderForCausalLM(config)
    return sum(p.numel() for p in theirs.parameters()), parameter_count(config)["total"], ours.num_parameters()


def lora_round_trip(path, targets: list[str], ids: torch.Tensor, out, before_step=None, family: str | None = None):
    """A LoRA adapter on `targets` made on transformers' model in `path / "theirs"` and loaded onto ours in
    `path / "ours"` (checked: the same modules adapted, the same logits on `ids`), trained one SGD step there (after
    `before_step(ours)`), saved under `out` and loaded back onto transformers' model (checked: ours' logits).
    With `family`, the adapter goes through `modular-decoder convert` on its way to ours and `export --family` back
    (the family names some modules otherwise than ours). Returns (ours, its logits before the step)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    from modular_decoder import ModularDecoderForCausalLM
    from modular_decoder.commands import main

    def adapted(model) -> set[str]:
        return {name.rsplit(".", 2)[-2] for name, _ in model.named_modules() if name.endswith(".base_layer")}

    config = LoraConfig(r=4, target_modules=targets, init_lora_weights=False)
    torch.manual_seed(1)
    theirs = get_peft_model(tf.AutoModelForCausalLM.from_pretrained(path / "theirs"), config).eval()
    theirs.save_pretrained(out / "adapter")
    if family is not None:
        assert main(["convert", str(out / "adapter"), str(out / "adapter-ours"),
                     "--adapter-base", str(path / "theirs")]) == 0
    ours = PeftModel.from_pretrained(ModularDecoderForCausalLM.from_pretrained(path / "ours"),
                                     out / ("adapter" if family is None else "adapter-ours"), is_trainable=True)
    assert adapted(ours) == adapted(theirs) == set(targets)
    with torch.no_grad():
        before = ours(ids).logits
        torch.testing.assert_close(before, theirs(ids).logits, rtol=1e-5, atol=1e-5)
    if before_step is not None:
        before_step(ours)
    optimizer = torch.optim.SGD([p for p in ours.parameters() if p.requires_grad], lr=0.1)
    ours.train()
    ours(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    ours.eval()
    # (the adapter names transformers' folder as its base, whose config.json PEFT's vocabulary check would read
    # with our config class: nothing was resized, so say so)
    ours.save_pretrained(out / "trained", save_embedding_layers=False)
    if family is not None:
        assert main(["export", str(out / "trained"), str(out / "trained-theirs"), "--family", family,
                     "--adapter-base", str(path / "ours")]) == 0
    back = PeftModel.from_pretrained(tf.AutoModelForCausalLM.from_pretrained(path / "theirs"),
                                     out / ("trained" if family is None else "trained-theirs")).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ours(ids).logits, rtol=1e-5, atol=1e-5)
    return ours, before
