"""Training parts: full fine-tune and LoRA steps on both pairs, sdpa and flex, padded and packed batches."""

from __future__ import annotations

import torch

from ..families import LORA_TARGETS
from .bench import Bench
from .timing import PartTimeout, ratio, timed


def _training_batches(bench: Bench) -> dict:
    """A right-padded batch (labels -100 on the padding) and packed documents in one row without padding
    (positions restart per document; no label across a document boundary)."""
    rows, length = bench.plan.train_batch
    ids = bench.ids(rows, length)
    mask = torch.ones_like(ids)
    for row in range(1, rows):
        mask[row, length - row * length // (2 * rows):] = 0
    padded = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    total = rows * length
    lengths = [total // 2, total // 4, total // 8, total - total // 2 - total // 4 - total // 8]
    packed_ids = bench.ids(1, total)
    positions = torch.cat([torch.arange(n) for n in lengths])[None].to(bench.device)
    labels = packed_ids.clone()
    labels[positions == 0] = -100
    packed = dict(input_ids=packed_ids, position_ids=positions, labels=labels)
    return {"padded": padded, "packed": packed}


def _lora(theirs, ours, family: str):
    """The same LoRA (r=8) on both sides; ours gets transformers' side's initial adapter weights by name."""
    from peft import LoraConfig, get_peft_model

    targets = LORA_TARGETS[family][0]  # the benchmarks' LoRA targets (same names on both sides for these two)
    models = [get_peft_model(m, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=targets))
              for m in (theirs, ours)]
    adapters = {k: v for k, v in models[0].state_dict().items() if "lora_" in k}
    missing = models[1].load_state_dict(adapters, strict=False).unexpected_keys
    if missing:
        raise RuntimeError(f"LoRA adapters named differently on the two sides: {missing[:3]}")
    return models


def _train_steps(pair: dict, optimizers: dict, batch: dict, repeats: int) -> dict:
    """Median step time of both sides and every step's loss (a warm-up step, then `repeats` alternating)."""
    losses = {side: [] for side in pair}
    side_of = {id(model): side for side, model in pair.items()}

    def step(model):
        side = side_of[id(model)]
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        optimizers[side].step()
        optimizers[side].zero_grad(set_to_none=True)
        losses[side].append(loss.item())

    seconds = timed(pair, step, repeats)
    diff = max(abs(a - b) / abs(a) for a, b in zip(losses["transformers"], losses["ours"]))
    return {"transformers_ms": 1e3 * seconds["transformers"], "ours_ms": 1e3 * seconds["ours"],
            "ratio": ratio(seconds), "losses": losses, "loss_max_rel_diff": diff}


def training(bench: Bench, family: str, method: str) -> dict:
    """Steps (forward, backward, AdamW) of a full fine-tune or a LoRA, on sdpa and flex, on a padded batch and on
    packed documents: median step time of both sides and the losses of every step (the same weights and data,
    so they agree to bf16 accuracy)."""
    theirs, ours = bench.pair(family, fresh=True)
    if method == "lora":
        theirs, ours = _lora(theirs, ours, family)
    pair = {"transformers": theirs, "ours": ours}
    optimizers = {side: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-5)
                  for side, m in pair.items()}
    trainable = {side: sum(p.numel() for p in m.parameters() if p.requires_grad) for side, m in pair.items()}
    result, rows, label = {}, [], "Llama" if family == "llama" else "DeepseekV3"
    try:
        for backend in ("sdpa", "flex_attention"):
            _train_backend(bench, pair, optimizers, backend, f"train {method} {label} {backend}", result, rows)
    except PartTimeout as error:  # keep the cases already measured
        result["timeout"] = str(error)
        rows.append((f"train {method} {label}: the rest", "", str(error), ""))
    finally:
        bench.models.clear()  # trained weights: the next user reloads
    return {"trainable": trainable, "train_batch": list(bench.plan.train_batch), **result, "rows": rows}


def _train_backend(bench: Bench, pair: dict, optimizers: dict, backend: str, case: str, result: dict,
                   rows: list) -> None:
    """One attention backend of `training`: a padded and a packed batch, each case's result and row added."""
    if backend == "flex_attention" and bench.device == "cpu":
        result[backend] = {"skipped": "FlexAttention has no backward on the CPU (torch: NotImplementedError)"}
        rows.append((case, "", "skipped on the CPU: no flex backward", ""))
        return
    for model in pair.values():
        model.train()
        model.set_attn_implementation(backend)
    for kind, batch in _training_batches(bench).items():
        try:
            result[f"{backend}_{kind}"] = run = _train_steps(pair, optimizers, batch, bench.plan.repeats)
            rows.append((f"{case} {kind} (ms/step; loss rel. diff {run['loss_max_rel_diff']:.1e})",
                         f"{run['transformers_ms']:.1f}", f"{run['ours_ms']:.1f}", f"{run['ratio']:.2f}x"))
        except Exception as error:  # one backend or batch failing keeps the others
            result[f"{backend}_{kind}"] = {"error": f"{type(error).__name__}: {error}"[:400]}
            rows.append((f"{case} {kind}", "", f"error: {type(error).__name__}", ""))
