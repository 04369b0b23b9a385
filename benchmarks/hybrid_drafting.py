"""Prompt lookup on a trained hybrid: small 3:1 hybrids (three recurrent layers to one full-attention layer) trained
here to copy, then greedy decoding of held-out input-grounded prompts, plain and with prompt lookup, ours against
transformers' own class with the same weights (CPU, fp32).

    HF_HUB_OFFLINE=1 .venv/bin/python -m benchmarks hybrid_drafting [--layouts gated_deltanet short_conv]
        [--train-steps 600] [--draft-tokens 3 10] [--prompts 4] [--new-tokens 64] [--repeats 3] [--threads N]
        [--out benchmarks/results_hybrid_drafting.json]

Each layout (`LAYOUTS`: Qwen3-Next's, three Gated DeltaNet layers then a gated full-attention layer; LFM2's, three
gated short convolutions then a full-attention layer; hidden 128, vocabulary 128) is made by transformers' class
with its seeded initialisation and converted (`families.save_pair`); ours is then trained here, fp32 on the CPU,
the forward with `labels` and AdamW at a constant 1e-3 (`healing.train_only`): `--train-steps` steps of `BATCH`
sequences of `LENGTH` tokens, each a random piece of 4-32 tokens and 2-16 others, repeated (`mixers.grounded_tokens`):
past the first round every next token is predictable only by copying, which the layers learn (an induction head:
the attention layer matching the recurrent layers' short convolutions of the tokens before). The trained model is
saved, exported to the family's format (`conversion.export`) and loaded by transformers' class; recorded: the
largest logit difference between the sides, and the loss over the second round of held-out sequences shaped as
the prompts (0 for a perfect copier, ln 128 = 4.85 for none) before and after training.

Held-out prompts (`--prompts`, their own seeds): a random piece of 32 tokens, 8 others, the piece again (72
tokens: mixers' drafting prompt with half its piece, a cycle the training draws). Each is decoded greedily for
`--new-tokens` tokens by every case: each side plain and with `prompt_lookup_num_tokens=K` for each K of
`--draft-tokens`, the cases alternating (`measure.alternating`) in one process, `--repeats` timed rounds after a
warm-up round. A case's tokens/s is new tokens over the seconds of the whole `generate` call (prefill included): its
median over repeats per prompt, then the median over prompts; its speed-up, the median over prompts of that ratio
to the same side's plain decoding. The drafted tokens and those kept are counted on transformers'
`PromptLookupCandidateGenerator` (`mixers.CountingDrafts`) over every prompt; every case's tokens are compared with
its side's plain greedy tokens and with ours plain (prompt lookup must give greedy's tokens). What ours writes:
`copied`, the share of its plain new tokens equal to the token one cycle (40 tokens) before (the cycle continued in
step, as a perfect copier writes it), and `repeated`, the share that follow their two preceding tokens as somewhere
earlier in the text (spans copied from anywhere: a jump within the cycle, a loop). `--smoke`: hidden 32, vocabulary
64, 4 training steps of 2 x 32 tokens, two prompts of 28 tokens, 8 new tokens.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers as tf

from . import harness, measure
from .families import load_side, save_pair
from .mixers import CountingDrafts, grounded_tokens

# the recurrent layers first, the attention layer last (as Qwen3-Next's blocks of four end); hidden 128
SIZES = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=128, intermediate_size=256,
             num_hidden_layers=4, max_position_embeddings=4096, pad_token_id=None, bos_token_id=None,
             eos_token_id=None)
SMOKE_SIZES = dict(SIZES, hidden_size=32, vocab_size=64, intermediate_size=64)
ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def _qwen3_next(sizes: dict):
    head = sizes["hidden_size"] // sizes["num_attention_heads"]
    return tf.Qwen3NextConfig(**sizes, head_dim=head, linear_num_key_heads=2, linear_num_value_heads=4,
                              linear_key_head_dim=head, linear_value_head_dim=head, linear_conv_kernel_dim=4,
                              layer_types=["linear_attention"] * 3 + ["full_attention"], num_experts=0,
                              rope_parameters=dict(ROPE, partial_rotary_factor=0.25))


def _lfm2(sizes: dict):
    return tf.Lfm2Config(**sizes, layer_types=["conv"] * 3 + ["full_attention"], conv_L_cache=3,
                         block_auto_adjust_ff_dim=False, rope_parameters=ROPE)


# layout: (transformers config at given sizes, the family `export` writes, transformers' class)
LAYOUTS = {
    "gated_deltanet": (_qwen3_next, "qwen3_next", "Qwen3NextForCausalLM"),
    "short_conv": (_lfm2, "lfm2", "Lfm2ForCausalLM"),
}
BATCH, LENGTH = 16, 128
PIECE, OTHERS = (4, 32), (2, 16)  # training: the piece's and the others' lengths, drawn per sequence
LEARNING_RATE = 1e-3
PROMPT_PIECE, PROMPT_OTHERS = 32, 8  # held-out prompts: a cycle of 40 (trained on cycles of 6 to 48)


def training_batch(vocab: int, generator: torch.Generator, batch: int, length: int) -> torch.Tensor:
    rows = []
    for _ in range(batch):
        piece, others = (int(torch.randint(low, high + 1, (1,), generator=generator)) for low, high in (PIECE, OTHERS))
        rows.append(grounded_tokens(vocab, generator, piece, others, length))
    return torch.cat(rows)


def train(model, steps: int, batch: int, length: int, seed: int = 0) -> dict:
    """`steps` AdamW steps of next-token prediction on copy sequences (`training_batch`, seeded); the losses."""
    from modular_decoder.tools.reshape.healing import train_only

    generator = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size

    def step_loss(step: int) -> torch.Tensor:
        ids = training_batch(vocab, generator, batch, length)
        return model(ids, labels=ids, use_cache=False).loss

    start = time.process_time()
    losses = train_only(model, list(model.parameters()), steps, step_loss, LEARNING_RATE, "training", progress=False)
    return {"steps": steps, "batch": batch, "length": length, "learning_rate": LEARNING_RATE, "seed": seed,
            "loss_first": losses[0], "loss_last": losses[-1], "loss_every_50": losses[::50],
            "cpu_seconds": time.process_time() - start}


@torch.no_grad()
def copy_loss(model, seed: int, piece: int, others: int, sequences: int = 8) -> float:
    """The mean loss over the second round of held-out sequences of a piece and others repeated (0: a perfect
    copier; the log of the vocabulary: none)."""
    generator = torch.Generator().manual_seed(seed)
    period, total = piece + others, 0.0
    for _ in range(sequences):
        ids = grounded_tokens(model.config.vocab_size, generator, piece, others, 2 * period)
        logits = model(ids, use_cache=False).logits[0, period - 1:-1]
        total += torch.nn.functional.cross_entropy(logits, ids[0, period:]).item()
    return total / sequences


def trained_pair(layout: str, folder: Path, sizes: dict, steps: int, batch: int, length: int, held_out: tuple,
                 seed: int = 0):
    """(ours trained, transformers' class with the same weights, how it was made) for `layout`; `held_out`: the
    piece and others of the sequences `copy_loss` is measured on."""
    from modular_decoder.conversion import export

    make_config, family, _ = LAYOUTS[layout]
    save_pair(make_config(sizes), folder, seed=seed)
    ours = load_side(folder, "ours")
    made = {"parameters": ours.num_parameters(), "family": family,
            "copy_loss_before": copy_loss(ours, 1000, *held_out)}
    made |= train(ours, steps, batch, length, seed)
    made["copy_loss_after"] = copy_loss(ours, 1000, *held_out)
    ours.save_pretrained(folder / "trained")
    export(folder / "trained", folder / "trained_hf", family, progress=False)
    theirs = tf.AutoModelForCausalLM.from_pretrained(folder / "trained_hf", dtype=torch.float32,
                                                     attn_implementation="sdpa").eval()
    probe = grounded_tokens(sizes["vocab_size"], torch.Generator().manual_seed(1), 16, 8, 48)
    with torch.no_grad():
        made["max_logit_diff"] = (ours(probe).logits - theirs(probe).logits).abs().max().item()
    return ours, theirs, made


def held_out_prompts(vocab: int, count: int, piece: int, others: int) -> list[torch.Tensor]:
    """`count` prompts (seeds 100, 101, ...): a random piece, others, the piece again."""
    return [grounded_tokens(vocab, torch.Generator().manual_seed(100 + i), piece, others, 2 * piece + others)
            for i in range(count)]


def cases(models: dict, counts: list[int]) -> dict:
    """{case: (model, generate keyword arguments)}: each side plain and with prompt lookup of each K."""
    listed = {}
    for side, model in models.items():
        listed[side] = (model, {})
        listed |= {f"{side}_prompt_lookup_k{k}": (model, {"prompt_lookup_num_tokens": k}) for k in counts}
    return listed


def decode_case(model, prompt: torch.Tensor, new_tokens: int, kwargs: dict):
    """A case for `measure.alternating`: tokens/s of the whole generate call, its tokens, drafted and kept."""
    greedy = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)

    def run() -> dict:
        with CountingDrafts() as counts, torch.no_grad():
            start = time.perf_counter()
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), **greedy, **kwargs)
            seconds = time.perf_counter() - start
        return {"tokens_per_s": new_tokens / seconds, "tokens": out[0, prompt.shape[1]:].tolist(),
                "drafted": counts.drafted, "kept": counts.accepted}
    return run


def copied_share(prompt: torch.Tensor, tokens: list[int], period: int) -> float:
    """The share of `tokens` (continuing `prompt`) equal to the token one `period` before it: the cycle continued in
    step."""
    text = prompt[0].tolist() + tokens
    start = len(prompt[0])
    return sum(text[i] == text[i - period] for i in range(start, len(text))) / len(tokens)


def repeated_share(prompt: torch.Tensor, tokens: list[int]) -> float:
    """The share of `tokens` (continuing `prompt`) that follow their two preceding tokens as those were followed
    somewhere earlier in the text: spans copied from anywhere before (a jump within the cycle, a loop), which
    prompt lookup drafts as well."""
    text = prompt[0].tolist() + tokens
    seen = {(text[j - 2], text[j - 1], text[j]) for j in range(2, len(prompt[0]))}
    repeated = 0
    for i in range(len(prompt[0]), len(text)):
        repeated += (text[i - 2], text[i - 1], text[i]) in seen
        seen.add((text[i - 2], text[i - 1], text[i]))
    return repeated / len(tokens)


def summarize(runs: list[dict], prompts: list[torch.Tensor], period: int) -> dict:
    """Per case over prompts: the median tokens/s (of per-prompt medians), the speed-up over its side's plain
    decoding, the share of drafted tokens kept, whether its tokens equal ours plain and its own side's plain."""
    per_case = {}
    for case in runs[0]:
        side = case.split("_prompt_lookup")[0]
        medians = [statistics.median(r["tokens_per_s"] for r in run[case]) for run in runs]
        plain = [statistics.median(r["tokens_per_s"] for r in run[side]) for run in runs]
        drafted = sum(run[case][0]["drafted"] for run in runs)
        kept = sum(run[case][0]["kept"] for run in runs)
        per_case[case] = {
            "tokens_per_s": statistics.median(medians), "per_prompt_tokens_per_s": medians,
            "speedup": statistics.median(m / p for m, p in zip(medians, plain)),
            "drafted": drafted, "kept": kept, "kept_share": kept / drafted if drafted else None,
            "same_tokens_as_ours_plain": all(run[case][0]["tokens"] == run["ours"][0]["tokens"] for run in runs),
            "same_tokens_as_its_plain": all(run[case][0]["tokens"] == run[side][0]["tokens"] for run in runs),
            "parted_prompts": sum(run[case][0]["tokens"] != run[side][0]["tokens"] for run in runs),
        }
    per_case["ours"]["copied"] = statistics.mean(copied_share(p, run["ours"][0]["tokens"], period)
                                                 for p, run in zip(prompts, runs))
    per_case["ours"]["repeated"] = statistics.mean(repeated_share(p, run["ours"][0]["tokens"])
                                                   for p, run in zip(prompts, runs))
    return per_case


def measure_layout(ours, theirs, prompts: list[torch.Tensor], counts: list[int], new_tokens: int, repeats: int,
                   period: int) -> dict:
    listed = cases({"ours": ours, "transformers": theirs}, counts)
    runs = []
    for i, prompt in enumerate(prompts):
        runs.append(measure.alternating({case: decode_case(model, prompt, new_tokens, kwargs)
                                         for case, (model, kwargs) in listed.items()}, repeats))
        print(f"prompt {i}: " + ", ".join(f"{case} {statistics.median(r['tokens_per_s'] for r in values):.1f}"
                                          for case, values in runs[-1].items()), flush=True)
    return summarize(runs, prompts, period)


def report(result: dict) -> str:
    """The table (markdown): per layout and drafting, each side's tokens/s, ours over transformers, the speed-up
    over its plain decoding, the drafts kept, and whether its tokens are its plain greedy tokens and ours."""
    lines = ["| layout (transformers class) | decoding | tok/s ours | tok/s transformers | ours / transformers | "
             "vs plain: ours | vs plain: transformers | drafted kept: ours / transformers | same tokens as greedy: "
             "ours / transformers |", "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for layout, row in result["layouts"].items():
        for drafting in ["", *(f"_prompt_lookup_k{k}" for k in result["draft_tokens"])]:
            ours, theirs = row["cases"]["ours" + drafting], row["cases"]["transformers" + drafting]
            ratio = statistics.median(a / b for a, b in zip(ours["per_prompt_tokens_per_s"],
                                                             theirs["per_prompt_tokens_per_s"]))
            kept = " / ".join("-" if c["kept_share"] is None else f"{c['kept_share']:.0%}" for c in (ours, theirs))
            same = " / ".join("yes" if c["same_tokens_as_its_plain"] and c["same_tokens_as_ours_plain"]
                              else f"NO ({c['parted_prompts']} prompts part)" for c in (ours, theirs))
            name = f"prompt lookup, K={drafting.rsplit('k', 1)[1]}" if drafting else "plain"
            lines.append(f"| {layout} ({LAYOUTS[layout][2]}) | {name} | {ours['tokens_per_s']:.1f} | "
                         f"{theirs['tokens_per_s']:.1f} | {ratio:.2f}x | {ours['speedup']:.2f}x | "
                         f"{theirs['speedup']:.2f}x | {kept} | {same} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser("hybrid_drafting", __doc__)
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--train-steps", type=int, default=600)
    parser.add_argument("--draft-tokens", type=int, nargs="+", default=[3, 10], metavar="K")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    run = harness.begin("hybrid_drafting", argv, args)
    sizes = SMOKE_SIZES if args.smoke else SIZES
    steps, batch, length = (4, 2, 32) if args.smoke else (args.train_steps, BATCH, LENGTH)
    new_tokens = 8 if args.smoke else args.new_tokens
    piece, others, count = (12, 4, 2) if args.smoke else (PROMPT_PIECE, PROMPT_OTHERS, args.prompts)
    prompts = held_out_prompts(sizes["vocab_size"], count, piece, others)
    result = {"sizes": sizes, "prompt_piece": piece, "prompt_others": others, "prompt_tokens": 2 * piece + others,
              "new_tokens": new_tokens, "draft_tokens": args.draft_tokens, "repeats": args.repeats, "layouts": {}}
    for layout in args.layouts:
        with tempfile.TemporaryDirectory() as tmp:
            ours, theirs, made = trained_pair(layout, Path(tmp), sizes, steps, batch, length, (piece, others))
            print(f"{layout}: {made}", flush=True)
            rows = measure_layout(ours, theirs, prompts, args.draft_tokens, new_tokens, args.repeats, piece + others)
            result["layouts"][layout] = {"model": made, "cases": rows}
    print(report(result))
    harness.write_result(args.out, result, run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
