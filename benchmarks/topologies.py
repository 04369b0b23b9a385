"""Llama 4, Gemma 4 and Gemma 3n (text): ours against each transformers class with the same weights, and the cache
bytes per token that sharing keys and values across layers leaves, ours against transformers', at the published
Gemma 3n and Gemma 4 layouts (CPU, fp32 timings; bf16 caches).

    HF_HUB_OFFLINE=1 .venv/bin/python -m benchmarks topologies [--repeats 3] [--prompt 512] [--new-tokens 32]
        [--contexts 4096 32768] [--families ...] [--threads N] [--out FILE]

Side by side (`hybrid.side_by_side`), per family a small model of its layout at hidden 512 (8 query heads of 64,
vocabulary 8,192), made by transformers' class and converted (`families.save_pair`), both loaded with
`from_pretrained` (SDPA): prefill of 1 x PROMPT tokens (no cache, the last position's logits) and greedy decode of
NEW_TOKENS after a 16-token prompt (batch 1, each side through its own cache), tokens/s, the sides alternating, their
ratio per repeat, and the largest logit difference of the prefill.
- Llama 4: 4 layers (chunks of 128 on the RoPE layers, the fourth NoPE with the temperature tuned from 128 tokens),
  2 K/V heads, the weightless QK-norm, interleaved RoPE; 8 experts of 1,024 in every layer, top-1 sigmoid scaling
  the input, a shared expert of 1,024.
- Gemma 4: 6 layers, local (window 128) then global every third; global layers with heads of 128 and one K/V head
  whose values are the key projection's output, proportional RoPE on a quarter of them; the last 2 layers reading
  earlier layers' keys and values with MLPs twice as wide (2,048); per-layer embeddings of 64; a soft-capped head.
- Gemma 3n: 6 layers, local (window 128) then global every third, 2 K/V heads; AltUp's 4 streams, LAUREL of rank 64,
  per-layer embeddings of 64, the last 2 layers reading earlier layers' keys and values, the Gaussian top-k on the
  first 2 layers' gates, MLPs of 2,048, a soft-capped head.

Cache bytes (`meta_cache.bytes_per_token`): the `gemma3n` (google/gemma-3n-E2B) and `gemma4` (google/gemma-4-E2B)
presets, both sides built on the meta device in bf16 and run through each side's own cache: a prefill of C tokens
and one decode step; every tensor each cache layer holds, each storage once, at its allocated size, per token, per
layer group (the shared layers hold none on either side), beside ours' payload and, from the contract's arithmetic
(`contract.cache_bytes`), what the same model would hold with no layer sharing (`num_kv_shared_layers=0`).
`--smoke`: tiny widths, a 32-token prompt, 4 new tokens, the tiny presets at 40 and 100 tokens.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import transformers as tf

from . import harness, meta_cache
from .hybrid import side_by_side, side_by_side_parser, side_rows

SIZES = dict(vocab_size=8192, hidden_size=512, num_attention_heads=8, head_dim=64, max_position_embeddings=4096,
             tie_word_embeddings=False)
SMOKE_SIZES = dict(SIZES, vocab_size=256, hidden_size=64, num_attention_heads=4, head_dim=16)
CLASSES = {"llama4_text": "Llama4ForCausalLM", "gemma4_text": "Gemma4ForCausalLM",
           "gemma3n_text": "Gemma3nForCausalLM"}
LOCAL_LOCAL_GLOBAL = ["sliding_attention", "sliding_attention", "full_attention"] * 2
# the KV-sharing presets whose cache bytes the run counts: preset -> conversion family
SHARING = {"gemma3n": "gemma3n_text", "gemma4": "gemma4_text"}


def reference_configs(s: dict, smoke: bool) -> dict:
    """Each family's transformers config at sizes `s` (module docstring; `smoke`: a 16-token window and chunk)."""
    width, window = s["hidden_size"], 16 if smoke else 128
    gemma = dict(s, sliding_window=window, hidden_size_per_layer_input=width // 8,
                 vocab_size_per_layer_input=s["vocab_size"], layer_types=LOCAL_LOCAL_GLOBAL,
                 num_hidden_layers=len(LOCAL_LOCAL_GLOBAL), num_kv_shared_layers=2, final_logit_softcapping=30.0,
                 intermediate_size=4 * width, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    return {
        "llama4_text": tf.Llama4TextConfig(
            **s, num_hidden_layers=4, num_key_value_heads=2, intermediate_size=2 * width,
            intermediate_size_mlp=4 * width, num_local_experts=8, interleave_moe_layer_step=1,
            attention_chunk_size=window, floor_scale=window, pad_token_id=None, bos_token_id=None, eos_token_id=None),
        "gemma4_text": tf.Gemma4TextConfig(
            **gemma, num_key_value_heads=2, global_head_dim=2 * s["head_dim"], num_global_key_value_heads=1,
            attention_k_eq_v=True, use_double_wide_mlp=True),
        "gemma3n_text": tf.Gemma3nTextConfig(
            **gemma, num_key_value_heads=2, altup_num_inputs=4, laurel_rank=width // 8,
            activation_sparsity_pattern=[0.95, 0.95, 0.0, 0.0, 0.0, 0.0]),
    }


def sharing_bytes(contexts: list[int], smoke: bool) -> dict:
    """Per KV-sharing preset: `meta_cache.bytes_per_token` rows, each with what the same model would hold without
    sharing (the contract's payload for `num_kv_shared_layers=0`, per token)."""
    from modular_decoder import preset_config
    from modular_decoder.contract import cache_bytes

    result = {}
    for preset, family in SHARING.items():
        rows = meta_cache.bytes_per_token(preset, family, contexts, tiny=smoke)
        unshared = preset_config(preset, tiny=smoke, num_kv_shared_layers=0)
        for row in rows:
            tokens = row["context"] + 1
            row["ours_payload_without_sharing_per_token"] = cache_bytes(unshared, tokens, dtype=torch.bfloat16) / tokens
        result[preset] = rows
    return result


def report(result: dict) -> str:
    """The two tables (markdown)."""
    first = next(iter(result["families"].values()))
    lines = [f"| family: 1 x {first['prompt']} prefill / batch-1 decode of {first['new_tokens']} | transformers "
             "tok/s | ours tok/s | ours / it (median; range) |", "|---|---:|---:|---:|"]
    for family, side in result["families"].items():
        lines += side_rows(side, CLASSES[family], f"{family} ")
    lines += ["", *meta_cache.TABLE_HEAD]
    for preset, rows in result["kv_sharing"].items():
        lines += meta_cache.rows_markdown(preset, rows, ("no layer sharing (the contract's payload)",
                                                         "ours_payload_without_sharing_per_token"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = side_by_side_parser("topologies", __doc__, [4096, 32768], CLASSES)
    args = parser.parse_args(argv)
    run = harness.begin("topologies", argv, args)
    prompt, new_tokens = (32, 4) if args.smoke else (args.prompt, args.new_tokens)
    contexts = [40, 100] if args.smoke else args.contexts
    configs = reference_configs(SMOKE_SIZES if args.smoke else SIZES, args.smoke)
    result = {"sizes": SMOKE_SIZES if args.smoke else SIZES, "families": {}}
    for family in args.families:
        with tempfile.TemporaryDirectory() as tmp:
            side = side_by_side(Path(tmp), configs[family], prompt, new_tokens, args.repeats,
                                reference=CLASSES[family])
        result["families"][family] = dict(side, reference=CLASSES[family])
        print(f"{family}: prefill {side['prefill']['median_ratio']:.2f}x, decode {side['decode']['median_ratio']:.2f}x"
              f" (ours / {CLASSES[family]}); largest logit difference {side['max_logit_diff']:.1e}", flush=True)
    result["kv_sharing"] = sharing_bytes(contexts, args.smoke)
    print(report(result))
    harness.write_result(args.out, result, run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
