"""`modular-decoder export SRC OUT --family NAME [--force]`: back into a family's own format."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from modular_decoder.conversion import FAMILIES, WRAPPERS

    parser.add_argument("src", help="a modular_decoder model folder")
    parser.add_argument("out", help="the folder to write in the family's own format")
    parser.add_argument("--family", required=True, choices=sorted({*FAMILIES, *WRAPPERS}),
                        help="target transformers model_type (a multimodal release such as gemma3: the language model "
                             "back beside the parts `convert` kept in SRC/multimodal)")
    parser.add_argument("--force", action="store_true", help="replace OUT if it exists")


def run(args: argparse.Namespace) -> int:
    from modular_decoder.commands import user_input
    from modular_decoder.conversion import export

    out = export(args.src, args.out, family=args.family, force=args.force, input_checks=user_input)
    print(f"wrote {out}")
    return 0
