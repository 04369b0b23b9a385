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
    mlp.gate.bias                        (E,)          `router_bias=True` only (gpt-oss)
    mlp.gate.e_score_correction_bias     (E,)          buffer, `router_type="sigmoid_topk"` only
    mlp.experts.gate_up_proj             (E, 2·f, d)   [gate; up] of every expert, concatenated
    mlp.experts.down_proj                (E, d, f)
    mlp.experts.{gate_up,down}_proj_bias (E, 2·f), (E, d)   `mlp_bias=True` only (gpt-oss)
    mlp.shared_experts.{gate,up,down}_proj.weight      one gated MLP of width n_shared·f_shared
    mlp.shared_expert_gate.weight        (1, d)        `shared_expert_gate=True` only

The router (`TopKRouter` or `HashRouter`, its selection functions and losses) is in `routers.py`, the routed experts
(`Experts`, transformers' experts kernels) in `experts.py`; this module holds the block that joins
them with the shared experts, and the kind's registry entry: completion, validation, parameter counts
and parallelism plans.

The config fields this kind owns (refused under other `mlp_type`s) are documented on
`ModularDecoderConfig` and, for the experts' form, on `ExpertFormFields` below; `MOE_FIELDS` lists them. The experts
have the gated form act(x W_gate) ⊙ (x W_up) W_down with `hidden_act`, or gpt-oss's clamped SwiGLU (`swiglu_limit`,
`swiglu_alpha`), with biases where `mlp_bias` says so (gpt-oss); with `moe_mlp_type="dense"` every MLP of the model
(experts, shared experts, dense layers) is act(x W_up) W_down instead (Nemotron-H's relu² experts). With
`moe_latent_size` the routed experts run in a narrower width between two projections (Nemotron-H's latent MoE):

    x ─┬─ gate ── top-k (w, i) ────────────────────────────────────┐
       ├─ fc1_latent_proj ── Σ w·E_i(·) (latent width) ── fc2_latent_proj ─(+)─>
       └─ shared_experts ──────────────────────────────────────────┘
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.activations import ACT2FN

from .compat import experts_ep_plan
from .experts import Experts, clamped_swiglu
from .kinds import FeedForwardKind, require_bool, require_choice, require_int, require_number, require_per_layer
from .mlp import DenseMLP, GatedMLP, activated_parameters, mlp_tp_plan
from .norms import build_norm, norm_parameters
from .routers import AUX_LOSS_COEF, ROUTERS, HashRouter, Router, TopKRouter

# transformers' own values for `mlp_layer_types` (`configuration_utils.ALLOWED_MLP_LAYER_TYPES`),
# which it checks whenever a config is saved
MLP_LAYER_TYPES = ("sparse", "dense")
# `moe_mlp_type` values -> the MLP module every feed-forward of the model has
EXPERT_FORMS = {"gated": GatedMLP, "dense": DenseMLP}


@dataclass(kw_only=True)
class ExpertFormFields:
    r"""The form of a mixture of experts' MLPs (`mlp_type="moe"` only).

    Args:
        moe_mlp_type (`str`): `"gated"`: every expert, shared expert and dense layer is act(x W_gate) ⊙ (x W_up)
            W_down; `"dense"`: act(x W_up) W_down (Nemotron-H's relu² experts, with `hidden_act="relu2"`), the
            experts' product then `mlp.experts.up_proj` (E, f, d).
        moe_latent_size (`int`, *optional*): The width the routed experts read and write: `mlp.fc1_latent_proj`
            projects d down to it before them, `mlp.fc2_latent_proj` back up after (Nemotron-H's latent MoE, biases
            with `mlp_bias`); the router and the shared experts still see d. `None`: the experts work at d.
    """

    moe_mlp_type: str = "gated"
    moe_latent_size: int | None = None

# ---------------------------------------------------------------------------------------------
# The sparse block
# ---------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class RoutingInputFields:
    """Args:
        apply_router_weight_on_input (`bool`): Each routed expert sees its token scaled by the routing weight,
            Σ_k E_{i_k}(w_k · x), instead of weighing the expert's output, Σ_k w_k · E_{i_k}(x) (Llama 4; vLLM's
            name). With gated experts the two differ. `mlp_type="moe"` only.
        parallel_dense_mlp (`bool`): Each sparse layer also runs a dense gated MLP of `intermediate_size` beside the
            experts, each branch with its own norms (Gemma 4): the dense MLP takes the block's normed input and
            ends in `post_dense_norm`; the router takes the layer's residual input, the experts that input normed
            by `pre_experts_norm`, ending in `post_experts_norm`; the branches add. Blocks with a pre-FFN norm
            (`norm_position` pre or sandwich) only.
        router_input_norm (`bool`): The router reads the RMS-normed input times a learned `scale` and d^-1/2
            (Gemma 4; `mlp.gate.scale`).
        router_expert_scale (`bool`): Each kept routing weight times its expert's learned scale (Gemma 4;
            `mlp.gate.per_expert_scale`).
    """

    apply_router_weight_on_input: bool = False
    parallel_dense_mlp: bool = False
    router_input_norm: bool = False
    router_expert_scale: bool = False


class SparseMoeBlock(nn.Module):
    """The feed-forward of a `"sparse"` layer: router, routed experts, optional (gated) shared experts.

    x ─┬─ gate ── top-k (w, i) ──┐
       ├─ experts ── Σ w·E_i(x) ─(+)─>          (`apply_router_weight_on_input`: Σ E_i(w·x))
       └─ shared_experts [· σ(shared_expert_gate x)] ─┘
    """

    def __init__(self, config, layer_idx: int = 0):
        super().__init__()
        self.gate = (HashRouter if layer_idx < config.num_hash_layers else TopKRouter)(config)
        self.routes_by_token = self.gate.tid2eid is not None  # the block then passes the tokens' ids
        latent = config.moe_latent_size
        if latent is not None:
            self.fc1_latent_proj = nn.Linear(config.hidden_size, latent, bias=config.mlp_bias)
            self.fc2_latent_proj = nn.Linear(latent, config.hidden_size, bias=config.mlp_bias)
        self.latent = latent is not None
        self.experts = Experts(config)
        shared = shared_experts_intermediate_size(config)
        mlp = ClampedGatedMLP if config.swiglu_limit is not None else EXPERT_FORMS[config.moe_mlp_type]
        self.shared_experts = mlp(config, intermediate_size=shared) if shared else None
        use_gate = shared and config.shared_expert_gate
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False) if use_gate else None
        self.weight_on_input = config.apply_router_weight_on_input

    def forward(self, hidden_states: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`token_ids` (B, T): the tokens of `hidden_states` (B, T, d), which a hash router routes by."""
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])  # (N, d)
        _, weights, indices = self.gate(x, token_ids)
        if self.weight_on_input:
            out = self._routed_on_input(x, weights, indices)
        elif self.latent:
            out = self.fc2_latent_proj(self.experts(self.fc1_latent_proj(x), indices, weights))
        else:
            out = self.experts(x, indices, weights)
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out.view(shape)

    def _routed_on_input(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Σ_k E_{i_k}(w_k · x): one row per (token, kept expert), scaled by its weight in the activations' dtype
        (as Llama 4 casts its scores), through the experts with unit weights (their kernels, and vLLM's fused
        experts, which take this call, weigh outputs only), summed per token."""
        tokens, top_k = indices.shape
        scaled = (x.unsqueeze(1) * weights.to(x.dtype).unsqueeze(-1)).reshape(tokens * top_k, -1)  # (N·k, d)
        ones = weights.new_ones(tokens * top_k, 1)
        out = self.experts(scaled, indices.reshape(-1, 1), ones)  # (N·k, d)
        return out.view(tokens, top_k, -1).sum(dim=1)


class ParallelDenseMoeBlock(nn.Module):
    """A sparse layer with a dense MLP beside its experts (`parallel_dense_mlp`, Gemma 4); takes the block's normed
    input x and its residual input r:

    x ─ dense ─ post_dense_norm ──────────────────────────────────────┐
    r ─┬─ gate ── top-k (w, i) ──────────────────────┐                (+)─>
       └─ pre_experts_norm ─ experts ── Σ w·E_i ─ post_experts_norm ─┘
    """

    reads_residual = True

    def __init__(self, config):
        super().__init__()
        self.dense = EXPERT_FORMS[config.moe_mlp_type](config)
        self.post_dense_norm = build_norm(config)
        self.gate = TopKRouter(config)
        self.pre_experts_norm = build_norm(config)
        self.experts = Experts(config)
        self.post_experts_norm = build_norm(config)

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        dense = self.post_dense_norm(self.dense(hidden_states))
        r = residual.reshape(-1, residual.shape[-1])  # (N, d)
        _, weights, indices = self.gate(r)
        routed = self.experts(self.pre_experts_norm(r), indices, weights).view(residual.shape)
        return dense + self.post_experts_norm(routed)


class ClampedGatedMLP(GatedMLP):
    """The shared experts of a model whose experts clamp their SwiGLU (`swiglu_limit`): the same clamped gate as
    the routed experts (`experts.clamped_swiglu`; DeepSeek-V4's shared expert clamps as its routed ones do)."""

    def __init__(self, config, intermediate_size: int | None = None):
        super().__init__(config, intermediate_size)
        self.limit, self.alpha, self.up_offset = config.swiglu_limit, config.swiglu_alpha, config.swiglu_up_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        glu = clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit, self.alpha, self.up_offset, self.act_fn)
        return self.down_proj(glu)


def _up_products(config) -> int:
    """The products before the activation in each MLP of a MoE model: gate and up, or up alone (`moe_mlp_type`)."""
    return 2 if config.moe_mlp_type == "gated" else 1


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
        init.normal_(getattr(module, module.up_name), mean=0.0, std=std)
        init.normal_(module.down_proj, mean=0.0, std=std)
        for bias in (getattr(module, f"{module.up_name}_bias"), module.down_proj_bias):
            if bias is not None:
                init.zeros_(bias)
    elif isinstance(module, Router):
        init.normal_(module.weight, mean=0.0, std=std)
        if module.bias is not None:
            init.normal_(module.bias, mean=0.0, std=std)  # as transformers' gpt-oss
        if module.e_score_correction_bias is not None:
            init.zeros_(module.e_score_correction_bias)
        for scale in (module.scale, module.per_expert_scale):  # (Gemma 4's start at 1)
            if scale is not None:
                init.ones_(scale)
    else:
        return False
    return True


# ---------------------------------------------------------------------------------------------
# The registry entry
# ---------------------------------------------------------------------------------------------

MOE_FIELDS = (
    "mlp_layer_types", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
    "shared_expert_intermediate_size", "shared_expert_gate", "router_type", "router_bias", "norm_topk_prob", "n_group",
    "topk_group", "routed_scaling_factor", "router_aux_loss_coef", "router_z_loss_coef", "output_router_logits",
    "swiglu_limit", "swiglu_alpha", "swiglu_up_offset", "num_hash_layers", *ExpertFormFields.__dataclass_fields__,
    *RoutingInputFields.__dataclass_fields__,
)

# gpt-oss's sigmoid gain in its clamped SwiGLU (transformers' `GptOssConfig.swiglu_alpha` default; 5.16-5.19 fix it)
GPT_OSS_SWIGLU_ALPHA = 1.702
# gpt-oss adds 1 to the clamped up projection ((u + 1) ⊙ g·σ(α·g), transformers' `GptOssExperts`)
GPT_OSS_SWIGLU_UP_OFFSET = 1.0

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
        if config.swiglu_alpha is None and config.swiglu_limit is not None:
            config.swiglu_alpha = GPT_OSS_SWIGLU_ALPHA
        if config.swiglu_up_offset is None and config.swiglu_limit is not None:
            config.swiglu_up_offset = GPT_OSS_SWIGLU_UP_OFFSET
        router = ROUTERS.get(config.router_type) if isinstance(config.router_type, str) else None
        if config.router_aux_loss_coef is None and router is not None:  # a bad `router_type` is named by `validate`
            config.router_aux_loss_coef = router.default_aux_loss_coef

    def reads_for(self, config) -> tuple[str, ...]:
        """`mlp_bias` (experts' biases), and `intermediate_size` only where a layer holds a gated MLP (a `"dense"`
        one, or the dense MLP beside the experts)."""
        dense = "dense" in (config.mlp_layer_types or ()) or config.parallel_dense_mlp
        return ("intermediate_size", "mlp_bias") if dense else ("mlp_bias",)

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
        require_bool("router_bias", config.router_bias)
        require_bool("norm_topk_prob", config.norm_topk_prob)
        if not config.norm_topk_prob and not ROUTERS[config.router_type].renormalizes:
            raise ValueError(f"`norm_topk_prob`=False does not apply to `router_type`={config.router_type!r}: its "
                             "softmax over the kept experts' logits sums to 1; leave it True.")
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
        for name in ("apply_router_weight_on_input", "parallel_dense_mlp", "router_input_norm", "router_expert_scale"):
            require_bool(name, getattr(config, name))
        if config.parallel_dense_mlp and (config.parallel_block or config.norm_position not in ("pre", "sandwich")):
            raise ValueError("`parallel_dense_mlp` runs the dense MLP on the block's normed FFN input and the experts "
                             "on its residual input: it needs a serial block with a pre-FFN norm (`norm_position` "
                             f"'pre' or 'sandwich'), got `norm_position`={config.norm_position!r}"
                             f"{' with `parallel_block`' if config.parallel_block else ''}.")
        if config.parallel_dense_mlp and (config.n_shared_experts or config.apply_router_weight_on_input
                                          or config.moe_latent_size):
            raise ValueError("`parallel_dense_mlp` layers hold no shared experts or latent projections and weigh the "
                             "experts' outputs: leave `n_shared_experts` and `moe_latent_size` unset and "
                             "`apply_router_weight_on_input` False.")
        if config.apply_router_weight_on_input and config.moe_latent_size:
            raise ValueError("`apply_router_weight_on_input` scales each expert's input, and `moe_latent_size` gives the "
                             "experts a latent input: set one or the other.")
        require_choice("hidden_act", config.hidden_act, ACT2FN)
        require_bool("mlp_bias", config.mlp_bias)
        require_choice("moe_mlp_type", config.moe_mlp_type, EXPERT_FORMS)
        require_int("moe_latent_size", config.moe_latent_size, minimum=1, optional=True)
        self._validate_clamped_swiglu(config)
        self._validate_hash_layers(config)
        if config.swiglu_limit is not None and config.moe_mlp_type != "gated":
            raise ValueError("`swiglu_limit` clamps a gated expert's gate and up products, and `moe_mlp_type` is "
                             f"{config.moe_mlp_type!r} (no gate): leave it unset.")

    @staticmethod
    def _validate_clamped_swiglu(config) -> None:
        require_number("swiglu_limit", config.swiglu_limit, above=0, optional=True)
        require_number("swiglu_alpha", config.swiglu_alpha, above=0, optional=True)
        require_number("swiglu_up_offset", config.swiglu_up_offset, optional=True)
        for name in ("swiglu_alpha", "swiglu_up_offset"):
            if config.swiglu_limit is None and getattr(config, name) is not None:
                raise ValueError(f"`{name}`={getattr(config, name)} shapes the clamped SwiGLU, which `swiglu_limit` "
                                 "turns on; set `swiglu_limit` or leave it unset.")
        if config.swiglu_limit is not None and config.hidden_act != "silu":
            raise ValueError(f"`swiglu_limit` gives the experts gpt-oss's clamped SwiGLU (g·σ(α·g)), which replaces "
                             f"`hidden_act`: leave it 'silu', got {config.hidden_act!r}.")

    @staticmethod
    def _validate_hash_layers(config) -> None:
        require_int("num_hash_layers", config.num_hash_layers, minimum=0, maximum=config.num_hidden_layers)
        if config.num_hash_layers and config.parallel_dense_mlp:
            raise ValueError("`num_hash_layers` with `parallel_dense_mlp` is not supported: the experts beside a dense "
                             "MLP are routed by their router, not by token id.")
        hashed = config.mlp_layer_types[: config.num_hash_layers]
        if "dense" in hashed:
            raise ValueError(f"`num_hash_layers`={config.num_hash_layers} routes the first layers by token id, and "
                             f"layer {hashed.index('dense')} is \"dense\" in `mlp_layer_types`: they must be sparse.")
        if config.num_mtp_layers and config.num_hash_layers == config.num_hidden_layers:
            raise ValueError("`num_mtp_layers` builds its modules' blocks of the last layer's kinds, and "
                             f"`num_hash_layers`={config.num_hash_layers} routes every layer by token id: MTP "
                             "blocks that route by token id are not supported; leave the last layer unhashed.")
        if config.num_hash_layers and ROUTERS[config.router_type].affinity is None:
            raise ValueError(f"`num_hash_layers` weighs each token's looked-up experts by the router's per-expert "
                             f"scores, which `router_type`={config.router_type!r} has none of: use 'softmax_topk', "
                             "'sigmoid_topk' or 'sqrtsoftplus_topk'.")

    @staticmethod
    def _validate_layer_types(config) -> None:
        kinds = config.mlp_layer_types
        require_per_layer("mlp_layer_types", kinds, config)
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
        if n_group > 1 and not ROUTERS[config.router_type].groups:
            raise ValueError(f"`router_type`={config.router_type!r} has no group-limited routing: leave `n_group` "
                             f"at 1, got {n_group}.")
        needed = ROUTERS[config.router_type].min_experts_per_group
        if n_group > 1 and per_group < needed:
            raise ValueError(
                f"`router_type`={config.router_type!r} scores a group by its {needed} best experts: `n_group`="
                f"{n_group} leaves {per_group} per group."
            )

    def backend_features(self, config) -> set[str]:
        """What vLLM's fused experts do not compute: another activation than SiLU, gpt-oss's clamped SwiGLU,
        biases on the experts or the router (it applies the gpt-oss forms only to gpt-oss's own architecture)."""
        needed = {"experts_activation"} if config.hidden_act != "silu" else set()
        if config.swiglu_limit is not None:
            needed.add("experts_clamped_swiglu")
        if config.num_hash_layers:
            needed.add("hash_routing")
        if config.mlp_bias:
            needed.add("experts_bias")
        if config.router_bias:
            needed.add("router_bias")
        return needed

    def build(self, config, layer_idx: int) -> nn.Module:
        """`SparseMoeBlock` (`ParallelDenseMoeBlock` with `parallel_dense_mlp`) for a `"sparse"` layer, an MLP of
        `intermediate_size` (of `moe_mlp_type`'s form) for a `"dense"` one."""
        if config.mlp_layer_types[layer_idx] == "sparse":
            return ParallelDenseMoeBlock(config) if config.parallel_dense_mlp else SparseMoeBlock(config, layer_idx)
        return EXPERT_FORMS[config.moe_mlp_type](config)

    def parameters(self, config, layer_idx: int) -> int:
        """Sparse: E·d (+ E: `router_bias`) (router) + E·3·d·f (+ E·(3·f + d): `mlp_bias`) + 3·d·f_s (+ d for the
        shared gate); dense: 3·d·d_f. Ungated MLPs (`moe_mlp_type="dense"`) have 2 products where gated ones have 3;
        latent experts read and write d_l, between d·d_l projections."""
        if config.mlp_layer_types[layer_idx] == "dense":
            return activated_parameters(config, _up_products(config), config.intermediate_size)
        return self._always(config) + config.num_experts * self._expert(config)

    def active_parameters(self, config, layer_idx: int) -> int:
        """Sparse: only k of the E routed experts (the router and shared experts see every token)."""
        if config.mlp_layer_types[layer_idx] == "dense":
            return activated_parameters(config, _up_products(config), config.intermediate_size)
        return self._always(config) + config.num_experts_per_tok * self._expert(config)

    @staticmethod
    def _expert(config) -> int:
        return activated_parameters(config, _up_products(config), config.moe_intermediate_size,
                                    width_in=config.moe_latent_size)

    @staticmethod
    def _always(config) -> int:
        """Router (its bias and scales), shared experts and their gate, the latent projections, a dense MLP beside
        the experts and its three norms: what every token of a sparse layer uses."""
        d, latent, bias = config.hidden_size, config.moe_latent_size, config.mlp_bias
        total = config.num_experts * (d + (1 if config.router_bias else 0))
        total += d * config.router_input_norm + config.num_experts * config.router_expert_scale
        if config.parallel_dense_mlp:
            total += activated_parameters(config, _up_products(config), config.intermediate_size)
            total += 3 * norm_parameters(config, d)
        shared = shared_experts_intermediate_size(config)
        if shared:
            total += activated_parameters(config, _up_products(config), shared)
            total += d if config.shared_expert_gate else 0
        if latent:
            total += 2 * d * latent + ((latent + d) if bias else 0)
        return total

    def tp_plan(self, config) -> dict[str, str]:
        """transformers' MoE families' plan: experts split inside each expert (`packed_colwise` keeps each
        half of [gate; up] on its rank), shared experts and dense layers Megatron-split, the router replicated.
        Ungated experts stay whole on every rank (transformers plans none for Nemotron-H's)."""
        gated = config.moe_mlp_type == "gated"
        plan = mlp_tp_plan("mlp", gated=gated) if "dense" in config.mlp_layer_types else {}
        if config.parallel_dense_mlp:
            plan.update(mlp_tp_plan("mlp.dense", gated=gated))
        if not config.mlp_bias and gated:  # experts with biases stay whole on every rank (as transformers' gpt-oss)
            plan.update(EXPERTS_TP_PLAN)
        if config.n_shared_experts:
            plan.update(mlp_tp_plan("mlp.shared_experts", gated=gated))
        return plan

    def ep_plan(self, config) -> dict[str, str]:
        """Whole experts per rank (`grouped_gemm` shards dim 0, the experts' biases too), in this transformers'
        styles (compat.py)."""
        up = "gate_up_proj" if config.moe_mlp_type == "gated" else "up_proj"
        plan = {key.replace("gate_up_proj", up): style for key, style in experts_ep_plan().items()}
        if config.mlp_bias:
            plan.update({f"mlp.experts.{up}_bias": "grouped_gemm", "mlp.experts.down_proj_bias": "grouped_gemm"})
        return plan

    def fp32_parameters(self, config) -> tuple[str, ...]:
        """A sigmoid router's weight and correction bias stay fp32, as DeepSeek-V3 keeps them: its scores
        are compared with a bias of order 1e-3, which bf16 logits would blur."""
        if ROUTERS[config.router_type].score_correction_bias:
            return ("mlp.gate.weight", "mlp.gate.e_score_correction_bias", "mlp.gate.bias")
        return ()


MIXTURE_OF_EXPERTS = MixtureOfExpertsKind()


__all__ = [
    "MIXTURE_OF_EXPERTS",
    "MLP_LAYER_TYPES",
    "MOE_FIELDS",
    "ClampedGatedMLP",
    "MixtureOfExpertsKind",
    "ParallelDenseMoeBlock",
    "RoutingInputFields",
    "SparseMoeBlock",
    "init_moe_weights",
    "shared_experts_intermediate_size",
]
