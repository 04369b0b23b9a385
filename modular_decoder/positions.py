"""Position encodings: learned and sinusoidal (added at the embedding), RoPE (rotates q and k,
through transformers' rope utilities) and ALiBi (a linear bias on the attention scores).

Each is computed once per forward in the base model and passed down to the layers.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update


class LearnedPositions(nn.Module):
    """A trained table of `max_position_embeddings` rows (+ `learned_position_offset`, OPT's 2)."""

    def __init__(self, config):
        super().__init__()
        self.offset = config.learned_position_offset
        self.max_positions = config.max_position_embeddings
        self.embed = nn.Embedding(config.max_position_embeddings + self.offset, config.hidden_size)

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(position_ids + self.offset)


class SinusoidalPositions(nn.Module):
    """Vaswani et al.'s fixed encoding: sin on even features, cos on odd ones; no length limit."""

    def __init__(self, config):
        super().__init__()
        dim = config.hidden_size
        inv_freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float) * (-math.log(10000.0) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.dim = dim

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        angles = position_ids[..., None].float() * self.inv_freq.to(position_ids.device)  # (B, T, d/2)
        table = torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)  # (B, T, d) interleaved
        return table[..., : self.dim]


ABSOLUTE_POSITIONS: dict[str, type[nn.Module]] = {"learned": LearnedPositions, "sinusoidal": SinusoidalPositions}


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every layer type, from transformers' `ROPE_INIT_FUNCTIONS`.

    A flat `rope_parameters` dict gives one table for all layers; a dict nested by layer type gives
    each type its own (Gemma 3's local base). The attribute names follow what transformers'
    `dynamic_rope_update` expects, so dynamic and longrope scaling work unchanged.
    """

    def __init__(self, config):
        super().__init__()
        # transformers' init functions read `head_dim`; MLA rotates only its d_R-wide key, so they
        # see a copy whose head is exactly the rotated width.
        rope_config = copy.copy(config)
        if config.attention_type == "mla":
            rope_config.head_dim = config.qk_rope_head_dim
        self.config = rope_config
        self.max_seq_len_cached = self.original_max_seq_len = config.max_position_embeddings
        self.interleaved = config.rope_interleaved
        self.nested = config.rope_is_nested
        if self.nested:
            self.rope_type = {}
            for layer_type in sorted(set(config.layer_types)):
                params = config.rope_parameters[layer_type]
                self.rope_type[layer_type] = params["rope_type"]
                inv_freq, scaling = self._init_fn(params["rope_type"])(rope_config, None, layer_type=layer_type)
                self.register_buffer(f"{layer_type}_inv_freq", inv_freq, persistent=False)
                self.register_buffer(f"{layer_type}_original_inv_freq", inv_freq.clone(), persistent=False)
                setattr(self, f"{layer_type}_attention_scaling", scaling)
        else:
            self.rope_type = config.rope_parameters["rope_type"]
            inv_freq, self.attention_scaling = self._init_fn(self.rope_type)(rope_config, None)
            self.register_buffer("inv_freq", inv_freq, persistent=False)
            self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

    def _init_fn(self, rope_type: str):
        return default_rope_parameters if rope_type == "default" else ROPE_INIT_FUNCTIONS[rope_type]

    @torch.no_grad()
    @dynamic_rope_update
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None = None):
        prefix = f"{layer_type}_" if layer_type is not None else ""
        inv_freq = getattr(self, f"{prefix}inv_freq")
        scaling = getattr(self, f"{prefix}attention_scaling")
        freqs = position_ids[..., None].float() * inv_freq.to(x.device)  # (B, T, rot/2)
        # Layout matches `apply_rotary`: pairs (2i, 2i+1) when interleaved, halves otherwise.
        emb = freqs.repeat_interleave(2, dim=-1) if self.interleaved else torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * scaling).to(x.dtype), (emb.sin() * scaling).to(x.dtype)

    def tables(self, x: torch.Tensor, position_ids: torch.Tensor, layer_types: list[str]) -> dict:
        """{layer_type: (cos, sin)} for the layer types present, each (B, 1, T, rot): shaped once per
        forward to broadcast over heads, not once per layer."""
        def for_heads(cos_sin):
            return tuple(table.unsqueeze(1) for table in cos_sin)

        if not self.nested:
            shared = for_heads(self(x, position_ids))
            return {layer_type: shared for layer_type in set(layer_types)}
        return {layer_type: for_heads(self(x, position_ids, layer_type)) for layer_type in set(layer_types)}


def default_rope_parameters(config, device=None, layer_type: str | None = None, **kwargs):
    """Plain RoPE: inv_freq_i = theta^(-2i/rot) over the rotated width (transformers has no
    shared function for the default type; each model defines this one)."""
    params = config.rope_parameters[layer_type] if layer_type is not None else config.rope_parameters
    rot = int(config.head_dim * params.get("partial_rotary_factor", 1.0))
    inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, rot, 2, dtype=torch.int64).float() / rot))
    return inv_freq.to(device), 1.0


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate the first `cos.shape[-1]` features of each head of `x` (B, H, T, D); pass the rest.

    `cos`/`sin` are (B, 1, T, rot), as `RotaryEmbedding.tables` shapes them. The half layout pairs
    feature i with i + rot/2 (GPT-NeoX, Llama); the interleaved layout pairs 2i with 2i+1 (GPT-J).
    """
    rot = cos.shape[-1]
    rotate = _rotate_pairs if interleaved else _rotate_half
    if rot == x.shape[-1]:
        return x * cos + rotate(x) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat((x_rot * cos + rotate(x_rot) * sin, x_pass), dim=-1)


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """Press et al.'s head slopes: a geometric sequence from 2^(-8/n), with the interleaved extension
    for head counts that are not powers of two (as BLOOM and the paper's code do)."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2.0 ** (-(2.0 ** -(math.log2(closest) - 3)))
    slopes = [base ** (i + 1) for i in range(closest)]
    if closest != num_heads:
        extra_base = 2.0 ** (-(2.0 ** -(math.log2(2 * closest) - 3)))
        slopes += [extra_base ** (2 * i + 1) for i in range(num_heads - closest)]
    return torch.tensor(slopes, dtype=torch.float32)


class AlibiBias(nn.Module):
    """Bias[h, i, j] = -slope_h · (i - j): a per-head linear penalty on query-key distance."""

    def __init__(self, config):
        super().__init__()
        self.register_buffer("slopes", alibi_slopes(config.num_attention_heads), persistent=False)

    def forward(self, query_positions: torch.Tensor, key_positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        distance = (key_positions[None, :] - query_positions[:, None]).float()  # (T_q, T_k), <= 0 for the past
        bias = self.slopes.to(distance.device)[:, None, None] * distance  # (H, T_q, T_k)
        return bias.unsqueeze(0).to(dtype)  # (1, H, T_q, T_k)
