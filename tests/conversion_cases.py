"""Tiny random configs of every convertible family, built with transformers' own config classes."""

from __future__ import annotations

import transformers as tf

V, D, F, L, H, P = 96, 32, 64, 2, 4, 64
COMMON = dict(vocab_size=V, hidden_size=D, intermediate_size=F, num_hidden_layers=L, num_attention_heads=H,
              max_position_embeddings=P)
GPT = dict(vocab_size=V, n_embd=D, n_layer=L, n_head=H, n_positions=P)

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
}
