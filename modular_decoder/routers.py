"""The routers that pick each token's experts (`router_type`).

The selection functions, the router kinds that pair each with its training losses, the router module every
sparse layer holds (`TopKRouter`; `HashRouter` in the layers routed by token id), and `router_losses`, what one forward's router logits add to the language-model loss.

    softmax_topk   softmax over all experts, keep the k largest (Mixtral, Qwen-MoE, OLMoE, DeepSeek-V2)
    sigmoid_topk   independent sigmoid scores, chosen with a correction bias (DeepSeek-V3 `noaux_tc`)
    sqrtsoftplus_topk   the same with √softplus scores (DeepSeek-V4)
    topk_softmax   keep the k largest logits, softmax over those k (gpt-oss)
    topk_sigmoid   keep the k largest logits, a sigmoid of each (Llama 4)

A layer among the first `num_hash_layers` routes by token id instead (DeepSeek-V4's hash routing, `hash_select`):
a fixed table `tid2eid` names each token's k experts, and the router kind's scores weigh them.

The first two may first keep the `topk_group` best of `n_group` expert groups (DeepSeek's device-limited
routing). Any of them may add a learned bias to the logits (`router_bias`, gpt-oss). The losses themselves are in `router_losses.py`. Part of the remote-code files: torch only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from .router_losses import load_balancing_loss, record_expert_load, router_z_loss, sequence_balance_loss


def _keep_best_groups(scores: torch.Tensor, group_scores: torch.Tensor, topk_group: int, fill: float) -> torch.Tensor:
    """Set `fill` on every expert outside the `topk_group` best groups (DeepSeek's device-limited routing)."""
    tokens, n_group = group_scores.shape
    best = group_scores.topk(topk_group, dim=-1).indices  # (N, topk_group)
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)  # (N, G)
    keep = keep.unsqueeze(-1).expand(tokens, n_group, scores.shape[-1] // n_group).reshape(scores.shape)
    return scores.masked_fill(~keep, fill)


def scaled(weights: torch.Tensor, factor: float) -> torch.Tensor:
    """The routing weights times `routed_scaling_factor` (no multiplication by 1: a decode step's router is a few
    small operations, each of which costs microseconds)."""
    return weights if factor == 1.0 else weights * factor


def softmax_topk(
    logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    *,
    top_k: int,
    norm_topk_prob: bool,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts, keep the k largest (Mixtral, Qwen-MoE, OLMoE, DeepSeek-V2).

    With groups, a group scores its best expert (DeepSeek-V2's `group_limited_greedy`).
    Returns fp32 weights (N, k) and expert ids (N, k).
    """
    del correction_bias  # softmax routers have none
    probs = logits.float().softmax(dim=-1)  # (N, E), fp32 as every family computes it
    choice = probs
    if n_group > 1:
        group_scores = probs.view(probs.shape[0], n_group, -1).amax(dim=-1)  # (N, G)
        choice = _keep_best_groups(probs, group_scores, topk_group, fill=0.0)
    weights, indices = choice.topk(top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return scaled(weights, routed_scaling_factor), indices


def biased_topk(
    affinity: Callable[[torch.Tensor], torch.Tensor],
    logits: torch.Tensor,
    correction_bias: torch.Tensor,
    *,
    top_k: int,
    norm_topk_prob: bool,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent per-expert scores s = `affinity`(logits); experts chosen on s + correction bias (DeepSeek-V3
    `noaux_tc`: sigmoid; DeepSeek-V4: √softplus).

    The bias (adjusted outside the gradient to balance the load) moves only the choice; the weights
    are the uncorrected scores of the chosen experts. With groups, a group scores the sum of its two
    best biased scores. Returns fp32 weights (N, k) and expert ids (N, k).
    """
    scores = affinity(logits.float())  # (N, E)
    choice = scores + correction_bias
    if n_group > 1:
        group_scores = choice.view(choice.shape[0], n_group, -1).topk(2, dim=-1).values.sum(dim=-1)  # (N, G)
        choice = _keep_best_groups(choice, group_scores, topk_group, fill=float("-inf"))
    indices = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, indices)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)  # as DeepSeek-V3: no 0/0
    return scaled(weights, routed_scaling_factor), indices


def sqrt_softplus(logits: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V4's expert affinities, √softplus(logits) (transformers' `ACT2FN["sqrtsoftplus"]`)."""
    return F.softplus(logits).sqrt()


sigmoid_topk = partial(biased_topk, torch.sigmoid)  # DeepSeek-V3
sqrtsoftplus_topk = partial(biased_topk, sqrt_softplus)  # DeepSeek-V4 (`scoring_func="sqrtsoftplus"`)


def hash_select(affinity, logits: torch.Tensor, indices: torch.Tensor, *, norm_topk_prob: bool,
                routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Hash routing (DeepSeek-V4's first layers): the experts are given, `indices` (N, k) looked up by token id;
    they are weighted by their `affinity`(logits) scores, renormalised and scaled as the router kind does.
    Returns fp32 weights (N, k) and the expert ids."""
    weights = affinity(logits.float()).gather(1, indices)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return scaled(weights, routed_scaling_factor), indices


def topk_softmax(
    logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    *,
    top_k: int,
    norm_topk_prob: bool,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the k largest logits, softmax over those k (gpt-oss's `GptOssTopKRouter`): the same weights as a
    softmax over all experts renormalised over the kept k, computed from the k logits alone.

    Returns fp32 weights (N, k) and expert ids (N, k). (No groups: the config refuses them with this router.)
    """
    del correction_bias, norm_topk_prob, n_group, topk_group  # none apply (weights sum to 1 by construction)
    values, indices = logits.topk(top_k, dim=-1)  # (N, k) each
    return scaled(values.float().softmax(dim=-1), routed_scaling_factor), indices


def topk_sigmoid(
    logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    *,
    top_k: int,
    norm_topk_prob: bool,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the k largest logits, weigh each kept expert by the sigmoid of its logit (Llama 4's `Llama4Router`;
    there k = 1, and `apply_router_weight_on_input` scales the expert's input by it instead of its output).

    Returns fp32 weights (N, k) and expert ids (N, k). (No groups: the config refuses them with this router.)
    """
    del correction_bias, n_group, topk_group
    values, indices = logits.topk(top_k, dim=-1)  # (N, k) each
    weights = values.float().sigmoid()
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return scaled(weights, routed_scaling_factor), indices


def _switch_balance_loss(router_logits, config, attention_mask, batch_size):
    # f_i counts the experts the router chose (with groups, not the plain top-k): its selection, run again
    select = selection(config)
    chosen = [select(logits.detach(), None)[1] for logits in router_logits]
    return load_balancing_loss(router_logits, config.num_experts, config.num_experts_per_tok, attention_mask, chosen)


def _sequence_balance_loss(router_logits, config, attention_mask, batch_size):
    return sequence_balance_loss(router_logits, config.num_experts, config.num_experts_per_tok, batch_size,
                                 attention_mask, affinity=ROUTERS[config.router_type].affinity)


@dataclass(frozen=True)
class RouterKind:
    """A router variant: its selection function, its training losses, and the rules it adds to the config."""

    select: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    score_correction_bias: bool  # whether the router owns `e_score_correction_bias`
    min_experts_per_group: int  # experts each group needs for the group score (with n_group > 1)
    # (router_logits, config, attention_mask of the new tokens, batch size) -> the unweighted balance loss
    balance_loss: Callable[..., torch.Tensor]
    default_aux_loss_coef: float  # `router_aux_loss_coef` where unset: the weight its paper / family uses
    z_loss: bool  # whether ST-MoE's z-loss (a softmax normaliser's) applies
    groups: bool = True  # whether it takes group-limited routing (`n_group` > 1)
    renormalizes: bool = True  # whether `norm_topk_prob` chooses anything (a softmax over the kept k sums to 1)
    # the per-expert scores (N, E) of fp32 logits that weigh the chosen experts, where they exist apart from the
    # choice: what hash routing (`num_hash_layers`) weighs its looked-up experts by; None: no hash routing
    affinity: Callable[[torch.Tensor], torch.Tensor] | None = None


# transformers' Mixtral / Qwen-MoE default weight of the load-balancing loss
AUX_LOSS_COEF = 0.001
# DeepSeek-V3's α of the sequence-wise balance loss (arXiv 2412.19437 §4.2: "we set α to 0.0001")
SEQUENCE_AUX_LOSS_COEF = 0.0001

ROUTERS: dict[str, RouterKind] = {
    "softmax_topk": RouterKind(softmax_topk, score_correction_bias=False, min_experts_per_group=1,
                               balance_loss=_switch_balance_loss, default_aux_loss_coef=AUX_LOSS_COEF, z_loss=True,
                               affinity=partial(torch.softmax, dim=-1)),
    "sigmoid_topk": RouterKind(sigmoid_topk, score_correction_bias=True, min_experts_per_group=2,
                               balance_loss=_sequence_balance_loss, default_aux_loss_coef=SEQUENCE_AUX_LOSS_COEF,
                               z_loss=False, affinity=torch.sigmoid),
    # DeepSeek-V4 keeps V3's balancing (the correction bias, the sequence-wise loss) over its √softplus affinities
    # (transformers' class returns Switch's loss over a softmax of the logits instead: docs/using.md)
    "sqrtsoftplus_topk": RouterKind(sqrtsoftplus_topk, score_correction_bias=True, min_experts_per_group=2,
                                    balance_loss=_sequence_balance_loss, default_aux_loss_coef=SEQUENCE_AUX_LOSS_COEF,
                                    z_loss=False, affinity=sqrt_softplus),
    # gpt-oss weights its Switch loss as Mixtral does (its `load_balancing_loss_func`: the same top-k)
    "topk_softmax": RouterKind(topk_softmax, score_correction_bias=False, min_experts_per_group=1,
                               balance_loss=_switch_balance_loss, default_aux_loss_coef=AUX_LOSS_COEF, z_loss=True,
                               groups=False, renormalizes=False),
    # Llama 4's router: transformers' class computes no balance loss; Switch's over its logits, weighted as
    # Llama4TextConfig's `router_aux_loss_coef` default (0.001), where router logits are returned. Its scores are
    # no softmax, so no z-loss.
    "topk_sigmoid": RouterKind(topk_sigmoid, score_correction_bias=False, min_experts_per_group=1,
                               balance_loss=_switch_balance_loss, default_aux_loss_coef=AUX_LOSS_COEF, z_loss=False,
                               groups=False),
}


def selection(config) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """`config`'s selection: (logits (N, E), correction bias or None) -> (fp32 weights (N, k), expert ids (N, k))."""
    return partial(
        ROUTERS[config.router_type].select,
        top_k=config.num_experts_per_tok,
        norm_topk_prob=config.norm_topk_prob,
        n_group=config.n_group,
        topk_group=config.topk_group,
        routed_scaling_factor=config.routed_scaling_factor,
    )


@dataclass(kw_only=True)
class HashRoutingFields:
    """Args:
        num_hash_layers (`int`): The first this many layers route by token id (DeepSeek-V4's hash routing, its
            config's name; transformers' `mlp_layer_types` "hash_moe"): a fixed table `mlp.gate.tid2eid`
            (vocab_size, k), saved with the weights, names each token's k experts, which the router's scores
            weigh (renormalised, times `routed_scaling_factor`). Those layers must be `"sparse"`, the router kind
            one with per-expert scores (`softmax_topk`, `sigmoid_topk`, `sqrtsoftplus_topk`), and the model
            called with `input_ids`. 0: none. `mlp_type="moe"` only.
    """

    num_hash_layers: int = 0


# ---------------------------------------------------------------------------------------------
# The router module
# ---------------------------------------------------------------------------------------------


class Router(nn.Module):
    """Router logits x·Wᵀ (+ b with `router_bias`), then the `router_type` selection. Returns (logits, weights,
    expert ids).

    The logits are computed in the dtype of `weight`: a model that keeps its routers in fp32 (as
    DeepSeek-V3's checkpoints do) routes in fp32 whatever the activations' dtype. With `router_input_norm` the router
    reads RMS(x)-normed x times a learned `scale` (d) and d^-1/2; with `router_expert_scale` each kept weight is
    multiplied by its expert's learned `per_expert_scale` (Gemma 4's router). Once
    `router_losses.track_expert_load` is called, training forwards count each expert's assignments in
    `expert_load` (for the correction bias update; a plain attribute, never saved).
    """

    hashed = False  # whether the experts come from the token-id table `tid2eid` (`HashRouter`)

    def __init__(self, config):
        super().__init__()
        hashed = self.hashed
        kind = ROUTERS[config.router_type]
        self.num_experts = config.num_experts  # read by transformers' expert-parallel router style (< 5.19)
        # a sigmoid router stays fp32 (`fp32_parameters`) also when built under a half default dtype (`from_config`)
        dtype = torch.float32 if kind.score_correction_bias else None
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size, dtype=dtype))
        # (a hash router's choice is its table: no correction bias)
        corrected = kind.score_correction_bias and not hashed
        bias = torch.zeros(config.num_experts, dtype=torch.float32) if corrected else None
        self.register_buffer("e_score_correction_bias", bias)
        logit_bias = nn.Parameter(torch.empty(config.num_experts, dtype=dtype)) if config.router_bias else None
        self.register_parameter("bias", logit_bias)  # transformers' gpt-oss name (`mlp.router.bias` there)
        scale = nn.Parameter(torch.empty(config.hidden_size)) if config.router_input_norm else None
        self.register_parameter("scale", scale)  # (Gemma 4's names)
        per_expert = nn.Parameter(torch.empty(config.num_experts)) if config.router_expert_scale else None
        self.register_parameter("per_expert_scale", per_expert)
        self.eps, self.input_scale = config.norm_eps, config.hidden_size ** -0.5
        self.expert_load: torch.Tensor | None = None
        self.select = selection(config)
        # hash routing: each token id's k experts, a fixed table saved with the weights (transformers' name)
        table = torch.zeros(config.vocab_size, config.num_experts_per_tok, dtype=torch.long) if hashed else None
        self.register_buffer("tid2eid", table)
        if hashed:
            self.hash_select = partial(hash_select, kind.affinity, norm_topk_prob=config.norm_topk_prob,
                                       routed_scaling_factor=config.routed_scaling_factor)

    def forward(self, hidden_states: torch.Tensor, token_ids: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`token_ids` (the tokens of `hidden_states`' rows, any shape of N ids): what a hash router looks its
        experts up by; other routers ignore them."""
        if self.scale is not None:  # RMS-normed (no weight, fp32), times the learned scale and d^-1/2
            x32 = hidden_states.float()
            normed = (x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)).type_as(hidden_states)
            hidden_states = normed * self.scale * self.input_scale
        weight = self.weight
        if hidden_states.dtype != weight.dtype:  # a router kept in fp32
            hidden_states = hidden_states.to(weight.dtype)
        logits = F.linear(hidden_states, weight, self.bias)  # (N, E)
        if self.tid2eid is not None:
            if token_ids is None:
                raise ValueError("Hash routing (`num_hash_layers`) picks each token's experts by its id: pass "
                                 "`input_ids`, not `inputs_embeds`.")
            weights, indices = self.hash_select(logits, self.tid2eid[token_ids.reshape(-1)])
        else:
            weights, indices = self.select(logits, self.e_score_correction_bias)  # (N, k) each
        if self.per_expert_scale is not None:
            weights = weights * self.per_expert_scale[indices]
        if self.training and self.expert_load is not None:
            record_expert_load(self.expert_load, indices)
        return logits, weights, indices


class TopKRouter(Router):
    """The router of a sparse layer that chooses its experts by score: its logits are the model's `router_logits`
    (the balance loss reads them)."""


class HashRouter(Router):
    """The router of a layer among the first `num_hash_layers`: the token-id table picks the experts, the scores only
    weigh them. Its logits are left out of `router_logits` and the balance loss, as transformers' DeepSeek-V4
    records only its learned routers': a balance loss would push the scores toward a choice the table makes."""

    hashed = True


# ---------------------------------------------------------------------------------------------
# What a forward's router logits add to the loss (the functions live in router_losses.py)
# ---------------------------------------------------------------------------------------------


def router_losses(
    router_logits: Sequence[torch.Tensor], config, attention_mask: torch.Tensor | None = None,
    batch_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(weighted sum to add to the LM loss, balance loss, z-loss or None) for one forward's router logits.

    The balance loss is the router kind's own (`RouterKind.balance_loss`): Switch's for softmax routers
    (over the experts they chose, within the best groups where there are groups), DeepSeek-V3's
    sequence-wise one for sigmoid routers. `attention_mask` is that of the new tokens
    (batch, seq); `batch_size` splits the logits into sequences where there is no mask.
    """
    kind = ROUTERS[config.router_type]
    if batch_size is None:
        batch_size = attention_mask.shape[0] if attention_mask is not None else 1
    aux = kind.balance_loss(router_logits, config, attention_mask, batch_size)
    total = config.router_aux_loss_coef * aux
    z = router_z_loss(router_logits, attention_mask) if kind.z_loss else None
    if z is not None:
        total = total + config.router_z_loss_coef * z
    return total, aux, z


__all__ = ["AUX_LOSS_COEF", "HashRouter", "HashRoutingFields", "ROUTERS", "Router", "RouterKind", "SEQUENCE_AUX_LOSS_COEF",
           "TopKRouter", "router_losses", "selection", "biased_topk", "hash_select", "sigmoid_topk", "softmax_topk", "sqrt_softplus",
           "sqrtsoftplus_topk", "topk_sigmoid", "topk_softmax"]
