"""Named presets: the published layouts as small dicts of config overrides.

Each names the `config.json` it follows. `preset_config(name, tiny=True)` keeps the layout (every
switch) and shrinks the sizes, for tests and experiments.
"""

from __future__ import annotations

import copy
import math

from modular_decoder.configuration_modular_decoder import ModularDecoderConfig

_GPT_STYLE = dict(norm_type="layernorm", norm_eps=1e-5, mlp_type="dense", mlp_bias=True, attention_bias=True)

PRESETS: dict[str, dict] = {
    # openai-community/openai-gpt config.json
    "gpt1": dict(_GPT_STYLE, vocab_size=40478, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                 num_attention_heads=12, max_position_embeddings=512, norm_position="post", hidden_act="gelu_new",
                 position_embedding_type="learned", tie_word_embeddings=True),
    # openai-community/gpt2 config.json
    "gpt2": dict(_GPT_STYLE, vocab_size=50257, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                 num_attention_heads=12, max_position_embeddings=1024, hidden_act="gelu_new",
                 position_embedding_type="learned", tie_word_embeddings=True),
    # facebook/opt-125m config.json (do_layer_norm_before=true, positions offset by 2)
    "opt": dict(_GPT_STYLE, vocab_size=50272, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                num_attention_heads=12, max_position_embeddings=2048, hidden_act="relu",
                position_embedding_type="learned", learned_position_offset=2, tie_word_embeddings=True),
    # EleutherAI/gpt-j-6b config.json (rotary_dim=64 of head_dim=256, rotate_every_two)
    "gptj": dict(_GPT_STYLE, vocab_size=50400, hidden_size=4096, intermediate_size=16384, num_hidden_layers=28,
                 num_attention_heads=16, max_position_embeddings=2048, hidden_act="gelu_new", attention_bias=False,
                 parallel_block=True, parallel_norms="shared", position_embedding_type="rope",
                 partial_rotary_factor=0.25, rope_interleaved=True, tie_word_embeddings=False, lm_head_bias=True),
    # EleutherAI/pythia-160m config.json (rotary_pct=0.25, use_parallel_residual=true)
    "pythia": dict(_GPT_STYLE, vocab_size=50304, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                   num_attention_heads=12, max_position_embeddings=2048, hidden_act="gelu",
                   parallel_block=True, parallel_norms="separate", position_embedding_type="rope",
                   partial_rotary_factor=0.25, tie_word_embeddings=False),
    # tiiuae/falcon-7b config.json (multi_query, parallel_attn, no bias)
    "falcon": dict(_GPT_STYLE, vocab_size=65024, hidden_size=4544, intermediate_size=18176, num_hidden_layers=32,
                   num_attention_heads=71, num_key_value_heads=1, max_position_embeddings=2048, hidden_act="gelu",
                   mlp_bias=False, attention_bias=False, parallel_block=True, parallel_norms="shared",
                   position_embedding_type="rope", tie_word_embeddings=True),
    # bigscience/bloom-560m config.json
    "bloom": dict(_GPT_STYLE, vocab_size=250880, hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                  num_attention_heads=16, max_position_embeddings=2048, hidden_act="gelu_pytorch_tanh",
                  position_embedding_type="alibi", embedding_norm=True, tie_word_embeddings=True),
    # meta-llama/Llama-2-7b-hf config.json
    "llama": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, max_position_embeddings=4096, norm_eps=1e-5,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False),
    # HuggingFaceTB/SmolLM2-135M-Instruct config.json (the bundled real checkpoint)
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, norm_eps=1e-5,
                    rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, tie_word_embeddings=True),
    # mistralai/Mistral-7B-v0.1 config.json
    "mistral": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768, norm_eps=1e-5,
                    sliding_window=4096, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                    tie_word_embeddings=False),
    # Qwen/Qwen2-0.5B config.json (q/k/v biases, none on o_proj)
    "qwen2": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, norm_eps=1e-6,
                  attention_bias=True, attention_output_bias=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=True),
    # Qwen/Qwen3-0.6B config.json
    "qwen3": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                  norm_eps=1e-6, qk_norm="head", rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                  tie_word_embeddings=True),
    # google/gemma-2b config.json
    "gemma": dict(vocab_size=256000, hidden_size=2048, intermediate_size=16384, num_hidden_layers=18,
                  num_attention_heads=8, num_key_value_heads=1, head_dim=256, max_position_embeddings=8192,
                  norm_eps=1e-6, norm_unit_offset=True, hidden_act="gelu_pytorch_tanh",
                  embedding_multiplier=math.sqrt(2048), rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                  tie_word_embeddings=True),
    # google/gemma-2-2b config.json (sliding layers at even indices)
    "gemma2": dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=8192,
                   norm_eps=1e-6, norm_unit_offset=True, norm_position="sandwich", hidden_act="gelu_pytorch_tanh",
                   embedding_multiplier=math.sqrt(2304), attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                   query_pre_attn_scalar=256, sliding_window=4096, sliding_window_pattern=2,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=True),
    # google/gemma-3-270m config.json (5 local : 1 global, local base 10k, global base 1M)
    "gemma3": dict(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                   num_attention_heads=4, num_key_value_heads=1, head_dim=256, max_position_embeddings=32768,
                   norm_eps=1e-6, norm_unit_offset=True, norm_position="sandwich", hidden_act="gelu_pytorch_tanh",
                   embedding_multiplier=math.sqrt(640), qk_norm="head", query_pre_attn_scalar=256,
                   sliding_window=512, sliding_window_pattern=6,
                   rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
                   tie_word_embeddings=True),
    # allenai/OLMo-2-1124-7B config.json (norm on the sublayer output, full-width QK-norm)
    "olmo2": dict(vocab_size=100352, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, max_position_embeddings=4096, norm_eps=1e-6, norm_position="output",
                  qk_norm="full", rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                  tie_word_embeddings=False),
    # microsoft/phi-2 config.json (partial_rotary_factor=0.4, parallel block, lm_head bias)
    "phi": dict(_GPT_STYLE, vocab_size=51200, hidden_size=2560, intermediate_size=10240, num_hidden_layers=32,
                num_attention_heads=32, max_position_embeddings=2048, hidden_act="gelu_new", parallel_block=True,
                parallel_norms="shared", position_embedding_type="rope", partial_rotary_factor=0.4,
                tie_word_embeddings=False, lm_head_bias=True),
    # mistralai/Mixtral-8x7B-v0.1 config.json (8 experts, top-2, every layer sparse)
    "mixtral": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768, norm_eps=1e-5,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=False,
                    mlp_type="moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=14336,
                    norm_topk_prob=True, router_aux_loss_coef=0.02),
    # Qwen/Qwen3-30B-A3B config.json (128 experts, top-8 renormalised, per-head QK-norm)
    "qwen3_moe": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                      num_attention_heads=32, num_key_value_heads=4, head_dim=128, max_position_embeddings=40960,
                      norm_eps=1e-6, qk_norm="head", rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                      tie_word_embeddings=False, mlp_type="moe", num_experts=128, num_experts_per_tok=8,
                      moe_intermediate_size=768, norm_topk_prob=True, router_aux_loss_coef=0.001),
    # allenai/OLMoE-1B-7B-0924 config.json (64 experts, top-8 not renormalised, full-width QK-norm)
    "olmoe": dict(vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
                  num_attention_heads=16, max_position_embeddings=4096, norm_eps=1e-5, qk_norm="full",
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
                  mlp_type="moe", num_experts=64, num_experts_per_tok=8, moe_intermediate_size=1024,
                  norm_topk_prob=False, router_aux_loss_coef=0.01),
    # deepseek-ai/DeepSeek-V2-Lite config.json (MLA without the query bottleneck, first layer dense,
    # 64 routed + 2 shared experts, greedy top-6 softmax, YaRN x40 with mscale_all_dim 0.707)
    "deepseek_v2_lite": dict(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, num_hidden_layers=27, num_attention_heads=16,
        max_position_embeddings=163840, norm_eps=1e-6, attention_type="mla", q_lora_rank=None, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rope_interleaved=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                         "mscale": 0.707, "mscale_all_dim": 0.707},
        tie_word_embeddings=False, mlp_type="moe", first_dense_layers=1, num_experts=64, num_experts_per_tok=6,
        moe_intermediate_size=1408, n_shared_experts=2, norm_topk_prob=False, router_aux_loss_coef=0.0),
    # deepseek-ai/DeepSeek-V3 config.json (first 3 layers dense, 256 routed + 1 shared experts, sigmoid
    # scores with the correction bias, top-8 within the best 4 of 8 groups, scaled by 2.5; the
    # multi-token-prediction layer is not part of the model; `aux_loss_alpha` 0.001 is the α of its
    # sequence-wise balance loss, which the paper's §4.2 gives as 0.0001)
    "deepseek_v3": dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_hidden_layers=61, num_attention_heads=128,
        max_position_embeddings=163840, norm_eps=1e-6, attention_type="mla", q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rope_interleaved=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                         "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                         "mscale": 1.0, "mscale_all_dim": 1.0},
        tie_word_embeddings=False, mlp_type="moe", first_dense_layers=3, num_experts=256, num_experts_per_tok=8,
        moe_intermediate_size=2048, n_shared_experts=1, router_type="sigmoid_topk", n_group=8, topk_group=4,
        routed_scaling_factor=2.5, norm_topk_prob=True, router_aux_loss_coef=0.001),
    # Qwen/Qwen3-Next-80B-A3B-Instruct config.json (48 layers, three Gated DeltaNet for each full-attention layer;
    # zero-centred norms; full layers with per-head QK-norm, the output gate and a quarter of each head rotated; 512
    # experts, top-10, plus one gated shared expert; the multi-token-prediction module is not part of the model)
    "qwen3_next": dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=5120, num_hidden_layers=48, num_attention_heads=16,
        num_key_value_heads=2, head_dim=256, max_position_embeddings=262144, norm_eps=1e-6, norm_unit_offset=True,
        qk_norm="head", attn_output_gate=True, partial_rotary_factor=0.25,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0}, tie_word_embeddings=False,
        full_attention_interval=4, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, mlp_type="moe", num_experts=512, num_experts_per_tok=10,
        moe_intermediate_size=512, n_shared_experts=1, shared_expert_intermediate_size=512, shared_expert_gate=True,
        norm_topk_prob=True, router_aux_loss_coef=0.001),
    # Qwen/Qwen3.5-27B config.json, its `text_config` (64 layers, three Gated DeltaNet for each full-attention layer,
    # 48 value heads on 16 key heads; dense SwiGLU; the vision tower and the multi-token-prediction module are not
    # part of the model)
    "qwen3_5": dict(
        vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24,
        num_key_value_heads=4, head_dim=256, max_position_embeddings=262144, norm_eps=1e-6, norm_unit_offset=True,
        qk_norm="head", attn_output_gate=True, partial_rotary_factor=0.25,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0}, tie_word_embeddings=False,
        full_attention_interval=4, linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4),
    # allenai/Olmo-Hybrid-7B (transformers' `OlmoHybridConfig` defaults, which it documents as that checkpoint's: 32
    # layers, three Gated DeltaNet (30 heads, keys of 96, values of 192, β in (0, 2)) in pre-norm blocks for each
    # output-norm full-attention layer with QK-norm over the whole projection; NoPE, as released)
    "olmo_hybrid": dict(
        vocab_size=100352, hidden_size=3840, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=30,
        max_position_embeddings=65536, norm_eps=1e-6, norm_position="output", qk_norm="full",
        position_embedding_type="none", tie_word_embeddings=False, full_attention_interval=4,
        linear_attention_norm_position="pre", linear_num_key_heads=30, linear_num_value_heads=30,
        linear_key_head_dim=96, linear_value_head_dim=192, linear_conv_kernel_dim=4, linear_allow_neg_eigval=True,
        linear_norm_eps=1e-5),
    # openai/gpt-oss-20b config.json (24 layers, sliding (128) and full alternating from a sliding one; 64 query heads
    # of 64 over 8 K/V heads with biases and a sink per head; YaRN x32 from 4,096; 32 experts of width 2,880 in every
    # layer, a biased router keeping the top 4 logits and softmaxing over them, experts with biases and the SwiGLU
    # clamped at 7.0; `router_aux_loss_coef` 0.9; its experts are published in MXFP4)
    "gpt_oss": dict(
        vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, norm_eps=1e-5, attention_bias=True,
        attention_sinks=True, sliding_window=128, sliding_window_pattern=2,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
        tie_word_embeddings=False, mlp_type="moe", num_experts=32, num_experts_per_tok=4, moe_intermediate_size=2880,
        router_type="topk_softmax", router_bias=True, mlp_bias=True, swiglu_limit=7.0, router_aux_loss_coef=0.9),
    # HuggingFaceTB/SmolLM3-3B config.json (Llama's layout, GQA 16 / 4, NoPE every fourth layer: `no_rope_layers`
    # 1, 1, 1, 0, ...; no sliding window)
    "smollm3": dict(vocab_size=128256, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                    num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=65536, norm_eps=1e-6,
                    rope_parameters={"rope_type": "default", "rope_theta": 5000000.0}, tie_word_embeddings=True,
                    no_rope_interval=4),
    # microsoft/phi-4 config.json (Phi3ForCausalLM: fused qkv_proj and gate_up_proj in its files, GQA 40 / 10, no
    # sliding window, plain RoPE with base 250,000 over the whole head)
    "phi4": dict(vocab_size=100352, hidden_size=5120, intermediate_size=17920, num_hidden_layers=40,
                 num_attention_heads=40, num_key_value_heads=10, max_position_embeddings=16384, norm_eps=1e-5,
                 rope_parameters={"rope_type": "default", "rope_theta": 250000.0}, tie_word_embeddings=False),
    # allenai/Olmo-3-7B-Instruct config.json (OLMo 2's output norms and full-width QK-norm, MHA; three sliding layers
    # (window 4,096) for each full one; YaRN x8 from 8,192 on the full layers only)
    "olmo3": dict(vocab_size=100278, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, max_position_embeddings=65536, norm_eps=1e-6, norm_position="output",
                  qk_norm="full", sliding_window=4096, sliding_window_pattern=4,
                  rope_parameters={"full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 8.0,
                                                      "original_max_position_embeddings": 8192,
                                                      "attention_factor": 1.2079441541679836, "beta_fast": 32.0,
                                                      "beta_slow": 1.0},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0}},
                  tie_word_embeddings=False),
    # mistralai/Ministral-3-8B-Instruct-2512 config.json, its `text_config` (Mistral's layout, GQA 32 / 8 of 128,
    # YaRN x16 from 16,384; the query temperature 1 + 0.1 log(1 + floor(p / 16,384)); the vision tower is not part of
    # the model)
    "ministral3": dict(vocab_size=131072, hidden_size=4096, intermediate_size=14336, num_hidden_layers=34,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144,
                       norm_eps=1e-5, rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0,
                                                       "original_max_position_embeddings": 16384, "beta_fast": 32.0,
                                                       "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
                       attn_temperature_tuning=True, floor_scale=16384, attn_scale=0.1, tie_word_embeddings=False),
    # MiniMaxAI/MiniMax-M2 config.json (62 layers, GQA 48 / 8 of 128 with QK-norm over the whole projection, half of
    # each head rotated (`rotary_dim` 64); 256 experts of width 1,536 in every layer, chosen by sigmoid scores plus a
    # correction bias, top 8 renormalised; its weights are published in FP8 with 128x128 blocks)
    "minimax_m2": dict(vocab_size=200064, hidden_size=3072, intermediate_size=1536, num_hidden_layers=62,
                       num_attention_heads=48, num_key_value_heads=8, head_dim=128, max_position_embeddings=196608,
                       norm_eps=1e-6, qk_norm="full", partial_rotary_factor=0.5,
                       rope_parameters={"rope_type": "default", "rope_theta": 5000000.0}, tie_word_embeddings=False,
                       mlp_type="moe", num_experts=256, num_experts_per_tok=8, moe_intermediate_size=1536,
                       router_type="sigmoid_topk", norm_topk_prob=True, router_aux_loss_coef=0.001),
    # zai-org/GLM-4.5 config.json (92 layers, GQA 96 / 8 of 128 with q/k/v biases and per-head QK-norm, half of each
    # head rotated; the first 3 layers dense, then 160 routed experts of width 1,536 (sigmoid scores with the
    # correction bias, top 8, renormalised, scaled by 2.5) and one shared; its multi-token-prediction layer is not
    # part of the model)
    "glm4_5": dict(vocab_size=151552, hidden_size=5120, intermediate_size=12288, num_hidden_layers=92,
                   num_attention_heads=96, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                   norm_eps=1e-5, attention_bias=True, attention_output_bias=False, qk_norm="head",
                   partial_rotary_factor=0.5, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                   tie_word_embeddings=False, mlp_type="moe", first_dense_layers=3, num_experts=160,
                   num_experts_per_tok=8, moe_intermediate_size=1536, n_shared_experts=1, router_type="sigmoid_topk",
                   routed_scaling_factor=2.5, norm_topk_prob=True),
    # LiquidAI/LFM2-1.2B config.json (16 layers: gated short convolutions of 3 taps, GQA 32 / 8 with per-head QK-norm
    # at layers 2, 5, 8, 10, 12, 14 (`full_attn_idxs`); SwiGLU of width 8,192, what its `block_ff_dim` 12,288 builds
    # with `block_auto_adjust_ff_dim`: 2/3 of it, a multiple of 256; tied)
    "lfm2": dict(
        vocab_size=65536, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=128000, norm_eps=1e-5, qk_norm="head",
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=True,
        attention_layers=[2, 5, 8, 10, 12, 14], linear_attention_type="short_conv", linear_conv_kernel_dim=3),
    # moonshotai/Kimi-Linear-48B-A3B-Instruct config.json (27 layers: Kimi Delta Attention (32 heads of 128) with
    # latent attention without RoPE at layers 3, 7, 11, 15, 19, 23, 26 (its `full_attn_layers`, 1-based: 4, ..., 27),
    # MLA's latent norms at 1e-6 beside block norms at 1e-5; a dense first layer, then 256 experts of width 1,024,
    # top-8 by sigmoid scores (one group), renormalised and scaled by 2.446, and one shared expert)
    "kimi_linear": dict(
        vocab_size=163840, hidden_size=2304, intermediate_size=9216, num_hidden_layers=27, num_attention_heads=32,
        max_position_embeddings=1048576, norm_eps=1e-5, position_embedding_type="none", attention_type="mla",
        q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        latent_norm_eps=1e-6, tie_word_embeddings=False, attention_layers=[3, 7, 11, 15, 19, 23, 26],
        linear_attention_type="kda", linear_num_key_heads=32, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, mlp_type="moe", first_dense_layers=1, num_experts=256,
        num_experts_per_tok=8, moe_intermediate_size=1024, n_shared_experts=1, router_type="sigmoid_topk",
        norm_topk_prob=True, routed_scaling_factor=2.446),
    # meta-llama/Llama-4-Scout-17B-16E config.json, its `text_config` (48 layers: chunks of 8,192 on the RoPE layers,
    # a NoPE full-attention layer every fourth with the temperature tuned (floor 8,192, scale 0.1); Llama 3 RoPE x8
    # on interleaved pairs; the rotated q / k RMS-normed without weight; 16 experts of width 8,192 in every layer, a
    # top-1 sigmoid router scaling the expert's input, one shared expert of the same width; the vision tower is not
    # part of the model)
    "llama4": dict(
        vocab_size=202048, hidden_size=5120, intermediate_size=16384, num_hidden_layers=48, num_attention_heads=40,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=262144, norm_eps=1e-5, qk_norm="weightless",
        rope_interleaved=True, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                                "original_max_position_embeddings": 8192},
        attention_chunk_size=8192, no_rope_interval=4, attn_temperature_tuning=True, floor_scale=8192,
        attn_scale=0.1, attn_temperature_offset=1, attn_temperature_layers="nope", tie_word_embeddings=False,
        mlp_type="moe", num_experts=16, num_experts_per_tok=1,
        moe_intermediate_size=8192, n_shared_experts=1, router_type="topk_sigmoid", norm_topk_prob=False,
        apply_router_weight_on_input=True, router_aux_loss_coef=0.001),
    # google/gemma-4-E2B config.json, its `text_config` (35 layers, four local (window 512) for each global one; global
    # layers with heads of 512 and proportional RoPE on a quarter of their pairs (base 1M), local ones of 256 (base
    # 10k), one K/V head; the last 20 layers read the keys and values of the last local and global layer before
    # them, with MLPs twice as wide (`use_double_wide_mlp`); per-layer embeddings of 256; a scalar per layer; the
    # vision and audio towers are not part of the model)
    "gemma4": dict(
        vocab_size=262144, hidden_size=1536, intermediate_size=6144, num_hidden_layers=35, num_attention_heads=8,
        num_key_value_heads=1, head_dim=256, global_head_dim=512, max_position_embeddings=131072, norm_eps=1e-6,
        norm_position="sandwich", hidden_act="gelu_pytorch_tanh", embedding_multiplier=math.sqrt(1536),
        qk_norm="head", value_norm=True, query_pre_attn_scalar=1.0, sliding_window=512, sliding_window_pattern=5,
        rope_parameters={"full_attention": {"rope_type": "proportional", "rope_theta": 1000000.0,
                                            "partial_rotary_factor": 0.25},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        final_logit_softcapping=30.0, num_kv_shared_layers=20, double_wide_shared_mlp=True,
        hidden_size_per_layer_input=256, vocab_size_per_layer_input=262144, layer_scalar=True,
        tie_word_embeddings=True),
    # google/gemma-3n-E2B config.json, its `text_config` (30 layers, four local (window 512) for each global one, heads
    # of 256, 2 K/V heads; AltUp's 4 streams around every layer, LAUREL of rank 64 beside attention, per-layer
    # embeddings of 256; the last 10 layers read the keys and values of the last local and global layer before them;
    # the first 10 layers' gates sparsified to 95 %; the vision and audio towers are not part of the model)
    "gemma3n": dict(
        vocab_size=262400, hidden_size=2048, intermediate_size=8192, num_hidden_layers=30, num_attention_heads=8,
        num_key_value_heads=2, head_dim=256, max_position_embeddings=32768, norm_eps=1e-6, norm_position="sandwich",
        hidden_act="gelu_pytorch_tanh", embedding_multiplier=math.sqrt(2048), qk_norm="head", value_norm=True,
        query_pre_attn_scalar=1.0, sliding_window=512, sliding_window_pattern=5,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        final_logit_softcapping=30.0, num_kv_shared_layers=10, hidden_size_per_layer_input=256,
        vocab_size_per_layer_input=262144, residual_stream="altup", altup_num_inputs=4, laurel_rank=64,
        sparse_first_layers=10, tie_word_embeddings=True),
}

# The Mamba-2 hybrids. Their layouts: the attention layers by index (the rest Mamba-2), or Nemotron-H's pattern, a
# letter per layer (M: Mamba-2, *: attention, -: MLP, E: experts), each layer one sublayer.
MAMBA2 = dict(linear_attention_type="mamba2", mamba_d_conv=4, mamba_chunk_size=256, mamba_conv_bias=True,
              mamba_proj_bias=False)
PRESETS.update({
    # ibm-ai-platform/Bamba-9B config.json (32 layers, attention at 9, 18 and 27 with RoPE on half of each head;
    # Mamba-2 with 128 heads of 64, one group, a state of 128)
    "bamba": dict(MAMBA2, vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=262144, norm_eps=1e-5,
                  partial_rotary_factor=0.5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                  tie_word_embeddings=False, attention_layers=[9, 18, 27], mamba_n_heads=128, mamba_d_head=64,
                  mamba_n_groups=1, mamba_d_state=128),
    # ibm-granite/granite-4.0-h-tiny config.json (40 layers, attention without positions at 5, 15, 25 and 35;
    # 64 experts of 512, top-6, beside a shared MLP of 1,024; Granite's μP multipliers; Mamba-2 with 48 heads of 64)
    "granite_4_h_tiny": dict(
        MAMBA2, vocab_size=100352, hidden_size=1536, intermediate_size=1024, num_hidden_layers=40,
        num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=131072, norm_eps=1e-5,
        position_embedding_type="none", query_pre_attn_scalar=0.0078125 ** -2, embedding_multiplier=12.0,
        residual_multiplier=0.22, logits_scaling=6.0, tie_word_embeddings=True, attention_layers=[5, 15, 25, 35],
        mamba_n_heads=48, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128, mlp_type="moe", num_experts=64,
        num_experts_per_tok=6, moe_intermediate_size=512, router_type="topk_softmax", n_shared_experts=1,
        shared_expert_intermediate_size=1024, router_aux_loss_coef=0.0),
    # nvidia/Nemotron-H-8B-Base-8K config.json (52 layers, each one sublayer: 24 Mamba-2 (128 heads of 64, 8 groups,
    # chunks of 128), 4 attention layers without positions, 24 relu² MLPs)
    "nemotron_h": dict(
        MAMBA2, vocab_size=131072, hidden_size=4096, intermediate_size=21504, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=8192, norm_eps=1e-5, mlp_type="dense",
        hidden_act="relu2", position_embedding_type="none", tie_word_embeddings=False,
        block_pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-", mamba_n_heads=128, mamba_d_head=64,
        mamba_n_groups=8, mamba_d_state=128, mamba_chunk_size=128),
    # tiiuae/Falcon-H1-7B-Base's sizes (transformers' Falcon-H1 documentation table and the release's config.json:
    # 44 layers, each attention (12 heads of 128 over 2 K/V heads) and Mamba-2 (24 heads of 128, one group, a state
    # of 256, chunks of 128) side by side on the same input, a SwiGLU of 12,288). Its μP multipliers and RoPE base are
    # the release's training choices and leave every shape alone: here transformers' FalconH1Config defaults (all 1)
    "falcon_h1": dict(
        MAMBA2, vocab_size=130048, hidden_size=3072, intermediate_size=12288, num_attention_heads=12,
        num_key_value_heads=2, head_dim=128, num_hidden_layers=44, max_position_embeddings=262144, norm_eps=1e-5,
        mlp_type="gated", hidden_act="silu", tie_word_embeddings=False, hybrid_layers=True, mamba_n_heads=24,
        mamba_d_head=128, mamba_n_groups=1, mamba_d_state=256, mamba_chunk_size=128, mamba_rms_norm=False),
})
# The tiny Mamba-2 layer (8 heads of 16 at d = 64, a state of 16, chunks of 16: in_proj 296 wide, a multiple of 8 as
# PEFT's block methods ask) and Nemotron-H's tiny pattern
TINY_MAMBA2 = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=16)
TINY_BLOCK_PATTERNS = {False: "M*M-", True: "M*ME"}  # by whether the preset has experts
NEMOTRON_LAYERS = {"M": ("mixer", "linear_attention", "dense"), "*": ("mixer", "full_attention", "dense"),
                   "-": ("mlp", "full_attention", "dense"), "E": ("mlp", "full_attention", "sparse")}

# deepseek-ai/DeepSeek-V3.2-Exp config.json: DeepSeek-V3's, with DeepSeek Sparse Attention, a lightning indexer of
# 64 heads of width 128 in every layer choosing each query's 2,048 keys (its multi-token-prediction layer, as V3's,
# is not part of the model)
PRESETS["deepseek_v32"] = dict(PRESETS["deepseek_v3"], attention_type="dsa", index_n_heads=64, index_head_dim=128,
                               index_topk=2048)

# DeepSeek-V4-Flash as transformers' `DeepseekV4Config` defaults give it (its docstring names
# deepseek-ai/DeepSeek-V4-Flash-Base): 43 layers, each a window of 128 keys over one key = value head of width 512
# (64 query heads from a 1,024-wide latent, the last 64 features rotated, interleaved) with sinks, a grouped output
# (8 groups of 1,024), two heavily compressed (HCA, 128 tokens per entry) layers then CSA (4 tokens, overlapping,
# an indexer of 64 heads of 128 keeping 512 entries) and HCA alternating, the compressed layers' RoPE base 160,000;
# 4 hyper-connection streams (20 Sinkhorn steps); 256 experts of width 2,048 in every layer, 6 per token by √softplus
# scores plus one shared, the first 3 layers routed by token id, SwiGLU clamped at 10 (its MTP module is not part of
# the model, as transformers' class does not hold it)
_V4_LAYERS = 43
PRESETS["deepseek_v4"] = dict(
    vocab_size=129280, hidden_size=4096, intermediate_size=2048, num_hidden_layers=_V4_LAYERS, num_attention_heads=64,
    num_key_value_heads=1, head_dim=512, max_position_embeddings=1048576, norm_eps=1e-6, tie_word_embeddings=False,
    bos_token_id=0, eos_token_id=1, attention_type="shared_kv", attention_sinks=True, q_lora_rank=1024, o_groups=8,
    o_lora_rank=1024, sliding_window=128, compressed_layers=True,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}, index_n_heads=64,
    index_head_dim=128, index_topk=512, rope_interleaved=True, partial_rotary_factor=64 / 512,
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                     "compressed_sparse_attention": {"rope_type": "default", "rope_theta": 160000.0},
                     "heavily_compressed_attention": {"rope_type": "default", "rope_theta": 160000.0}},
    residual_stream="hyper_connections", hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, mlp_type="moe",
    num_experts=256, num_experts_per_tok=6, moe_intermediate_size=2048, n_shared_experts=1,
    router_type="sqrtsoftplus_topk", routed_scaling_factor=1.5, num_hash_layers=3, swiglu_limit=10.0, swiglu_alpha=1.0,
    swiglu_up_offset=0.0, router_aux_loss_coef=0.001)
# Qwen/Qwen3.5-35B-A3B config.json, its `text_config`: Qwen3-Next's layout at 40 layers, with 256 experts, top-8 (a
# shared expert of width 512 beside them, in every layer; the vision tower and the multi-token-prediction module are
# not part of the model)
PRESETS["qwen3_5_moe"] = dict(PRESETS["qwen3_next"], vocab_size=248320, num_hidden_layers=40, num_experts=256,
                              num_experts_per_tok=8)

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=128)
# Tiny latent attention (every width a quarter of a 64-wide model's) and tiny experts: 8 of width 32, top-2,
# grouped routing kept as 4 groups of 2 with the best 2 groups eligible.
TINY_MLA = dict(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
TINY_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
# A tiny lightning indexer that keeps 4 keys per query, so prompts of a few tokens already attend sparsely (8 heads:
# a tie at the k-th place, a key every head's ReLU zeroes beside another, stays rare)
TINY_INDEXER = dict(index_n_heads=8, index_head_dim=16, index_topk=4)


# The pre-training length a tiny preset's scaled RoPE (YaRN, LongRoPE, llama3) extends, so that its scaled range is
# reached within the tiny `max_position_embeddings`
TINY_ORIGINAL_LENGTH = 32


def _tiny_rope(params: dict | None) -> dict | None:
    """A preset's RoPE dict (flat, or nested by layer type) with each scaled table extending `TINY_ORIGINAL_LENGTH`."""
    if not params:
        return params
    if all(isinstance(table, dict) for table in params.values()):
        return {key: _tiny_rope(table) for key, table in params.items()}
    if not params.get("original_max_position_embeddings"):
        return params
    return dict(params, original_max_position_embeddings=TINY_ORIGINAL_LENGTH,
                factor=TINY["max_position_embeddings"] / TINY_ORIGINAL_LENGTH)


def _layer_types(num_layers: int, pattern: int | None, sliding_window: int | None) -> list[str] | None:
    """Every `pattern`-th layer global, the rest local (Gemma 2: pattern 2, Gemma 3: 6)."""
    if pattern is None or sliding_window is None:
        return None
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]


def _hybrid_layer_types(num_layers: int, interval: int) -> list[str]:
    """Qwen3-Next's `full_attention_interval`: every `interval`-th layer full attention, the others linear."""
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
def _block_pattern(pattern: str, experts: bool) -> dict:
    """Nemotron-H's pattern (a letter per layer) as `block_types`, `layer_types` and, with experts,
    `mlp_layer_types`."""
    blocks, mixers, mlps = (list(column) for column in zip(*(NEMOTRON_LAYERS[letter] for letter in pattern)))
    fields = dict(num_hidden_layers=len(pattern), block_types=blocks, layer_types=mixers)
    return dict(fields, mlp_layer_types=mlps) if experts else fields


def _no_rope_layers(num_layers: int, interval: int | None) -> list[int] | None:
    """SmolLM3's `no_rope_layer_interval`: every `interval`-th layer NoPE (0), the rest RoPE (1)."""
    if interval is None:
        return None
    return [int((i + 1) % interval != 0) for i in range(num_layers)]


def _compressed_layer_types(num_layers: int) -> list[str]:
    """DeepSeek-V4's schedule (transformers' default): two HCA layers, then CSA and HCA alternating from CSA."""
    rest = ["compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(num_layers - 2)]
    return ["heavily_compressed_attention"] * min(num_layers, 2) + rest


def _mlp_layer_types(num_layers: int, first_dense: int | None) -> list[str] | None:
    """DeepSeek's `first_k_dense_replace`: the first layers dense, the rest sparse."""
    if first_dense is None:
        return None
    return ["dense"] * first_dense + ["sparse"] * (num_layers - first_dense)


def preset_config(name: str, tiny: bool = False, **overrides) -> ModularDecoderConfig:
    """The config of preset `name`; `tiny=True` keeps every switch and shrinks the sizes.

    Tiny: 2 layers, d=64, 4 heads keeping MHA / GQA / MQA, vocabulary 128; MLA widths of a 64-wide model and a
    DSA indexer of 8 heads of 16 keeping 4 keys per query; 8 experts of width 32, top-2, one dense layer first
    where the preset has dense layers; NoPE on the second layer where the preset has NoPE layers; a hybrid's
    linear-attention layer then its full layer, with 2 key heads of 16 and values in the preset's ratios."""
    if name not in PRESETS:
        raise ValueError(f"Unknown preset {name!r}; known presets: {sorted(PRESETS)}.")
    fields = copy.deepcopy(PRESETS[name])  # the config standardises its rope dicts in place
    pattern = fields.pop("sliding_window_pattern", None)
    first_dense = fields.pop("first_dense_layers", None)
    interval = fields.pop("full_attention_interval", None)
    no_rope_interval = fields.pop("no_rope_interval", None)
    compressed = fields.pop("compressed_layers", False)
    double_wide = fields.pop("double_wide_shared_mlp", False)
    sparse_first = fields.pop("sparse_first_layers", None)
    attention_layers = fields.pop("attention_layers", None)
    block_pattern = fields.pop("block_pattern", None)
    hybrid_layers = fields.pop("hybrid_layers", False)  # every layer attention and Mamba-2 side by side
    if tiny:
        heads, kv = fields["num_attention_heads"], fields.get("num_key_value_heads") or fields["num_attention_heads"]
        fields.update(TINY, num_attention_heads=4, num_key_value_heads=4 if kv == heads else (1 if kv == 1 else 2))
        fields.pop("head_dim", None)
        if "embedding_multiplier" in fields:
            fields["embedding_multiplier"] = math.sqrt(TINY["hidden_size"])
        if "sliding_window" in fields:
            fields["sliding_window"] = 8
        if fields.get("query_pre_attn_scalar"):
            fields["query_pre_attn_scalar"] = 16
        if pattern is not None:
            pattern = 2
        if fields.get("attention_type") in ("mla", "dsa"):
            fields.update(TINY_MLA, q_lora_rank=None if fields["q_lora_rank"] is None else 48)
            if fields["attention_type"] == "dsa":
                fields.update(TINY_INDEXER)
        fields["rope_parameters"] = _tiny_rope(fields.get("rope_parameters"))
        if fields.get("floor_scale"):  # the query temperature steps within the tiny range too, at the RoPE's length
            fields["floor_scale"] = TINY_ORIGINAL_LENGTH
        if fields.get("mlp_type") == "moe":
            fields.update(TINY_MOE)
            if fields.get("n_group", 1) > 1:
                fields.update(n_group=4, topk_group=2)
        if first_dense:
            first_dense = 1
        if interval is not None:  # one linear and one full layer
            interval = 2
        if attention_layers is not None:  # one linear layer, then one attention layer
            attention_layers = [1]
        if fields.get("linear_num_key_heads"):  # 2 key heads, value heads and widths in the preset's ratios
            ratio = fields["linear_num_value_heads"] // fields["linear_num_key_heads"]
            widths = fields["linear_value_head_dim"] // fields["linear_key_head_dim"]  # OLMo hybrid's values: 2x
            fields.update(linear_num_key_heads=2, linear_num_value_heads=2 * ratio, linear_key_head_dim=16,
                          linear_value_head_dim=16 * widths)
        if fields.get("shared_expert_intermediate_size"):
            fields["shared_expert_intermediate_size"] = TINY_MOE["moe_intermediate_size"]
        if no_rope_interval is not None:
            no_rope_interval = 2
        if compressed:  # one CSA layer after an HCA one: entries every 4 and 8 tokens, 4 of them kept per query
            fields.update(num_attention_heads=4, num_key_value_heads=1, head_dim=32, q_lora_rank=48, o_groups=2,
                          o_lora_rank=16, partial_rotary_factor=0.5, num_hash_layers=1, **TINY_INDEXER,
                          compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8})
        if "attention_chunk_size" in fields:  # chunks these lengths cross
            fields["attention_chunk_size"] = 8
        if fields.get("num_kv_shared_layers"):  # a local and a global layer, then two reading theirs
            fields.update(num_hidden_layers=4, num_kv_shared_layers=2)
        if fields.get("global_head_dim"):
            fields["global_head_dim"] = 2 * TINY["hidden_size"] // 4
        if fields.get("hidden_size_per_layer_input"):
            fields.update(hidden_size_per_layer_input=8, vocab_size_per_layer_input=TINY["vocab_size"])
        if fields.get("laurel_rank"):
            fields["laurel_rank"] = 8
        if sparse_first:
            sparse_first = 1
        if fields.get("linear_attention_type") == "mamba2":  # one Mamba-2 layer, then one attention layer
            fields.update(TINY_MAMBA2, mamba_n_groups=min(fields["mamba_n_groups"], 2))
        if block_pattern is not None:
            block_pattern = TINY_BLOCK_PATTERNS[fields.get("mlp_type") == "moe"]
    if block_pattern is not None:
        fields.update(_block_pattern(block_pattern, fields.get("mlp_type") == "moe"))
    if hybrid_layers:
        fields["layer_types"] = ["hybrid"] * fields["num_hidden_layers"]
    if attention_layers is not None and "layer_types" not in overrides:
        fields["layer_types"] = ["full_attention" if i in attention_layers else "linear_attention"
                                 for i in range(fields["num_hidden_layers"])]
    fields.update(overrides)
    if "layer_types" not in overrides and "layer_types" not in fields:
        fields["layer_types"] = _layer_types(fields["num_hidden_layers"], pattern, fields.get("sliding_window"))
        if interval is not None:
            fields["layer_types"] = _hybrid_layer_types(fields["num_hidden_layers"], interval)
        if compressed:
            layers = fields["num_hidden_layers"]
            fields["layer_types"] = (_compressed_layer_types(layers) if layers > 2
                                     else ["heavily_compressed_attention", "compressed_sparse_attention"][:layers])
    if "mlp_layer_types" not in overrides and "mlp_layer_types" not in fields:
        fields["mlp_layer_types"] = _mlp_layer_types(fields["num_hidden_layers"], first_dense)
    if "no_rope_layers" not in overrides:
        fields["no_rope_layers"] = _no_rope_layers(fields["num_hidden_layers"], no_rope_interval)
    if sparse_first and "activation_sparsity_pattern" not in overrides:  # Gemma 3n: the first layers' gates, 95 %
        fields["activation_sparsity_pattern"] = [0.95 * (i < sparse_first) for i in range(fields["num_hidden_layers"])]
    if double_wide and "layer_intermediate_sizes" not in overrides:  # the layers reading shared keys: twice as wide
        layers, shared = fields["num_hidden_layers"], fields["num_kv_shared_layers"]
        fields["layer_intermediate_sizes"] = [fields["intermediate_size"] * (1 + (i >= layers - shared))
                                              for i in range(layers)]
    if fields.get("attention_chunk_size") and "layer_types" not in overrides:  # Llama 4: chunks where RoPE turns
        fields["layer_types"] = ["chunked_attention" if rotates else "full_attention"
                                 for rotates in fields["no_rope_layers"] or [1] * fields["num_hidden_layers"]]
    return ModularDecoderConfig(**fields)
