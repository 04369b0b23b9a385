"""`heal_steps=S`: a short distillation after reshaping. The reshaped model (student) is trained to match the
source model's (teacher's) next-token distributions on the calibration text, KL(teacher ‖ student) per token,
with only the modules the transformations changed trainable (`Change.changed`); everything else stays as
it was. The gap it closes is measured on held-out text it never trained on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BATCH = 4  # calibration sequences per step
LEARNING_RATE = 1e-3  # AdamW; enough for a few steps on freshly pooled / factorised modules (benchmarks/reshape_smollm2.py)


def trainable_parameters(model, prefixes: list[str]) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters under any of `prefixes` (module names), each once."""
    chosen = []
    for name, param in model.named_parameters():
        if any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes):
            chosen.append((name, param))
    return chosen


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of KL(teacher ‖ student) between next-token distributions, in fp32."""
    teacher = F.log_softmax(teacher_logits.float().flatten(0, -2), dim=-1)
    student = F.log_softmax(student_logits.float().flatten(0, -2), dim=-1)
    return F.kl_div(student, teacher, log_target=True, reduction="batchmean")


def heal(student, teacher, calibration_ids: torch.LongTensor, steps: int, prefixes: list[str],
         learning_rate: float = LEARNING_RATE, progress: bool = True) -> list[float]:
    """`steps` AdamW steps of distillation from `teacher` into the `prefixes` modules of `student` on
    `calibration_ids` (cycled `BATCH` sequences at a time); returns the loss of every step. Afterwards every
    parameter of `student` is trainable again and it is in eval mode."""
    from tqdm.auto import tqdm

    params = trainable_parameters(student, prefixes)
    if not params:
        raise ValueError("`heal_steps`: the transformations changed no parameter to train.")
    batches = calibration_ids.split(BATCH)
    teacher.eval()

    def step_loss(step: int) -> torch.Tensor:
        batch = batches[step % len(batches)]
        with torch.no_grad():
            target = teacher(input_ids=batch, use_cache=False).logits
        return distillation_loss(student(input_ids=batch, use_cache=False).logits, target)

    return train_only(student, [param for _, param in params], steps, step_loss, learning_rate, "healing",
                      progress, train_mode=True)


def train_only(model, params: list, steps: int, step_loss, learning_rate: float, desc: str, progress: bool = True,
               train_mode: bool = True) -> list[float]:
    """`steps` AdamW steps on `params` only, every other parameter of `model` frozen meanwhile; `step_loss(step)`
    gives step `step`'s loss (`model` in train mode, or eval mode with `train_mode=False`). Returns every step's
    loss; afterwards every parameter is trainable again and `model` is in eval mode."""
    from tqdm.auto import tqdm

    chosen = {id(param) for param in params}
    for param in model.parameters():
        param.requires_grad_(id(param) in chosen)
    optimizer = torch.optim.AdamW(params, lr=learning_rate, weight_decay=0.0)
    model.train(train_mode)
    losses = []
    try:
        for step in tqdm(range(steps), desc=desc, unit="step", disable=not progress):
            loss = step_loss(step)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    finally:
        for param in model.parameters():
            param.requires_grad_(True)
        model.eval()
    return losses
