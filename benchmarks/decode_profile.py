"""Where a batch-1 decode step's time goes: ours vs transformers' Llama on the real SmolLM2-135M (fp32).

    HF_HUB_OFFLINE=1 .venv/bin/python -m benchmarks.decode_profile [--steps 30] [--repeats 3]

Each repeat times `--steps` cached one-token forwards per model (interleaved, median per model), then
the same with every linear product replaced by an empty output of its shape (`nn.Linear.forward` and
this package's `split_products.linear`): the difference is the time of the products, the rest (norms, rotary,
attention, cache, Python) is what remains. Nothing here is asserted; it explains the decode rows of
`benchmarks.run`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from modular_decoder import split_products

from .families import build_pair


def _step_ms(model, prompt: torch.Tensor, steps: int) -> float:
    with torch.inference_mode():
        out = model(prompt)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            model(token, past_key_values=cache)
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _empty_product(x, weight, bias=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _empty_linear_forward(self, x):
    return x.new_empty(*x.shape[:-1], self.weight.shape[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        reference, ours, label = build_pair("llama", Path(folder), quick=False)
    torch.manual_seed(0)
    prompt = torch.randint(0, reference.config.vocab_size, (1, 32))
    print(f"{label}, {torch.get_num_threads()} threads; step ms (median of {args.steps})")
    real_product, real_forward = split_products.linear, nn.Linear.forward
    for _ in range(args.repeats):
        full = {"transformers": _step_ms(reference, prompt, args.steps), "ours": _step_ms(ours, prompt, args.steps)}
        split_products.linear, nn.Linear.forward = _empty_product, _empty_linear_forward
        try:
            rest = {"transformers": _step_ms(reference, prompt, args.steps), "ours": _step_ms(ours, prompt, args.steps)}
        finally:
            split_products.linear, nn.Linear.forward = real_product, real_forward
        print(" | ".join(f"{name}: step {full[name]:.1f}, products {full[name] - rest[name]:.1f}, rest {rest[name]:.1f}"
                         for name in full) + f" | step ratio {full['transformers'] / full['ours']:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
