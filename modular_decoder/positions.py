"""Position encodings: learned and sinusoidal (added at the embedding), RoPE (rotates q and k,
through transformers' rope utilities) and ALiBi (a linear bias on the attention scores).

Each is computed once per forward in the base model and passed down to the layers.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, RotaryEmbeddingConfigMixin, dynamic_rope_update

from .compat import rope_validation_view
from .kinds import Kind, Registry, attention_layer_type, require_bool, require_int, require_number, require_per_layer
from .split_products import is_fx_proxy


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
        # transformers' init functions read `head_dim`; an attention kind may rotate another width
        # (MLA: its d_R-wide key), so they see a copy whose head is the kind's `rope_head_dim`.
        rope_config = copy.copy(config)
        rope_config.head_dim = config.rope_head_dim
        self.config = rope_config
        self.max_seq_len_cached = self.original_max_seq_len = config.max_position_embeddings
        self.interleaved = config.rope_interleaved
        self.nested = config.rope_is_nested
        if self.nested:
            self.rope_type, self.table_of, tables = {}, {}, {}
            for layer_type in sorted(attending_layer_types(config.layer_types)):
                params = config.rope_parameters[layer_type]
                self.rope_type[layer_type] = params["rope_type"]
                type_config = copy.copy(rope_config)  # a layer type may have its own head width (Gemma 4's global)
                type_config.head_dim = config.attention_kind.rope_head_dim(config, layer_type)
                # layer types of equal parameters and width read one table, computed once a forward
                self.table_of[layer_type] = tables.setdefault(repr((sorted(params.items()), type_config.head_dim)),
                                                              layer_type)
                inv_freq, scaling = self._init_fn(params["rope_type"])(type_config, None, layer_type=layer_type)
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
        cos, sin = emb.cos(), emb.sin()
        if not isinstance(scaling, float) or scaling != 1.0:
            cos, sin = cos * scaling, sin * scaling
        return (cos, sin) if cos.dtype is x.dtype else (cos.to(x.dtype), sin.to(x.dtype))

    def tables(self, x: torch.Tensor, position_ids: torch.Tensor, layer_types: list[str]) -> dict:
        """{layer_type: (cos, sin)} for the layer types present, each (B, 1, T, rot): shaped once per
        forward to broadcast over heads, not once per layer."""
        def for_heads(cos_sin):
            return tuple(table.unsqueeze(1) for table in cos_sin)

        attending = attending_layer_types(layer_types)
        if not self.nested:
            shared = for_heads(self(x, position_ids))
            return {layer_type: shared for layer_type in attending}
        computed = {t: for_heads(self(x, position_ids, t)) for t in {self.table_of[t] for t in attending}}
        return {layer_type: computed[self.table_of[layer_type]] for layer_type in attending}


def longrope_switch_length(config) -> int | None:
    """The length past which LongRoPE's tables switch from the short factors to the long ones (its
    `original_max_position_embeddings`; the shortest where several layer types use it), None without LongRoPE."""
    if not config.uses_rope:
        return None
    tables = config.rope_parameters.values() if config.rope_is_nested else [config.rope_parameters]
    lengths = [t.get("original_max_position_embeddings", config.max_position_embeddings)
               for t in tables if t.get("rope_type") == "longrope"]
    return min(lengths) if lengths else None


def keys_rotated_before_the_switch(config, length: int, cache) -> bool:
    """Whether a generate step of `length` tokens crosses LongRoPE's switch with keys cached from before it: those
    were rotated with the short factors, which no longer apply, so the whole text is run again without the cache
    (once, at the crossing), as transformers' `Phi3ForCausalLM` does."""
    switch = longrope_switch_length(config)
    return bool(switch is not None and cache is not None and length > switch and cache.get_seq_length() <= switch)


def attending_layer_types(layer_types) -> set[str]:
    """The layer types present that attend, and so read positions (not `"linear_attention"`; a hybrid layer's
    attention)."""
    return {attention_layer_type(t) for t in set(layer_types)} - {None}


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


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
                 trailing: bool = False) -> torch.Tensor:
    """Rotate the first `cos.shape[-1]` features of each head of `x` (B, H, T, D) (the last ones with `trailing`,
    DeepSeek-V4's [content | rotary] head); pass the rest.

    `cos`/`sin` are (B, 1, T, rot), as `RotaryEmbedding.tables` shapes them. The half layout pairs
    feature i with i + rot/2 (GPT-NeoX, Llama); the interleaved layout pairs 2i with 2i+1 (GPT-J).
    """
    rot = cos.shape[-1]
    rotate = _rotate_pairs if interleaved else _rotate_half
    if not is_fx_proxy(x) and rot == x.shape[-1]:  # (a traced proxy has no shape to branch on: general form)
        return x * cos + rotate(x) * sin
    if trailing:
        x_pass, x_rot = x[..., :-rot], x[..., -rot:]
        return torch.cat((x_pass, x_rot * cos + rotate(x_rot) * sin), dim=-1)
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
    """Bias[h, i, j] = -slope_h · (i + T_k - T_q - j): a per-head linear penalty on query-key distance,
    with the T_q queries at the last T_q key positions (bottom-right, as the flash kernel aligns them).

    Only distances within a query's row matter (softmax ignores a constant per row), so this holds
    for every cache that keeps keys in position order ending at the newest token.
    """

    def __init__(self, config):
        super().__init__()
        self.register_buffer("slopes", alibi_slopes(config.num_attention_heads), persistent=False)

    def forward(self, q_len: int, kv_len: int, dtype: torch.dtype) -> torch.Tensor:
        device = self.slopes.device
        query = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
        distance = (torch.arange(kv_len, device=device)[None, :] - query).float()  # (T_q, T_k), <= 0 for the past
        bias = self.slopes[:, None, None] * distance  # (H, T_q, T_k)
        return bias.unsqueeze(0).to(dtype)  # (1, H, T_q, T_k)


# ---------------------------------------------------------------------------------------------
# `position_embedding_type` entries


class PositionKind(Kind):
    """A value of `position_embedding_type`: where position enters and the fields it reads."""

    def __init__(self, name: str, fields: tuple[str, ...] = (), validate=None, reads: tuple[str, ...] = ()):
        self.name, self.fields, self.reads = name, fields, reads
        if validate is not None:
            self.validate = validate


def _validate_learned(config) -> None:
    require_int("learned_position_offset", config.learned_position_offset, minimum=0)


def _validate_rope(config) -> None:
    """Every RoPE dict (flat, or one per layer type) names a known `rope_type` with the keys
    transformers needs for it, finite values, and a rotary width the type can use; `no_rope_layers`
    one 0 / 1 per layer."""
    require_number("partial_rotary_factor", config.partial_rotary_factor, above=0, at_most=1)
    require_bool("rope_interleaved", config.rope_interleaved)
    validate_no_rope_layers(config)
    params = config.rope_parameters
    if not isinstance(params, dict) or not params:
        raise ValueError(f"`rope_parameters` must be a dict with a `rope_type`, got {params!r}.")
    if config.rope_is_nested:
        missing = sorted(attending_layer_types(config.layer_types) - set(params))
        if missing:
            raise ValueError(f"`rope_parameters` is nested per layer type but lacks {missing}.")
        per_type = {f"rope_parameters[{key!r}]": value for key, value in params.items()}
    else:
        per_type = {"rope_parameters": params}
    rotary = config.rotary_dim
    if rotary <= 0 or rotary % 2:
        head = config.attention_kind.describe_rope_head_dim(config)
        raise ValueError(
            f"The rotary width, {head} x `partial_rotary_factor`={config.partial_rotary_factor} = {rotary}, must "
            "be a positive even number (RoPE rotates pairs): set an even `head_dim`, or change `hidden_size`, "
            "`num_attention_heads` or `partial_rotary_factor`."
        )
    for where, one in per_type.items():
        _validate_rope_dict(config, where, one, rotary)
    try:  # the keys transformers' own validation requires for each rope type
        transformers_rope_check(config)
    except KeyError as error:
        raise ValueError(f"`rope_parameters` is incomplete: {error.args[0]}") from None


def validate_no_rope_layers(config) -> None:
    """`None` (every layer rotates) or transformers' SmolLM3 list: 1 for a RoPE layer, 0 for a NoPE one, per layer."""
    flags = config.no_rope_layers
    if flags is None:
        return
    require_per_layer("no_rope_layers", flags, config, "one 1 (RoPE) or 0 (NoPE)")
    for flag in flags:
        if isinstance(flag, bool) or flag not in (0, 1):
            raise ValueError(f"`no_rope_layers` holds 1 (the layer rotates) or 0 (NoPE) per layer, got {flag!r}.")
    if not any(flag for flag, layer_type in zip(flags, config.layer_types) if attention_layer_type(layer_type)):
        raise ValueError("`no_rope_layers` marks every attention layer NoPE (0): no layer rotates, which is "
                         "`position_embedding_type='none'`.")


def rotary_layers(config) -> list[bool]:
    """Whether each layer rotates its queries and keys: every layer with RoPE, less the NoPE layers of
    `no_rope_layers`; none without RoPE."""
    if not config.uses_rope:
        return [False] * config.num_hidden_layers
    if config.no_rope_layers is None:
        return [True] * config.num_hidden_layers
    return [bool(flag) for flag in config.no_rope_layers]


ROPE_TYPES = ("default", *sorted(ROPE_INIT_FUNCTIONS))


def transformers_rope_check(config) -> None:
    """Check `rope_parameters` with transformers' own RoPE validation.

    `validate_rope` (the keys each rope type needs), on a view of
    `config` whose `head_dim` is the attention kind's RoPE head, as `RotaryEmbedding` builds its tables
    (MLA rotates `qk_rope_head_dim`; its unused `head_dim` may be odd)."""
    view = copy.copy(config)
    view.head_dim = config.rope_head_dim
    rope_validation_view(view)
    RotaryEmbeddingConfigMixin.validate_rope(view)


def require_rope_dicts(params, layer_types) -> None:
    """`rope_parameters` as given, before transformers standardises it (which assumes dicts and fails
    with an AttributeError / TypeError on anything else): `None`, one dict, or a dict nested by layer type."""
    if params is None:
        return
    if not isinstance(params, dict):
        raise ValueError(f"`rope_parameters` must be a dict with a `rope_type` (or one such dict per layer type "
                         f"{list(layer_types)}), got {params!r}.")
    for key, value in params.items():
        if key in layer_types and not isinstance(value, dict):
            raise ValueError(f"`rope_parameters[{key!r}]` must be a dict with a `rope_type`, got {value!r}.")


def _validate_rope_dict(config, where: str, params, rotary: int) -> None:
    if not isinstance(params, dict):
        raise ValueError(f"`{where}` must be a dict with a `rope_type`, got {params!r}.")
    rope_type = params.get("rope_type")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"`{where}['rope_type']`={rope_type!r} is not one of the allowed values {list(ROPE_TYPES)}.")
    if "rope_theta" not in params:
        raise ValueError(f"`{where}` needs `rope_theta`.")
    factor = params.get("partial_rotary_factor", config.partial_rotary_factor)
    if factor != config.partial_rotary_factor and rope_type != "proportional":  # (its own: a whole-head table)
        raise ValueError(f"`{where}['partial_rotary_factor']`={factor} differs from `partial_rotary_factor`="
                         f"{config.partial_rotary_factor}; set one value.")
    for key, value in params.items():
        if key in ("rope_type", "type"):
            continue
        if isinstance(value, (list, tuple)):
            for item in value:
                require_number(f"{where}['{key}'][...]", item)
            if key in ("short_factor", "long_factor") and len(value) != rotary // 2:
                raise ValueError(f"`{where}['{key}']` needs one entry per rotated pair ({rotary // 2}), got {len(value)}.")
        elif value is not None and not isinstance(value, bool):
            require_number(f"{where}['{key}']", value)
    require_number(f"{where}['rope_theta']", params["rope_theta"], above=0)
    if params.get("factor") is not None:
        require_number(f"{where}['factor']", params["factor"], above=0)
    if rope_type == "dynamic" and rotary <= 2:
        raise ValueError(f"`{where}` rope_type='dynamic' needs a rotary width above 2 (its base rescaling divides by "
                         f"width - 2), got {rotary}.")


POSITIONS: Registry[PositionKind] = Registry("position_embedding_type", [
    PositionKind("learned", ("learned_position_offset",), _validate_learned),
    PositionKind("sinusoidal"),
    PositionKind("rope", ("partial_rotary_factor", "rope_interleaved", "no_rope_layers"), _validate_rope,
                 reads=("rope_parameters",)),
    PositionKind("alibi"),
    PositionKind("none"),
])
