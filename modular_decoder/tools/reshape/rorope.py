"""RoRoPE (TransMLA, Meng et al. 2025, https://arxiv.org/abs/2502.07864, steps 1-2): rotate the keys of the
g K/V heads so that one rotated head carries most of each RoPE frequency, then keep RoPE on that head only.

Stack the g K/V heads' keys into one joint key of width n = g·d_h. At RoPE frequency f, head j holds a pair
(x_jf, y_jf) which RoPE turns by the angle θ_f·t, the same for every head. So an orthogonal g×g matrix U_f
mixing the heads, applied alike to the x's and to the y's, commutes with RoPE:

    rotated pair a at frequency f = Σ_j U_f[j, a] · (x_jf, y_jf)

Giving every query the same rotation leaves every score unchanged (step 1, exact: `rotated_model`). U_f's
columns are the principal directions of E[x xᵀ + y yᵀ] across the heads, so rotated head 0 carries most of
each frequency's energy. Step 2 keeps RoPE on head 0's pairs at the D/2 highest frequencies only (MLA's
shared rotary key, D = `rope_dim`) and treats every other coordinate as NoPE: the one lossy step at full
rank (`partial_rope_model`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ...attention_layer import AttentionLayer
from ...eager_attention import eager_attention
from ...split_products import project
from .moments import attention_moments, principal_directions


@dataclass
class KeyBasis:
    """One layer's new coordinates of the joint key: `matrix` M (n, n), orthogonal, row i the i-th new
    coordinate in terms of the concatenated K/V heads' keys. Coordinates `rope_x[p]`, `rope_y[p]` form a
    pair RoPE turns at the source's frequency `rope_freq[p]`; every other coordinate is NoPE. With
    `rope_dim` = D, the first D rows are MLA's rotary key in the source's pair layout."""

    matrix: torch.Tensor  # (n, n)
    rope_x: torch.Tensor  # (P,)
    rope_y: torch.Tensor  # (P,)
    rope_freq: torch.Tensor  # (P,)
    rope_dim: int | None = None


def check_rope_source(config, rope_dim: int | None) -> int:
    """Refuse a source whose keys are not a RoPE'd linear function of the hidden state (nothing to rotate
    exactly); return the rotary key width D (default: the source's rotary width)."""
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
    if config.no_rope_layers is not None and not all(config.no_rope_layers):
        raise ValueError(f"`no_rope_layers`={config.no_rope_layers!r}: a NoPE layer has no rotary key to carry its "
                         "position into MLA's, and MLA has no NoPE layers.")
    if config.attention_sinks:
        raise ValueError("`attention_sinks=True`: this conversion's calibration and rotated reference do not "
                         "carry the sinks; convert a model without them.")
    rotary = config.rotary_dim
    rope_dim = rotary if rope_dim is None else rope_dim
    if isinstance(rope_dim, bool) or not isinstance(rope_dim, int) or rope_dim < 2 or rope_dim % 2:
        raise ValueError(f"`rope_dim` must be a positive even integer, got {rope_dim!r}.")
    if rope_dim > rotary:
        raise ValueError(f"`rope_dim`={rope_dim} exceeds the source's rotary width {rotary}: MLA's rotary key turns "
                         f"each pair at its own frequency, and the source has {rotary // 2} frequencies.")
    return rope_dim


def key_pair_index(config) -> torch.Tensor:
    """(g, r/2, 2): the joint-key coordinate of head j's x (0) / y (1) at frequency f."""
    g, head_dim, rotary = config.num_key_value_heads, config.head_dim, config.rotary_dim
    freq = torch.arange(rotary // 2)
    if config.rope_interleaved:  # adjacent pairs
        within_head = torch.stack((2 * freq, 2 * freq + 1), -1)  # (r/2, 2)
    else:  # halves
        within_head = torch.stack((freq, freq + rotary // 2), -1)  # (r/2, 2)
    return torch.arange(g)[:, None, None] * head_dim + within_head


def rorope_rotations(k_weight: torch.Tensor, moment: torch.Tensor, config) -> torch.Tensor:
    """U_f for every frequency: (r/2, g, g), columns the principal directions of E[x xᵀ + y yᵀ] across the
    g heads, by decreasing energy. `k_weight` (n, d) is the key projection, `moment` (d, d) E[h hᵀ] of its
    input h."""
    pair_rows = k_weight.double()[key_pair_index(config)]  # (g, r/2, 2, d)
    pair_rows = pair_rows.permute(1, 2, 0, 3)  # (f, p, j, d): W_k's row of head j's coordinate p at frequency f
    # energy[f, j, k] = Σ_p E[k_jfp k_kfp] = Σ_p w_jfp · E[h hᵀ] · w_kfp
    energy = torch.einsum("fpjd,fpkd->fjk", pair_rows @ moment, pair_rows)  # (r/2, g, g)
    return principal_directions(energy)


def key_basis(rotations: torch.Tensor, config, rope_dim: int | None) -> KeyBasis:
    """The joint key's new coordinates from the rotations U (r/2, g, g). `rope_dim=None`: every rotated pair
    keeps RoPE at its frequency (step 1, exact); `rope_dim=D`: only rotated head 0's pairs at frequencies
    0..D/2-1 do, laid out first as MLA's rotary key, the rest is NoPE (step 2)."""
    g, head_dim, rotary = config.num_key_value_heads, config.head_dim, config.rotary_dim
    half, n = rotary // 2, g * head_dim
    coordinate = torch.nn.functional.one_hot(key_pair_index(config), n).double()  # (j, f, p, n)
    rotated = torch.einsum("fja,jfpn->afpn", rotations, coordinate)  # (g, r/2, 2, n): pair a at frequency f
    # each head's dims past the rotary width carry no position: kept as they are
    nope_dims = (torch.arange(g)[:, None] * head_dim + torch.arange(rotary, head_dim)).flatten()
    unrotated = torch.eye(n, dtype=torch.float64)[nope_dims]  # (g·(d_h - r), n)
    if rope_dim is None:
        pair = torch.arange(g * half) * 2  # rotated rows in (a, f, p) order: x, y adjacent
        return KeyBasis(torch.cat((rotated.reshape(-1, n), unrotated)), pair, pair + 1, torch.arange(half).repeat(g))
    kept = rope_dim // 2
    rope_pairs = rotated[0, :kept]  # (D/2, 2, n): head 0 at the D/2 highest frequencies
    if config.rope_interleaved:
        rope_rows = rope_pairs.reshape(rope_dim, n)  # x0 y0 x1 y1 ...
        xs, ys = torch.arange(kept) * 2, torch.arange(kept) * 2 + 1
    else:
        rope_rows = rope_pairs.transpose(0, 1).reshape(rope_dim, n)  # x0 x1 ... y0 y1 ...
        xs, ys = torch.arange(kept), torch.arange(kept) + kept
    dropped = torch.ones(g, half, dtype=torch.bool)
    dropped[0, :kept] = False  # every other rotated pair loses RoPE
    matrix = torch.cat((rope_rows, rotated[dropped].reshape(-1, n), unrotated))
    return KeyBasis(matrix, xs, ys, torch.arange(kept), rope_dim)


def layer_bases(model, moments: list[torch.Tensor], rope_dim: int | None) -> list[KeyBasis]:
    """`key_basis` of every layer from its RoRoPE rotations."""
    bases = []
    for layer, moment in zip(model.model.layers, moments):
        rotations = rorope_rotations(layer.self_attn.k_proj.weight.detach(), moment, model.config)
        bases.append(key_basis(rotations, model.config, rope_dim))
    return bases


class RotatedKeyAttention(AttentionLayer):
    """Reference attention in the rotated coordinates, without a cache: every query head h scores the one
    n-wide key M k, with its query placed through its group's block of M, and RoPE turns `basis`'s pairs
    only. With every pair kept it rewrites the source (must equal it); with D kept it is the partial-RoPE
    model the MLA at full rank must equal. Shares the source's projections."""

    def __init__(self, source: nn.Module, basis: KeyBasis):
        super().__init__(source.config, source.layer_idx, scaling=source.scaling)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = source.q_proj, source.k_proj, source.v_proj, source.o_proj
        self.num_heads, self.head_dim = source.num_heads, source.head_dim
        self.groups = source.num_key_value_groups
        self.num_key_value_groups = 1  # one joint key, expanded over the heads
        self.register_buffer("matrix", basis.matrix.to(source.q_proj.weight.dtype), persistent=False)
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
        k = project(self.k_proj, hidden_states)  # (B, T, n)
        v = project(self.v_proj, hidden_states).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)  # (B, g, T, d_h)
        # q_hᵀ k_j(h) = (M_h q_h)ᵀ (M k), M_h the columns of M for head h's K/V head (M orthogonal)
        head_blocks = self.matrix.unflatten(1, (-1, self.head_dim)).repeat_interleave(self.groups, dim=1)  # (n, H, d_h)
        queries = torch.einsum("bthd,nhd->bhtn", q, head_blocks)  # (B, H, T, n)
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


def with_rotated_keys(model, bases: list[KeyBasis]):
    """A copy of `model` whose every attention is a `RotatedKeyAttention` over that layer's basis."""
    out = copy.deepcopy(model)
    for layer, basis in zip(out.model.layers, bases):
        layer.self_attn = RotatedKeyAttention(layer.self_attn, basis)
    return out


def rotated_model(model, calibration_ids=None, *, moments=None, progress: bool = False):
    """Step 1: the source with its keys RoRoPE-rotated and RoPE kept on every pair (equal to the source up
    to rounding). Runs with `use_cache=False`."""
    check_rope_source(model.config, None)
    moments = moments if moments is not None else attention_moments(model, calibration_ids, progress=progress)
    return with_rotated_keys(model, layer_bases(model, moments, None))


def partial_rope_model(model, rope_dim: int | None = None, calibration_ids=None, *, moments=None,
                       progress: bool = False):
    """Step 2: the rotated source with RoPE on rotated head 0's pairs at the `rope_dim`/2 highest frequencies
    only. Runs with `use_cache=False`."""
    rope_dim = check_rope_source(model.config, rope_dim)
    moments = moments if moments is not None else attention_moments(model, calibration_ids, progress=progress)
    return with_rotated_keys(model, layer_bases(model, moments, rope_dim))
