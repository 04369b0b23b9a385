"""The Mamba-2 hybrids (Bamba, Granite 4.0-H, Nemotron-H, Falcon-H1): ours against each transformers class with the
same weights, and one Mamba-2 layer's decode step beside a full-attention layer as the cached context grows (CPU,
fp32).

    HF_HUB_OFFLINE=1 .venv/bin/python -m benchmarks mamba2 [--repeats 3] [--prompt 512] [--new-tokens 32]
                                                           [--contexts 1024 4096 16384] [--threads N] [--out FILE]

Side by side, per family: a small model of its layout at hidden 512 (Mamba-2 of 16 heads of 64, one group, a state
of 64, 4 taps, chunks of 128; attention of 8 heads of 64 over 2 K/V heads; a SwiGLU or relu² FFN of 1,536;
vocabulary 8,192): Bamba and Granite 4.0-H (its dense layout, as Granite-4.0-H-Micro; no positions) with three Mamba-2
layers and one attention layer, Nemotron-H with the same mixers as eight one-sublayer layers (M - M * M - M -),
Falcon-H1 with attention and Mamba-2 side by side in four layers (its μP multipliers at 1). Made by transformers'
class and converted (`families.save_pair`), both loaded with `from_pretrained`: prefill of 1 x PROMPT tokens (no
cache, the last position's logits) and greedy decode of NEW_TOKENS after a 16-token prompt (batch 1, each side
through its own cache), tokens/s, the sides alternating (`measure.alternating`), their ratio per repeat, and the
largest logit difference of the prefill. Neither side has mamba_ssm or causal-conv1d on a CPU: transformers runs its
`torch_forward`, ours `mamba2_scan`'s PyTorch scan.

Flat in context (`hybrid.flat_in_context`): two one-layer models of ours at hidden 1024 (a Mamba-2 layer of 32 heads
of 64, one group, a state of 128, as Bamba-9B's; a full-attention layer of 8 heads of 128 over 2 K/V heads), the
Mamba-2 state filled by a real prefill of C tokens, the attention layer's cache with C random keys and values. Each
row: the median time of one decode step at C cached tokens and the bytes the cache holds (Mamba-2: its convolution
window and fp32 state; attention: its keys and values).
`--smoke`: tiny widths, a 32-token prompt, 4 new tokens, contexts 64 and 256.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import transformers as tf

from modular_decoder import ModularDecoderConfig, ModularDecoderForCausalLM

from . import harness
from .hybrid import OURS, context_rows, flat_in_context, side_by_side, side_by_side_parser, side_rows

# The side-by-side widths (`--smoke`: a 64-wide model)
SIZES = dict(hidden=512, heads=8, head_dim=64, mamba_heads=16, mamba_head_dim=64, state=64, chunk=128, ffn=1536,
             vocab=8192)
SMOKE_SIZES = dict(hidden=64, heads=4, head_dim=16, mamba_heads=8, mamba_head_dim=16, state=16, chunk=16, ffn=128,
                   vocab=256)
# The one-layer models of the context rows: Bamba-9B's Mamba-2 layer at hidden 1024 beside a GQA attention layer
LAYER_WIDTHS = dict(hidden_size=1024, num_attention_heads=8, num_key_value_heads=2, head_dim=128, mamba_n_heads=32,
                    mamba_d_head=64, mamba_d_state=128)
SMOKE_LAYER_WIDTHS = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, mamba_n_heads=8,
                          mamba_d_head=16, mamba_d_state=16)


def _common(s: dict) -> dict:
    return dict(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["ffn"],
                num_attention_heads=s["heads"], num_key_value_heads=2, max_position_embeddings=4096,
                tie_word_embeddings=False)


def _mamba(s: dict) -> dict:
    """Bamba's, Granite's and Falcon-H1's names for the mixer's sizes."""
    return dict(mamba_n_heads=s["mamba_heads"], mamba_d_head=s["mamba_head_dim"], mamba_n_groups=1,
                mamba_d_state=s["state"], mamba_d_conv=4, mamba_chunk_size=s["chunk"])


def reference_configs(s: dict) -> dict:
    """Family -> (transformers' class name, its config) at sizes `s`."""
    common, mamba = _common(s), _mamba(s)
    return {
        "bamba": ("BambaForCausalLM", tf.BambaConfig(**common, **mamba, num_hidden_layers=4, attn_layer_indices=[2],
                                                     mamba_expand=s["mamba_heads"] * s["mamba_head_dim"] // s["hidden"])),
        "granitemoehybrid": ("GraniteMoeHybridForCausalLM", tf.GraniteMoeHybridConfig(
            **common, **mamba, num_hidden_layers=4, layer_types=["mamba", "mamba", "attention", "mamba"],
            num_local_experts=0, shared_intermediate_size=s["ffn"],
            mamba_expand=s["mamba_heads"] * s["mamba_head_dim"] // s["hidden"])),
        "nemotron_h": ("NemotronHForCausalLM", tf.NemotronHConfig(
            **common, head_dim=s["head_dim"], layers_block_type=["linear_attention", "mlp", "linear_attention",
                                                                 "full_attention", "linear_attention", "mlp",
                                                                 "linear_attention", "mlp"],
            mamba_num_heads=s["mamba_heads"], mamba_head_dim=s["mamba_head_dim"], ssm_state_size=s["state"],
            n_groups=1, conv_kernel=4, chunk_size=s["chunk"])),
        "falcon_h1": ("FalconH1ForCausalLM", tf.FalconH1Config(
            **common, **mamba, head_dim=s["head_dim"], num_hidden_layers=4,
            mamba_d_ssm=s["mamba_heads"] * s["mamba_head_dim"], mamba_rms_norm=True)),
    }


def one_layer_models(widths: dict) -> dict:
    """Our one-layer models: a Mamba-2 layer (no positions: it reads none) and a full-attention layer, a small FFN
    and vocabulary so that a step is mostly the layer."""
    common = dict(vocab_size=256, intermediate_size=256, num_hidden_layers=1, norm_type="rmsnorm", mlp_type="gated",
                  hidden_act="silu", max_position_embeddings=65536)
    mamba_fields = {k: v for k, v in widths.items() if k.startswith("mamba_")}
    attention_fields = {k: v for k, v in widths.items() if not k.startswith("mamba_")}
    mamba = ModularDecoderConfig(**common, **mamba_fields, hidden_size=widths["hidden_size"],
                                 num_attention_heads=widths["num_attention_heads"], layer_types=["linear_attention"],
                                 linear_attention_type="mamba2", position_embedding_type="none")
    full = ModularDecoderConfig(**common, **attention_fields, layer_types=["full_attention"])
    torch.manual_seed(0)
    return {"mamba2": ModularDecoderForCausalLM(mamba).eval(),
            "full_attention": ModularDecoderForCausalLM(full).eval()}


def report(result: dict) -> str:
    """The two tables (markdown): per family the sides' tokens/s and ratio, and each layer kind's decode step and
    cache bytes per context."""
    first = next(iter(result["families"].values()))
    lines = [f"| family: 1 x {first['prompt']} prefill / batch-1 decode of {first['new_tokens']} | transformers "
             "tok/s | ours tok/s | ours / it (median; range) |", "|---|---:|---:|---:|"]
    for family, side in result["families"].items():
        lines += side_rows(side, side["reference"], f"{family}: ")
    return "\n".join(lines + [""] + context_rows(result["flat_in_context"]))


def main(argv: list[str] | None = None) -> int:
    parser = side_by_side_parser("mamba2", __doc__, [1024, 4096, 16384])
    args = parser.parse_args(argv)
    run = harness.begin("mamba2", argv, args)
    sizes, widths = (SMOKE_SIZES, SMOKE_LAYER_WIDTHS) if args.smoke else (SIZES, LAYER_WIDTHS)
    prompt, new_tokens = (32, 4) if args.smoke else (args.prompt, args.new_tokens)
    contexts = [64, 256] if args.smoke else args.contexts
    result = {"sizes": sizes, "layer_widths": widths, "families": {}}
    for family, (reference, config) in reference_configs(sizes).items():
        with tempfile.TemporaryDirectory() as tmp:
            side = side_by_side(Path(tmp), config, prompt, new_tokens, args.repeats, reference=reference)
        result["families"][family] = dict(side, reference=reference)
        print(f"{family}: prefill {side['prefill']['median_ratio']:.2f}x, decode {side['decode']['median_ratio']:.2f}x"
              f" ({OURS} / {reference}); largest logit difference {side['max_logit_diff']:.1e}", flush=True)
    result["flat_in_context"] = flat_in_context(one_layer_models(widths), contexts, args.repeats)
    print(report(result))
    harness.write_result(args.out, result, run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
