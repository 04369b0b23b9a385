"""Where a decode step's time goes: ours vs transformers' Llama with the same weights (fp32, CPU).

    HF_HUB_OFFLINE=1 .venv/bin/python -m benchmarks decode_profile [--steps 30] [--repeats 3] [--out FILE]
    HF_HUB_OFFLINE=1 .venv/bin/python -m benchmarks decode_profile --host [--repeats 7] [--out FILE]

Each repeat times `--steps` cached one-token forwards per model (interleaved, median per model), then
the same with every linear product replaced by an empty output of its shape (`nn.Linear.forward` and
this package's `split_products.linear`): the difference is the time of the products, the rest (norms, rotary,
attention, cache, Python) is what remains. Nothing here is asserted; it explains the decode rows of
`benchmarks.run`.

`--host` measures instead the host's work in a step of `generate`: a Llama of width 64 with 16 layers (the
layer count of Llama-3.2-1B) on one thread, whose products take microseconds, so a step's time is Python,
dispatch, masks, positions and cache handling: what a GPU step waits on while the host launches its kernels.
Both models generate greedily from left-padded 64-token prompts at batch 1 and 32; a step's time is the CPU
time of this thread ((`--new-tokens` + 8 steps) - 8 steps, so the prefill cancels), which a busy machine
disturbs less than the clock; the median of `--repeats`, models alternating (`measure.alternating`). Ours runs
twice: as shipped, and with the split products off (`split_products.set_split_products("off")`).

`--smoke`: tiny random shapes, few steps.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from modular_decoder import split_products
from modular_decoder.compat import cache_of, with_cache

from . import harness, measure
from .families import build_pair, load_pair, save_pair


def _step_ms(model, prompt: torch.Tensor, steps: int) -> float:
    with torch.inference_mode():
        out = model(prompt)
        cache, token = cache_of(out), out.logits[:, -1:].argmax(-1)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            model(token, **with_cache(cache))
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _host_step_ms(model, prompt: torch.Tensor, mask: torch.Tensor, new_tokens: int) -> float:
    """CPU time of this thread per `generate` step (the prefill and the first 8 steps cancel)."""
    times = {}
    for steps in (8, 8 + new_tokens):
        start = time.thread_time()
        model.generate(prompt, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
        times[steps] = time.thread_time() - start
    return (times[8 + new_tokens] - times[8]) / new_tokens * 1e3


def host_overhead(repeats: int, new_tokens: int, layers: int = 16) -> dict:
    """The `--host` table (module docstring): {batch: {model: median ms per step}}."""
    import transformers

    torch.set_num_threads(1)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                      pad_token_id=0, tie_word_embeddings=True)
    with tempfile.TemporaryDirectory() as folder:
        reference, ours = load_pair(save_pair(config, Path(folder)))
    for model in (reference, ours):
        model.generation_config.pad_token_id = 0

    def ours_unsplit(*args):
        with split_products.using_split_products("off"):
            return _host_step_ms(ours, *args)

    runs = {"transformers": lambda *a: _host_step_ms(reference, *a), "ours": lambda *a: _host_step_ms(ours, *a),
            "ours, split products off": ours_unsplit}
    print(f"host time per generate step (ms, CPU thread time, median of {repeats}), width 64 x {layers} layers")
    print("| batch | " + " | ".join(runs) + " | ratio transformers / ours |\n|---|" + "---:|" * (len(runs) + 1))
    table = {}
    for batch in (1, 32):
        prompt = torch.randint(1, config.vocab_size, (batch, 64), generator=torch.Generator().manual_seed(1))
        mask = torch.ones_like(prompt)
        mask[::2, :8] = 0  # every other row left-padded (row 0 too, so batch 1 is padded as well)
        with torch.inference_mode():
            times = measure.alternating({name: (lambda run=run: run(prompt, mask, new_tokens))
                                         for name, run in runs.items()}, repeats, warmup=0)
        table[batch] = median = {name: statistics.median(values) for name, values in times.items()}
        print(f"| {batch} | " + " | ".join(f"{median[name]:.2f}" for name in runs)
              + f" | {median['transformers'] / median['ours']:.2f} |", flush=True)
    return table


def _empty_product(x, weight, bias=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _empty_linear_forward(self, x):
    return x.new_empty(*x.shape[:-1], self.weight.shape[0])


def products_and_rest(reference, ours, prompt: torch.Tensor, steps: int, repeats: int) -> list[dict]:
    """Per repeat: each model's step, with its products emptied (the rest), and the products' share."""
    real_product, real_forward = split_products.linear, nn.Linear.forward
    rows = []
    for _ in range(repeats):
        full = {"transformers": _step_ms(reference, prompt, steps), "ours": _step_ms(ours, prompt, steps)}
        split_products.linear, nn.Linear.forward = _empty_product, _empty_linear_forward
        try:
            rest = {"transformers": _step_ms(reference, prompt, steps), "ours": _step_ms(ours, prompt, steps)}
        finally:
            split_products.linear, nn.Linear.forward = real_product, real_forward
        rows.append({name: {"step_ms": full[name], "products_ms": full[name] - rest[name], "rest_ms": rest[name]}
                     for name in full})
        print(" | ".join(f"{name}: step {full[name]:.1f}, products {full[name] - rest[name]:.1f}, rest {rest[name]:.1f}"
                         for name in full) + f" | step ratio {full['transformers'] / full['ours']:.2f}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser("decode_profile", __doc__, smoke="tiny random shapes, few steps")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--host", action="store_true", help="host time per generate step (module docstring)")
    parser.add_argument("--new-tokens", type=int, default=32, help="with --host: steps timed per generate")
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.new_tokens, args.repeats = 3, 2, 1
    run = harness.begin("decode_profile", argv, args)
    if args.host:
        table = host_overhead(args.repeats, args.new_tokens, layers=2 if args.smoke else 16)
        harness.write_result(args.out, {"host_step_ms": table}, run)
        return 0
    with tempfile.TemporaryDirectory() as folder:
        reference, ours, label = build_pair("llama", Path(folder), quick=args.smoke)
    torch.manual_seed(0)
    prompt = torch.randint(0, reference.config.vocab_size, (1, 32))
    print(f"{label}, {torch.get_num_threads()} threads; step ms (median of {args.steps})")
    rows = products_and_rest(reference, ours, prompt, args.steps, args.repeats)
    harness.write_result(args.out, {"label": label, "repeats": rows}, run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
