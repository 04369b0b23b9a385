"""Standard attention (MHA / GQA) -> multi-head latent attention, the TransMLA way (Meng et al. 2025,
https://arxiv.org/abs/2502.07864; MHA2MLA, Ji et al. 2025, https://arxiv.org/abs/2502.14837), step 3.

After RoRoPE (`rorope`) the rotated joint key M k splits into a rotary part (D wide, shared by all heads)
and a NoPE part (n - D wide). The NoPE key and the values are factorised jointly to rank R:

    [K_nope; V] = W_kv x          (2n - D, d)
    c = Pᵀ [K_nope / s; V]        the latent the cache holds (R), P (2n - D, R) orthonormal
    K_nope ≈ s · P_k c,  V ≈ P_v c

P holds the principal directions of the calibration activations (`factorise`; K_nope is divided by s to
match V's RMS, so neither part dominates). Query head h of K/V group j(h) saw the key through its group's
block M_h of M, so its NoPE weight is W_uk[h] = M_h[D:]ᵀ s P_k and its rotary query M_h[:D] q_h: the MLA's
`q_proj` holds [q_h; M_h[:D] q_h], `kv_a_proj_with_mqa` [latent; rotary key], `kv_b_proj` [W_uk; W_uv].
At R = 2n - D the factorisation is exact, so the MLA equals `rorope.partial_rope_model`.

The source's score scale is folded into `q_proj`, so the MLA keeps DeepSeek's (d_h + D)^-1/2. The exact
result has no latent norm (`kv_latent_norm=False`): DeepSeek's RMSNorm divides each token's latent by its
RMS, which no choice of weights undoes (see `to_mla`'s `latent_norm`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from ...mla import mla_softmax_scale
from ...modeling_modular_decoder import ModularDecoderForCausalLM
from ...positions import RotaryEmbedding
from .moments import attention_moments, one_thread, principal_directions, progress_bar
from .rebuild import derived_config, model_from_state
from .rorope import KeyBasis, check_rope_source, layer_bases

# rope types whose inv_freq at base θ^(D/r) over width D equals the source's first D/2 at base θ over r
# (each is a function of the frequency alone); others keep RoPE only at the full rotary width
RESCALABLE_ROPE_TYPES = ("default", "linear", "llama3")


def check_source(config, kv_lora_rank: int | None, rope_dim: int | None, sweep_ranks=()) -> int:
    """Refuse, naming the option, what the conversion cannot do with `kv_lora_rank` or any of the `sweep_ranks`;
    return the rotary key width D."""
    rope_dim = check_rope_source(config, rope_dim)
    full = 2 * config.num_key_value_heads * config.head_dim - rope_dim
    ranks = ([("kv_lora_rank", kv_lora_rank)] if kv_lora_rank is not None else []) + \
        [("sweep_ranks", rank) for rank in sweep_ranks]
    for name, rank in ranks:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= full:
            raise ValueError(f"`{name}` must be an integer in [1, {full}] (2·kv_heads·head_dim - rope_dim, "
                             f"the width of [K_nope; V]), got {rank!r}.")
    return rope_dim


@dataclass
class Factorisation:
    """[K_nope; V] ≈ diag(s, 1) · P Pᵀ · [K_nope / s; V]: `basis` P (2n - D, R), orthonormal columns;
    `key_scale` s."""

    basis: torch.Tensor
    key_scale: float


def factorise(kv_weight: torch.Tensor, key_rows: int, moment: torch.Tensor, rank: int,
              method: str = "pca") -> Factorisation:
    """Rank-`rank` basis of [K_nope; V] = `kv_weight` x (its first `key_rows` rows K_nope). `method="pca"`:
    eigenvectors of the activations' second moment (least calibration reconstruction error); `"svd"`: left
    singular vectors of the weights alone (the activation-blind baseline)."""
    w = kv_weight.detach().double()  # (2n - D, d)
    row_energy = ((w @ moment) * w).sum(-1)  # (2n - D,): E[z_r²]
    key_scale = float((row_energy[:key_rows].mean() / row_energy[key_rows:].mean()).sqrt()) if key_rows else 1.0
    w = torch.cat((w[:key_rows] / key_scale, w[key_rows:]))
    if method == "pca":
        basis = principal_directions(w @ moment @ w.T)[:, :rank]
    elif method == "svd":
        with one_thread():
            basis = torch.linalg.svd(w, full_matrices=False)[0][:, :rank]
    else:
        raise ValueError(f"`method`={method!r} is not one of ['pca', 'svd'].")
    return Factorisation(basis, key_scale)


def mla_config(config, kv_lora_rank: int, rope_dim: int, latent_norm: bool = False):
    """The converted model's config: latent R + rotary key D, per-head NoPE key and value of the source's
    head width, the source's D/2 highest RoPE frequencies, no latent norm unless `latent_norm`."""
    rotary = config.rotary_dim
    params = copy.deepcopy(config.rope_parameters)
    for one in (params.values() if config.rope_is_nested else [params]):
        one.pop("partial_rotary_factor", None)
        if rope_dim != rotary:
            if one.get("rope_type", "default") not in RESCALABLE_ROPE_TYPES:
                raise ValueError(f"`rope_dim`={rope_dim} below the rotary width {rotary} needs a rope type whose "
                                 f"frequencies rescale with the base ({list(RESCALABLE_ROPE_TYPES)}), got "
                                 f"{one.get('rope_type')!r}; use `rope_dim`={rotary}.")
            one["rope_theta"] = one["rope_theta"] ** (rope_dim / rotary)  # keeps the D/2 highest frequencies
    new = derived_config(
        config, attention_type="mla", q_lora_rank=None, kv_lora_rank=kv_lora_rank, qk_nope_head_dim=config.head_dim,
        qk_rope_head_dim=rope_dim, v_head_dim=config.head_dim, kv_latent_norm=latent_norm,
        num_key_value_heads=config.num_attention_heads, partial_rotary_factor=1.0, rope_parameters=params,
        query_pre_attn_scalar=None,  # MLA's own scale (d_h + D)^-1/2; the source's is folded into the query
        head_dim=None,  # MLA's default: the latent width the cache holds per token (what vLLM sizes it by)
    )
    _check_positions(config, new)
    return new


def _check_positions(source, target) -> None:
    """The MLA's rotary tables must turn its D/2 pairs at the source's D/2 highest frequencies with the same
    temperature (else the conversion is not what it claims)."""
    old, new = RotaryEmbedding(source), RotaryEmbedding(target)
    for layer_type in sorted(set(source.layer_types)):
        prefix = f"{layer_type}_" if source.rope_is_nested else ""
        a, b = getattr(old, f"{prefix}inv_freq"), getattr(new, f"{prefix}inv_freq")
        if not torch.allclose(a[: len(b)], b, rtol=1e-5) or \
                getattr(old, f"{prefix}attention_scaling") != getattr(new, f"{prefix}attention_scaling"):
            raise ValueError(f"`rope_dim`={target.qk_rope_head_dim}: the MLA's rotary frequencies would differ "
                             f"from the source's ({layer_type}); use the full rotary width {source.rotary_dim}.")


def mla_attention_weights(attention: nn.Module, basis: KeyBasis, moment: torch.Tensor, target,
                          method: str = "pca") -> dict[str, torch.Tensor]:
    """One layer's MLA weights (float64) for the MLA config `target`, from a standard attention, its key
    basis and its input moment (the module docstring's formulas)."""
    config = attention.config
    g, head_dim, heads = config.num_key_value_heads, config.head_dim, config.num_attention_heads
    rope = basis.rope_dim  # D
    matrix = basis.matrix  # M (n, n)
    key = matrix @ attention.k_proj.weight.double()  # (n, d): rows [rotary (D); NoPE (n - D)]
    nope = key.shape[0] - rope
    kv = torch.cat((key[rope:], attention.v_proj.weight.double()))  # (2n - D, d): [K_nope; V]
    fac = factorise(kv, nope, moment, target.kv_lora_rank, method)
    up_key = fac.key_scale * fac.basis[:nope]  # (n - D, R): K_nope ≈ up_key · c
    up_value = fac.basis[nope:]  # (n, R): V ≈ up_value · c
    latent = fac.basis.T @ torch.cat((kv[:nope] / fac.key_scale, kv[nope:]))  # (R, d): c = latent · x

    group = torch.arange(heads) // (heads // g)  # query head -> its K/V head
    head_blocks = matrix.unflatten(1, (g, head_dim))[:, group]  # (n, H, d_h): M_h
    q = attention.q_proj.weight.double().unflatten(0, (heads, head_dim))  # (H, d_h, d)
    q_rope = torch.einsum("rhe,hed->hrd", head_blocks[:rope], q)  # (H, D, d): M_h[:D] q_h
    w_uk = torch.einsum("nhe,nc->hec", head_blocks[rope:], up_key)  # (H, d_h, R): M_h[D:]ᵀ s P_k
    w_uv = up_value.unflatten(0, (g, head_dim))[group]  # (H, d_h, R)
    scale = attention.scaling / mla_softmax_scale(target, config.layer_types[attention.layer_idx])
    weights = {
        "q_proj.weight": scale * torch.cat((q, q_rope), 1).flatten(0, 1),
        "kv_a_proj_with_mqa.weight": torch.cat((latent, key[:rope])),
        "kv_b_proj.weight": torch.cat((w_uk, w_uv), 1).flatten(0, 1),
        "o_proj.weight": attention.o_proj.weight.double(),
    }
    if attention.o_proj.bias is not None:
        weights["o_proj.bias"] = attention.o_proj.bias.double()
    if target.kv_latent_norm:  # the identity for a latent of the calibration's RMS
        rms = (((latent @ moment) * latent).sum() / len(latent)).sqrt()
        weights["kv_a_layernorm.weight"] = torch.full((len(latent),), float(rms) - target.norm_unit_offset,
                                                      dtype=torch.float64)
        if target.norm_type == "layernorm" and target.norm_bias:
            weights["kv_a_layernorm.bias"] = torch.zeros(len(latent), dtype=torch.float64)
    return weights


@torch.no_grad()
def to_mla(model, kv_lora_rank: int, rope_dim: int | None, calibration_ids: torch.LongTensor, *,
           progress: bool = True, moments: list[torch.Tensor] | None = None, method: str = "pca",
           latent_norm: bool = False) -> ModularDecoderForCausalLM:
    """A new `attention_type="mla"` model from a standard-attention RoPE one (steps 1-3).

    Args:
        model: a `ModularDecoderForCausalLM` with standard attention (MHA / GQA / MQA) and RoPE.
        kv_lora_rank: the latent width R, at most 2·kv_heads·head_dim - rope_dim (full rank: exact up to
            the partial-RoPE step).
        rope_dim: the rotary key width D (even, at most the source's rotary width; default: that width).
        calibration_ids: (N, T) token ids whose activations choose the rotations and the latent basis.
        progress: show progress bars.
        moments: `attention_moments(model, calibration_ids)` computed already (then the ids are unused).
        method: `"pca"` (activation-aware, the default) or `"svd"` (of the weights; a baseline).
        latent_norm: keep DeepSeek's norm on the latent, its weight the latent's calibration RMS. Approximate
            even at full rank, but the result exports to transformers' DeepSeek-V3 and has the RMSNorm vLLM's
            MLA path looks for; untrained it is far worse (SmolLM2 at rank 192: held-out perplexity 994
            against 52 without the norm), a starting point for healing. Without it the model loads,
            generates and fine-tunes here, but DeepSeek's classes cannot hold it and export refuses it.
    Raises:
        ValueError: naming the option the method cannot honour.
    """
    rope_dim = check_source(model.config, kv_lora_rank, rope_dim)
    config = mla_config(model.config, kv_lora_rank, rope_dim, latent_norm)
    if moments is None:
        moments = attention_moments(model, calibration_ids, progress=progress)
    with one_thread():  # hundreds of small matrices: threads add only synchronisation (`moments.one_thread`)
        bases = layer_bases(model, moments, rope_dim)
        state = {name: t for name, t in model.state_dict().items() if ".self_attn." not in name}
        layers = model.model.layers
        for i in progress_bar(range(len(layers)), progress, "to MLA"):
            weights = mla_attention_weights(layers[i].self_attn, bases[i], moments[i], config, method)
            dtype = layers[i].self_attn.q_proj.weight.dtype
            state.update({f"model.layers.{i}.self_attn.{name}": w.to(dtype) for name, w in weights.items()})
        out = model_from_state(config, state, model, copy=True)  # the kept tensors copied, never shared
    return out.eval()
