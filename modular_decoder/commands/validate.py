"""`modular-decoder validate PATH | --preset NAME [--tiny]`: check a checkpoint or preset end to end.

Shapes, causality, backends, cached decoding, cache bytes, positions and speed (`modular_decoder.tools.validate`)."""

from __future__ import annotations

import sys

import torch

from modular_decoder.tools.validate import CHECKS, validate

def add_arguments(parser) -> None:
    parser.add_argument("path", nargs="?", help="a modular_decoder checkpoint folder")
    parser.add_argument("--preset", help="validate a preset's config (random weights) instead of a folder")
    parser.add_argument("--tiny", action="store_true", help="with --preset: the tiny version of the layout")
    parser.add_argument("--checks", nargs="+", choices=CHECKS, default=list(CHECKS), help="which checks to run")
    parser.add_argument("--backends", nargs="+", help="backends to compare with eager (default: all that run here)")
    parser.add_argument("--seq-len", type=int, default=16, help="sequence length of the checks (default 16)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--seed", type=int, default=0)


def run(args) -> int:
    from modular_decoder.commands import UserError, user_input
    from modular_decoder.tools.presets import preset_config

    if (args.path is None) == (args.preset is None):
        raise UserError("give a checkpoint PATH or --preset NAME")
    with user_input():
        target = preset_config(args.preset, tiny=args.tiny) if args.preset else args.path
    report = validate(target, checks=args.checks, seq_len=args.seq_len, seed=args.seed,
                      backends=args.backends, dtype=getattr(torch, args.dtype), input_checks=user_input)
    if args.preset:
        report.target = f"preset {args.preset}{' (tiny)' if args.tiny else ''}"
    print(report.table())
    if not report.ok:
        print(f"validate: failed check(s): {', '.join(report.failed)}", file=sys.stderr)
        return 1
    return 0
