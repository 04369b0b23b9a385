"""Batch-1 greedy decoding of SmolLM2-135M (fp32) with multi-token prediction: `generate(use_mtp=True)` with MTP
modules added to it, against plain `generate` of the same model, transformers' `LlamaForCausalLM` with the same base
weights, prompt lookup and assistant early exit; the same tokens in every case, in one process.

    HF_HUB_OFFLINE=1 .venv/bin/python -m benchmarks mtp_decode [--mtp FOLDER] [--draft-tokens K ...] [--new-tokens 64]
        [--repeats 3] [--draft-vocab N] [--out benchmarks/results_mtp_decode.json]

The MTP model is `--mtp FOLDER` (a folder `modular-decoder reshape SMOLLM2 FOLDER --add-mtp K --heal-steps S`
wrote; its base weights must be SmolLM2's, checked bit for bit), or, without it, modules added here and trained by
the same self-distillation (`--modules`, `--train-steps`, on `--train-sequences` sequences sampled from the model,
every other one continued greedily as `reshape --add-mtp` does). `--draft-vocab N`: the modules draft among the N
token ids the model predicts most often on that text (`reshape --draft-vocab`, FR-Spec; set before the training,
which then learns over them), and the same modules
drafting over the whole vocabulary are timed beside them (`ours_mtp_whole_vocab`).
Each prompt (a few kinds of text) is decoded greedily for `--new-tokens` tokens by every case; a case's decode
tokens/s is (new tokens - 1) / (time of the whole generate - time of a generate of one token), both timed in each
repeat, the cases alternating (`measure.alternating`). The tokens of every case are compared with ours plain
(`same_tokens`); the acceptance of each prompt is the share of drafted tokens the model kept. `--draft-tokens K
[K ...]`: `ours_mtp` drafts the first K tokens per step (`generate(use_mtp=True, mtp_draft_tokens=K)`; default one
per module), `ours_mtp_kK` each further K; the share of steps that kept at least j drafts is recorded per position j.

The parts of one speculative step are timed apart on the first prompt's context: the model's forward over 1, 2,
... K+1 new tokens against its cache (K drafts per step), the K drafts (blocks and head) and the head alone, and
what `generate` adds around them. With them, the ceiling of the speed-up (every draft accepted) and the speed-up at
the measured acceptance per position follow. `--smoke`: tiny random shapes, a few training steps.
"""

from __future__ import annotations

import copy
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from . import harness, measure
from .families import build_pair

PROMPTS = {
    "chat": "<|im_start|>user\nWhat are three good ways to stay healthy?<|im_end|>\n<|im_start|>assistant\n",
    "facts": "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is",
    "story": "Once upon a time, in a small village at the edge of a forest, there lived a",
    "code": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
}
TRAINING_RECORD = "mtp_training.json"
PROMPT_LOOKUP_TOKENS = 3
EARLY_EXIT_LAYER = 12


def mtp_model(base, args, command: str):
    """The model with MTP modules: `--mtp FOLDER`, or modules added to `base` and trained here by `command` (this
    run's, recorded with `--save-mtp` for the runs that load the folder). Returns (model, how it was made)."""
    from transformers import AutoModelForCausalLM

    from modular_decoder.tools.reshape.add_mtp import add_mtp_modules, agreement, train_mtp
    from modular_decoder.tools.reshape.draft_vocab import with_draft_vocab

    if args.mtp is not None:
        model = AutoModelForCausalLM.from_pretrained(args.mtp, dtype=torch.float32).eval()
        theirs = base.state_dict()
        for name, tensor in model.state_dict().items():
            if not name.startswith("mtp.") and not torch.equal(tensor, theirs[name]):
                raise ValueError(f"--mtp {args.mtp}: `{name}` is not SmolLM2's (the MTP model must keep the base).")
        record = Path(args.mtp) / TRAINING_RECORD  # written by --save-mtp; a reshape folder has its report
        if not record.exists():
            record = Path(args.mtp) / "reshape_report.json"
        made = json.loads(record.read_text()) if record.exists() else {}
        made = {**made, "folder": str(args.mtp), "num_mtp_layers": model.config.num_mtp_layers}
        if args.draft_vocab:  # ranked on text sampled as the training text was (the same seed and sizes)
            text = _training_text(base, args)
            made["draft_vocab"] = with_draft_vocab(model, args.draft_vocab, text.ids, text.held_out)
        return model, made
    start = time.process_time()
    calibration = _training_text(base, args)
    model, _ = add_mtp_modules(base, args.modules)
    if args.draft_vocab:  # ranked on the training text, before training (the modules learn over those ids, as
        # `reshape --draft-vocab` trains them); coverage on its held-out sequences
        draft = with_draft_vocab(model, args.draft_vocab, calibration.ids, calibration.held_out)
    losses = train_mtp(model, calibration.ids, args.train_steps, args.train_lr)
    made = {"trained_here": True, "num_mtp_layers": args.modules, "steps": args.train_steps,
            "learning_rate": args.train_lr, "sequences": args.train_sequences, "text": calibration.source,
            "kl_first": losses[0], "kl_last": losses[-1], "kl_every_50": losses[::50],
            "cpu_seconds": time.process_time() - start, "top1_agreement": agreement(model, calibration.held_out), "command": command}
    if args.draft_vocab:
        made["draft_vocab"] = draft
    if args.save_mtp is not None:  # for later runs (--mtp): the model and how it was made
        model.save_pretrained(args.save_mtp)
        (Path(args.save_mtp) / TRAINING_RECORD).write_text(json.dumps(made, indent=1) + "\n")
    return model, made


def _training_text(base, args):
    """The text the modules train on (and the draft vocabulary is ranked on): sequences sampled from the model,
    every other one continued greedily, as `reshape --add-mtp` calibrates (a `Calibration`: ids, held-out ids)."""
    from modular_decoder.tools.reshape.add_mtp import GREEDY_AFTER
    from modular_decoder.tools.reshape.calibration import sampled_calibration

    return sampled_calibration(base, seed=0, sequences=args.train_sequences, held_out=4,
                               length=16 if args.smoke else 128, greedy_after=GREEDY_AFTER)


def cases(reference, ours, with_mtp, counts: list[int]) -> dict:
    """{case: (model, generate keyword arguments)}: `ours_mtp` drafts at most `counts[0]` tokens per step (as many
    as pay, by the call's measurements: `draft_schedule.py`), `ours_mtp_constant` exactly `counts[0]` every step,
    `ours_mtp_k{K}` at most each further K of `counts`; with a draft vocabulary, also the same modules drafting at
    most `counts[0]` over the whole vocabulary (`ours_mtp_whole_vocab`, a copy of the model without it)."""
    from modular_decoder.draft_vocab import set_draft_vocab

    layers = ours.config.num_hidden_layers
    mtp = {"use_mtp": True, "mtp_draft_tokens": counts[0]}
    listed = {
        "transformers": (reference, {}),
        "ours": (ours, {}),
        "ours_mtp": (with_mtp, mtp),
        "ours_mtp_constant": (with_mtp, mtp | {"num_assistant_tokens_schedule": "constant"}),
        **{f"ours_mtp_k{count}": (with_mtp, mtp | {"mtp_draft_tokens": count}) for count in counts[1:]},
        "ours_prompt_lookup": (ours, {"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS}),
        "ours_early_exit": (ours, {"assistant_early_exit": min(EARLY_EXIT_LAYER, layers - 1)}),
    }
    if with_mtp.mtp.draft_vocab is not None:
        whole = copy.deepcopy(with_mtp)
        set_draft_vocab(whole, None)
        listed["ours_mtp_whole_vocab"] = (whole, mtp)
    return listed


def generate(model, prompt, new_tokens: int, **kwargs) -> torch.Tensor:
    return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, **kwargs)


def decode_case(model, prompt, new_tokens: int, kwargs: dict):
    """A case for `measure.alternating`: (decode tokens/s, the tokens, drafts recorded)."""
    from modular_decoder.mtp_generation import recorded_drafts

    def run():
        first = measure.wall(lambda: generate(model, prompt, 1, **kwargs))
        with recorded_drafts() as drafts:
            start = time.perf_counter()
            tokens = generate(model, prompt, new_tokens, **kwargs)
            seconds = time.perf_counter() - start
        return {"tokens_per_s": (new_tokens - 1) / max(seconds - first, 1e-9), "tokens": tokens[0].tolist(),
                "forwards": drafts.forwards, "drafted": drafts.drafted, "steps": drafts.steps,
                "drafted_at_least": drafts.drafted_at_least, "accepted_at_least": drafts.accepted_at_least}
    return run


def step_parts(model, prompt, new_tokens: int, repeats: int, counts: list[int]) -> dict:
    """Milliseconds of the parts of a speculative step of K drafts for each K of `counts`, on `prompt` followed by
    `new_tokens` greedy tokens: the model's forward over 1 .. max(K)+1 new tokens against its cache (cropped back
    after each), the K drafts after one verified token (`drafts_{K}`: the modules' blocks and the head over one
    position each) and the head alone over one position."""
    from modular_decoder.cache import ModularDecoderCache
    from modular_decoder.draft_vocab import subset_logits

    count = max(counts)
    text = generate(model, prompt, new_tokens)
    cache = ModularDecoderCache(model.config)
    out = model(text[:, :-count - 1], cache=cache, output_hidden_states=True)
    hidden = out.hidden_states[-1][:, -1:]
    forwards = {}
    for k in range(1, count + 2):
        def forward(k=k):
            model(text[:, -count - 1:][:, :k], cache=cache)
            cache.crop(-k)
        forwards[k] = forward
    parts = {f"forward_{k}_tokens": fn for k, fn in forwards.items()}
    parts |= {f"drafts_{k}": drafting(model, text, out.hidden_states[-1], cache, count, k) for k in counts}
    parts["head_one_position"] = lambda: model._logits(hidden)
    if model.mtp.draft_vocab is not None:
        parts["draft_head_one_position"] = lambda: subset_logits(model, hidden[:, -1], model.mtp.draft_vocab)
    with torch.inference_mode():
        timed = measure.alternating({name: measure.seconds(fn) for name, fn in parts.items()}, repeats * 5)
    return {name: 1e3 * statistics.median(values) for name, values in timed.items()}


def drafting(model, text, hidden, cache, count: int, drafts: int | None = None):
    """One speculative step's `drafts` drafts (default `count`) as a call (the modules' cache cropped back after
    it): the modules drafting after `text` (1, T) but its last `count`+1 tokens, from the model's last hidden states
    `hidden` over `text[:, :-count-1]` (its forward into `cache`), their own cache filled with what comes before."""
    from modular_decoder.mtp_generation import DraftingOptions, MtpCandidateGenerator, drafting_options

    with drafting_options(DraftingOptions(drafts or count)):
        generator = MtpCandidateGenerator(model, model.generation_config, {"cache": cache}, None)
    drafter, mtp_cache = generator.drafter, generator.cache
    prefix = text[:, 1:-count - 1]
    drafter(prefix, hidden[:, :-1], None, torch.arange(1, prefix.shape[1] + 1).unsqueeze(0), mtp_cache)
    last = hidden[:, -1:]

    def draft():  # one verified token: each module drafting writes one entry, cropped back
        drafter(text[:, -count - 1:-count], last, None, torch.tensor([[text.shape[1] - count - 1]]), mtp_cache)
        mtp_cache.crop(-1)
    return draft


def ceiling(parts: dict, count: int, acceptance: float, overhead_ms: float,
            position_acceptance: list[float] | None = None) -> dict:
    """The speed-up over plain decoding a step of `count` drafts with these parts gives: every draft accepted, and
    at the measured acceptance: the expected tokens per step are 1 + p_1 + ... + p_K, p_j the share of steps that
    kept at least j drafts (`position_acceptance`), or without it 1 + a + a^2 + ... + a^K (each draft accepted with
    probability `acceptance` given the ones before it)."""
    plain = parts["forward_1_tokens"] + overhead_ms
    step = parts[f"forward_{count + 1}_tokens"] + parts[f"drafts_{count}"] + overhead_ms
    if position_acceptance:
        expected = 1 + sum(position_acceptance[:count])
    else:
        expected = sum(acceptance ** k for k in range(count + 1))
    return {"all_accepted": (count + 1) * plain / step, "at_measured_acceptance": expected * plain / step,
            "tokens_per_step": expected}


def table(results: dict) -> str:
    """The printed (and rendered) table: per case the median decode tokens/s over prompts, the ratio to ours plain
    and to transformers, the acceptance and whether every token matched."""
    rows = results["cases"]
    lines = ["| case | decode tok/s (median over prompts) | vs ours plain | vs transformers | acceptance | "
             "steps that drafted | same tokens |",
             "|---|---:|---:|---:|---:|---:|:---:|"]
    base, theirs = rows["ours"]["tokens_per_s"], rows["transformers"]["tokens_per_s"]
    for name, row in rows.items():
        acceptance = f"{row['acceptance']:.0%}" if row.get("acceptance") is not None else ""
        drafting = f"{row['drafting_steps']:.0%}" if row.get("drafting_steps") is not None else ""
        lines.append(f"| {name} | {row['tokens_per_s']:.1f} | {row['tokens_per_s'] / base:.2f} | "
                     f"{row['tokens_per_s'] / theirs:.2f} | {acceptance} | {drafting} | "
                     f"{'yes' if row['same_tokens'] else 'NO'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser("mtp_decode", __doc__)
    parser.add_argument("--mtp", type=Path, help="a folder with SmolLM2 and MTP modules (reshape --add-mtp)")
    parser.add_argument("--modules", type=int, default=1, help="without --mtp: MTP modules to add and train here")
    parser.add_argument("--train-steps", type=int, default=200)
    parser.add_argument("--train-lr", type=float, default=1e-3)
    parser.add_argument("--train-sequences", type=int, default=16)
    parser.add_argument("--save-mtp", type=Path, help="without --mtp: save the model trained here to this folder")
    parser.add_argument("--draft-tokens", type=int, nargs="+", default=None, metavar="K",
                        help="tokens drafted per step (generate(mtp_draft_tokens=K)), one MTP case per K (the first: "
                             "ours_mtp, the others ours_mtp_kK); default one per module")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--draft-vocab", type=int, metavar="N",
                        help="the modules draft among the N ids the model predicts most often on their training text "
                             "(FR-Spec); adds the case ours_mtp_whole_vocab (the same modules, the whole head)")
    args = parser.parse_args(argv)
    if args.draft_tokens is not None and (min(args.draft_tokens) < 1 or len(set(args.draft_tokens)) < len(args.draft_tokens)):
        parser.error(f"--draft-tokens {' '.join(map(str, args.draft_tokens))}: each at least 1, each once")
    if args.smoke:
        args.train_steps, args.train_sequences, args.new_tokens = 2, 2, 8
    run = harness.begin("mtp_decode", argv, args)
    with tempfile.TemporaryDirectory() as folder:
        reference, ours, label = build_pair("llama", Path(folder), quick=args.smoke)
        with_mtp, made = mtp_model(ours, args, run.command)
        tokenizer = None if args.smoke else _tokenizer(Path(folder) / "ours")
    prompts = {name: (tokenizer(text, return_tensors="pt").input_ids if tokenizer is not None
                      else torch.randint(0, ours.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(i)))
               for i, (name, text) in enumerate(PROMPTS.items())}
    print(f"{label}, {torch.get_num_threads()} threads, {args.new_tokens} new tokens, MTP modules: {made}", flush=True)
    counts = args.draft_tokens or [with_mtp.config.num_mtp_layers]
    runs = {}
    with torch.inference_mode():
        for prompt_name, prompt in prompts.items():
            runs[prompt_name] = measure.alternating(
                {case: decode_case(model, prompt, args.new_tokens, kwargs)
                 for case, (model, kwargs) in cases(reference, ours, with_mtp, counts).items()},
                args.repeats)
            print(prompt_name, {case: round(statistics.median(r["tokens_per_s"] for r in values), 1)
                                for case, values in runs[prompt_name].items()}, flush=True)
    results = summarize(runs, args.new_tokens)
    parts = step_parts(with_mtp, prompts[next(iter(prompts))], args.new_tokens, args.repeats, counts)
    overhead = _generate_overhead(results, parts)
    ceilings = {}
    for count in counts:
        row = results["cases"][ceiling_case(counts, count)]
        ceilings[str(count)] = ceiling(parts, count, row["acceptance"], overhead, row.get("position_acceptance"))
    results.update(label=label, new_tokens=args.new_tokens, repeats=args.repeats, mtp=made, draft_tokens=counts,
                   draft_vocab=with_mtp.config.mtp_draft_vocab_size,
                   step_ms=parts, generate_overhead_ms=overhead, ceiling=ceilings)
    print("\n" + table(results) + f"\n\nstep parts (ms): {parts}\nceiling: {results['ceiling']}", flush=True)
    harness.write_result(args.out, results, run)
    return 0


def mtp_case(counts: list[int], count: int) -> str:
    """The case that drafts at most `count` tokens per step (`cases`)."""
    return "ours_mtp" if count == counts[0] else f"ours_mtp_k{count}"


def ceiling_case(counts: list[int], count: int) -> str:
    """The case whose acceptance gives the ceiling of `count` drafts per step: the one drafting `count` every step
    where there is one."""
    return "ours_mtp_constant" if count == counts[0] else mtp_case(counts, count)


def summarize(runs: dict, new_tokens: int) -> dict:
    """Per case: the median tokens/s over prompts (each prompt's median over repeats), per-prompt figures, the
    acceptance over every prompt's drafts, and whether every prompt's tokens equal ours plain."""
    per_case = {}
    for case in next(iter(runs.values())):
        prompts = {}
        for prompt, values in runs.items():
            rows = values[case]
            drafted = rows[0]["drafted"]
            prompts[prompt] = {"tokens_per_s": measure.summary([r["tokens_per_s"] for r in rows]),
                               "same_tokens": rows[0]["tokens"] == values["ours"][0]["tokens"],
                               "acceptance": (new_tokens - rows[0]["forwards"]) / drafted if drafted else None}
        drafted = [(p["acceptance"], runs[name][case][0]["drafted"]) for name, p in prompts.items()
                   if p["acceptance"] is not None]
        per_case[case] = {
            "tokens_per_s": statistics.median(p["tokens_per_s"]["median"] for p in prompts.values()),
            "same_tokens": all(p["same_tokens"] for p in prompts.values()),
            "acceptance": (sum(a * d for a, d in drafted) / sum(d for _, d in drafted)) if drafted else None,
            "prompts": prompts,
        }
        steps = sum(values[case][0].get("steps", 0) for values in runs.values())
        if steps:  # per position j, the share of every prompt's steps drafting j drafts that kept at least j
            kept, tried = ([values[case][0][name] for values in runs.values()]
                           for name in ("accepted_at_least", "drafted_at_least"))
            per_case[case]["position_acceptance"] = [
                sum(row[j] for row in kept if j < len(row)) / sum(row[j] for row in tried if j < len(row))
                for j in range(max(len(row) for row in tried))]
            # the share of the steps after the prefill that drafted (the rest decoded plainly)
            per_case[case]["drafting_steps"] = steps / sum(values[case][0]["forwards"] - 1 for values in runs.values())
    return {"cases": per_case}


def _generate_overhead(results: dict, parts: dict) -> float:
    """What plain `generate` adds to the model's forward per token (ms): its measured step less the forward."""
    step_ms = 1e3 / results["cases"]["ours"]["tokens_per_s"]
    return max(0.0, step_ms - parts["forward_1_tokens"])


def _tokenizer(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


if __name__ == "__main__":
    raise SystemExit(main())
