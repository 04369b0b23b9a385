"""Mixture of experts: the `mlp_type="moe"` feed-forward kind (Mixtral, Qwen-MoE, OLMoE, DeepSeek-V2/V3).

A sparse block replaces the feed-forward network of the layers `mlp_layer_types` marks `"sparse"`:
a router scores the experts for each token and keeps the top k, each expert (a gated MLP) runs
once on the tokens routed to it, and optional shared experts see every token. The layers marked
`"dense"` (DeepSeek's first k layers, Qwen's `mlp_only_layers`) hold a gated MLP of
`intermediate_size`.

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

The config fields this kind owns (refused under other `mlp_type`s) are documented on
`ModularDecoderConfig`; `MOE_FIELDS` lists them. The experts always have the gated form
act(x W_gate) ⊙ (x W_up) W_down with `hidden_act`, as every supported family's experts do, and
carry no biases (`mlp_bias` must be False).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from .compat import experts_ep_plan, experts_kernels
from .kinds import FeedForwardKind, require_bool, require_choice, require_int, require_number
from .split_products import linear
from .mlp import GatedMLP, activated_parameters, mlp_tp_plan
from .router_losses import load_balancing_loss, record_expert_load, router_z_loss, sequence_balance_loss

# transformers' own values for `mlp_layer_types` (`configuration_utils.ALLOWED_MLP_LAYER_TYPES`),
# which it checks whenever a config is saved
MLP_LAYER_TYPES = ("sparse", "dense")

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


def _switch_balance_loss(router_logits, config, attention_mask, batch_size):
    return load_balancing_loss(router_logits, config.num_experts, config.num_experts_per_tok, attention_mask)


def _sequence_balance_loss(router_logits, config, attention_mask, batch_size):
    return sequence_balance_loss(router_logits, config.num_experts, config.num_experts_per_tok, batch_size,
                                 attention_mask)


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


# transformers' Mixtral / Qwen-MoE default weight of the load-balancing loss
AUX_LOSS_COEF = 0.001
# DeepSeek-V3's α of the sequence-wise balance loss (arXiv 2412.19437 §4.2: "we set α to 0.0001")
SEQUENCE_AUX_LOSS_COEF = 0.0001

ROUTERS: dict[str, RouterKind] = {
    "softmax_topk": RouterKind(softmax_topk, score_correction_bias=False, min_experts_per_group=1,
                               balance_loss=_switch_balance_loss, default_aux_loss_coef=AUX_LOSS_COEF, z_loss=True),
    "sigmoid_topk": RouterKind(sigmoid_topk, score_correction_bias=True, min_experts_per_group=2,
                               balance_loss=_sequence_balance_loss, default_aux_loss_coef=SEQUENCE_AUX_LOSS_COEF,
                               z_loss=False),
}


# ---------------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------------


class TopKRouter(nn.Module):
    """Router logits x·Wᵀ, then the `router_type` selection. Returns (logits, weights, expert ids).

    The logits are computed in the dtype of `weight`: a model that keeps its routers in fp32 (as
    DeepSeek-V3's checkpoints do) routes in fp32 whatever the activations' dtype. Once
    `router_losses.track_expert_load` is called, training forwards count each expert's assignments in
    `expert_load` (for the correction bias update; a plain attribute, never saved).
    """

    def __init__(self, config):
        super().__init__()
        kind = ROUTERS[config.router_type]
        self.num_experts = config.num_experts  # read by transformers' expert-parallel router style (< 5.19)
        # a sigmoid router stays fp32 (`fp32_parameters`) also when built under a half default dtype (`from_config`)
        dtype = torch.float32 if kind.score_correction_bias else None
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size, dtype=dtype))
        bias = torch.zeros(config.num_experts, dtype=torch.float32) if kind.score_correction_bias else None
        self.register_buffer("e_score_correction_bias", bias)
        self.expert_load: torch.Tensor | None = None
        self.select = partial(
            kind.select,
            top_k=config.num_experts_per_tok,
            norm_topk_prob=config.norm_topk_prob,
            n_group=config.n_group,
            topk_group=config.topk_group,
            routed_scaling_factor=config.routed_scaling_factor,
        )

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(hidden_states.to(self.weight.dtype), self.weight)  # (N, E)
        weights, indices = self.select(logits, self.e_score_correction_bias)  # (N, k) each
        if self.training and self.expert_load is not None:
            record_expert_load(self.expert_load, indices)
        return logits, weights, indices


class Experts(nn.Module):
    """E gated MLPs stored as two 3-D parameters (transformers' v5 layout).

    `forward(hidden_states (N, d), top_k_index (N, k), top_k_weights (N, k)) -> (N, d)`: the
    (token, slot) pairs are sorted by expert, so each expert's tokens form one contiguous run and
    each expert with tokens runs once, as two matrix products on its own slices of the weights; a
    decode step reads only the chosen experts. Ids outside [0, E) are skipped (transformers'
    expert-parallel code marks tokens of experts on other ranks that way).

    Where transformers has its experts kernels, the class is wrapped by its decorator (below):
    `config._experts_implementation` then picks "eager" (this forward) or one of its kernels on the
    same weights.
    """

    def __init__(self, config):
        super().__init__()
        self.num_experts = config.num_experts
        self.hidden_dim = config.hidden_size
        self.intermediate_dim = config.moe_intermediate_size
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
        # f from the tensor, not the config: tensor parallelism shards each half of gate_up_proj
        # `linear`: a decode step's few rows split across the cores (plain fp32 CPU weights only)
        gate, up = linear(x, self.gate_up_proj[expert]).chunk(2, dim=-1)  # (n, f) each
        return linear(self.act_fn(gate) * up, self.down_proj[expert])  # (n, d)


_EXPERTS_KERNELS = experts_kernels()
# The dtypes transformers' experts kernels take; another (a float64 model) runs this module's forward
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _kernel_applies(module: nn.Module, hidden_states: torch.Tensor) -> bool:
    """Whether transformers' kernel can take these tensors: its dtypes, and for `grouped_mm` widths
    whose rows are multiples of 16 bytes (torch's grouped product refuses other strides)."""
    if hidden_states.dtype not in KERNEL_DTYPES:
        return False
    if module.config._experts_implementation in (None, "grouped_mm"):
        size = hidden_states.element_size()
        return (module.hidden_dim * size) % 16 == 0 and (module.down_proj.shape[-1] * size) % 16 == 0
    return True

if _EXPERTS_KERNELS is not None:
    # transformers' kernels ("grouped_mm", "batched_mm", ...), `experts_implementation=` and its
    # expert-parallel dispatch work on this module; without the decorator its own forward is all there is
    _own_forward = Experts.forward
    Experts = _EXPERTS_KERNELS(Experts)
    _dispatching_forward = Experts.forward

    def _forward(self, hidden_states, top_k_index, top_k_weights):
        run = _dispatching_forward if _kernel_applies(self, hidden_states) else _own_forward
        return run(self, hidden_states, top_k_index, top_k_weights)

    Experts.forward = _forward


def experts_kernels_available() -> bool:
    """Whether `Experts` dispatches on `config._experts_implementation` (transformers has the kernels)."""
    return _EXPERTS_KERNELS is not None


class SparseMoeBlock(nn.Module):
    """The feed-forward of a `"sparse"` layer: router, routed experts, optional (gated) shared experts.

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
        use_gate = shared and config.shared_expert_gate
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


def shared_experts_intermediate_size(config) -> int:
    """Width of the one gated MLP that holds all shared experts (0 without shared experts)."""
    if not config.n_shared_experts:
        return 0
    return config.n_shared_experts * config.shared_expert_intermediate_size


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
# Training losses on router logits (the functions live in router_losses.py; each router kind names its own)
# ---------------------------------------------------------------------------------------------


def router_losses(
    router_logits: Sequence[torch.Tensor], config, attention_mask: torch.Tensor | None = None,
    batch_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(weighted sum to add to the LM loss, balance loss, z-loss or None) for one forward's router logits.

    The balance loss is the router kind's own (`RouterKind.balance_loss`): Switch's for softmax routers,
    DeepSeek-V3's sequence-wise one for sigmoid routers. `attention_mask` is that of the new tokens
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


# ---------------------------------------------------------------------------------------------
# The registry entry
# ---------------------------------------------------------------------------------------------

MOE_FIELDS = (
    "mlp_layer_types", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
    "shared_expert_intermediate_size", "shared_expert_gate", "router_type", "norm_topk_prob", "n_group",
    "topk_group", "routed_scaling_factor", "router_aux_loss_coef", "router_z_loss_coef", "output_router_logits",
)

# transformers' names and styles for the experts module (mixtral, qwen*_moe, olmoe, deepseek_v2/v3)
EXPERTS_TP_PLAN = {"mlp.experts.gate_up_proj": "packed_colwise", "mlp.experts.down_proj": "rowwise",
                   "mlp.experts": "moe_tp_experts"}


class MixtureOfExpertsKind(FeedForwardKind):
    """`mlp_type="moe"`: `SparseMoeBlock` in the `"sparse"` layers, a gated MLP in the `"dense"` ones."""

    name = "moe"
    module = SparseMoeBlock
    fields = MOE_FIELDS
    # Under another feed-forward kind: no router, so no loss to weight (TRL's trainers read a non-zero
    # coefficient, beside an `output_router_logits` field, as "this model returns router logits").
    unused_values = {"router_aux_loss_coef": 0.0}
    # Until the default became per kind, every config (dense ones too) was saved with this one; a saved
    # file's value is dropped on load, a config built with it is refused.
    formerly_written = {"router_aux_loss_coef": (AUX_LOSS_COEF,)}
    routed = True

    def complete(self, config) -> None:
        """`mlp_layer_types` all sparse, experts as wide as `intermediate_size`, shared experts as wide as
        routed ones, and every group eligible, unless set."""
        if config.mlp_layer_types is None:
            config.mlp_layer_types = ["sparse"] * config.num_hidden_layers
        elif isinstance(config.mlp_layer_types, tuple):
            config.mlp_layer_types = list(config.mlp_layer_types)
        if config.moe_intermediate_size is None:
            config.moe_intermediate_size = config.intermediate_size
        if config.shared_expert_intermediate_size is None and config.n_shared_experts:
            config.shared_expert_intermediate_size = config.moe_intermediate_size
        if config.topk_group is None:
            config.topk_group = config.n_group
        router = ROUTERS.get(config.router_type) if isinstance(config.router_type, str) else None
        if config.router_aux_loss_coef is None and router is not None:  # a bad `router_type` is named by `validate`
            config.router_aux_loss_coef = router.default_aux_loss_coef

    def reads_for(self, config) -> tuple[str, ...]:
        """`intermediate_size` only where a `"dense"` layer holds a gated MLP; never `mlp_bias` (no biases)."""
        return ("intermediate_size",) if "dense" in (config.mlp_layer_types or ()) else ()

    def validate(self, config) -> None:
        self._validate_layer_types(config)
        for name in ("num_experts", "num_experts_per_tok"):
            if getattr(config, name) is None:
                raise ValueError(f"`mlp_type='moe'` needs `{name}`.")
        require_int("num_experts", config.num_experts, minimum=1)
        require_int("num_experts_per_tok", config.num_experts_per_tok, minimum=1, maximum=config.num_experts)
        require_int("moe_intermediate_size", config.moe_intermediate_size, minimum=1)
        require_int("n_shared_experts", config.n_shared_experts, minimum=0)
        require_int("shared_expert_intermediate_size", config.shared_expert_intermediate_size, minimum=1,
                    optional=True)
        require_bool("shared_expert_gate", config.shared_expert_gate)
        if config.n_shared_experts == 0:
            for name in ("shared_expert_intermediate_size", "shared_expert_gate"):
                if getattr(config, name):
                    raise ValueError(f"`{name}` is set but `n_shared_experts` is 0: there are no shared experts.")
        require_choice("router_type", config.router_type, ROUTERS)
        require_bool("norm_topk_prob", config.norm_topk_prob)
        self._validate_groups(config)
        require_number("routed_scaling_factor", config.routed_scaling_factor, above=0)
        require_number("router_aux_loss_coef", config.router_aux_loss_coef, at_least=0)
        require_number("router_z_loss_coef", config.router_z_loss_coef, at_least=0)
        if config.router_z_loss_coef and not ROUTERS[config.router_type].z_loss:
            raise ValueError(
                f"`router_z_loss_coef`={config.router_z_loss_coef} does not apply to `router_type`="
                f"{config.router_type!r}: the z-loss bounds a softmax router's normaliser; leave it at 0."
            )
        require_bool("output_router_logits", config.output_router_logits)
        require_choice("hidden_act", config.hidden_act, ACT2FN)
        require_bool("mlp_bias", config.mlp_bias)
        if config.mlp_bias:
            raise ValueError("`mlp_bias=True` is not supported with `mlp_type='moe'`: experts carry no biases.")

    @staticmethod
    def _validate_layer_types(config) -> None:
        kinds = config.mlp_layer_types
        if not isinstance(kinds, list) or len(kinds) != config.num_hidden_layers:
            raise ValueError(f"`mlp_layer_types` must list one entry per layer (`num_hidden_layers`="
                             f"{config.num_hidden_layers}), got {kinds!r}.")
        for kind in kinds:
            require_choice("mlp_layer_types[...]", kind, MLP_LAYER_TYPES)
        if "sparse" not in kinds:
            raise ValueError("`mlp_layer_types` has no \"sparse\" layer: a model without experts is `mlp_type='gated'`.")

    @staticmethod
    def _validate_groups(config) -> None:
        num_experts, top_k = config.num_experts, config.num_experts_per_tok
        require_int("n_group", config.n_group, minimum=1, maximum=num_experts)
        n_group = config.n_group
        if num_experts % n_group:
            raise ValueError(f"`num_experts`={num_experts} must be divisible by `n_group`={n_group}.")
        require_int("topk_group", config.topk_group, minimum=1, maximum=n_group)
        per_group = num_experts // n_group
        reachable = config.topk_group * per_group
        if top_k > reachable:
            raise ValueError(
                f"`num_experts_per_tok`={top_k} exceeds the {reachable} experts of the `topk_group`="
                f"{config.topk_group} kept groups ({per_group} experts per group)."
            )
        needed = ROUTERS[config.router_type].min_experts_per_group
        if n_group > 1 and per_group < needed:
            raise ValueError(
                f"`router_type`={config.router_type!r} scores a group by its {needed} best experts: `n_group`="
                f"{n_group} leaves {per_group} per group."
            )

    def backend_features(self, config) -> set[str]:
        """Experts with another activation than SiLU (vLLM's fused experts compute SiLU only)."""
        return {"experts_activation"} if config.hidden_act != "silu" else set()

    def build(self, config, layer_idx: int) -> nn.Module:
        """`SparseMoeBlock` for a `"sparse"` layer, `GatedMLP` of `intermediate_size` for a `"dense"` one."""
        return SparseMoeBlock(config) if config.mlp_layer_types[layer_idx] == "sparse" else GatedMLP(config)

    def parameters(self, config, layer_idx: int) -> int:
        """Sparse: E·d (router) + E·3·d·f + 3·d·f_s (+ d for the shared gate); dense: 3·d·d_f."""
        if config.mlp_layer_types[layer_idx] == "dense":
            return activated_parameters(config, 2, config.intermediate_size)
        return self._always(config) + config.num_experts * self._expert(config)

    def active_parameters(self, config, layer_idx: int) -> int:
        """Sparse: only k of the E routed experts (the router and shared experts see every token)."""
        if config.mlp_layer_types[layer_idx] == "dense":
            return activated_parameters(config, 2, config.intermediate_size)
        return self._always(config) + config.num_experts_per_tok * self._expert(config)

    @staticmethod
    def _expert(config) -> int:
        return activated_parameters(config, 2, config.moe_intermediate_size)

    @staticmethod
    def _always(config) -> int:
        """Router, shared experts and their gate: what every token of a sparse layer uses."""
        total = config.num_experts * config.hidden_size
        shared = shared_experts_intermediate_size(config)
        if shared:
            total += activated_parameters(config, 2, shared) + (config.hidden_size if config.shared_expert_gate else 0)
        return total

    def tp_plan(self, config) -> dict[str, str]:
        """transformers' MoE families' plan: experts split inside each expert (`packed_colwise` keeps each
        half of [gate; up] on its rank), shared experts and dense layers Megatron-split, the router replicated."""
        plan = mlp_tp_plan("mlp", gated=True) if "dense" in config.mlp_layer_types else {}
        plan.update(EXPERTS_TP_PLAN)
        if config.n_shared_experts:
            plan.update(mlp_tp_plan("mlp.shared_experts", gated=True))
        return plan

    def ep_plan(self, config) -> dict[str, str]:
        """Whole experts per rank (`grouped_gemm` shards dim 0), in this transformers' styles (compat.py)."""
        return experts_ep_plan()

    def fp32_parameters(self, config) -> tuple[str, ...]:
        """A sigmoid router's weight and correction bias stay fp32, as DeepSeek-V3 keeps them: its scores
        are compared with a bias of order 1e-3, which bf16 logits would blur."""
        if ROUTERS[config.router_type].score_correction_bias:
            return ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")
        return ()


MIXTURE_OF_EXPERTS = MixtureOfExpertsKind()


__all__ = [
    "MIXTURE_OF_EXPERTS",
    "MLP_LAYER_TYPES",
    "MOE_FIELDS",
    "ROUTERS",
    "Experts",
    "MixtureOfExpertsKind",
    "RouterKind",
    "SparseMoeBlock",
    "TopKRouter",
    "experts_kernels_available",
    "init_moe_weights",
    "load_balancing_loss",
    "router_losses",
    "router_z_loss",
    "sequence_balance_loss",
    "shared_experts_intermediate_size",
    "sigmoid_topk",
    "softmax_topk",
]
