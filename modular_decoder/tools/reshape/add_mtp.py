"""`add_mtp=K`: multi-token-prediction modules for a checkpoint that never had them (`modular_decoder/mtp.py`).

Each module starts as DeepSeek-V3's layout with the model's own parts: its block a copy of the model's last block,
`post_norm` a copy of the final norm (the block's output then reaches the head as the model's last layer's does),
`enorm` / `hnorm` the identity scale, and `eh_proj` passing the hidden half through ([small random | I]). Only the
modules are then trained, by self-distillation on the model's own predictions (as EAGLE and Medusa-2's
self-distillation train their heads): module k at position i learns KL(model's next-token distribution at
i+k+1 ‖ module's) on the calibration text, the model frozen and left bit for bit as it was. With a draft vocabulary
(`mtp.draft_vocab`, FR-Spec) set before training, both distributions are the head's over those ids only: what the
drafts choose among, at a fraction of the head's work. What it bought is
measured on held-out text: each module's top-1 agreement with the model (teacher-forced), and the share of drafts
`generate(use_mtp=True)` accepts in greedy decoding from held-out prompts.
"""

from __future__ import annotations

import torch

from modular_decoder.draft_vocab import subset_logits
from modular_decoder.mtp import token_embeddings

from .healing import BATCH, distillation_loss, train_only
from .rebuild import Change, derived_config, model_from_state, require_positive_int

# Without a calibration file the modules learn from text sampled from the model, every other row continued greedily
# after its first GREEDY_AFTER tokens (`sampled_calibration`): greedy decoding checks drafts on such text
GREEDY_AFTER = 16
DECODE_PROMPT_TOKENS = 32  # of each held-out sequence, the prompt acceptance is measured from
DECODE_NEW_TOKENS = 64


def check_add_mtp(config, add_mtp: int, heal_steps: int) -> None:
    """Refuse, naming the option, what `add_mtp` cannot do."""
    require_positive_int("add_mtp", add_mtp)
    if config.num_mtp_layers:
        raise ValueError(f"`add_mtp`: this model has {config.num_mtp_layers} MTP module(s) already "
                         "(`num_mtp_layers`); fine-tune them instead.")
    if not heal_steps:
        raise ValueError("`add_mtp` trains the new modules by self-distillation: pass `heal_steps` > 0 "
                         "(`--heal-steps S`).")


def add_mtp_modules(model, count: int, seed: int = 0, copy: bool = True):
    """`model` with `count` new MTP modules initialised from its last block (see the module docstring); returns
    (model, Change). The model's own parameters are the same tensors' values, untouched."""
    config = model.config
    state = dict(model.state_dict())
    d = config.hidden_size
    last = model.model.layers[-1].state_dict()
    final_norm = model.model.final_norm.state_dict() if model.model.final_norm is not None else None
    generator = torch.Generator().manual_seed(seed)
    for k in range(count):
        prefix = f"mtp.layers.{k}."
        state.update({f"{prefix}mtp_block.{name}": tensor.clone() for name, tensor in last.items()})
        for norm in ("enorm", "hnorm", "post_norm"):
            identity = _identity_norm(model, final_norm if norm == "post_norm" else None)
            state.update({f"{prefix}{norm}.{name}": tensor for name, tensor in identity.items()})
        embed_half = torch.randn(d, d, generator=generator) * config.initializer_range
        eh_proj = torch.cat([embed_half, torch.eye(d)], dim=1)  # (d, 2d): [embedding | hidden]
        state[f"{prefix}eh_proj.weight"] = eh_proj.to(dtype=_floating_dtype(last), device=next(model.parameters()).device)
    new = model_from_state(derived_config(config, num_mtp_layers=count), state, model, copy=copy)
    change = Change(
        "add_mtp",
        keeps="every parameter of the model (the modules are added beside it; its forward never runs them)",
        approximates="",
        details={"add_mtp": count, "initialised_from": f"model.layers.{config.num_hidden_layers - 1}"},
    )
    return new, change


def _floating_dtype(state: dict) -> torch.dtype:
    return next(tensor.dtype for tensor in state.values() if tensor.is_floating_point())


def _identity_norm(model, copy_of: dict | None) -> dict:
    """A norm's state at the identity scale (ones, zeros with `norm_unit_offset`; no bias), or a copy of `copy_of`."""
    if copy_of is not None:
        return {name: tensor.clone() for name, tensor in copy_of.items()}
    from modular_decoder.norms import build_norm

    fresh = build_norm(model.config).to(next(model.parameters()).device)
    return {name: tensor.detach().to(next(model.parameters()).dtype) for name, tensor in fresh.state_dict().items()}


def train_mtp(model, calibration_ids: torch.LongTensor, steps: int, learning_rate: float,
              progress: bool = True) -> list[float]:
    """`steps` AdamW steps of self-distillation into the MTP modules only (see the module docstring); returns the
    loss of every step (the mean over modules of their KL). Afterwards every parameter is trainable again and the
    model is in eval mode; the model's own parameters are never changed (they get no gradient)."""
    batches = [_teacher_inputs(model, batch) for batch in calibration_ids.split(BATCH)]
    # the frozen model's dropout stays off; the modules train without dropout too
    return train_only(model, list(model.mtp.parameters()), steps,
                      lambda step: _distillation_step(model, *batches[step % len(batches)]), learning_rate,
                      "training MTP modules", progress, train_mode=False)


@torch.no_grad()
def _teacher_inputs(model, batch: torch.LongTensor):
    """(ids, the model's last hidden state, token embeddings, positions) for one calibration batch."""
    hidden = model.model(input_ids=batch, use_cache=False).last_hidden_state
    positions = torch.arange(batch.shape[1], device=batch.device).unsqueeze(0).expand(batch.shape[0], -1)
    return batch, hidden, token_embeddings(model, batch), positions


def _module_logits(model, hidden, embeds, positions):
    """Each module's draft logits (`_draft_logits`) over the positions that have a model prediction k+1 places
    ahead to learn from."""
    length = hidden.shape[1]
    for depth, out in enumerate(model.mtp.depths(model, hidden, embeds, None, positions, False)):
        yield depth, _draft_logits(model, out[:, : length - depth - 1])


def _draft_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """The logits the modules draft from: the head's over the draft vocabulary where one is set (`mtp.draft_vocab`,
    in its order), else the whole head's. The modules learn the model's distribution renormalised over the ids they
    can draft, and the head's work per position shrinks with the vocabulary."""
    ids = model.mtp.draft_vocab
    return model._logits(hidden) if ids is None else subset_logits(model, hidden, ids)


def _draft_ids(model, logits: torch.Tensor) -> torch.Tensor:
    """The token ids the argmax of `_draft_logits` stands for."""
    ids = model.mtp.draft_vocab
    top = logits.argmax(-1)
    return top if ids is None else ids.to(top.device)[top]


def _distillation_step(model, ids, hidden, embeds, positions) -> torch.Tensor:
    losses = []
    for depth, student in _module_logits(model, hidden, embeds, positions):
        with torch.no_grad():
            teacher = _draft_logits(model, hidden[:, depth + 1:])
        losses.append(distillation_loss(student, teacher))
    return torch.stack(losses).mean()


@torch.no_grad()
def agreement(model, held_out: torch.LongTensor) -> list[float]:
    """Per module, the share of held-out positions where its top-1 token (among the draft vocabulary where one is
    set, as its drafts) equals the model's top-1 token k+1 places ahead (inputs: the held-out text,
    teacher-forced)."""
    hits = [0] * model.config.num_mtp_layers
    counts = [0] * model.config.num_mtp_layers
    for batch in held_out.split(1):
        ids, hidden, embeds, positions = _teacher_inputs(model, batch)
        for depth, student in _module_logits(model, hidden, embeds, positions):
            teacher = model._logits(hidden[:, depth + 1:])
            hits[depth] += (_draft_ids(model, student) == teacher.argmax(-1)).sum().item()
            counts[depth] += student.shape[1]
    return [hit / max(count, 1) for hit, count in zip(hits, counts, strict=True)]


@torch.no_grad()
def decoding_acceptance(model, held_out: torch.LongTensor, prompt_tokens: int = DECODE_PROMPT_TOKENS,
                        new_tokens: int = DECODE_NEW_TOKENS) -> dict:
    """Greedy `generate(use_mtp=True)` from the start of each held-out sequence: the share of drafted tokens the
    model accepted, the tokens per forward, and whether the tokens equal plain greedy decoding (they must)."""
    from modular_decoder.mtp_generation import recorded_drafts

    drafted = accepted = forwards = 0
    same = True
    for row in held_out:
        prompt = row[:prompt_tokens].unsqueeze(0)
        kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                      attention_mask=torch.ones_like(prompt), pad_token_id=0)
        with recorded_drafts() as stats:
            drafts = model.generate(prompt, use_mtp=True, **kwargs)
        plain = model.generate(prompt, **kwargs)
        same = same and torch.equal(drafts, plain)
        made = drafts.shape[1] - prompt.shape[1]
        drafted += stats.drafted
        accepted += made - stats.forwards
        forwards += stats.forwards
    return {"acceptance": accepted / max(drafted, 1), "tokens_per_forward": (accepted + forwards) / max(forwards, 1),
            "prompts": held_out.shape[0], "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
            "same_tokens_as_plain_greedy": same}
