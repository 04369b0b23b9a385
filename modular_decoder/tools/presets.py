"""Named presets: the published layouts as small dicts of contract overrides.

Each names the `config.json` it follows. `preset_config(name, tiny=True)` keeps the layout (every
switch) and shrinks the sizes, for tests and experiments.
"""

from __future__ import annotations

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
}

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=128)


def _layer_types(num_layers: int, pattern: int | None, sliding_window: int | None) -> list[str] | None:
    """Every `pattern`-th layer global, the rest local (Gemma 2: pattern 2, Gemma 3: 6)."""
    if pattern is None or sliding_window is None:
        return None
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]


def preset_config(name: str, tiny: bool = False, **overrides) -> ModularDecoderConfig:
    """The contract of preset `name`; `tiny=True` keeps every switch and shrinks the sizes
    (2 layers, d=64, 4 heads keeping MHA / GQA / MQA, vocabulary 128)."""
    if name not in PRESETS:
        raise ValueError(f"Unknown preset {name!r}; known presets: {sorted(PRESETS)}.")
    fields = dict(PRESETS[name])
    pattern = fields.pop("sliding_window_pattern", None)
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
    fields.update(overrides)
    if "layer_types" not in overrides:
        fields["layer_types"] = _layer_types(fields["num_hidden_layers"], pattern, fields.get("sliding_window"))
    return ModularDecoderConfig(**fields)
