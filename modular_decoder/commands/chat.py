"""`modular-decoder chat FOLDER`: a chat loop on a checkpoint with a chat template; each reply
streams as it is generated. Reads user turns from stdin; an empty line, `/exit` or EOF ends it."""

from __future__ import annotations

import argparse
import sys

from modular_decoder.commands.generate import add_generation_arguments, load_checkpoint, stream


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_generation_arguments(parser)
    parser.add_argument("--system", default=None, help="a system message to start the conversation")


def run(args: argparse.Namespace) -> int:
    model, tokenizer = load_checkpoint(args.folder, args, chat=True)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    while True:
        print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() in ("", "/exit"):
            if not line:  # EOF: the terminal has no newline after the prompt
                print()
            return 0
        messages.append({"role": "user", "content": line.rstrip("\n")})
        inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)
        reply = stream(model, tokenizer, dict(inputs), args)
        messages.append({"role": "assistant", "content": tokenizer.decode(reply, skip_special_tokens=True)})
