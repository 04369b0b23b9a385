"""`experts=E, top_k=K [, shared_experts=S, fine_grained=G]`: dense -> mixture of experts by sparse upcycling
(Komatsuzaki et al. 2022, "Sparse Upcycling: Training Mixture-of-Experts from Dense Checkpoints"), exact
at step 0.

The dense gated FFN of width f is cut into G slices of width f/G along its hidden dimension; a gated FFN is
the sum of its slices (each hidden unit adds its own column of `down_proj`), so

    FFN(x) = Σ_g FFN_g(x).

The S shared experts hold slices 0..S-1 unchanged (always on). The routed experts hold the other R = G - S
slices: E/R copies of those R slices, each slice's `down_proj` multiplied by R. The router (softmax top-k,
renormalised) gets one random row per copy, shared by that copy's R slices, so the R slices of a copy have
equal logits and top-k with K a multiple of R picks whole copies; the renormalised weights then give each
chosen copy's slices p_c / (R·Σ p) each, and Σ_c p_c/Σp · Σ_r R·FFN_r / R = Σ_r FFN_r: the dense function
for every input, whatever the router's rows (random normal with `initializer_range`, seeded, so that the
copies route differently once training moves them apart). With G = 1 and S = 0 this is the paper's recipe:
every expert is a copy of the FFN.

This is He et al. 2024's "virtual group" initialisation of fine-grained upcycling ("Upcycling Large
Language Models into Mixture of Experts"), with shared experts taking whole slices.
"""

from __future__ import annotations

import torch

from .rebuild import Change, derived_config, model_from_state, require_positive_int


def check_experts(config, experts: int, top_k: int, shared_experts: int = 0, fine_grained: int = 1) -> None:
    """Refuse what upcycling cannot do exactly on `config`, by option name."""
    require_positive_int("experts", experts)
    require_positive_int("top_k", top_k)
    require_positive_int("shared_experts", shared_experts, minimum=0)
    require_positive_int("fine_grained", fine_grained)
    if config.mlp_type != "gated":
        raise ValueError(f"`experts` upcycles a gated FFN (experts are gated MLPs); this model has mlp_type="
                         f"{config.mlp_type!r}.")
    if config.mlp_bias:
        raise ValueError("`experts` slices a bias-free gated FFN into experts; this model has mlp_bias=True (the "
                         "down bias would have to be shared out across the slices, which this upcycling does not do).")
    width = config.intermediate_size
    if width % fine_grained:
        raise ValueError(f"`fine_grained`={fine_grained} must divide the FFN width intermediate_size={width}.")
    if shared_experts >= fine_grained:
        raise ValueError(
            f"`shared_experts`={shared_experts} must be below `fine_grained`={fine_grained}: the shared experts hold "
            f"{shared_experts} of the FFN's {fine_grained} slices and the routed experts the rest (e.g. "
            f"`--fine-grained {shared_experts + 1}`).")
    routed = fine_grained - shared_experts
    if experts % routed:
        raise ValueError(f"`experts`={experts} must be a multiple of the {routed} routed slices (`fine_grained` - "
                         "`shared_experts`): each copy of the FFN is that many experts.")
    if top_k % routed or top_k > experts:
        raise ValueError(f"`top_k`={top_k} must be a multiple of the {routed} routed slices (`fine_grained` - "
                         f"`shared_experts`), at most `experts`={experts}, for the upcycled model to be exact.")


def upcycle(model, experts: int, top_k: int, shared_experts: int = 0, fine_grained: int = 1, seed: int = 0,
            copy: bool = True):
    """A new model whose every FFN is a mixture of experts computing the same function; returns (model, Change)."""
    config = model.config
    check_experts(config, experts, top_k, shared_experts, fine_grained)
    width = config.intermediate_size // fine_grained
    routed = fine_grained - shared_experts
    copies = experts // routed
    generator = torch.Generator().manual_seed(seed)
    source = model.state_dict()
    state = {name: tensor for name, tensor in source.items() if ".mlp." not in name}
    changed = []
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}.mlp."
        dense = {part: source[f"{prefix}{part}.weight"] for part in ("gate_proj", "up_proj", "down_proj")}
        state.update(_layer_state(prefix, dense, width, shared_experts, routed, copies, config, generator))
        changed.append(prefix[:-1])
    new_config = derived_config(
        config, mlp_type="moe", num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=width,
        n_shared_experts=shared_experts, shared_expert_intermediate_size=width if shared_experts else None,
        router_type="softmax_topk", norm_topk_prob=True, mlp_layer_types=None, router_aux_loss_coef=None)
    new = model_from_state(new_config, state, model, copy=copy)
    change = Change(
        "experts",
        keeps="the FFN function at step 0 by construction (every routing gives the dense output), attention, "
              "norms, embeddings",
        approximates="",
        changed=changed,
        details={"experts": experts, "top_k": top_k, "shared_experts": shared_experts, "fine_grained": fine_grained,
                 "expert_width": width, "router_init": "random normal rows (std initializer_range, seed "
                 f"{seed}), one per copy of the FFN, shared by its {routed} slice(s)"},
    )
    return new, change


def _layer_state(prefix: str, dense: dict, width: int, shared: int, routed: int, copies: int, config,
                 generator: torch.Generator) -> dict[str, torch.Tensor]:
    """One layer's router, experts and shared experts from its dense gated FFN (see the module docstring)."""
    gate, up, down = dense["gate_proj"], dense["up_proj"], dense["down_proj"]  # (f, d), (f, d), (d, f)

    def rows(slice_index: int) -> slice:
        return slice(slice_index * width, (slice_index + 1) * width)

    gate_up, downs = [], []
    for _ in range(copies):
        for r in range(routed):
            part = rows(shared + r)
            gate_up.append(torch.cat([gate[part], up[part]]))  # (2·f/G, d)
            downs.append(down[:, part] * routed)  # (d, f/G)
    router = torch.randn(copies, config.hidden_size, generator=generator, dtype=torch.float32)
    router = (router * config.initializer_range).to(gate.dtype).repeat_interleave(routed, dim=0)  # (E, d)
    state = {prefix + "gate.weight": router.contiguous(),
             prefix + "experts.gate_up_proj": torch.stack(gate_up).contiguous(),
             prefix + "experts.down_proj": torch.stack(downs).contiguous()}
    if shared:
        kept = slice(0, shared * width)
        state[prefix + "shared_experts.gate_proj.weight"] = gate[kept].clone()
        state[prefix + "shared_experts.up_proj.weight"] = up[kept].clone()
        state[prefix + "shared_experts.down_proj.weight"] = down[:, kept].contiguous()
    return state
