"""Architecture surgery: move a trained checkpoint to another point of the design space.

`reshape(model, **options) -> model` transforms the weights and the config; `reshape_folder(src, out,
**options) -> report` does it folder to folder (the `modular-decoder reshape` command) and measures what
the change bought and cost. The transformations, applied in this order when combined:

| option | module | keeps exactly | approximates |
|---|---|---|---|
| `drop_layers=N` | `reshape_layers` | the other layers | the removed block (the most redundant on calibration text) |
| `kv_heads=N` | `reshape_heads` | everything when N is a multiple of the K/V heads | fewer heads: group means |
| `experts=E, top_k=K, shared_experts=S, fine_grained=G` | `reshape_experts` | the function, at step 0 | nothing |
| `attention="mla", kv_lora_rank=R, rope_dim=D` | `reshape_mla` | see there (TransMLA) | partial RoPE, rank R |

`heal_steps=S` then distils the source into the changed modules on the calibration text (`reshape_heal`).
Tools, not model code: nothing here ships with a checkpoint.
"""

from __future__ import annotations

import contextlib

import json
import resource
import time
from pathlib import Path

import torch

from .reshape_base import Change, require_positive_int
from .reshape_eval import Calibration, calibration_from_file, measured_cache_bytes_per_token, perplexity, \
    sampled_calibration
from .reshape_experts import check_experts, upcycle
from .reshape_heads import POOLS, check_kv_heads, reshape_kv_heads
from .reshape_heal import LEARNING_RATE, heal
from .reshape_layers import check_drop_layers, drop_block

ATTENTIONS = ("mla",)
REPORT_FILE = "reshape_report.json"


def check_options(config, *, kv_heads=None, kv_pool="mean", attention=None, kv_lora_rank=None, rope_dim=None,
                  sweep_ranks=None, experts=None, top_k=None, shared_experts=0, fine_grained=1, drop_layers=None,
                  heal_steps=0, heal_lr=LEARNING_RATE, calibration_ids=None, needs_calibration_ids=True) -> None:
    """Refuse bad options before any work: a `ValueError` naming the option. Checks each transformation's
    options against `config` as it will be when that transformation runs."""
    _check_attention(config, attention, kv_lora_rank, rope_dim, sweep_ranks)
    if not any(value is not None for value in (kv_heads, attention, experts, drop_layers)):
        raise ValueError("Nothing to do: pass at least one of `kv_heads`, `attention`, `experts`, `drop_layers`.")
    if kv_pool not in POOLS:
        raise ValueError(f"`kv_pool`={kv_pool!r} is not one of {list(POOLS)}.")
    if drop_layers is not None:
        check_drop_layers(config, drop_layers)
    if kv_heads is not None:
        if attention is not None:
            raise ValueError("`kv_heads` and `attention='mla'` are two ways to shrink the K/V cache: choose one.")
        check_kv_heads(config, kv_heads, kv_pool)
    if (experts is None) != (top_k is None):
        raise ValueError("`experts` and `top_k` go together (upcycling needs both).")
    if experts is None and (shared_experts or fine_grained != 1):
        raise ValueError("`shared_experts` and `fine_grained` need `experts` and `top_k`.")
    if experts is not None:
        check_experts(config, experts, top_k, shared_experts, fine_grained)
    require_positive_int("heal_steps", heal_steps, minimum=0)
    if not (isinstance(heal_lr, (int, float)) and heal_lr > 0):
        raise ValueError(f"`heal_lr` must be a positive number, got {heal_lr!r}.")
    needs = drop_layers is not None or attention is not None or heal_steps
    if needs_calibration_ids and needs and calibration_ids is None:
        raise ValueError("`calibration_ids` are needed for `drop_layers`, `attention` and `heal_steps`.")


def _check_attention(config, attention, kv_lora_rank, rope_dim, sweep_ranks) -> None:
    if attention is None:
        for name, value in (("kv_lora_rank", kv_lora_rank), ("rope_dim", rope_dim), ("sweep_ranks", sweep_ranks)):
            if value is not None:
                raise ValueError(f"`{name}` needs `attention='mla'`.")
        return
    if attention not in ATTENTIONS:
        raise ValueError(f"`attention`={attention!r} is not one of {list(ATTENTIONS)}.")
    if config.attention_type != "standard":
        raise ValueError(f"`attention='mla'` converts standard attention; this model has attention_type="
                         f"{config.attention_type!r}.")
    if kv_lora_rank is None:
        raise ValueError("`attention='mla'` needs `kv_lora_rank` (the latent width d_c).")
    require_positive_int("kv_lora_rank", kv_lora_rank)
    if rope_dim is not None:
        require_positive_int("rope_dim", rope_dim)
        if rope_dim % 2 or rope_dim > config.head_dim:
            raise ValueError(f"`rope_dim`={rope_dim} must be even and at most head_dim={config.head_dim}.")
    for rank in sweep_ranks or ():
        require_positive_int("sweep_ranks", rank)


def transform(model, calibration_ids=None, *, kv_heads=None, kv_pool="mean", attention=None, kv_lora_rank=None,
              rope_dim=None, experts=None, top_k=None, shared_experts=0, fine_grained=1, drop_layers=None,
              seed: int = 0, progress: bool = True) -> tuple[torch.nn.Module, list[Change]]:
    """Apply the chosen transformations in order (drop layers, K/V heads, experts, MLA); returns the new
    model (sharing no tensor with `model`, which is left unchanged) and each transformation's record."""
    changes: list[Change] = []
    current, owned = model, False  # `owned`: an intermediate model of ours, whose tensors can be reused
    if drop_layers is not None:
        current, change = drop_block(current, calibration_ids, drop_layers, progress, copy=not owned)
        changes.append(change)
        owned = True
    if kv_heads is not None:
        current, change = reshape_kv_heads(current, kv_heads, kv_pool, seed, copy=not owned)
        changes.append(change)
        owned = True
    if experts is not None:
        current, change = upcycle(current, experts, top_k, shared_experts, fine_grained, seed, copy=not owned)
        changes.append(change)
        owned = True
    if attention == "mla":
        current, change = to_latent_attention(current, kv_lora_rank, rope_dim, calibration_ids, progress)
        changes.append(change)
    return current, changes


def to_latent_attention(model, kv_lora_rank: int, rope_dim: int | None, calibration_ids, progress: bool = True):
    """GQA / MHA -> MLA the TransMLA way (`reshape_mla.to_mla`); returns (model, Change)."""
    try:
        from .reshape_mla import to_mla
    except ModuleNotFoundError as error:
        if error.name and error.name.endswith("reshape_mla"):
            raise ValueError("`attention='mla'` needs modular_decoder/tools/reshape_mla.py, which this build "
                             "lacks.") from None
        raise
    new = to_mla(model, kv_lora_rank, rope_dim, calibration_ids, progress=progress)
    change = Change(
        "attention",
        keeps="queries' RoPE part on the kept rotary dimensions, FFN, norms, embeddings",
        approximates=f"keys and values through a rank-{kv_lora_rank} latent (TransMLA: RoRoPE, partial RoPE on "
                     f"{new.config.qk_rope_head_dim} dimensions, activation-aware factorisation)",
        changed=[f"model.layers.{i}.self_attn" for i in range(new.config.num_hidden_layers)],
        details={"attention": "mla", "kv_lora_rank": kv_lora_rank, "rope_dim": new.config.qk_rope_head_dim},
    )
    return new, change


def reshape(model, calibration_ids: torch.LongTensor | None = None, *, heal_steps: int = 0,
            heal_lr: float = LEARNING_RATE, progress: bool = True, **options) -> torch.nn.Module:
    """A new model at another point of the design space, from a trained `ModularDecoderForCausalLM`.

    Args:
        model: The source; left unchanged (the result shares no tensor with it).
        calibration_ids: (sequences, T) token ids, needed by `drop_layers`, `attention="mla"` and
            `heal_steps` (`reshape_eval.sampled_calibration(model)` makes them data-free).
        kv_heads: K/V heads of the result (MHA / GQA / MQA); `kv_pool` = "mean" (default), "first", "random".
        attention: "mla" with `kv_lora_rank` (and `rope_dim`): TransMLA's conversion to latent attention.
        experts, top_k, shared_experts, fine_grained: sparse upcycling of the FFN (exact at step 0).
        drop_layers: remove the most redundant block of this many consecutive layers.
        heal_steps: AdamW steps distilling `model` into the changed modules on `calibration_ids`.
        seed: Seeds the router rows and `kv_pool="random"`.

    Raises `ValueError` naming the option for what a transformation cannot do.
    """
    check_options(model.config, heal_steps=heal_steps, heal_lr=heal_lr, calibration_ids=calibration_ids, **options)
    new, changes = transform(model, calibration_ids, progress=progress, **options)
    if heal_steps:
        heal(new, model, calibration_ids, heal_steps, _changed(changes), heal_lr, progress)
    return new


def _changed(changes: list[Change]) -> list[str]:
    return [prefix for change in changes for prefix in change.changed]


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

    from .reshape_report import render_card, summary

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

        saved_dtype = config.dtype if isinstance(config.dtype, torch.dtype) else getattr(torch, str(config.dtype or "float32"))
        model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
        tokenizer = _tokenizer(src)
    timing = {"load": time.perf_counter() - start}
    calib = calibration_from_file(calibration, tokenizer) if calibration else sampled_calibration(model, seed)
    timing["calibration"] = time.perf_counter() - start - sum(timing.values())
    before = measure(model, calib.held_out)
    structural = {**options, "attention": None, "kv_lora_rank": None, "rope_dim": None}
    base, changes = transform(model, calib.ids, seed=seed, progress=progress, **structural)
    new = base
    if options.get("attention") == "mla":
        new, change = to_latent_attention(base, options["kv_lora_rank"], options.get("rope_dim"), calib.ids, progress)
        changes.append(change)
    timing["transform"] = time.perf_counter() - start - sum(timing.values())
    after = measure(new, calib.held_out)
    report = {"source": str(src), "options": _given(options, calibration, heal_steps, seed),
              "calibration": calib.describe(), "transformations": [change.as_dict() for change in changes],
              "measured_in": "float32", "before": before, "after": after}
    if heal_steps:
        losses = heal(new, model, calib.ids, heal_steps, _changed(changes), heal_lr, progress)
        healed = perplexity(new, calib.held_out)
        gap = after["perplexity"] - before["perplexity"]
        report["heal"] = {"steps": heal_steps, "learning_rate": heal_lr, "trainable": _changed(changes),
                          "kl_first": losses[0], "kl_last": losses[-1], "perplexity": healed,
                          "gap_closed": (after["perplexity"] - healed) / gap if gap else None}
        timing["heal"] = time.perf_counter() - start - sum(timing.values())
    if sweep_ranks:
        report["sweep"] = _sweep(base, calib, sweep_ranks, options.get("rope_dim"), progress)
        timing["sweep"] = time.perf_counter() - start - sum(timing.values())
    del model, base
    new = new.to(saved_dtype)
    with atomic_folder(out, force=force, sources=(src,)) as tmp:
        new.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        copy_side_files(src, tmp)
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


def _sweep(base, calib: Calibration, ranks, rope_dim: int | None, progress: bool) -> list[dict]:
    """Cache bytes and held-out perplexity of the MLA conversion of `base` at each latent rank."""
    from tqdm.auto import tqdm

    rows = []
    for rank in tqdm(sorted(set(ranks)), desc="rank sweep", unit="rank", disable=not progress):
        candidate, _ = to_latent_attention(base, rank, rope_dim, calib.ids, progress=False)
        rows.append({"kv_lora_rank": rank, **measure(candidate, calib.held_out)})
        del candidate
    return rows
