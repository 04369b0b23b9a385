"""`modular-decoder convert SRC OUT [--gguf-file NAME] [--dtype ...] [--verify] [--force] [--allow-bin]`; SRC a LoRA
adapter folder: `convert SRC OUT [--adapter-base FOLDER]`."""

from __future__ import annotations

import argparse
from pathlib import Path

from modular_decoder.conversion.api import DTYPES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="a Hugging Face model folder, or the folder holding --gguf-file, or a LoRA adapter "
                                    "folder made on one")
    parser.add_argument("out", help="the modular_decoder folder to write")
    parser.add_argument("--gguf-file", default=None, help="name of a GGUF file inside SRC")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="weight dtype to write (default: the source's; GGUF dequantizes to float32)")
    parser.add_argument("--verify", action="store_true",
                        help="run the source model beside the converted one and print the largest logit difference")
    parser.add_argument("--force", action="store_true", help="replace OUT if it exists")
    parser.add_argument("--base-model", default=None,
                        help="Hub id of the source checkpoint, recorded as `base_model` in the model card")
    parser.add_argument("--allow-bin", action="store_true",
                        help="read legacy pytorch_model*.bin weights (unpickling: only for trusted sources)")
    parser.add_argument("--adapter-base", default=None,
                        help="SRC an adapter: the model folder it was made on (default: its base_model_name_or_path)")


def run(args: argparse.Namespace) -> int:
    from modular_decoder.commands import user_input
    from modular_decoder.conversion import convert
    from modular_decoder.conversion.adapters import ADAPTER_CONFIG, convert_adapter

    if (Path(args.src) / ADAPTER_CONFIG).is_file():
        out = convert_adapter(args.src, args.out, args.adapter_base, force=args.force, input_checks=user_input)
    else:
        out = convert(args.src, args.out, gguf_file=args.gguf_file, dtype=args.dtype, force=args.force,
                      verify=args.verify, allow_bin=args.allow_bin, base_model=args.base_model, input_checks=user_input)
    print(f"wrote {out}")
    return 0
