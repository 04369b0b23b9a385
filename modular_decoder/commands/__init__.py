"""`modular-decoder` command line: one subcommand per module of this package, registered in `COMMANDS`.

Not model code: a saved checkpoint never carries these files. Each command module exposes
`add_arguments(parser)` and `run(args) -> int`; it is imported only when its command runs, so
`modular-decoder --help` stays fast. `python -m modular_decoder.commands` is the same entry point.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# command name -> (module in this package, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("demo", "convert the bundled SmolLM2 checkpoint, load it, generate, print its contract"),
    "convert": ("convert", "convert a public checkpoint (HF folder or GGUF)"),
    "export": ("export", "write a modular_decoder checkpoint in a family's format"),
    "generate": ("generate", "complete a prompt with a checkpoint, streaming tokens"),
    "chat": ("chat", "chat with a checkpoint through its chat template, streaming replies"),
    "push": ("push", "upload a checkpoint folder to the Hugging Face Hub"),
    "plot": ("plot", "plots: `plot cache` draws KV-cache bytes against context length"),
    "validate": ("validate", "run the seed's validation checklist on a checkpoint or preset"),
    "experiment": ("experiment", "reproduce the seed's findings: gradnorm, ffn-budget, ablation"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="modular-decoder", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        command.set_defaults(_module=f"{__name__}.{module_name}")
        if argv[:1] == [name]:  # only the chosen command's module is imported
            importlib.import_module(f"{__name__}.{module_name}").add_arguments(command)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    return int(importlib.import_module(args._module).run(args) or 0)

