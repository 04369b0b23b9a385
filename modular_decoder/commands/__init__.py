"""modular-decoder: convert, reshape, run, check and publish checkpoints of the modular_decoder family.

One subcommand per module of this package (the table `COMMANDS`).

Not model code: a saved checkpoint never carries these files. Each command module exposes
`add_arguments(parser)` and `run(args) -> int`; it is imported only when its command runs, so
`modular-decoder --help` stays fast. `python -m modular_decoder.commands` is the same entry point.

User errors print one line `error: <message>` to stderr and exit with status 2. A user error is one
the code raises on purpose about the user's input: a `UserError`, or a `ValueError` / `OSError`
raised inside `user_input()`, which each command wraps around exactly the calls that check its
input (its arguments, paths and files, config construction, `from_pretrained`'s checkpoint check,
the prompt's checks). Any other exception, a `ValueError` from anywhere else included, is a bug: it
keeps its traceback and exits with status 1. `--traceback` (or `MODULAR_DECODER_TRACEBACK=1`) prints
the traceback of a user error too, for bug reports; the exit status stays 2. Ctrl-C prints
`interrupted` and exits 130.

The tools behind the commands are Python functions whose errors name their parameters
(``pass `kv_heads`=3``); `in_flags` rewrites a user error in the words the user typed, for every
command at once: a parameter that is the destination of one of the command's options becomes that
option (`` `kv_heads` `` -> `` `--kv-heads` ``, `` `attention='mla'` `` -> `` `--attention mla` ``,
``force=True`` -> `` `--force` ``). Tools therefore name a parameter in backticks, as `name`,
`name=value` or `name`=value, and the command gives it an option whose destination has that name.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import re
import sys
import traceback

# What the checks of a user's input raise (bad paths, bad files, bad values), inside `user_input()`
USER_ERRORS = (ValueError, OSError)


class UserError(Exception):
    """An error about the user's input: `main` prints its message on one line and exits with status 2."""


@contextlib.contextmanager
def user_input(errors: tuple[type[BaseException], ...] = USER_ERRORS):
    """Run calls that check the user's input: an `errors` exception raised inside is a `UserError`
    (the original is its `__cause__`)."""
    try:
        yield
    except errors as error:
        raise UserError(one_line(error)) from error
TRACEBACK_ENV = "MODULAR_DECODER_TRACEBACK"

# command name -> (module in this package, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("demo", "convert the bundled SmolLM2 checkpoint, load it, generate, print its contract"),
    "convert": ("convert", "convert a public checkpoint (HF folder or GGUF)"),
    "export": ("export", "write a modular_decoder checkpoint in a family's format"),
    "reshape": ("reshape", "move a trained checkpoint to another design point (K/V heads, MLA, experts, depth)"),
    "generate": ("generate", "complete a prompt with a checkpoint, streaming tokens"),
    "chat": ("chat", "chat with a checkpoint through its chat template, streaming replies"),
    "push": ("push", "upload a checkpoint folder to the Hugging Face Hub"),
    "plot": ("plot", "plots: `plot cache` (KV-cache bytes against context), `plot reshape` (perplexity against cache bytes)"),
    "validate": ("validate", "check a checkpoint or preset: shapes, causality, backends, cached decoding, "
                             "cache bytes, positions, speed"),
    "experiment": ("experiment", "reproduce three findings on small models: gradnorm, ffn-budget, ablation"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="modular-decoder", description=__doc__.splitlines()[0])
    traceback_help = f"on an error show the full traceback (also: {TRACEBACK_ENV}=1)"
    parser.add_argument("--traceback", action="store_true", help=traceback_help)
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = next((arg for arg in argv if not arg.startswith("-")), None)  # the main parser's options are flags
    for name, (module_name, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        command.set_defaults(_module=f"{__name__}.{module_name}")
        # accepted after the command too; SUPPRESS keeps the subparser from resetting the main flag
        command.add_argument("--traceback", action="store_true", default=argparse.SUPPRESS, help=traceback_help)
        if name == chosen:  # only the chosen command's module is imported
            importlib.import_module(f"{__name__}.{module_name}").add_arguments(command)
            command.set_defaults(_flags=option_flags(command))
    return parser


def chosen_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the (sub)command `args` chose (`plot cache`'s, not `plot`'s or the program's)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and getattr(args, action.dest, None) in action.choices:
            return chosen_parser(action.choices[getattr(args, action.dest)], args)
    return parser


def suggestion(unknown: list[str], parser: argparse.ArgumentParser) -> str:
    """` (did you mean `--max-new-tokens`?)` for the first unknown option close to one of `parser`'s, else ''."""
    import difflib

    options = [flag for action in parser._actions for flag in action.option_strings]
    for arg in unknown:
        if arg.startswith("--"):
            close = difflib.get_close_matches(arg.split("=", 1)[0], options, n=1, cutoff=0.75)
            if close:
                return f" (did you mean `{close[0]}`?)"
    return ""


def option_flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Each option's destination -> its action, through nested subcommands (`plot cache`, ...)."""
    flags = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                flags.update(option_flags(subparser))
        elif action.option_strings and action.dest not in (argparse.SUPPRESS, "help", "traceback"):
            flags[action.dest] = action
    return flags


def in_flags(message: str, flags: dict[str, argparse.Action]) -> str:
    """`message` with the Python parameters that are options of the command named as the options."""
    for dest in sorted(flags, key=len, reverse=True):
        action, name = flags[dest], re.escape(dest)
        flag = max(action.option_strings, key=len)  # the long spelling
        switch = action.nargs == 0  # store_true: `force=True` is the bare flag

        def assigned(match: re.Match, flag=flag, switch=switch) -> str:
            value = match.group(1).strip("'\"")
            return f"`{flag}`" if switch and value == "True" else f"`{flag} {value}`"

        message = re.sub(rf"`{name}=([^`]*)`", assigned, message)
        message = re.sub(rf"`{name}`", f"`{flag}`", message)
        if switch:
            message = re.sub(rf"(?<![\w`-]){name}=True\b", f"`{flag}`", message)
        message = message.replace(f"`{flag}` (`{flag}`)", f"`{flag}`")  # "force=True (`--force`)"
    return message


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns its exit status (2 for a user error, 130 when interrupted)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # refused by the command's own parser: its usage, and the option meant where one is close
        command = chosen_parser(parser, args)
        command.error(f"unrecognized arguments: {' '.join(unknown)}{suggestion(unknown, command)}")
    verbose = args.traceback or os.environ.get(TRACEBACK_ENV, "").strip().lower() not in ("", "0", "false", "no")
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except UserError as error:
        if verbose:  # for a bug report; still a user error
            traceback.print_exception(error.__cause__ or error, file=sys.stderr)
        print(f"error: {in_flags(one_line(error), getattr(args, '_flags', {}))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if verbose:
            raise
        print("interrupted", file=sys.stderr)
        return 130


def one_line(error: BaseException) -> str:
    """The error's message on one line; an OS error as `<what>: <path>` rather than `[Errno 2] ...`."""
    if isinstance(error, OSError) and error.strerror and error.filename:
        text = f"{error.strerror}: {error.filename}" + (f" -> {error.filename2}" if error.filename2 else "")
    else:
        text = str(error) or type(error).__name__
    return " ".join(text.split())

