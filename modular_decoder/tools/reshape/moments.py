"""The one calibration statistic the MLA conversion needs: E[x xᵀ] of every layer's attention input.

Keys and values are linear in x (k = W_k x), so their covariances follow from it: E[k kᵀ] = W_k E[x xᵀ] W_kᵀ.
One pass of the source model, memory L·d² whatever the calibration length.
"""

from __future__ import annotations

import contextlib

import torch


def check_ids(model, calibration_ids) -> None:
    if not torch.is_tensor(calibration_ids) or calibration_ids.dtype != torch.long or calibration_ids.dim() != 2:
        raise ValueError("`calibration_ids` must be a 2-D LongTensor (rows of token ids).")
    if calibration_ids.numel() == 0 or calibration_ids.min() < 0 or calibration_ids.max() >= model.config.vocab_size:
        raise ValueError(f"`calibration_ids` must be non-empty ids in [0, {model.config.vocab_size}).")


def progress_bar(iterable, progress: bool, desc: str, total: int | None = None):
    if not progress:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total, leave=False)


@torch.no_grad()
def attention_moments(model, calibration_ids: torch.LongTensor, batch_size: int = 4,
                      progress: bool = False) -> list[torch.Tensor]:
    """E[x xᵀ] (float64, (d, d)) of every layer's attention input x over the calibration tokens."""
    check_ids(model, calibration_ids)
    d = model.config.hidden_size
    layers = model.model.layers
    sums = [torch.zeros(d, d, dtype=torch.float64) for _ in layers]

    def collect_into(index):
        def hook(module, args, kwargs):
            x = (args[0] if args else kwargs["hidden_states"]).reshape(-1, d).double()  # (B·T, d)
            sums[index] += (x.T @ x).cpu()
        return hook

    handles = [layer.self_attn.register_forward_pre_hook(collect_into(i), with_kwargs=True)
               for i, layer in enumerate(layers)]
    try:
        batches = calibration_ids.split(batch_size)
        for batch in progress_bar(batches, progress, "calibration", total=len(batches)):
            model.model(input_ids=batch.to(model.device), use_cache=False)  # the base model: no logits needed
    finally:
        for handle in handles:
            handle.remove()
    return [moment / calibration_ids.numel() for moment in sums]


@contextlib.contextmanager
def one_thread():
    """LAPACK's threaded eigh / svd of a few hundred rows is slower than one thread, and far slower on a
    busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def principal_directions(moment: torch.Tensor) -> torch.Tensor:
    """Eigenvectors of symmetric `moment` (..., n, n) as columns, by decreasing eigenvalue."""
    with one_thread():
        return torch.linalg.eigh(moment)[1].flip(-1)  # eigh sorts ascending
