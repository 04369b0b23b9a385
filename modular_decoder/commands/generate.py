"""`modular-decoder generate FOLDER PROMPT`: complete a prompt with a checkpoint, streaming tokens
to stdout as they are generated (transformers' `TextStreamer`)."""

from __future__ import annotations

import argparse
from pathlib import Path


# Files one of which a tokenizer folder holds (fast, slow SentencePiece, BPE vocabulary, or its config)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")

# `--compile`: the static cache grows in steps of this many tokens (each step compiles the decode step again)
CACHE_STEP = 512


def add_generation_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by `generate` and `chat`."""
    parser.add_argument("folder", type=Path, help="a checkpoint folder (model + tokenizer)")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="a folder with the tokenizer, when FOLDER has none (default: FOLDER)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 decodes greedily")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", action="store_true",
                        help="compile the decode step (torch.compile through generate, static cache): a one-time "
                             "compile (about a minute for SmolLM2 on 2 cores), then about twice the tokens/s on a CPU")
    parser.add_argument("--mtp", action="store_true",
                        help="draft tokens with the checkpoint's multi-token-prediction modules and verify them "
                             "(generate(use_mtp=True)): the same tokens, faster where drafts are accepted")
    parser.add_argument("--mtp-draft-tokens", type=int, default=None, metavar="K",
                        help="with --mtp: tokens drafted per step (generate(mtp_draft_tokens=K)); past the number "
                             "of modules the last module drafts the rest on its own output (default: one per module)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_generation_arguments(parser)
    parser.add_argument("prompt", help="text to complete")


def check_generation_arguments(args: argparse.Namespace) -> None:
    """Refuse option values generate would not take, naming the option."""
    if args.max_new_tokens < 1:
        raise ValueError(f"`--max-new-tokens`={args.max_new_tokens} must be at least 1.")
    if args.temperature < 0:
        raise ValueError(f"`--temperature`={args.temperature} must be 0 (greedy) or more.")
    if not 0 < args.top_p <= 1:
        raise ValueError(f"`--top-p`={args.top_p} must lie in (0, 1].")
    draft_tokens = getattr(args, "mtp_draft_tokens", None)
    if draft_tokens is not None and not getattr(args, "mtp", False):
        raise ValueError(f"`--mtp-draft-tokens`={draft_tokens} sets how many tokens `--mtp` drafts per step: "
                         "pass `--mtp` with it.")
    if draft_tokens is not None and draft_tokens < 1:
        raise ValueError(f"`--mtp-draft-tokens`={draft_tokens} must be at least 1.")
    if getattr(args, "mtp", False) and args.compile:
        raise ValueError("`--mtp` drafts into a cache it crops back, `--compile` decodes with a static one: "
                         "choose one.")


def load_checkpoint(folder: Path, args: argparse.Namespace | None = None, chat: bool = False):
    """Model (eval mode) and tokenizer from a checkpoint folder.

    With `args`, their values are checked first; with `chat`, that the tokenizer has a chat template. The path, the
    options and `from_pretrained`'s checks of the checkpoint are the user's input (`user_input`): their errors are
    one line."""
    from transformers import AutoModelForCausalLM

    import modular_decoder  # noqa: F401  (registers the family with the Auto classes)
    from modular_decoder.commands import user_input

    with user_input():
        if args is not None:
            check_generation_arguments(args)
        if not Path(folder).exists():
            raise FileNotFoundError(f"{folder} does not exist.")
        tokenizer = load_tokenizer(folder, getattr(args, "tokenizer", None))
        if chat and tokenizer.chat_template is None:
            raise ValueError(f"the tokenizer in {folder} has no chat template; use `modular-decoder generate`.")
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        if getattr(args, "mtp", False) and not getattr(model.config, "num_mtp_layers", 0):
            raise ValueError(f"`--mtp` drafts with multi-token-prediction modules, and {folder} has none "
                             "(`num_mtp_layers`=0): add some with `modular-decoder reshape SRC OUT --add-mtp 1 "
                             "--heal-steps S`.")
        return model, tokenizer


def load_tokenizer(folder: Path, tokenizer_folder: Path | None = None,
                   remedy: str = "pass `--tokenizer DIR` with the folder of the tokenizer the model was trained with"):
    """The tokenizer from `tokenizer_folder` (`--tokenizer`), else from the checkpoint `folder`.

    A folder
    holding none of TOKENIZER_FILES is refused with what to do (`remedy`, a command's own way to get one, or
    saving one beside the weights), before tokenizers' own error."""
    from transformers import AutoTokenizer

    source = Path(tokenizer_folder or folder)
    if not source.exists():
        given = "`--tokenizer` " if tokenizer_folder is not None else ""  # else the checkpoint folder itself
        raise FileNotFoundError(f"{given}{source} does not exist.")
    if source.is_dir() and not any((source / name).exists() for name in TOKENIZER_FILES):
        if tokenizer_folder is not None:
            raise ValueError(f"`--tokenizer` {source} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}).")
        raise ValueError(f"{source} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}): {remedy}, or save "
                         f"one beside the weights (`tokenizer.save_pretrained(\"{source}\")`).")
    return AutoTokenizer.from_pretrained(source)


def generation_kwargs(args: argparse.Namespace, prompt_length: int) -> dict:
    kwargs = {"max_new_tokens": args.max_new_tokens, "do_sample": args.temperature > 0}
    if getattr(args, "mtp", False):
        kwargs["use_mtp"] = True
        if getattr(args, "mtp_draft_tokens", None) is not None:
            kwargs["mtp_draft_tokens"] = args.mtp_draft_tokens
    if args.temperature > 0:
        kwargs |= {"temperature": args.temperature, "top_p": args.top_p}
    if args.compile:
        from modular_decoder import compiled_decoding

        # The compiled step is specialised to the static cache's length: size it in steps of CACHE_STEP
        # tokens, so that a chat whose turns grow recompiles once per step, not once per turn
        needed = prompt_length + args.max_new_tokens
        kwargs |= compiled_decoding() | {"max_cache_len": -(-needed // CACHE_STEP) * CACHE_STEP}
    return kwargs


def stream(model, tokenizer, inputs: dict, args: argparse.Namespace):
    """Generate from `inputs`, printing the new text as it comes; returns the new token ids."""
    import torch
    from transformers import TextStreamer

    from modular_decoder.input_checks import check_generate_inputs
    from modular_decoder.commands import user_input

    with user_input():  # the prompt, as generate checks it
        check_generate_inputs(model.config, input_ids=inputs["input_ids"], attention_mask=inputs.get("attention_mask"))
    torch.manual_seed(args.seed)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    kwargs = generation_kwargs(args, inputs["input_ids"].shape[1])
    with torch.no_grad():
        output = model.generate(**inputs, streamer=streamer, pad_token_id=tokenizer.pad_token_id, **kwargs)
    return output[0, inputs["input_ids"].shape[1]:]


def run(args: argparse.Namespace) -> int:
    model, tokenizer = load_checkpoint(args.folder, args)
    print(args.prompt, end="", flush=True)
    stream(model, tokenizer, tokenizer(args.prompt, return_tensors="pt"), args)
    return 0
