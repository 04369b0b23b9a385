"""Training the routers: each router kind's balance loss, the router z-loss, and DeepSeek-V3's
auxiliary-loss-free balancing (the correction bias moved after each training step).

    softmax_topk   Switch Transformer's load-balancing loss over the softmax (Mixtral, Qwen-MoE, OLMoE:
                   the value transformers' MoE families compute), and ST-MoE's z-loss
    sigmoid_topk   DeepSeek-V3's complementary sequence-wise balance loss over the normalised sigmoid
                   affinities, and, opt-in, the bias update (`update_router_bias`)

Each loss takes one forward's router logits, one (tokens, experts) tensor per sparse layer, and an optional
(batch, seq) mask of the new tokens (1 real, 0 padding). Part of the remote-code files: torch only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def _token_weights(attention_mask: torch.Tensor | None, rows: int, device: torch.device) -> torch.Tensor:
    """1 for each real token row of one layer's (B·T, E) logits, 0 for padding."""
    if attention_mask is None:
        return torch.ones(rows, device=device)
    batch = attention_mask.shape[0]
    # the mask of the new tokens: the logits are those of the last T
    mask = attention_mask[:, -(rows // batch) :]
    return mask.reshape(-1).to(device=device, dtype=torch.float32)


def load_balancing_loss(
    router_logits: Sequence[torch.Tensor],
    num_experts: int,
    top_k: int,
    attention_mask: torch.Tensor | None = None,
    chosen_experts: Sequence[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Switch Transformer's balance loss (Fedus et al. 2021, eq. 4-6), pooled over MoE layers.

    E · Σ_i f_i · P_i, with f_i the share of (token, slot) assignments the router gave expert i (the f_i
    sum to k) and P_i the mean softmax probability of expert i, both over all real tokens of all layers.
    `chosen_experts` holds each layer's (N, k) expert ids as the router chose them; without it, the top-k
    of the softmax, which is the choice of a router without groups: then this is the value transformers'
    MoE families add to the loss (`load_balancing_loss_func` of Mixtral). With DeepSeek-V2's groups the
    choice is not the plain top-k, and f_i counts what was chosen, as its expert-level balance loss does
    (arXiv 2405.04434 §2.2.3, eq. 12-14: "Token t selects Expert i"); that loss is this one divided by k.
    The loss of softmax routers.
    """
    device = router_logits[0].device
    assigned = torch.zeros(num_experts, device=device)
    probability = torch.zeros(num_experts, device=device)
    total = torch.zeros((), device=device)
    for layer, logits in enumerate(router_logits):
        probs = logits.to(device).float().softmax(dim=-1)  # (N, E)
        weights = _token_weights(attention_mask, probs.shape[0], device)  # (N,)
        if chosen_experts is None:
            chosen = probs.topk(top_k, dim=-1).indices  # (N, k)
        else:
            chosen = chosen_experts[layer].to(device)
        hits = torch.zeros_like(probs).scatter_(1, chosen, 1.0)  # (N, E) one per kept slot
        assigned = assigned + weights @ hits
        probability = probability + weights @ probs
        total = total + weights.sum()
    return num_experts * torch.sum((assigned / total) * (probability / total))


def sequence_balance_loss(
    router_logits: Sequence[torch.Tensor],
    num_experts: int,
    top_k: int,
    batch_size: int,
    attention_mask: torch.Tensor | None = None,
    affinity=torch.sigmoid,
) -> torch.Tensor:
    """DeepSeek-V3's complementary sequence-wise balance loss (arXiv 2412.19437 §2.1.2, eq. 17-20), unweighted.

    For each sequence of T real tokens and each layer, Σ_i f_i · P_i with
    f_i = N_r / (K_r · T) · Σ_t 1[s_{i,t} ∈ TopK({s_{j,t}}, K_r)] and P_i = 1/T · Σ_t s'_{i,t}, where
    s = `affinity`(logits) are the affinities (sigmoid: DeepSeek-V3; √softplus: DeepSeek-V4) and s' = s / Σ_j s_j
    their per-token normalisation. The TopK is that of the affinities, as eq. 18 writes it (not the bias-corrected,
    group-limited choice). Averaged over the sequences that hold a real token, summed over MoE layers as DeepSeek's
    reference code adds each layer's loss; the config's `router_aux_loss_coef` is the paper's α. The loss of
    routers whose affinities are independent per expert (sigmoid, √softplus).
    """
    device = router_logits[0].device
    loss = torch.zeros((), device=device)
    for logits in router_logits:
        scores = affinity(logits.to(device).float()).view(batch_size, -1, num_experts)  # (B, T, E)
        weights = _token_weights(attention_mask, logits.shape[0], device).view(batch_size, -1, 1)  # (B, T, 1)
        tokens = weights.sum(dim=1)  # (B, 1) real tokens of each sequence
        chosen = scores.topk(top_k, dim=-1).indices
        hits = torch.zeros_like(scores).scatter_(-1, chosen, 1.0)  # (B, T, E)
        f = num_experts / top_k * (weights * hits).sum(dim=1) / tokens.clamp(min=1)  # (B, E)
        normalised = scores / scores.sum(dim=-1, keepdim=True)
        p = (weights * normalised).sum(dim=1) / tokens.clamp(min=1)  # (B, E)
        held = (tokens.squeeze(1) > 0).float()  # (B,) sequences with a real token
        loss = loss + ((f * p).sum(dim=-1) * held).sum() / held.sum().clamp(min=1)
    return loss


def router_z_loss(router_logits: Sequence[torch.Tensor], attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """ST-MoE's router z-loss (Zoph et al. 2022, eq. 5): mean over real tokens of logsumexp(logits)²,
    pooled over MoE layers. It keeps a softmax router's logits small, which keeps bf16 routing stable."""
    device = router_logits[0].device
    squares, total = torch.zeros((), device=device), torch.zeros((), device=device)
    for logits in router_logits:
        weights = _token_weights(attention_mask, logits.shape[0], device)
        squares = squares + weights @ torch.logsumexp(logits.to(device).float(), dim=-1).square()
        total = total + weights.sum()
    return squares / total


# ---------------------------------------------------------------------------------------------
# Auxiliary-loss-free balancing (DeepSeek-V3 §2.1.2): the correction bias follows each step's load
# ---------------------------------------------------------------------------------------------


def track_expert_load(model: nn.Module) -> int:
    """Start counting how many tokens each expert takes, for DeepSeek-V3's bias update (`update_router_bias`).

    In every training forward, the (token, slot) assignments of each router that has a correction bias
    (DeepSeek-V3's sigmoid routers): `router.expert_load` (E,), read and cleared by
    `update_router_bias`. Off until called, so training without the bias update pays nothing. Every routed
    token counts (padding too: it occupies its experts); a forward recomputed by gradient checkpointing counts
    again, which scales every count alike. Returns the number of routers tracked."""
    tracked = 0
    for module in model.modules():
        bias = getattr(module, "e_score_correction_bias", None)
        if bias is not None and hasattr(module, "expert_load"):
            module.expert_load = torch.zeros(bias.shape[0], device=bias.device, dtype=torch.float32)
            tracked += 1
    return tracked


def record_expert_load(load: torch.Tensor, indices: torch.Tensor) -> None:
    """Add one forward's chosen expert ids (N, k) to the counts `load` (E,), in place."""
    load.scatter_add_(0, indices.reshape(-1).to(load.device), torch.ones(indices.numel(), device=load.device))


@torch.no_grad()
def update_router_bias(model: nn.Module, step_size: float) -> int:
    """Move each router's correction bias by one step of DeepSeek-V3's auxiliary-loss-free load balancing.

    Every tracked router (`track_expert_load`)
    moves the correction bias of each expert down by `step_size` (γ) if the expert took more than the mean
    load over the step's training forwards, up by γ if less, and clears the counts.

    Call it after each optimizer step (`tools.training.RouterBiasCallback` does both calls in transformers'
    `Trainer`). Under `torch.distributed` the counts are summed over ranks first, so every rank moves its
    copy of the bias alike. Returns the number of routers updated; a model with correction biases none of
    which is tracked raises a `ValueError` (the update would silently do nothing).
    """
    if isinstance(step_size, bool) or not isinstance(step_size, (int, float)) or not step_size > 0:
        raise ValueError(f"`step_size` must be a positive number, got {step_size!r}.")
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    updated = untracked = 0
    for module in model.modules():
        bias = getattr(module, "e_score_correction_bias", None)
        if bias is None:
            continue
        load = getattr(module, "expert_load", None)
        if load is None:
            untracked += 1
            continue
        if distributed:
            torch.distributed.all_reduce(load)
        bias.add_((step_size * torch.sign(load.mean() - load)).to(device=bias.device, dtype=bias.dtype))
        load.zero_()
        updated += 1
    if untracked and not updated:
        raise ValueError("`update_router_bias` found no expert counts: call `track_expert_load(model)` before "
                         "training (the counts are kept only once asked for).")
    return updated


__all__ = ["load_balancing_loss", "record_expert_load", "router_z_loss", "sequence_balance_loss",
           "track_expert_load", "update_router_bias"]
