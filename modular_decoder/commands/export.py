"""`modular-decoder export SRC OUT --family NAME [--force]`: back into a family's own format (SRC a model folder, or a
LoRA adapter folder made on one: `[--adapter-base FOLDER]`)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from modular_decoder.conversion import FAMILIES, WRAPPERS

    parser.add_argument("src", help="a modular_decoder model folder, or a LoRA adapter folder made on one")
    parser.add_argument("out", help="the folder to write in the family's own format")
    parser.add_argument("--family", required=True, choices=sorted({*FAMILIES, *WRAPPERS}),
                        help="target transformers model_type (a multimodal release such as gemma3: the language model "
                             "back beside the parts `convert` kept in SRC/multimodal)")
    parser.add_argument("--force", action="store_true", help="replace OUT if it exists")
    parser.add_argument("--adapter-base", default=None,
                        help="SRC an adapter: the model folder it was made on (default: its base_model_name_or_path)")


def run(args: argparse.Namespace) -> int:
    from modular_decoder.commands import user_input
    from modular_decoder.conversion import export
    from modular_decoder.conversion.adapters import ADAPTER_CONFIG, export_adapter

    if (Path(args.src) / ADAPTER_CONFIG).is_file():
        out = export_adapter(args.src, args.out, args.family, args.adapter_base, force=args.force,
                             input_checks=user_input)
    else:
        out = export(args.src, args.out, family=args.family, force=args.force, input_checks=user_input)
    print(f"wrote {out}")
    return 0
