"""Mixture of experts: the `"moe"` feed-forward kind (Mixtral, Qwen-MoE, OLMoE, DeepSeek-V2/V3).

A sparse block replaces the feed-forward network of the layers `mlp_layer_types` marks `"moe"`:
a router scores the experts for each token and keeps the top k, each expert (a gated MLP) runs
once on the tokens routed to it, and optional shared experts see every token.

    x ─┬─ gate (router) ── top-k (weights w, experts i) ─┐
       ├─ experts ──────────── Σ_k w_k · E_{i_k}(x) ─────(+)──>
       └─ shared_experts ─ [· σ(shared_expert_gate(x))] ──┘

Parameters are plain tensors with transformers' v5 names and layout, so its TP / EP plans, its
experts kernels and PEFT's `target_parameters` apply unchanged:

    mlp.gate.weight                      (E, d)        router (a Parameter, not an nn.Linear)
    mlp.gate.e_score_correction_bias     (E,)          buffer, `router_type="sigmoid_topk"` only
    mlp.experts.gate_up_proj             (E, 2·f, d)   [gate; up] of every expert, concatenated
    mlp.experts.down_proj                (E, d, f)
    mlp.shared_experts.{gate,up,down}_proj.weight      one gated MLP of width n_shared·f_shared
    mlp.shared_expert_gate.weight        (1, d)        `shared_expert_gate=True` only

Config fields (transformers' names where a family has one):

| field | type, default | meaning |
|---|---|---|
| `mlp_layer_types` | list[str] or None | one feed-forward kind per layer (`"dense"`, `"gated"`, `"moe"`), like `layer_types`; `None`: `mlp_type` everywhere. DeepSeek `first_k_dense_replace=k`: k × `"gated"` then `"moe"`; Qwen2-MoE: `"moe"` where `(i+1) % decoder_sparse_step == 0` and `i not in mlp_only_layers` |
| `num_experts` | int, 8 | routed experts E (Mixtral `num_local_experts`, DeepSeek `n_routed_experts`) |
| `num_experts_per_tok` | int, 2 | experts per token k |
| `moe_intermediate_size` | int or None | width f of each routed expert; `None`: `intermediate_size` (Mixtral) |
| `num_shared_experts` | int, 0 | always-on experts (DeepSeek `n_shared_experts`; Qwen2-MoE: 1) |
| `shared_expert_intermediate_size` | int or None | width of each shared expert; `None`: `moe_intermediate_size` (DeepSeek) |
| `shared_expert_gate` | bool, False | scale the shared output by σ(x·w_g) (Qwen2-MoE) |
| `router_type` | str, `"softmax_topk"` | a key of `ROUTERS`: `"softmax_topk"` (Mixtral, Qwen, OLMoE, DeepSeek-V2) or `"sigmoid_topk"` (DeepSeek-V3) |
| `norm_topk_prob` | bool, True | renormalise the k kept weights to sum to 1 (Mixtral, Qwen3-MoE, DeepSeek-V3: yes; Qwen2-MoE, OLMoE, DeepSeek-V2: no) |
| `n_group`, `topk_group` | int, 1 / None | group-limited routing: experts in `n_group` equal groups, top-k only among the `topk_group` best groups (`None`: all) |
| `routed_scaling_factor` | float, 1.0 | multiplies the routed weights (DeepSeek) |
| `router_aux_loss_coef` | float, 0.001 | weight of the load-balancing loss added to the LM loss |
| `router_z_loss_coef` | float, 0.0 | weight of the ST-MoE router z-loss |
| `output_router_logits` | bool, False | return router logits (and add the router losses) by default |

The experts always have the gated form act(x W_gate) ⊙ (x W_up) W_down with `hidden_act`, as
every supported family's experts do, and carry no biases (`mlp_bias` must be False).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from .mlp import GatedMLP

MOE_DEFAULTS: dict[str, Any] = {
    "mlp_layer_types": None,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": None,
    "num_shared_experts": 0,
    "shared_expert_intermediate_size": None,
    "shared_expert_gate": False,
    "router_type": "softmax_topk",
    "norm_topk_prob": True,
    "n_group": 1,
    "topk_group": None,
    "routed_scaling_factor": 1.0,
    "router_aux_loss_coef": 0.001,
    "router_z_loss_coef": 0.0,
    "output_router_logits": False,
}
"""The MoE fields and their defaults (a Mixtral-style router) for configs that predate them."""

MLP_LAYER_KINDS = ("dense", "gated", "moe")


def _field(config, name: str) -> Any:
    return getattr(config, name, MOE_DEFAULTS[name])


# ---------------------------------------------------------------------------------------------
# transformers compatibility: its pluggable experts kernels (moves into the internals module)
# ---------------------------------------------------------------------------------------------


def _experts_kernels() -> Callable[[type], type]:
    """transformers' `use_experts_implementation` decorator, or the identity where it is missing.

    With it, `config._experts_implementation` ("eager" = our own forward below, "grouped_mm",
    "batched_mm", "deepgemm", "sonicmoe") picks the experts kernel, `from_pretrained(...,
    experts_implementation=...)` and `set_experts_implementation` work, `generate` switches
    grouped_mm to batched_mm for GPU decoding, and the expert-parallel plans can shard the experts.
    """
    try:
        from transformers.integrations import use_experts_implementation
    except ImportError:  # older transformers: our grouped forward is the only implementation
        return lambda cls: cls
    return use_experts_implementation


# ---------------------------------------------------------------------------------------------
# Routers: pure selection functions, registered with what they need
# ---------------------------------------------------------------------------------------------


def _keep_best_groups(scores: torch.Tensor, group_scores: torch.Tensor, topk_group: int, fill: float) -> torch.Tensor:
    """Set `fill` on every expert outside the `topk_group` best groups (DeepSeek's device-limited routing)."""
    tokens, n_group = group_scores.shape
    best = group_scores.topk(topk_group, dim=-1).indices  # (N, topk_group)
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)  # (N, G)
    keep = keep.unsqueeze(-1).expand(tokens, n_group, scores.shape[-1] // n_group).reshape(scores.shape)
    return scores.masked_fill(~keep, fill)


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
    return weights * routed_scaling_factor, indices


def sigmoid_topk(
    logits: torch.Tensor,
    correction_bias: torch.Tensor,
    *,
    top_k: int,
    norm_topk_prob: bool,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent sigmoid scores; experts chosen on score + correction bias (DeepSeek-V3 `noaux_tc`).

    The bias (adjusted outside the gradient to balance the load) moves only the choice; the weights
    are the uncorrected scores of the chosen experts. With groups, a group scores the sum of its two
    best biased scores. Returns fp32 weights (N, k) and expert ids (N, k).
    """
    scores = logits.float().sigmoid()  # (N, E)
    choice = scores + correction_bias
    if n_group > 1:
        group_scores = choice.view(choice.shape[0], n_group, -1).topk(2, dim=-1).values.sum(dim=-1)  # (N, G)
        choice = _keep_best_groups(choice, group_scores, topk_group, fill=float("-inf"))
    indices = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, indices)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)  # as DeepSeek-V3: no 0/0
    return weights * routed_scaling_factor, indices


@dataclass(frozen=True)
class RouterKind:
    """A router variant: its selection function and the rules it adds to the config."""

    select: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    score_correction_bias: bool  # whether the router owns `e_score_correction_bias`
    min_experts_per_group: int  # experts each group needs for the group score (with n_group > 1)


ROUTERS: dict[str, RouterKind] = {
    "softmax_topk": RouterKind(softmax_topk, score_correction_bias=False, min_experts_per_group=1),
    "sigmoid_topk": RouterKind(sigmoid_topk, score_correction_bias=True, min_experts_per_group=2),
}


# ---------------------------------------------------------------------------------------------
# Config: resolution and validation
# ---------------------------------------------------------------------------------------------


def mlp_layer_types(config) -> list[str]:
    """The feed-forward kind of every layer: `mlp_layer_types`, or `mlp_type` repeated."""
    kinds = _field(config, "mlp_layer_types")
    return list(kinds) if kinds is not None else [config.mlp_type] * config.num_hidden_layers


def expert_intermediate_size(config) -> int:
    """Width f of one routed expert."""
    return _field(config, "moe_intermediate_size") or config.intermediate_size


def shared_experts_intermediate_size(config) -> int:
    """Width of the one gated MLP that holds all shared experts (0 without shared experts)."""
    each = _field(config, "shared_expert_intermediate_size") or expert_intermediate_size(config)
    return _field(config, "num_shared_experts") * each


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_in(name: str, value: Any, low: int, high: int | None = None, why: str = "") -> None:
    if not _is_int(value) or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"`{name}` must be an integer {bound}{why}, got {value!r}.")


def _number_at_least(name: str, value: Any, low: float, strict: bool) -> None:
    bad = isinstance(value, bool) or not isinstance(value, (int, float))
    if bad or (value <= low if strict else value < low):
        raise ValueError(f"`{name}` must be a number {'>' if strict else '>='} {low}, got {value!r}.")


def _bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"`{name}` must be True or False, got {value!r}.")


def validate_moe(config, allowed_kinds: Sequence[str] = MLP_LAYER_KINDS) -> None:
    """Check `mlp_layer_types` and, when a layer is `"moe"`, every MoE field and combination.

    Raises `ValueError` naming the field. `config` is any object with the model config's
    attributes; MoE fields it lacks take `MOE_DEFAULTS`.
    """
    kinds = mlp_layer_types(config)
    if len(kinds) != config.num_hidden_layers:
        raise ValueError(
            f"`mlp_layer_types` has {len(kinds)} entries for `num_hidden_layers`={config.num_hidden_layers}."
        )
    for kind in kinds:
        if kind not in allowed_kinds:
            raise ValueError(
                f"`mlp_layer_types` entry {kind!r} is not one of the allowed values {list(allowed_kinds)}."
            )
    has_moe = "moe" in kinds
    if _field(config, "mlp_layer_types") is not None and has_moe != (config.mlp_type == "moe"):
        raise ValueError(
            f"`mlp_type`={config.mlp_type!r} disagrees with `mlp_layer_types`: a model with \"moe\" layers has "
            "`mlp_type='moe'`, and `mlp_type='moe'` needs at least one \"moe\" layer."
        )
    if has_moe:
        _validate_moe_fields(config)


def _validate_moe_fields(config) -> None:
    get = partial(_field, config)
    _int_in("num_experts", get("num_experts"), 1)
    num_experts = get("num_experts")
    _int_in("num_experts_per_tok", get("num_experts_per_tok"), 1, num_experts, " (at most `num_experts`)")
    if get("moe_intermediate_size") is not None:
        _int_in("moe_intermediate_size", get("moe_intermediate_size"), 1)
    _int_in("num_shared_experts", get("num_shared_experts"), 0)
    shared = get("num_shared_experts")
    if get("shared_expert_intermediate_size") is not None:
        _int_in("shared_expert_intermediate_size", get("shared_expert_intermediate_size"), 1)
        if shared == 0:
            raise ValueError("`shared_expert_intermediate_size` is set but `num_shared_experts` is 0.")
    _bool("shared_expert_gate", get("shared_expert_gate"))
    if get("shared_expert_gate") and shared == 0:
        raise ValueError("`shared_expert_gate=True` gates the shared experts, but `num_shared_experts` is 0.")
    if get("router_type") not in ROUTERS:
        raise ValueError(f"`router_type`={get('router_type')!r} is not one of the allowed values {list(ROUTERS)}.")
    _bool("norm_topk_prob", get("norm_topk_prob"))
    _validate_groups(config)
    _number_at_least("routed_scaling_factor", get("routed_scaling_factor"), 0.0, strict=True)
    _number_at_least("router_aux_loss_coef", get("router_aux_loss_coef"), 0.0, strict=False)
    _number_at_least("router_z_loss_coef", get("router_z_loss_coef"), 0.0, strict=False)
    _bool("output_router_logits", get("output_router_logits"))
    if getattr(config, "mlp_bias", False):
        raise ValueError("`mlp_bias=True` is not supported with \"moe\" layers: experts carry no biases.")
    if config.hidden_act not in ACT2FN:
        raise ValueError(f"`hidden_act`={config.hidden_act!r} is not a transformers activation.")


def _validate_groups(config) -> None:
    get = partial(_field, config)
    num_experts, top_k = get("num_experts"), get("num_experts_per_tok")
    _int_in("n_group", get("n_group"), 1, num_experts)
    n_group = get("n_group")
    if num_experts % n_group:
        raise ValueError(f"`num_experts`={num_experts} must be divisible by `n_group`={n_group}.")
    topk_group = get("topk_group")
    if topk_group is not None:
        _int_in("topk_group", topk_group, 1, n_group, " (at most `n_group`)")
    per_group = num_experts // n_group
    reachable = (topk_group or n_group) * per_group
    if top_k > reachable:
        raise ValueError(
            f"`num_experts_per_tok`={top_k} exceeds the {reachable} experts of the `topk_group`={topk_group} "
            f"kept groups ({per_group} experts per group)."
        )
    needed = ROUTERS[get("router_type")].min_experts_per_group
    if n_group > 1 and per_group < needed:
        raise ValueError(
            f"`router_type`={get('router_type')!r} scores a group by its {needed} best experts: `n_group`={n_group} "
            f"leaves {per_group} per group."
        )


# ---------------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------------


class TopKRouter(nn.Module):
    """Router logits x·Wᵀ, then the `router_type` selection. Returns (logits, weights, expert ids).

    The logits are computed in the dtype of `weight`: a model that keeps its routers in fp32 (as
    DeepSeek-V3's checkpoints do) routes in fp32 whatever the activations' dtype.
    """

    def __init__(self, config):
        super().__init__()
        get = partial(_field, config)
        num_experts = get("num_experts")
        kind = ROUTERS[get("router_type")]
        self.weight = nn.Parameter(torch.empty(num_experts, config.hidden_size))
        bias = torch.zeros(num_experts, dtype=torch.float32) if kind.score_correction_bias else None
        self.register_buffer("e_score_correction_bias", bias)
        self.select = partial(
            kind.select,
            top_k=get("num_experts_per_tok"),
            norm_topk_prob=get("norm_topk_prob"),
            n_group=get("n_group"),
            topk_group=get("topk_group") or get("n_group"),
            routed_scaling_factor=get("routed_scaling_factor"),
        )

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(hidden_states.to(self.weight.dtype), self.weight)  # (N, E)
        weights, indices = self.select(logits, self.e_score_correction_bias)  # (N, k) each
        return logits, weights, indices


@_experts_kernels()
class Experts(nn.Module):
    """E gated MLPs stored as two 3-D parameters (transformers' v5 layout).

    `forward(hidden_states (N, d), top_k_index (N, k), top_k_weights (N, k)) -> (N, d)`: the
    (token, slot) pairs are sorted by expert, so each expert's tokens form one contiguous run and
    each expert with tokens runs once, as two matrix products on its own slices of the weights; a
    decode step reads only the chosen experts. Ids outside [0, E) are skipped (transformers'
    expert-parallel code marks tokens of experts on other ranks that way).
    """

    def __init__(self, config):
        super().__init__()
        self.num_experts = _field(config, "num_experts")
        self.hidden_dim = config.hidden_size
        self.intermediate_dim = expert_intermediate_size(config)
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * self.intermediate_dim, self.hidden_dim))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, self.hidden_dim, self.intermediate_dim))
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        num_tokens, top_k = top_k_index.shape
        # `num_experts` is the local count under expert parallelism; other ids sort to the end
        local = self.num_experts
        expert_ids = top_k_index.reshape(-1)  # (N·k,)
        expert_ids = expert_ids.masked_fill((expert_ids < 0) | (expert_ids >= local), local)
        order = torch.argsort(expert_ids, stable=True)  # (N·k,) pairs grouped by expert
        counts = torch.bincount(expert_ids, minlength=local + 1)[:local].tolist()  # one host sync
        pairs = order[: sum(counts)]
        tokens = pairs // top_k
        grouped = hidden_states[tokens]  # (S, d)
        outputs, start = [], 0
        for expert, count in enumerate(counts):
            if count:
                outputs.append(self._expert(expert, grouped[start : start + count]))
                start += count
        out = hidden_states.new_zeros(num_tokens, self.hidden_dim)
        if not outputs:
            return out
        weighted = torch.cat(outputs) * top_k_weights.reshape(-1)[pairs].unsqueeze(-1)  # (S, d)
        # accumulate in the weights' precision (fp32 routing weights), cast once
        summed = torch.zeros(num_tokens, self.hidden_dim, dtype=weighted.dtype, device=weighted.device)
        return summed.index_add_(0, tokens, weighted).to(hidden_states.dtype)

    def _expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up_proj[expert]).chunk(2, dim=-1)  # (n, f) each
        return F.linear(self.act_fn(gate) * up, self.down_proj[expert])  # (n, d)


class SparseMoeBlock(nn.Module):
    """The `"moe"` feed-forward kind: router, routed experts, optional (gated) shared experts.

    x ─┬─ gate ── top-k (w, i) ──┐
       ├─ experts ── Σ w·E_i(x) ─(+)─>
       └─ shared_experts [· σ(shared_expert_gate x)] ─┘
    """

    def __init__(self, config):
        super().__init__()
        self.gate = TopKRouter(config)
        self.experts = Experts(config)
        shared = shared_experts_intermediate_size(config)
        self.shared_experts = GatedMLP(config, intermediate_size=shared) if shared else None
        use_gate = shared and _field(config, "shared_expert_gate")
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False) if use_gate else None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])  # (N, d)
        _, weights, indices = self.gate(x)
        out = self.experts(x, indices, weights)
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out.view(shape)


def init_moe_weights(module: nn.Module, std: float, init) -> bool:
    """Initialise a router or experts module; returns whether `module` was one.

    `init` is `transformers.initialization`, whose helpers skip tensors loaded from a checkpoint
    and are safe on the meta device. Shared experts and their gate are `nn.Linear`s: the caller's
    usual Linear rule covers them.
    """
    if isinstance(module, Experts):
        init.normal_(module.gate_up_proj, mean=0.0, std=std)
        init.normal_(module.down_proj, mean=0.0, std=std)
    elif isinstance(module, TopKRouter):
        init.normal_(module.weight, mean=0.0, std=std)
        if module.e_score_correction_bias is not None:
            init.zeros_(module.e_score_correction_bias)
    else:
        return False
    return True


# ---------------------------------------------------------------------------------------------
# Training losses on router logits
# ---------------------------------------------------------------------------------------------


def _token_weights(attention_mask: torch.Tensor | None, rows: int, device: torch.device) -> torch.Tensor:
    """1 for each real token row of one layer's (B·T, E) logits, 0 for padding."""
    if attention_mask is None:
        return torch.ones(rows, device=device)
    batch = attention_mask.shape[0]
    # with a cache the mask also covers past tokens: the logits are those of the last T
    mask = attention_mask[:, -(rows // batch) :]
    return mask.reshape(-1).to(device=device, dtype=torch.float32)


def load_balancing_loss(
    router_logits: Sequence[torch.Tensor],
    num_experts: int,
    top_k: int,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Switch Transformer's balance loss (Fedus et al. 2021, eq. 4-6), pooled over MoE layers.

    E · Σ_i f_i · P_i, with f_i the share of (token, slot) assignments that the top-k of the
    softmax gives expert i (the f_i sum to k) and P_i the mean softmax probability of expert i,
    both over all real tokens of all layers: the value transformers' MoE families add to the loss.
    The assignments come from softmax(logits) whatever `router_type` chose (the grouped and
    sigmoid routers' own choice differs; transformers computes no aux loss for DeepSeek).
    """
    device = router_logits[0].device
    assigned = torch.zeros(num_experts, device=device)
    probability = torch.zeros(num_experts, device=device)
    total = torch.zeros((), device=device)
    for logits in router_logits:
        probs = logits.to(device).float().softmax(dim=-1)  # (N, E)
        weights = _token_weights(attention_mask, probs.shape[0], device)  # (N,)
        chosen = probs.topk(top_k, dim=-1).indices  # (N, k)
        hits = torch.zeros_like(probs).scatter_(1, chosen, 1.0)  # (N, E) one per kept slot
        assigned = assigned + weights @ hits
        probability = probability + weights @ probs
        total = total + weights.sum()
    return num_experts * torch.sum((assigned / total) * (probability / total))


def router_z_loss(router_logits: Sequence[torch.Tensor], attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """ST-MoE's router z-loss (Zoph et al. 2022, eq. 5): mean over real tokens of logsumexp(logits)²,
    pooled over MoE layers. It keeps router logits small, which keeps bf16 routing stable."""
    device = router_logits[0].device
    squares, total = torch.zeros((), device=device), torch.zeros((), device=device)
    for logits in router_logits:
        weights = _token_weights(attention_mask, logits.shape[0], device)
        squares = squares + weights @ torch.logsumexp(logits.to(device).float(), dim=-1).square()
        total = total + weights.sum()
    return squares / total


def router_losses(
    router_logits: Sequence[torch.Tensor], config, attention_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weighted sum to add to the LM loss, load-balancing loss, z-loss) for one forward's router logits."""
    get = partial(_field, config)
    aux = load_balancing_loss(router_logits, get("num_experts"), get("num_experts_per_tok"), attention_mask)
    z = router_z_loss(router_logits, attention_mask)
    return get("router_aux_loss_coef") * aux + get("router_z_loss_coef") * z, aux, z


# ---------------------------------------------------------------------------------------------
# Arithmetic
# ---------------------------------------------------------------------------------------------


def moe_parameters(config) -> tuple[int, int]:
    """(total, active per token) parameters of one MoE feed-forward layer.

    total  = E·d (router) + E·3·d·f + 3·d·f_s (+ d for the shared gate)
    active = E·d          + k·3·d·f + 3·d·f_s (+ d)
    with f = `moe_intermediate_size`, f_s = `num_shared_experts`·`shared_expert_intermediate_size`.
    The router's correction bias is a buffer, not a parameter.
    """
    get = partial(_field, config)
    d, num_experts, top_k = config.hidden_size, get("num_experts"), get("num_experts_per_tok")
    expert = 3 * d * expert_intermediate_size(config)
    always = num_experts * d + 3 * d * shared_experts_intermediate_size(config)
    if shared_experts_intermediate_size(config) and get("shared_expert_gate"):
        always += d
    return always + num_experts * expert, always + top_k * expert


__all__ = [
    "MOE_DEFAULTS",
    "ROUTERS",
    "Experts",
    "RouterKind",
    "SparseMoeBlock",
    "TopKRouter",
    "expert_intermediate_size",
    "init_moe_weights",
    "load_balancing_loss",
    "mlp_layer_types",
    "moe_parameters",
    "router_losses",
    "router_z_loss",
    "shared_experts_intermediate_size",
    "sigmoid_topk",
    "softmax_topk",
    "validate_moe",
]
