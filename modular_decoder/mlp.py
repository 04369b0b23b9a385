"""Feed-forward sublayers, chosen by `config.mlp_type` through `registries.MLPS` (entries below).

Module names follow the Llama convention (`up_proj`, `gate_proj`, `down_proj`) so PEFT's usual
`target_modules` work on every variant. The dense and gated kinds may give each layer its own width
(`layer_intermediate_sizes`: Gemma 4 doubles the layers that read shared keys and values) and sparsify the
activation's input on chosen layers (`activation_sparsity_pattern`, Gemma 3n), fields in `MlpLayerFields`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.activations import ACT2FN

from .kinds import FeedForwardKind, require_bool, require_choice, require_int, require_number, require_per_layer
from .mup import validate_mlp_multipliers
from .split_products import project, takes_split_branch


@dataclass(kw_only=True)
class MlpLayerFields:
    """Args:
        layer_intermediate_sizes (`list[int]`, *optional*): The dense or gated MLP's width d_f of each layer (Gemma 4
            makes the layers that read shared keys and values twice as wide, `use_double_wide_mlp`; Gemma 3n lists
            one per layer). `None`: `intermediate_size` in every layer.
        activation_sparsity_pattern (`list[float]`, *optional*): Per layer, a target sparsity s in [0, 1) of the
            activation's input (Gemma 3n's field): where s > 0, the input u keeps only what exceeds
            mean(u) + std(u)·Φ⁻¹(s) over its features, relu(u - that), before the activation (a Gaussian top-k).
            `None`: no layer sparsified.
    """

    layer_intermediate_sizes: list[int] | None = None
    activation_sparsity_pattern: list[float] | None = None


def layer_width(config, layer_idx: int) -> int:
    """The dense or gated MLP's width in layer `layer_idx`."""
    widths = config.layer_intermediate_sizes
    return widths[layer_idx] if widths is not None else config.intermediate_size


def layer_sparsity(config, layer_idx: int) -> float:
    pattern = config.activation_sparsity_pattern
    return pattern[layer_idx] if pattern is not None else 0.0


class GaussianTopK(nn.Module):
    """relu(u - (mean(u) + std(u)·Φ⁻¹(s))) over the last dim: keeps about the top 1 - s of a Gaussian's values
    (Gemma 3n's `_gaussian_topk`, its arithmetic: Φ⁻¹ in fp32, cast to the input's dtype)."""

    def __init__(self, sparsity: float):
        super().__init__()
        self.sparsity = sparsity
        zero, one, target = (torch.tensor(v, dtype=torch.float32, device="cpu") for v in (0.0, 1.0, sparsity))
        self.multiplier = float(torch.distributions.Normal(zero, one).icdf(target))  # (on the CPU, also under meta)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        cutoff = u.mean(-1, keepdim=True) + u.std(-1, keepdim=True, unbiased=False) * torch.tensor(
            self.multiplier).to(u.dtype)
        return nn.functional.relu(u - cutoff)

    def extra_repr(self) -> str:
        return f"sparsity={self.sparsity}"


def sparsified_activation(config, layer_idx: int | None):
    """The activation, after a Gaussian top-k of its input where layer `layer_idx` is sparsified."""
    act = activation(config.hidden_act)
    sparsity = layer_sparsity(config, layer_idx) if layer_idx is not None else 0.0
    return nn.Sequential(GaussianTopK(sparsity), act) if sparsity > 0 else act


def activation(name: str) -> nn.Module:
    """The activation function `name` (`ACT2FN`), its parameters in the dtype the model is built in.

    Any parameters and buffers it has (PReLU, xIELU) follow the model's dtype: transformers' xIELU makes them
    bfloat16 whatever the model's dtype, so an fp32 model would compute them in bf16 after a save / load, and load
    fp32 checkpoint values rounded."""
    act = ACT2FN[name]
    return act.to(torch.get_default_dtype()) if isinstance(act, nn.Module) else act


class DenseMLP(nn.Module):
    """act(x W_up) W_down: GPT-1/2, OPT, GPT-J, NeoX, Falcon, BLOOM, Phi. 2·d·d_f weights."""

    def __init__(self, config, intermediate_size: int | None = None, layer_idx: int | None = None):
        super().__init__()
        d, f = config.hidden_size, intermediate_size or config.intermediate_size
        self.up_proj = nn.Linear(d, f, bias=config.mlp_bias)
        self.down_proj = nn.Linear(f, d, bias=config.mlp_bias)
        self.act_fn = sparsified_activation(config, layer_idx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(self.down_proj, self.act_fn(project(self.up_proj, x)))


class GatedMLP(nn.Module):
    """(act(x W_gate) ⊙ x W_up) W_down: GLU / ReGLU / GEGLU / SwiGLU by `hidden_act`. 3·d·d_f weights."""

    def __init__(self, config, intermediate_size: int | None = None, layer_idx: int | None = None):
        super().__init__()
        # `intermediate_size` overrides the config's width (a layer's own, an MoE block's shared experts); `layer_idx`
        # picks the layer's activation sparsity
        d, f = config.hidden_size, intermediate_size or config.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=config.mlp_bias)
        self.up_proj = nn.Linear(d, f, bias=config.mlp_bias)
        self.down_proj = nn.Linear(f, d, bias=config.mlp_bias)
        self.act_fn = sparsified_activation(config, layer_idx)
        # μP (mup.py; Falcon-H1): the gate before its activation, the output
        self.gate_multiplier, self.down_multiplier = config.mlp_multipliers or (1.0, 1.0)
        self.scaled = (self.gate_multiplier, self.down_multiplier) != (1.0, 1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scaled:
            return self.scaled_forward(x)
        if takes_split_branch(self.down_proj, x):  # our own linears: few-row products on all cores
            return self.split_forward(x)
        # The GLU as vLLM's Transformers backend reads it (module calls): it fuses gate and up into one
        # product, and leaves the reduction of shared experts under tensor parallelism to its fused experts
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    def split_forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(self.down_proj, self.act_fn(project(self.gate_proj, x)) * project(self.up_proj, x))

    def scaled_forward(self, x: torch.Tensor) -> torch.Tensor:
        """With `mlp_multipliers`: down(act(gate(x)·m_gate) ⊙ up(x))·m_down, in Falcon-H1's order."""
        hidden = project(self.up_proj, x) * self.act_fn(project(self.gate_proj, x) * self.gate_multiplier)
        return project(self.down_proj, hidden) * self.down_multiplier


class ActivatedKind(FeedForwardKind):
    """Dense or gated: one activation (`hidden_act`) between `up_projections` d x d_f matrices and d_f x d."""

    up_projections: int

    def __init__(self, name: str, module: type[nn.Module], up_projections: int, fields: tuple[str, ...] = ()):
        # every such kind: `MlpLayerFields` (a width and an activation sparsity per layer)
        self.name, self.module, self.up_projections = name, module, up_projections
        self.fields = ("layer_intermediate_sizes", "activation_sparsity_pattern", *fields)

    def build(self, config, layer_idx: int) -> nn.Module:
        return self.module(config, layer_width(config, layer_idx), layer_idx)

    def validate(self, config) -> None:
        require_choice("hidden_act", config.hidden_act, ACT2FN)
        require_bool("mlp_bias", config.mlp_bias)
        for name, check in (("layer_intermediate_sizes", lambda v: require_int("layer_intermediate_sizes[...]", v,
                                                                              minimum=1)),
                            ("activation_sparsity_pattern", lambda v: require_number(
                                "activation_sparsity_pattern[...]", v, at_least=0, below=1))):
            values = getattr(config, name)
            if values is None:
                continue
            require_per_layer(name, values, config, "one value")
            for value in values:
                check(value)
        if "mlp_multipliers" in self.fields:
            validate_mlp_multipliers(config)

    def parameters(self, config, layer_idx: int = 0) -> int:
        """Dense 2·d·d_f, gated 3·d·d_f (+ biases), d_f the layer's width."""
        return activated_parameters(config, self.up_projections, layer_width(config, layer_idx))

    def tp_plan(self, config) -> dict[str, str]:
        """Column-parallel up (and gate) projections, row-parallel down projection."""
        return mlp_tp_plan("mlp", gated=self.up_projections == 2)


def activated_parameters(config, up_projections: int, width: int, width_in: int | None = None) -> int:
    """`up_projections` d x width matrices and one width x d matrix (+ biases with `mlp_bias`); d is `width_in`
    where given (latent experts), else `hidden_size`."""
    d, bias = width_in or config.hidden_size, config.mlp_bias
    return up_projections * (d * width + (width if bias else 0)) + width * d + (d if bias else 0)


def mlp_tp_plan(prefix: str, gated: bool) -> dict[str, str]:
    """The Megatron split of one (gated) MLP at `prefix`: no communication between its two products."""
    plan = {f"{prefix}.gate_proj": "colwise"} if gated else {}
    plan.update({f"{prefix}.up_proj": "colwise", f"{prefix}.down_proj": "rowwise"})
    return plan


DENSE_MLP = ActivatedKind("dense", DenseMLP, up_projections=1)
GATED_MLP = ActivatedKind("gated", GatedMLP, up_projections=2, fields=("mlp_multipliers",))
