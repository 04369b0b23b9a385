"""`modular-decoder experiment ...`: small runs that reproduce three findings of the literature.

    modular-decoder experiment gradnorm      # post- vs pre-norm FFN gradient norms per layer (+ PNG)
    modular-decoder experiment ffn-budget    # the 8d/3 rule, checked against the built modules
    modular-decoder experiment ablation      # matched-budget training of small variants (+ PNG)
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path


def add_arguments(parser) -> None:
    sub = parser.add_subparsers(dest="experiment", required=True)
    grad = sub.add_parser("gradnorm", help="post- vs pre-norm gradient norm of each layer's FFN weight")
    grad.add_argument("--hidden", type=int, default=512)
    grad.add_argument("--layers", type=int, default=6)
    grad.add_argument("--steps", type=int, default=20, help="optimizer steps for the trained conditions")
    grad.add_argument("--seed", type=int, default=0)
    grad.add_argument("--out", default="experiments_out", help="folder for gradnorm.md and gradnorm.png")
    ffn = sub.add_parser("ffn-budget", help="parameter-matched dense vs gated FFN widths (8d/3)")
    ffn.add_argument("--multiple-of", type=int, default=256)
    abl = sub.add_parser("ablation", help="matched-budget training of small variants on a generated corpus")
    abl.add_argument("--tokens", type=int, default=32_768, help="training tokens per variant")
    abl.add_argument("--variants", nargs="+", help="subset of variant names (default: all)")
    abl.add_argument("--seed", type=int, default=0, help="the first seed")
    abl.add_argument("--seeds", type=int, default=3, help="seeds per variant (seed, seed+1, ...); the table reports "
                                                         "the mean and the min-max range over them")
    abl.add_argument("--out", default="experiments_out",
                     help="folder for ablation.md, ablation.png and ablation.json (every seed's losses)")


def run(args) -> int:
    if args.experiment == "ffn-budget":
        from modular_decoder.tools.experiments.ffn_budget import table

        text, ok = table(multiple_of=args.multiple_of)
        print(text)
        if not ok:
            print("ffn-budget: a formula disagrees with the built module", file=sys.stderr)
        return 0 if ok else 1
    from modular_decoder.commands import UserError, user_input

    out = Path(args.out)
    with user_input(OSError):
        out.mkdir(parents=True, exist_ok=True)
    if args.experiment == "gradnorm":
        from modular_decoder.tools.experiments import gradnorm

        grid = gradnorm.default_grid(args.hidden, args.layers, args.steps)
        rows = gradnorm.run(grid, seed=args.seed, progress=lambda line: print(line, file=sys.stderr))
        (out / "gradnorm.md").write_text(gradnorm.markdown(rows) + "\n")
        gradnorm.plot(rows, out / "gradnorm.png")
        print(gradnorm.markdown(rows))
        print(f"wrote {out / 'gradnorm.md'} and {out / 'gradnorm.png'}")
        return 0
    from modular_decoder.tools.experiments import ablation

    if args.seeds < 1:
        raise UserError(f"`--seeds`={args.seeds} must be at least 1.")
    with user_input():
        for name in args.variants or ():
            ablation.config_for(name)  # an unknown name fails before any training
    import os
    import time

    from modular_decoder.tools import provenance

    started, load, code = time.time(), os.getloadavg(), provenance.commit()
    results = ablation.run(args.tokens, names=args.variants, seed=args.seed, seeds=args.seeds,
                           progress=lambda line: print(line, file=sys.stderr, flush=True))
    options = ["--tokens", str(args.tokens), "--seeds", str(args.seeds)]
    options += ["--seed", str(args.seed)] if args.seed else []
    options += ["--variants", *args.variants] if args.variants else []
    options += ["--out", args.out]
    command = ".venv/bin/modular-decoder experiment ablation " + " ".join(shlex.quote(a) for a in options)
    record = provenance.record(command, code, started, load, {"tokens": args.tokens, "seeds": args.seeds,
                                                             "seed": args.seed, "variants": args.variants})
    (out / "ablation.md").write_text(ablation.page(results, args.tokens, command, "ablation.png", record) + "\n")
    ablation.plot(results, out / "ablation.png")
    ablation.write_json(results, out / "ablation.json", record)
    print(ablation.markdown(results, args.tokens))
    print(f"wrote {out / 'ablation.md'}, {out / 'ablation.png'} and {out / 'ablation.json'}")
    return 0
