"""`modular-decoder reshape`: move a trained checkpoint to another architecture, with a report of what it cost.

`modular-decoder reshape SRC OUT [--kv-heads N] [--attention mla --kv-lora-rank R [--rope-dim D]
[--sweep-ranks R1,R2,...]] [--experts E --top-k K [--shared-experts S] [--fine-grained G]] [--drop-layers N]
[--add-mtp K] [--draft-vocab N] [--calibration FILE] [--heal-steps S]`: move a trained checkpoint to another point of the design space
(`modular_decoder.tools.reshape`), with a report of what it bought and cost."""

from __future__ import annotations

import argparse


def ranks(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated ranks such as 64,128,256, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from modular_decoder.tools.reshape.kv_heads import POOLS

    parser.add_argument("src", help="a modular_decoder checkpoint folder")
    parser.add_argument("out", help="the folder to write (weights, config, code, tokenizer, report)")
    parser.add_argument("--kv-heads", type=int, help="K/V heads of the result (fewer: mean-pooled; a multiple: repeated)")
    parser.add_argument("--kv-pool", choices=POOLS, default="mean",
                        help="how fewer K/V heads are initialised (mean: the GQA paper's; first, random: baselines)")
    parser.add_argument("--attention", choices=["mla"], help="convert attention to MLA (TransMLA)")
    parser.add_argument("--kv-lora-rank", type=int, help="MLA latent width d_c")
    parser.add_argument("--rope-dim", type=int, help="MLA decoupled rotary key width d_R")
    parser.add_argument("--sweep-ranks", type=ranks, help="also measure these latent ranks (R1,R2,...)")
    parser.add_argument("--experts", type=int, help="routed experts per layer (sparse upcycling)")
    parser.add_argument("--top-k", type=int, help="experts per token")
    parser.add_argument("--shared-experts", type=int, default=0, help="always-on experts (slices of the FFN)")
    parser.add_argument("--fine-grained", type=int, default=1, help="cut the FFN into G slices (expert width f/G)")
    parser.add_argument("--drop-layers", type=int, help="remove the most redundant block of N consecutive layers")
    parser.add_argument("--add-mtp", type=int, metavar="K",
                        help="add K multi-token-prediction modules, trained for --heal-steps steps by self-distillation "
                             "(the model itself unchanged); for generate(use_mtp=True)")
    parser.add_argument("--draft-vocab", type=int, metavar="N",
                        help="the MTP modules draft among the N token ids the model predicts most often on the "
                             "calibration text (FR-Spec: a cheaper draft head; the tokens stay plain decoding's)")
    parser.add_argument("--calibration", help="a plain-text file (default: text sampled from the source model)")
    parser.add_argument("--heal-steps", type=int, default=0, help="distillation steps into the changed modules (and the added MTP modules)")
    parser.add_argument("--heal-lr", type=float, default=None, help="healing learning rate (default 1e-3)")
    parser.add_argument("--seed", type=int, default=0, help="seeds sampling, router rows, random K/V")
    parser.add_argument("--force", action="store_true", help="replace OUT if it exists")


def run(args: argparse.Namespace) -> int:
    from modular_decoder.commands import user_input
    from modular_decoder.tools.reshape import LEARNING_RATE, reshape_folder

    reshape_folder(
        args.src, args.out, calibration=args.calibration, sweep_ranks=args.sweep_ranks, heal_steps=args.heal_steps,
        heal_lr=LEARNING_RATE if args.heal_lr is None else args.heal_lr, force=args.force, seed=args.seed,
        kv_heads=args.kv_heads, kv_pool=args.kv_pool, attention=args.attention, kv_lora_rank=args.kv_lora_rank,
        rope_dim=args.rope_dim, experts=args.experts, top_k=args.top_k, shared_experts=args.shared_experts,
        fine_grained=args.fine_grained, drop_layers=args.drop_layers, add_mtp=args.add_mtp, draft_vocab=args.draft_vocab,
        input_checks=user_input,
    )
    print(f"wrote {args.out}")
    return 0
