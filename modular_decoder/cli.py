"""`modular-decoder` command line: one subcommand per module, registered in `COMMANDS`.

Each command module exposes `add_arguments(parser)` and `run(args) -> int`; it is imported only
when its command runs, so `modular-decoder --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# command name -> (module path, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("modular_decoder.demo", "convert the bundled SmolLM2 checkpoint, load it, generate, print its contract"),
    "convert": ("modular_decoder.conversion.convert_command", "convert a public checkpoint (HF folder or GGUF)"),
    "export": ("modular_decoder.conversion.export_command", "write a modular_decoder checkpoint in a family's format"),
    "generate": ("modular_decoder.generate_command", "complete a prompt with a checkpoint, streaming tokens"),
    "chat": ("modular_decoder.chat_command", "chat with a checkpoint through its chat template, streaming replies"),
    "push": ("modular_decoder.push_command", "upload a checkpoint folder to the Hugging Face Hub"),
    "plot": ("modular_decoder.plot_command", "plots: `plot cache` draws KV-cache bytes against context length"),
    "validate": ("modular_decoder.validate", "run the seed's validation checklist on a checkpoint or preset"),
    "experiment": ("modular_decoder.experiments", "reproduce the seed's findings: gradnorm, ffn-budget, ablation"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="modular-decoder", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_path, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        command.set_defaults(_module=module_path)
        if argv[:1] == [name]:  # only the chosen command's module is imported
            importlib.import_module(module_path).add_arguments(command)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
