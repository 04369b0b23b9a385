"""The MTP draft head over a frequency-ranked part of SmolLM2-135M's vocabulary (FR-Spec, arXiv 2502.14856): one
module's draft and the head alone, over the whole vocabulary against the top `--sizes` ids, at each of `--thread-counts`
(fp32, CPU, in one process); and how much of the model's own greedy text the top N ids cover.

    HF_HUB_OFFLINE=1 .venv/bin/python -m benchmarks draft_vocab [--sizes 4096,8192,16384] [--thread-counts 1,2]
        [--repeats 5] [--out benchmarks/results_draft_vocab.json]

A module is added (`reshape --add-mtp`'s initialisation, untrained: its time does not depend on its values) and
drafts after the first prompt's greedy continuation (`mtp_decode.drafting`: the modules' block and head over one
position, as `generate(use_mtp=True)` calls them). The cases alternate in each repeat; the median is reported. The
ranking is `reshape --draft-vocab`'s: the model's argmax predictions on `--rank-sequences` sequences sampled from it
(every other one continued greedily), ties by the text's own counts, then by id. Coverage: the share of the model's
argmax predictions inside the top N on (a) the greedy continuations of `mtp_decode`'s prompts (the tokens greedy
decoding emits there) and (b) held-out sampled sequences. `--smoke`: tiny random shapes.
"""

from __future__ import annotations

import os
import statistics
import tempfile
from pathlib import Path

import torch

from . import harness, measure
from .families import build_pair
from .mtp_decode import PROMPTS, drafting, generate


def sizes(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def timed(model, text, ranking: torch.LongTensor, draft_sizes: list[int], repeats: int) -> dict:
    """{case: {"draft_ms", "head_ms"}} for the whole vocabulary and each size, the cases alternating; each case sets
    its draft vocabulary (and its gathered head rows, made once) before it runs."""
    from modular_decoder.cache import ModularDecoderCache
    from modular_decoder.draft_vocab import draft_logits, set_draft_vocab

    count = model.config.num_mtp_layers
    cache = ModularDecoderCache(model.config)
    hidden = model(text[:, :-count - 1], cache=cache, output_hidden_states=True).hidden_states[-1]
    draft = drafting(model, text, hidden, cache, count)
    states = {}
    for size in [None, *draft_sizes]:
        set_draft_vocab(model, None if size is None else ranking[:size])
        draft_logits(model, hidden[:, -1])  # gathers the rows once
        states["whole" if size is None else str(size)] = (model.mtp.draft_vocab, getattr(model.mtp, "_draft_rows", None))

    def case(name, part):
        def run():
            model.mtp.draft_vocab, model.mtp._draft_rows = states[name]
            return measure.seconds(part)()
        return run

    cases = {}
    for name in states:
        cases[f"{name}/draft"] = case(name, draft)
        cases[f"{name}/head"] = case(name, lambda: draft_logits(model, hidden[:, -1]))
    times = measure.alternating(cases, repeats)
    set_draft_vocab(model, None)
    return {name: {"draft_ms": 1e3 * statistics.median(times[f"{name}/draft"]),
                   "head_ms": 1e3 * statistics.median(times[f"{name}/head"])} for name in states}


def main(argv: list[str] | None = None) -> int:
    from modular_decoder.tools.reshape.add_mtp import GREEDY_AFTER, add_mtp_modules
    from modular_decoder.tools.reshape.calibration import sampled_calibration
    from modular_decoder.tools.reshape.draft_vocab import predicted_counts, rank_by_prediction

    parser = harness.parser("draft_vocab", __doc__, repeats=5)
    parser.add_argument("--sizes", type=sizes, default=[4096, 8192, 16384], help="draft vocabulary sizes N1,N2,...")
    parser.add_argument("--thread-counts", type=sizes, default=[1, 2], help="torch threads to time at")
    parser.add_argument("--rank-sequences", type=int, default=16, help="sampled sequences the ranking is made on")
    parser.add_argument("--new-tokens", type=int, default=128, help="greedy tokens per prompt (coverage, context)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.sizes, args.rank_sequences, args.new_tokens, args.repeats = [16, 32], 2, 8, 1
    run = harness.begin("draft_vocab", argv, args)
    with tempfile.TemporaryDirectory() as folder:
        _, ours, label = build_pair("llama", Path(folder), quick=args.smoke)
        tokenizer = None if args.smoke else _tokenizer(Path(folder) / "ours")
    model, _ = add_mtp_modules(ours, 1)
    del ours
    prompts = [tokenizer(text, return_tensors="pt").input_ids if tokenizer is not None
               else torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(i))
               for i, text in enumerate(PROMPTS.values())]
    with torch.inference_mode():
        greedy = [generate(model, prompt, args.new_tokens) for prompt in prompts]
        sampled = sampled_calibration(model, seed=0, sequences=args.rank_sequences, held_out=4,
                                      length=16 if args.smoke else 128, greedy_after=GREEDY_AFTER)
        ranking = rank_by_prediction(model, sampled.ids)
        # the model's argmax over its own greedy text, where it generated (the tokens greedy decoding emits)
        emitted = sum(torch.bincount(text[0, prompt.shape[1]:], minlength=model.config.vocab_size)
                      for text, prompt in zip(greedy, prompts, strict=True))
        held_out = predicted_counts(model, sampled.held_out)
    coverage = {str(size): {"greedy_text": emitted[ranking[:size]].sum().item() / emitted.sum().item(),
                            "held_out_sampled": held_out[ranking[:size]].sum().item() / held_out.sum().item()}
                for size in args.sizes}
    print(f"{label}, vocab {model.config.vocab_size:,}; coverage of the top N: {coverage}", flush=True)
    threads = {}
    for count in args.thread_counts:
        torch.set_num_threads(count)
        load = os.getloadavg()[0]
        with torch.inference_mode():
            ms = timed(model, greedy[0], ranking, args.sizes, args.repeats)
        threads[str(count)] = {"load_before": load, "ms": ms, "load_after": os.getloadavg()[0]}
        print(f"{count} thread(s): {threads[str(count)]}", flush=True)
    results = {"label": label, "vocab_size": model.config.vocab_size, "sizes": args.sizes,
               "ranked_on_tokens": sampled.ids.numel(), "greedy_tokens": int(emitted.sum().item()),
               "held_out_tokens": sampled.held_out.numel(), "coverage": coverage, "threads": threads}
    print("\n" + table(results), flush=True)
    harness.write_result(args.out, results, run)
    return 0


def table(results: dict) -> str:
    """Per thread count and draft vocabulary: the draft's and the head's ms, the draft against the whole head's, and
    the coverage."""
    lines = ["| threads | draft vocabulary | draft ms | head ms | draft vs whole | coverage (greedy text) |",
             "|---:|---|---:|---:|---:|---:|"]
    for count, row in results["threads"].items():
        whole = row["ms"]["whole"]["draft_ms"]
        for name, ms in row["ms"].items():
            cover = "100%" if name == "whole" else f"{results['coverage'][name]['greedy_text']:.1%}"
            label = f"whole ({results['vocab_size']:,})" if name == "whole" else f"top {int(name):,}"
            lines.append(f"| {count} | {label} | {ms['draft_ms']:.2f} | {ms['head_ms']:.2f} | "
                         f"{ms['draft_ms'] / whole:.2f} | {cover} |")
    return "\n".join(lines)


def _tokenizer(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


if __name__ == "__main__":
    raise SystemExit(main())
