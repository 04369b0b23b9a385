"""`reshape_folder`: a checkpoint folder in, a reshaped folder out, with the measured report
(`reshape_report.json` and the model card) of what the change bought and cost."""

from __future__ import annotations

import contextlib
import json
import resource
import time
from pathlib import Path

import torch

from .add_mtp import GREEDY_AFTER, add_mtp_modules, agreement, decoding_acceptance, train_mtp
from .calibration import Calibration, calibration_from_file, sampled_calibration
from .draft_vocab import with_draft_vocab
from .healing import LEARNING_RATE, heal
from .measures import logit_change, measured_cache_bytes_per_token, perplexity, perplexity_gap
from .moments import attention_moments
from .pipeline import changed_modules, check_options, to_latent_attention, transform

REPORT_FILE = "reshape_report.json"


def measure(model, held_out: torch.LongTensor) -> dict:
    """Parameters, measured cache bytes per token and held-out perplexity of one model."""
    from modular_decoder.contract import parameter_count

    counts = parameter_count(model.config)
    return {"parameters": model.num_parameters(), "active_parameters": counts["active"],
            "kv_cache_bytes_per_token": measured_cache_bytes_per_token(model),
            "perplexity": perplexity(model, held_out)}


def reshape_folder(src, out, *, calibration=None, sweep_ranks=None, heal_steps: int = 0,
                   heal_lr: float = LEARNING_RATE, force: bool = False, progress: bool = True, seed: int = 0,
                   input_checks=contextlib.nullcontext, **options) -> dict:
    """Reshape the checkpoint folder `src` into `out` (weights, config, code, tokenizer, model card and
    `reshape_report.json`, written atomically: nothing is left behind on failure or Ctrl-C); returns the report.

    `calibration` is a plain-text file (tokenised with the source's tokenizer); without it, text is sampled
    from the source model. `sweep_ranks` (with `attention="mla"`) adds a table of cache bytes and perplexity
    over those latent ranks. Options are checked against the source's config before anything is loaded.
    `input_checks`: a context manager the steps that check the caller's input run inside (the CLI's
    `user_input`, which turns their errors into one-line user errors).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from modular_decoder import ModularDecoderConfig
    from modular_decoder.conversion.io import atomic_folder, check_destination, copy_side_files
    from modular_decoder.conversion.multimodal import copy_kept_release

    from .report import render_card, summary

    src, out = Path(src), Path(out)
    start = time.perf_counter()
    with input_checks():
        check_destination(out, force, sources=(src,))
        if not (src / "config.json").is_file():
            raise FileNotFoundError(f"{src} is not a checkpoint folder (no config.json).")
        config = AutoConfig.from_pretrained(str(src))
        if not isinstance(config, ModularDecoderConfig):
            raise ValueError(f"{src} is not a modular_decoder checkpoint (model_type={config.model_type!r}); "
                             "convert it first (`modular-decoder convert`).")
        if calibration is not None and not Path(calibration).is_file():
            raise FileNotFoundError(f"`calibration` file not found: {calibration}")
        check_options(config, sweep_ranks=sweep_ranks, heal_steps=heal_steps, heal_lr=heal_lr,
                      needs_calibration_ids=False, **options)

        tokenizer = _tokenizer(src)
        # the calibration text is read (and refused) before the model loads
        calib = calibration_from_file(calibration, tokenizer, config.vocab_size) if calibration else None
        saved_dtype = config.dtype if isinstance(config.dtype, torch.dtype) else getattr(torch, str(config.dtype or "float32"))
        model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    timing = {"load": time.perf_counter() - start}
    drafting = options.get("add_mtp") or options.get("draft_vocab")  # greedy text: what drafts are checked on
    calib = calib or sampled_calibration(model, seed, greedy_after=GREEDY_AFTER if drafting else None)
    timing["calibration"] = time.perf_counter() - start - sum(timing.values())
    before = measure(model, calib.held_out)
    structural = {**{k: v for k, v in options.items() if k != "draft_vocab"}, "attention": None, "kv_lora_rank": None,
                  "rope_dim": None, "add_mtp": None}
    base, changes = transform(model, calib.ids, seed=seed, progress=progress, measure_ids=calib.ids, **structural)
    new = base
    if options.get("attention") == "mla":  # apart, so that the sweep starts from `base`
        moments = attention_moments(base, calib.ids, progress=progress)  # one calibration pass, reused by the sweep
        new, change = to_latent_attention(base, options["kv_lora_rank"], options.get("rope_dim"), calib.ids, progress,
                                          moments)
        change.measured = logit_change(base, new, calib.ids)
        changes.append(change)
    if options.get("add_mtp"):  # last: the modules copy the last block as the other transformations leave it
        with_mtp, change = add_mtp_modules(new, options["add_mtp"], seed, copy=new is model)
        change.measured = logit_change(new, with_mtp, calib.ids)
        new = with_mtp
        changes.append(change)
    timing["transform"] = time.perf_counter() - start - sum(timing.values())
    after = measure(new, calib.held_out)
    report = {"source": str(src), "options": _given(options, calibration, heal_steps, seed),
              "calibration": calib.describe(), "transformations": [change.as_dict() for change in changes],
              "measured_in": "float32", "before": before, "after": after}
    if heal_steps and changed_modules(changes):
        losses = heal(new, model, calib.ids, heal_steps, changed_modules(changes), heal_lr, progress)
        healed = perplexity(new, calib.held_out)
        gap = perplexity_gap(before["perplexity"], after["perplexity"], healed, report["transformations"])
        report["heal"] = {"steps": heal_steps, "learning_rate": heal_lr, "trainable": changed_modules(changes),
                          "kl_first": losses[0], "kl_last": losses[-1], "perplexity": healed,
                          "gap_closed": gap.pop("closed"), **gap}
        timing["heal"] = time.perf_counter() - start - sum(timing.values())
    if options.get("draft_vocab"):  # before the modules' training, which then learns over it (`train_mtp`)
        report["draft_vocab"] = with_draft_vocab(new, options["draft_vocab"], calib.ids, calib.held_out)
        timing["draft_vocab"] = time.perf_counter() - start - sum(timing.values())
    if options.get("add_mtp"):
        losses = train_mtp(new, calib.ids, heal_steps, heal_lr, progress)
        report["mtp"] = {"modules": options["add_mtp"], "steps": heal_steps, "learning_rate": heal_lr,
                         "kl_first": losses[0], "kl_last": losses[-1],
                         "top1_agreement": agreement(new, calib.held_out),
                         "decoding": decoding_acceptance(new, calib.held_out)}
        timing["mtp"] = time.perf_counter() - start - sum(timing.values())
    if sweep_ranks:
        report["sweep"] = _sweep(base, calib, sweep_ranks, options.get("rope_dim"), moments, progress)
        timing["sweep"] = time.perf_counter() - start - sum(timing.values())
    del model, base
    new = new.to(saved_dtype)
    with atomic_folder(out, force=force, sources=(src,)) as tmp:
        new.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        copy_side_files(src, tmp)
        copy_kept_release(src, tmp)  # a release's vision tower and processor, so that it exports back
        timing["total"] = time.perf_counter() - start
        report["timing_s"] = {k: round(v, 2) for k, v in timing.items()}
        report["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        (tmp / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
        (tmp / "README.md").write_text(render_card(new.config, report))
    if progress:
        print(summary(report))
    return report


def _tokenizer(src: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(src))
    except (OSError, ValueError, TypeError):
        return None  # a folder without tokenizer files: calibration is sampled as token ids


def _given(options: dict, calibration, heal_steps: int, seed: int) -> dict:
    given = {k: v for k, v in options.items() if v is not None}
    given.update({"calibration": str(calibration) if calibration else None, "heal_steps": heal_steps, "seed": seed})
    return given


def _sweep(base, calib: Calibration, ranks, rope_dim: int | None, moments: list[torch.Tensor],
           progress: bool) -> list[dict]:
    """Cache bytes and held-out perplexity of the MLA conversion of `base` at each latent rank, from `base`'s
    attention moments on `calib.ids`."""
    from tqdm.auto import tqdm

    rows = []
    for rank in tqdm(sorted(set(ranks)), desc="rank sweep", unit="rank", disable=not progress):
        candidate, _ = to_latent_attention(base, rank, rope_dim, calib.ids, progress=False, moments=moments)
        rows.append({"kv_lora_rank": rank, **measure(candidate, calib.held_out)})
        del candidate
    return rows
