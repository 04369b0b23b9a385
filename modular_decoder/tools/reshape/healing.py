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
    names = {name for name, _ in params}
    for name, param in student.named_parameters():
        param.requires_grad_(name in names)
    optimizer = torch.optim.AdamW([param for _, param in params], lr=learning_rate, weight_decay=0.0)
    batches = calibration_ids.split(BATCH)
    teacher.eval()
    student.train()
    losses = []
    try:
        for step in tqdm(range(steps), desc="healing", unit="step", disable=not progress):
            batch = batches[step % len(batches)]
            with torch.no_grad():
                target = teacher(input_ids=batch, use_cache=False).logits
            loss = distillation_loss(student(input_ids=batch, use_cache=False).logits, target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    finally:
        for param in student.parameters():
            param.requires_grad_(True)
        student.eval()
    return losses
