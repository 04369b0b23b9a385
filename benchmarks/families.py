"""The model pairs the benchmarks measure: transformers' own class and ours with the same weights.

`save_pair(config, folder)` is the one way to make a pair: random weights made by transformers' own class for a
transformers config, saved, and converted with `modular_decoder.conversion.convert` (the production path);
`load_pair(folder)` loads both sides the default way. `build_pair(name, ...)` does both for the named families
below.

Each entry builds the reference with transformers (random weights at a small-but-real shape, or
the real SmolLM2 checkpoint for `llama`), converts it with `modular_decoder.conversion.convert`
(the production path) and loads the result with `AutoModelForCausalLM`. `quick=True` gives tiny
shapes for a smoke test.

`mixtral` and `deepseek_moe` are mixture-of-experts layouts (random weights) small enough for a 24 GB,
2-core machine: Mixtral's (8 experts, top-2, softmax router, GQA) and DeepSeek-V3's (latent attention,
a dense first layer, 64 routed experts top-6 chosen within 4 of 8 groups by a sigmoid router with a
correction bias and a routed scaling factor, one shared expert).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import transformers as tf

import modular_decoder  # noqa: F401  (registers the family with the Auto classes)
from modular_decoder.conversion import convert
from modular_decoder.commands.demo import GGUF_NAME, bundled_smollm2

# Tiny shapes for --quick (hidden 64, 2 layers, vocab 128)
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=1024)


def _llama_config(quick: bool):
    return tf.LlamaConfig(**TINY, num_key_value_heads=2, tie_word_embeddings=True)


def _gpt2_config(quick: bool):
    if quick:
        return tf.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=1024)
    # distilgpt2's shape (82M parameters)
    return tf.GPT2Config(vocab_size=50257, n_embd=768, n_layer=6, n_head=12, n_positions=1024)


def _gpt_neox_config(quick: bool):
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    if quick:
        return tf.GPTNeoXConfig(**TINY, rope_parameters=rope)
    # pythia-70m's shape
    return tf.GPTNeoXConfig(vocab_size=50304, hidden_size=512, intermediate_size=2048, num_hidden_layers=6,
                            num_attention_heads=8, max_position_embeddings=2048, rope_parameters=rope)


def _gemma2_config(quick: bool):
    # Gemma 2's structure (sandwich norms, alternating sliding/global layers, soft-caps) at a small
    # width: the smallest published Gemma 2 (2B) is too slow for a CPU suite.
    if quick:
        return tf.Gemma2Config(**TINY, num_key_value_heads=2, head_dim=16, sliding_window=16, query_pre_attn_scalar=16)
    return tf.Gemma2Config(vocab_size=32000, hidden_size=512, intermediate_size=2048, num_hidden_layers=6,
                           num_attention_heads=8, num_key_value_heads=4, head_dim=64, sliding_window=256,
                           query_pre_attn_scalar=64, max_position_embeddings=4096)


def _deepseek_v3_config(quick: bool):
    # DeepSeek-V3's MLA (q and kv low-rank, interleaved rotary part) with dense layers only.
    if quick:
        sizes = dict(**TINY, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
        layers = TINY["num_hidden_layers"]
    else:
        sizes = dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=6,
                     num_attention_heads=8, max_position_embeddings=4096, q_lora_rank=256, kv_lora_rank=128,
                     qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64)
        layers = 6
    return tf.DeepseekV3Config(**sizes, num_key_value_heads=sizes["num_attention_heads"],
                               first_k_dense_replace=layers, n_routed_experts=0, rms_norm_eps=1e-6)


def _mixtral_config(quick: bool):
    if quick:
        return tf.MixtralConfig(**TINY, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    # Mixtral-8x7B's structure (8 experts of width 3.5d, top-2, GQA 4:1) at d=512 x 6
    return tf.MixtralConfig(vocab_size=32000, hidden_size=512, intermediate_size=1792, num_hidden_layers=6,
                            num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096,
                            num_local_experts=8, num_experts_per_tok=2, rope_parameters={"rope_type": "default",
                                                                                         "rope_theta": 1e6})


def _deepseek_moe_config(quick: bool):
    # DeepSeek-V3's MoE layout: MLA, first layer dense, then routed experts chosen by a sigmoid router
    # (correction bias, group-limited top-k, routed scaling factor) plus one shared expert.
    if quick:
        sizes = dict(**TINY, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                     n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_group=2, topk_group=1)
    else:
        sizes = dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=6,
                     num_attention_heads=8, max_position_embeddings=4096, q_lora_rank=256, kv_lora_rank=128,
                     qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, n_routed_experts=64,
                     num_experts_per_tok=6, moe_intermediate_size=256, n_group=8, topk_group=4)
    config = tf.DeepseekV3Config(**sizes, num_key_value_heads=sizes["num_attention_heads"], first_k_dense_replace=1,
                                 n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                                 rms_norm_eps=1e-6)
    return config


def _gpt_oss_config(quick: bool):
    if quick:
        return tf.GptOssConfig(**TINY, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                               sliding_window=16)
    # gpt-oss's structure (attention sinks, 128-token windows alternating with full layers, YaRN, GQA 8:1, a
    # biased router over 32 biased experts of width d with the clamped SwiGLU, top-4) at d=512 x 6
    return tf.GptOssConfig(vocab_size=32000, hidden_size=512, intermediate_size=512, num_hidden_layers=6,
                           num_attention_heads=8, num_key_value_heads=1, head_dim=64, num_local_experts=32,
                           num_experts_per_tok=4, sliding_window=128)


def _smollm3_config(quick: bool):
    if quick:
        return tf.SmolLM3Config(**TINY, num_key_value_heads=2, pad_token_id=None, bos_token_id=1, eos_token_id=2)
    # SmolLM3's structure (no rotary position in every fourth layer, GQA 3:1, tied embeddings) at SmolLM2-135M's
    # shape (d=576 x 30, 9 heads): the published SmolLM3-3B is too slow for a CPU suite
    return tf.SmolLM3Config(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                            num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
                            max_position_embeddings=8192, pad_token_id=None, bos_token_id=1, eos_token_id=2)


CONFIGS: dict[str, Callable] = {
    "llama": _llama_config,
    "gpt2": _gpt2_config,
    "gpt_neox": _gpt_neox_config,
    "gemma2": _gemma2_config,
    "deepseek_v3": _deepseek_v3_config,
    "mixtral": _mixtral_config,
    "deepseek_moe": _deepseek_moe_config,
    "gpt_oss": _gpt_oss_config,
    "smollm3": _smollm3_config,
}
# The families with routed experts (their roofline counts the active weights only)
MOE_FAMILIES = ("mixtral", "deepseek_moe", "gpt_oss")
LABELS = {
    "llama": "SmolLM2-135M (real, GGUF Q4_1 -> fp32)",
    "gpt2": "distilgpt2 shape (random)",
    "gpt_neox": "pythia-70m shape (random)",
    "gemma2": "Gemma 2 structure, d=512 x 6 (random)",
    "deepseek_v3": "DeepSeek-V3 MLA dense, d=512 x 6 (random)",
    "mixtral": "Mixtral structure, d=512 x 6, 8 experts top-2 (random)",
    "deepseek_moe": "DeepSeek-V3 MoE structure, MLA, d=512 x 6, 64 experts top-6 + 1 shared (random)",
    "gpt_oss": "gpt-oss structure (sinks, alternating windows), d=512 x 6, 32 experts top-4 (random)",
    "smollm3": "SmolLM3 structure (NoPE every 4th layer) at SmolLM2-135M's shape (random)",
}
# LoRA target modules (transformers' names, ours) covering the same linear maps on both sides: q and v
# where both have them; the attention output and FFN down projections where transformers fuses QKV
# (GPT-2's c_attn, GPT-NeoX's query_key_value); the query and key/value up-projections for MLA.
LORA_TARGETS = {
    "llama": (["q_proj", "v_proj"], ["q_proj", "v_proj"]),
    "gpt2": (["c_proj"], ["o_proj", "down_proj"]),  # attn.c_proj and mlp.c_proj (Conv1D)
    "gpt_neox": (["dense", "dense_4h_to_h"], ["o_proj", "down_proj"]),
    "gemma2": (["q_proj", "v_proj"], ["q_proj", "v_proj"]),
    "deepseek_v3": (["q_b_proj", "kv_b_proj"], ["q_b_proj", "kv_b_proj"]),
    "mixtral": (["q_proj", "v_proj"], ["q_proj", "v_proj"]),
    "deepseek_moe": (["q_b_proj", "kv_b_proj"], ["q_b_proj", "kv_b_proj"]),
    "gpt_oss": (["q_proj", "v_proj"], ["q_proj", "v_proj"]),
    "smollm3": (["q_proj", "v_proj"], ["q_proj", "v_proj"]),
}


def save_pair(config, folder: Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0) -> Path:
    """Random weights made by transformers' class for `config` (seeded), saved to `folder/"hf"`, converted to
    `folder/"ours"`; returns `folder`. `device="cuda"` initialises on the GPU (seconds instead of a minute for a
    1B model on the host)."""
    folder = Path(folder)
    torch.manual_seed(seed)
    with torch.device(device):
        reference = tf.AutoModelForCausalLM.from_config(config, dtype=dtype)
    reference.save_pretrained(folder / "hf")
    del reference
    convert(folder / "hf", folder / "ours", progress=False)
    return folder


def load_side(folder: Path, side: str, *, dtype: torch.dtype = torch.float32, device: str = "cpu",
              attn_implementation: str | None = "sdpa"):
    """One side of a saved pair ("transformers" or "ours"), loaded with `AutoModelForCausalLM.from_pretrained`,
    in eval mode on `device`."""
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    path = Path(folder) / ("hf" if side == "transformers" else "ours")
    return tf.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs).to(device).eval()


def load_pair(folder: Path, **kwargs) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(transformers' model, ours) from a folder `save_pair` wrote; keyword arguments as `load_side`."""
    return load_side(folder, "transformers", **kwargs), load_side(folder, "ours", **kwargs)


def build_pair(name: str, folder: Path, quick: bool) -> tuple[torch.nn.Module, torch.nn.Module, str]:
    """(transformers' model, ours, label) of a named family, both fp32 in eval mode, same weights.

    `folder/"hf"` and `folder/"ours"` hold the two checkpoints (fp32 safetensors) afterwards, for the
    memory probes that load each in a fresh process."""
    folder = Path(folder)
    if name == "llama" and not quick:
        source, gguf = bundled_smollm2(), GGUF_NAME
        dequantized = tf.AutoModelForCausalLM.from_pretrained(source, gguf_file=gguf, dtype=torch.float32)
        # The GGUF loader de-quantizes to plain fp32 but keeps its quantizer, which refuses to save; drop it
        # so the reference is an ordinary fp32 Llama checkpoint, loaded back from disk like ours.
        dequantized.hf_quantizer = None
        del dequantized.config.quantization_config
        dequantized.save_pretrained(folder / "hf")
        del dequantized
        convert(source, folder / "ours", gguf_file=gguf, progress=False)
        label = LABELS[name]
    else:
        save_pair(CONFIGS[name](quick), folder)
        label = "tiny (random)" if quick else LABELS[name]
    reference, ours = load_pair(folder, attn_implementation=None)
    return reference, ours, label
