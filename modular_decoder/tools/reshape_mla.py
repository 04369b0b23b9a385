"""Standard attention (MHA / GQA) -> multi-head latent attention, the TransMLA way.

TransMLA (Meng et al. 2025, https://arxiv.org/abs/2502.07864) and MHA2MLA (Ji et al. 2025,
https://arxiv.org/abs/2502.14837) turn a trained GQA model into DeepSeek's MLA in three steps, each a
function here so it can be checked on its own:

1. `rorope_rotations` + `rotated_model` (exact). Treat the g KV heads' keys as one joint key of width
   g·d_h, which every query head attends to with zeros outside its own group's dims. At each RoPE
   frequency the g heads hold g (x, y) pairs that RoPE turns by the same angle; an orthogonal g×g
   matrix mixing the heads, applied alike to the x's and the y's, commutes with that turn. Its columns
   are the principal directions of the keys at that frequency (PCA over the calibration tokens), so
   the first rotated "head" carries most of each frequency's energy. Queries get the same rotation,
   so every score is unchanged.
2. `partial_rope_model` (the one lossy step at full rank). Keep RoPE on the first D dims of the rotated
   key only, the principal pair of the D/2 highest frequencies (the decoupled rotary key shared by all
   heads, DeepSeek's `qk_rope_head_dim`); every other dim becomes NoPE.
3. `to_mla`: the NoPE key and the values, [K_nope; V] (2·g·d_h - D wide), are factorised jointly to
   rank R (`kv_lora_rank`) by PCA of their calibration activations (`factorise`, K rescaled to V's
   RMS first and back after); the latent c = P_Rᵀ[K_nope; V] is what the cache holds beside the
   rotary key. Per query head, the NoPE key it sees is its group's slice of the rotation applied to
   the reconstructed K_nope, so its content query is its original query; the rotation's rotary rows
   move into the query projection. At R = 2·g·d_h - D the factorisation is exact.

The exact result needs `kv_latent_norm=False`: DeepSeek's RMSNorm on the latent is not linear (it divides
each token's latent by that token's RMS, while the rotary key is left alone), so no choice of weights
reproduces the source's scores through it. Such a model loads, generates, caches the latent and fine-tunes
like any MLA checkpoint of this family, but transformers' DeepSeek-V2/V3 classes (latent always normed)
cannot hold it, `conversion` refuses that export, and vLLM's MLA fuser (which looks for the RMSNorm between
`kv_a_proj_with_mqa` and `kv_b_proj`) does not recognise it. `to_mla(..., latent_norm=True)` keeps the
norm with its weight at the latent's calibration RMS instead: approximate even at full rank, but that
model exports to DeepSeek-V3 exactly (where the source's `norm_eps` is DeepSeek's fixed 1e-6).

The source's score scale d_h^-1/2 (or `query_pre_attn_scalar`^-1/2) is folded into the query projection,
so the MLA keeps DeepSeek's own (d_h + D)^-1/2 and its config needs no `query_pre_attn_scalar`.

What the method cannot do exactly is refused with a `ValueError` naming the option: a QK-norm (the
keys are then not a linear function of the hidden state), a query bias (MLA's `q_proj` has none),
positions other than RoPE, a rotary key wider than the source's rotary width, a rank above full.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import torch
from torch import nn
from transformers.initialization import no_init_weights
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..attention_layer import AttentionLayer
from ..eager_attention import eager_attention
from ..split_products import project
from ..mla import mla_softmax_scale
from ..modeling_modular_decoder import ModularDecoderForCausalLM
from ..positions import RotaryEmbedding

# rope types whose inv_freq at base θ^(D/r) over width D equals the source's first D/2 at base θ over r
# (each is a function of the frequency alone); others keep RoPE only at the full rotary width
RESCALABLE_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass
class KeyBasis:
    """One layer's orthogonal change of coordinates of the joint key (g·d_h wide) and its rotary pairs.

    `matrix` rows are the new coordinates in terms of the concatenated KV heads' keys; coordinates
    `rope_x[p]`, `rope_y[p]` form a pair that RoPE turns at the source's frequency `rope_freq[p]`;
    every other coordinate is NoPE. With `rope_dim` set, the first `rope_dim` rows are MLA's rotary key
    in its pair layout (halves, or adjacent pairs when `rope_interleaved`).
    """

    matrix: torch.Tensor  # (g·d_h, g·d_h)
    rope_x: torch.Tensor  # (P,)
    rope_y: torch.Tensor  # (P,)
    rope_freq: torch.Tensor  # (P,)
    rope_dim: int | None = None


def check_source(config, kv_lora_rank: int | None, rope_dim: int | None) -> int:
    """Refuse what the conversion cannot do exactly; return the rotary key width D (`rope_dim`)."""
    if config.attention_type != "standard":
        raise ValueError(f"`attention_type`={config.attention_type!r}: only standard attention converts to MLA.")
    if config.position_embedding_type != "rope":
        raise ValueError(f"`position_embedding_type`={config.position_embedding_type!r}: MLA carries position only "
                         "in its rotary key, so only a RoPE model converts (ALiBi / absolute positions cannot).")
    if config.qk_norm != "none":
        raise ValueError(f"`qk_norm`={config.qk_norm!r}: a norm on the keys before RoPE makes them a nonlinear "
                         "function of the hidden state, which no latent projection reproduces.")
    if config.attention_bias:
        raise ValueError("`attention_bias=True`: MLA's query projection has no bias to carry the query bias.")
    rotary, joint = config.rotary_dim, config.num_key_value_heads * config.head_dim
    rope_dim = rotary if rope_dim is None else rope_dim
    if isinstance(rope_dim, bool) or not isinstance(rope_dim, int) or rope_dim < 2 or rope_dim % 2:
        raise ValueError(f"`rope_dim` must be a positive even integer, got {rope_dim!r}.")
    if rope_dim > rotary:
        raise ValueError(f"`rope_dim`={rope_dim} exceeds the source's rotary width {rotary}: MLA's rotary key turns "
                         f"each pair at its own frequency, and the source has {rotary // 2} frequencies.")
    if kv_lora_rank is not None:
        full = 2 * joint - rope_dim
        if isinstance(kv_lora_rank, bool) or not isinstance(kv_lora_rank, int) or not 1 <= kv_lora_rank <= full:
            raise ValueError(f"`kv_lora_rank` must be an integer in [1, {full}] (2·kv_heads·head_dim - rope_dim, "
                             f"the width of [K_nope; V]), got {kv_lora_rank!r}.")
    return rope_dim


def _check_ids(model, calibration_ids) -> None:
    if not torch.is_tensor(calibration_ids) or calibration_ids.dtype != torch.long or calibration_ids.dim() != 2:
        raise ValueError("`calibration_ids` must be a 2-D LongTensor (rows of token ids).")
    if calibration_ids.numel() == 0 or calibration_ids.min() < 0 or calibration_ids.max() >= model.config.vocab_size:
        raise ValueError(f"`calibration_ids` must be non-empty ids in [0, {model.config.vocab_size}).")


def _bar(iterable, progress: bool, desc: str, total: int | None = None):
    if not progress:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total, leave=False)


@torch.no_grad()
def attention_moments(model, calibration_ids: torch.LongTensor, batch_size: int = 4,
                      progress: bool = False) -> list[torch.Tensor]:
    """E[x xᵀ] (float64, d×d) of every layer's attention input x over the calibration tokens.

    Every key, value and their covariances are linear in x, so these moments are all the calibration
    the conversion needs: one pass of the source model, memory L·d² whatever the calibration length.
    """
    _check_ids(model, calibration_ids)
    layers = model.model.layers
    sums = [torch.zeros(model.config.hidden_size, model.config.hidden_size, dtype=torch.float64) for _ in layers]

    def hook(index):
        def collect(module, args, kwargs):
            x = (args[0] if args else kwargs["hidden_states"]).reshape(-1, sums[index].shape[0]).double()
            sums[index] += (x.T @ x).cpu()
        return collect

    handles = [layer.self_attn.register_forward_pre_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        for start in _bar(range(0, len(calibration_ids), batch_size), progress, "calibration",
                          total=-(-len(calibration_ids) // batch_size)):
            batch = calibration_ids[start:start + batch_size].to(model.device)
            model.model(input_ids=batch, use_cache=False)  # the base model: no logits needed
    finally:
        for handle in handles:
            handle.remove()
    return [moment / calibration_ids.numel() for moment in sums]


@contextlib.contextmanager
def _one_thread():
    """LAPACK's threaded eigh / svd of a few hundred rows is slower than one thread, and far slower on a
    busy machine (measured: 0.05 s on one thread, 0.9 s on two, for 320 rows on a loaded 2-core host)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _principal_directions(moment: torch.Tensor) -> torch.Tensor:
    """Eigenvectors of symmetric `moment` (..., n, n) as columns, by decreasing eigenvalue."""
    with _one_thread():
        return torch.linalg.eigh(moment)[1].flip(-1)  # eigh sorts ascending


def _key_index(config) -> torch.Tensor:
    """(g, r/2, 2): where each KV head's x / y of each frequency pair sits in the joint key."""
    g, head, rotary = config.num_key_value_heads, config.head_dim, config.rotary_dim
    freq = torch.arange(rotary // 2)
    within = torch.stack((2 * freq, 2 * freq + 1), -1) if config.rope_interleaved else \
        torch.stack((freq, freq + rotary // 2), -1)  # (r/2, 2)
    return torch.arange(g)[:, None, None] * head + within  # (g, r/2, 2)


def rorope_rotations(k_weight: torch.Tensor, moment: torch.Tensor, config) -> torch.Tensor:
    """RoRoPE's per-frequency rotations: (r/2, g, g), columns the principal directions of the keys at
    each frequency across the g KV heads (x and y halves pooled), by decreasing energy.

    k_weight (g·d_h, d) is the key projection, moment E[x xᵀ] its input's second moment.
    """
    w = k_weight.double()[_key_index(config)]  # (g, r/2, 2, d)
    w = w.permute(1, 2, 0, 3)  # (r/2, 2, g, d)
    energy = torch.einsum("fpjd,fpkd->fjk", w @ moment, w)  # (r/2, g, g): E[x xᵀ + y yᵀ] per frequency
    return _principal_directions(energy)


def key_basis(rotations: torch.Tensor, config, rope_dim: int | None) -> KeyBasis:
    """The joint key's new coordinates. `rope_dim=None`: every rotated pair keeps RoPE at its frequency
    (the exact RoRoPE model); `rope_dim=D`: only the principal pair of frequencies 0..D/2-1 does, laid
    out first as MLA's rotary key, the rest is NoPE."""
    g, head, rotary = config.num_key_value_heads, config.head_dim, config.rotary_dim
    half, joint = rotary // 2, g * head
    index = _key_index(config)  # (g, r/2, 2)
    # row (a, f, p): sum_j U_f[j, a] e_{index[j, f, p]}
    rows = torch.zeros(g, half, 2, joint, dtype=torch.float64)
    freq = torch.arange(half)
    for j in range(g):
        for p in range(2):
            rows[:, freq, p, index[j, :, p]] = rotations[:, j, :].T  # (a, f)
    passthrough = torch.eye(joint, dtype=torch.float64)[
        (torch.arange(g)[:, None] * head + torch.arange(rotary, head)).flatten()]
    if rope_dim is None:
        matrix = torch.cat((rows.reshape(-1, joint), passthrough))
        pair = torch.arange(g * half) * 2
        return KeyBasis(matrix, pair, pair + 1, torch.arange(half).repeat(g))
    kept = rope_dim // 2
    rope_rows = rows[0, :kept]  # (D/2, 2, joint): the principal pair of the D/2 highest frequencies
    if config.rope_interleaved:
        rope = rope_rows.reshape(rope_dim, joint)
        xs, ys = torch.arange(kept) * 2, torch.arange(kept) * 2 + 1
    else:
        rope = rope_rows.transpose(0, 1).reshape(rope_dim, joint)
        xs, ys = torch.arange(kept), torch.arange(kept) + kept
    mask = torch.ones(g, half, dtype=torch.bool)
    mask[0, :kept] = False
    matrix = torch.cat((rope, rows[mask].reshape(-1, joint), passthrough))
    return KeyBasis(matrix, xs, ys, torch.arange(kept), rope_dim)


def layer_bases(model, moments: list[torch.Tensor], rope_dim: int | None) -> list[KeyBasis]:
    """`key_basis` of every layer from its RoRoPE rotations."""
    bases = []
    for layer, moment in zip(model.model.layers, moments):
        rotations = rorope_rotations(layer.self_attn.k_proj.weight.detach(), moment, model.config)
        bases.append(key_basis(rotations, model.config, rope_dim))
    return bases


class RotatedKeyAttention(AttentionLayer):
    """Reference attention over the rotated joint key: every query head scores the one g·d_h-wide key,
    its own query placed in its group's dims; RoPE on `basis`'s pairs only. Built from a standard
    attention's projections (shared), forward without a cache. It is the partial-RoPE model MLA at full
    rank must equal, and, with every pair kept, a rewrite of the source that must equal it."""

    def __init__(self, source: nn.Module, basis: KeyBasis):
        super().__init__(source.config, source.layer_idx, scaling=source.scaling)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = source.q_proj, source.k_proj, source.v_proj, source.o_proj
        self.num_heads, self.head_dim = source.num_heads, source.head_dim
        self.groups = source.num_key_value_groups
        self.num_key_value_groups = 1  # one joint key, expanded over the heads
        dtype = source.q_proj.weight.dtype
        self.register_buffer("matrix", basis.matrix.to(dtype), persistent=False)
        self.rope_x, self.rope_y = basis.rope_x, basis.rope_y
        # the source's cos/sin tables hold frequency f at column f (halves) or 2f (adjacent pairs)
        self.rope_column = basis.rope_freq * (2 if self.interleaved else 1)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c, s = cos[..., self.rope_column], sin[..., self.rope_column]
        first, second = x[..., self.rope_x], x[..., self.rope_y]
        x = x.clone()
        x[..., self.rope_x] = first * c - second * s
        x[..., self.rope_y] = second * c + first * s
        return x

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, position_bias=None, cache=None,
                **kwargs):
        if cache is not None:
            raise ValueError("The rotated-key reference attention runs without a cache: pass `use_cache=False`.")
        batch, seq = hidden_states.shape[:2]
        q = project(self.q_proj, hidden_states).unflatten(-1, (-1, self.head_dim))  # (B, T, H, d_h)
        k = project(self.k_proj, hidden_states)  # (B, T, g·d_h)
        v = project(self.v_proj, hidden_states).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)  # (B, g, T, d_h)
        # query head h sees only its group's block of the rotation: q_h · M[:, block]ᵀ
        blocks = self.matrix.unflatten(1, (-1, self.head_dim))  # (n, g, d_h)
        per_head = blocks.repeat_interleave(self.groups, dim=1)  # (n, H, d_h)
        queries = torch.einsum("bthd,nhd->bhtn", q, per_head)  # (B, H, T, n)
        keys = (k @ self.matrix.T).unsqueeze(1)  # (B, 1, T, n)
        cos, sin = position_embeddings
        queries, keys = self._rope(queries, cos, sin), self._rope(keys, cos, sin)
        keys = keys.expand(-1, self.num_heads, -1, -1)
        values = v.repeat_interleave(self.groups, dim=1)  # (B, H, T, d_h)
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention)
        out, weights = attention_interface(
            self, queries, keys, values, attention_mask, scaling=self.scaling, **self.score_kwargs(kwargs)
        )
        return project(self.o_proj, out.reshape(batch, seq, -1)), weights


def _with_attention(model, bases: list[KeyBasis]):
    out = copy.deepcopy(model)
    for layer, basis in zip(out.model.layers, bases):
        layer.self_attn = RotatedKeyAttention(layer.self_attn, basis)
    return out


def rotated_model(model, calibration_ids=None, *, moments=None, progress: bool = False):
    """The source with its keys RoRoPE-rotated across KV heads and RoPE kept on every pair (exact:
    equal to the source up to rounding). Reference for step 1; runs with `use_cache=False`."""
    check_source(model.config, None, None)
    moments = moments if moments is not None else attention_moments(model, calibration_ids, progress=progress)
    return _with_attention(model, layer_bases(model, moments, None))


def partial_rope_model(model, rope_dim: int | None = None, calibration_ids=None, *, moments=None,
                       progress: bool = False):
    """The RoRoPE-rotated source with RoPE on the principal pair of the `rope_dim`/2 highest frequencies
    only (step 2, the one lossy step at full rank). Runs with `use_cache=False`."""
    rope_dim = check_source(model.config, None, rope_dim)
    moments = moments if moments is not None else attention_moments(model, calibration_ids, progress=progress)
    return _with_attention(model, layer_bases(model, moments, rope_dim))


@dataclass
class Factorisation:
    """[K_nope; V] ≈ scale · basis · basisᵀ [K_nope / scale; V]: `basis` (2n - D, R) orthonormal columns;
    `scale` the factor K_nope was divided by to balance it with V (diag: K rows scaled, V rows 1)."""

    basis: torch.Tensor
    key_scale: float


def factorise(kv_weight: torch.Tensor, key_rows: int, moment: torch.Tensor, rank: int,
              method: str = "pca") -> Factorisation:
    """Rank-`rank` basis of the joint [K_nope; V] = kv_weight · x (kv_weight (2n - D, d), its first
    `key_rows` rows K_nope). K_nope is rescaled to V's RMS over the calibration first so neither part
    dominates the principal directions. `method="pca"`: eigenvectors of the activations' second moment
    (minimises the calibration reconstruction error); `"svd"`: left singular vectors of the balanced
    weights alone (the activation-blind baseline)."""
    w = kv_weight.detach().double()
    energy = ((w @ moment) * w).sum(-1)  # E[z_r²] per row
    key_scale = float((energy[:key_rows].mean() / energy[key_rows:].mean()).sqrt()) if key_rows else 1.0
    w = torch.cat((w[:key_rows] / key_scale, w[key_rows:]))
    if method == "pca":
        basis = _principal_directions(w @ moment @ w.T)[:, :rank]
    elif method == "svd":
        with _one_thread():
            basis = torch.linalg.svd(w, full_matrices=False)[0][:, :rank]
    else:
        raise ValueError(f"`method`={method!r} is not one of ['pca', 'svd'].")
    return Factorisation(basis, key_scale)


def mla_config(config, kv_lora_rank: int, rope_dim: int, latent_norm: bool = False):
    """The MLA config of the converted model: latent R + rotary key D, per-head NoPE key and value of the
    source's head width, RoPE frequencies kept, no latent norm unless `latent_norm`."""
    fields = config.to_dict()
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
    fields.update(
        attention_type="mla", q_lora_rank=None, kv_lora_rank=kv_lora_rank, qk_nope_head_dim=config.head_dim,
        qk_rope_head_dim=rope_dim, v_head_dim=config.head_dim, kv_latent_norm=latent_norm,
        num_key_value_heads=config.num_attention_heads, partial_rotary_factor=1.0, rope_parameters=params,
        query_pre_attn_scalar=None,  # MLA's own scale (d_h + D)^-1/2; the source's is folded into the query
        head_dim=None,  # MLA's default: the latent width the cache holds per token (what vLLM sizes it by)
    )
    new = type(config).from_dict(fields)
    _check_positions(config, new)
    return new


def _check_positions(source, target) -> None:
    """The MLA's rotary tables turn its D/2 pairs at the source's D/2 highest frequencies with the same
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
    """One layer's MLA weights (float64) for the MLA config `target` from a standard attention, its key
    basis and input moment:
    `q_proj` (per head [q_h; rotary rows of its group's block · q_h]), `kv_a_proj_with_mqa` ([latent;
    rotary key]), `kv_b_proj` (per head [its group's NoPE key slice; its group's value]) and `o_proj`."""
    config = attention.config
    g, head, heads, rope = config.num_key_value_heads, config.head_dim, config.num_attention_heads, basis.rope_dim
    matrix = basis.matrix
    key = matrix @ attention.k_proj.weight.double()  # (n, d): rotated joint key
    kv = torch.cat((key[rope:], attention.v_proj.weight.double()))  # (2n - D, d): [K_nope; V]
    fac = factorise(kv, key.shape[0] - rope, moment, target.kv_lora_rank, method)
    nope = key.shape[0] - rope
    up_key = fac.key_scale * fac.basis[:nope]  # (n - D, R): K_nope ≈ up_key · c
    up_value = fac.basis[nope:]  # (n, R): V ≈ up_value · c
    latent = fac.basis.T @ torch.cat((kv[:nope] / fac.key_scale, kv[nope:]))  # (R, d)
    group = torch.arange(heads) // (heads // g)
    blocks = matrix.unflatten(1, (g, head))  # (n, g, d_h)
    q = attention.q_proj.weight.double().unflatten(0, (heads, head))  # (H, d_h, d)
    q_rope = torch.einsum("rhd,hde->hre", blocks[:rope, group], q)  # (H, D, d)
    w_uk = torch.einsum("nhd,nc->hdc", blocks[rope:, group], up_key)  # (H, d_h, R)
    w_uv = up_value.unflatten(0, (g, head))[group]  # (H, d_h, R)
    # the source's score scale, folded into the query (MLA scales by (d_h + D)^-1/2, DeepSeek's rule)
    scale = attention.scaling / mla_softmax_scale(target, config.layer_types[attention.layer_idx])
    weights = {
        "q_proj.weight": scale * torch.cat((q, q_rope), 1).flatten(0, 1),
        "kv_a_proj_with_mqa.weight": torch.cat((latent, key[:rope])),
        "kv_b_proj.weight": torch.cat((w_uk, w_uv), 1).flatten(0, 1),
        "o_proj.weight": attention.o_proj.weight.double(),
    }
    if attention.o_proj.bias is not None:
        weights["o_proj.bias"] = attention.o_proj.bias.double()
    if target.kv_latent_norm:  # approximately the identity: the latent's RMS over the calibration
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
    """A new `attention_type="mla"` model from a standard-attention one (TransMLA; see the module doc).

    Args:
        model: a `ModularDecoderForCausalLM` with standard attention (MHA / GQA / MQA) and RoPE.
        kv_lora_rank: the latent width R, at most 2·kv_heads·head_dim - rope_dim (full rank: exact up to
            the partial-RoPE step).
        rope_dim: the rotary key width D (even, at most the source's rotary width; default: that width).
        calibration_ids: (N, T) token ids whose activations choose the rotations and the latent basis.
        progress: show progress bars.
        moments: `attention_moments(model, calibration_ids)` computed already (then the ids are unused).
        method: `"pca"` (activation-aware, the default) or `"svd"` (of the weights; a baseline).
        latent_norm: keep DeepSeek's norm on the latent, its weight the latent's calibration RMS, so that it
            is the identity for a token of average norm: approximate even at full rank, but the result
            exports to transformers' DeepSeek-V3 and has the RMSNorm vLLM's MLA path looks for. Untrained it
            is far worse (SmolLM2 at rank 192: held-out perplexity 994 against 52 without the norm; the
            latent's RMS varies too much across tokens): a starting point for healing, not a result.
    Raises:
        ValueError: naming the option the method cannot honour exactly.
    """
    rope_dim = check_source(model.config, kv_lora_rank, rope_dim)
    config = mla_config(model.config, kv_lora_rank, rope_dim, latent_norm)
    if moments is None:
        moments = attention_moments(model, calibration_ids, progress=progress)
    with _one_thread():  # hundreds of small matrices: threads add only synchronisation (9x slower on two)
        bases = layer_bases(model, moments, rope_dim)
        state = _copied((name, t) for name, t in model.state_dict().items() if ".self_attn." not in name)
        layers = model.model.layers
        for i in _bar(range(len(layers)), progress, "to MLA"):
            weights = mla_attention_weights(layers[i].self_attn, bases[i], moments[i], config, method)
            dtype = layers[i].self_attn.q_proj.weight.dtype
            state.update({f"model.layers.{i}.self_attn.{name}": w.to(dtype) for name, w in weights.items()})
        config._attn_implementation = model.config._attn_implementation
        with no_init_weights():  # every parameter is assigned below; the empty ones are never touched
            out = ModularDecoderForCausalLM(config).to(device=model.device, dtype=model.dtype)
        out.load_state_dict(state, strict=True, assign=True)  # no second copy of the new weights
        if config.tie_word_embeddings:
            out.tie_weights()
    return out.eval()


def _copied(items) -> dict[str, torch.Tensor]:
    """Copies of `(name, tensor)` items that share storage where the source does (tied embeddings)."""
    copies = {}
    out = {}
    for name, tensor in items:
        key = (tensor.data_ptr(), tensor.shape, tensor.stride())
        if key not in copies:
            copies[key] = tensor.detach().clone()
        out[name] = copies[key]
    return out


__all__ = ["to_mla", "attention_moments", "rorope_rotations", "key_basis", "layer_bases", "rotated_model",
           "partial_rope_model", "factorise", "mla_config", "mla_attention_weights", "check_source",
           "RotatedKeyAttention", "KeyBasis"]
