"""The shape of each layer's standard attention where it differs by layer type (Gemma 4), and how its keys and
values are made (Gemma 3n, Gemma 4).

- `global_head_dim`, `num_global_key_value_heads`: the full-attention layers' head width and K/V heads (their own
  RoPE table is built at that width); the other layers keep `head_dim` and `num_key_value_heads`.
- `attention_k_eq_v`: the full-attention layers have no `v_proj`; their values are the key projection's output,
  taken before the key norm and the rotation.
- `value_norm`: an RMS norm without weight over each value head.

`AttentionShapeFields` holds the fields; the standard attention kind owns their rules (`attention.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .kinds import require_bool, require_int

GLOBAL_LAYER = "full_attention"  # the layer type whose shape the `global` fields set (Gemma 4's global layers)
SHAPE_FIELDS = ("global_head_dim", "num_global_key_value_heads", "attention_k_eq_v", "value_norm")


@dataclass(kw_only=True)
class AttentionShapeFields:
    """Args:
        global_head_dim (`int`, *optional*): Head width of the `"full_attention"` layers' queries, keys and values
            (Gemma 4's field); their RoPE table has this width. `None`: `head_dim`.
        num_global_key_value_heads (`int`, *optional*): K/V heads of the `"full_attention"` layers (Gemma 4's field).
            `None`: `num_key_value_heads`.
        attention_k_eq_v (`bool`): The `"full_attention"` layers have no `v_proj`: their values are the key
            projection's output, before the key norm and rotation (Gemma 4's field).
        value_norm (`bool`): An RMS norm without weight over each value head (Gemma 3n and Gemma 4 norm their values
            so; eps `norm_eps`).
    """

    global_head_dim: int | None = None
    num_global_key_value_heads: int | None = None
    attention_k_eq_v: bool = False
    value_norm: bool = False


def layer_head_dim(config, layer_type: str) -> int:
    """The head width of a layer of `layer_type`."""
    if layer_type == GLOBAL_LAYER and config.global_head_dim is not None:
        return config.global_head_dim
    return config.head_dim


def layer_kv_heads(config, layer_type: str) -> int:
    """The K/V heads of a layer of `layer_type`."""
    if layer_type == GLOBAL_LAYER and config.num_global_key_value_heads is not None:
        return config.num_global_key_value_heads
    return config.num_key_value_heads


def keys_are_values(config, layer_type: str) -> bool:
    """Whether a layer of `layer_type` takes its values from its key projection (`attention_k_eq_v`)."""
    return config.attention_k_eq_v and layer_type == GLOBAL_LAYER


def shapes_vary(config) -> bool:
    """Whether some layer's heads differ from `head_dim` x `num_key_value_heads`."""
    return any((layer_head_dim(config, t), layer_kv_heads(config, t)) != (config.head_dim, config.num_key_value_heads)
               for t in config.layer_types)


def validate_shapes(config) -> None:
    """The fields' types; the global heads dividing the query heads; a full-attention layer for them to shape."""
    require_int("global_head_dim", config.global_head_dim, minimum=1, optional=True)
    require_int("num_global_key_value_heads", config.num_global_key_value_heads, minimum=1, optional=True)
    require_bool("attention_k_eq_v", config.attention_k_eq_v)
    require_bool("value_norm", config.value_norm)
    heads = config.num_attention_heads
    if config.num_global_key_value_heads is not None and heads % config.num_global_key_value_heads:
        raise ValueError(f"`num_attention_heads`={heads} must be a multiple of `num_global_key_value_heads`="
                         f"{config.num_global_key_value_heads}.")
    used = [name for name in ("global_head_dim", "num_global_key_value_heads", "attention_k_eq_v")
            if getattr(config, name) not in (None, False)]
    if used and GLOBAL_LAYER not in config.layer_types:
        raise ValueError(f"`{used[0]}` shapes the 'full_attention' layers, and `layer_types` has none.")
    if config.uses_rope and config.global_head_dim not in (None, config.head_dim) and not config.rope_is_nested:
        raise ValueError(f"`global_head_dim`={config.global_head_dim} gives the 'full_attention' layers a RoPE table of "
                         "their own width: nest `rope_parameters` by layer type.")


__all__ = ["AttentionShapeFields", "SHAPE_FIELDS", "keys_are_values", "layer_head_dim", "layer_kv_heads",
           "shapes_vary", "validate_shapes"]
