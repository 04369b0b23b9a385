"""Registries of variants: every config field that picks a variant names an entry of one registry,
and the entry owns that variant's rules.

A registry maps the field's values to entries; its keys are the values the config allows, so
registering an entry is all a new variant needs (`register_attention`, `register_mlp`). An entry
declares the config fields only it reads (`fields`): under any other entry they must keep their
defaults, so a setting that would be ignored is refused instead. Each entry's `validate(config)`
checks its own fields and combinations with a `ValueError` that names the field.

The attention and feed-forward entries carry what the rest of the model asks of a kind (its
module, rotary width, backend features, cache layers, parameter and cache arithmetic), so no
other module tests `config.attention_type == ...`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Generic, TypeVar

from torch import nn

Entry = TypeVar("Entry")


def field_default(config, name: str) -> Any:
    """The dataclass default of config field `name` (`config` an instance or the class)."""
    for field in dataclasses.fields(config if isinstance(config, type) else type(config)):
        if field.name == name:
            return field.default
    raise KeyError(name)


class Registry(dict, Generic[Entry]):
    """`value of config.<field>` -> entry. `of(config)` is the chosen entry; `check(config)` validates
    the choice, the chosen entry's own rules, and that no other entry's fields were set."""

    def __init__(self, field: str, entries=()):
        super().__init__((entry.name, entry) for entry in entries)
        self.field = field

    def register(self, entry: Entry, replace: bool = False) -> Entry:
        if entry.name in self and not replace:
            raise ValueError(f"{self.field}={entry.name!r} is registered already; pass replace=True to replace it.")
        self[entry.name] = entry
        return entry

    def of(self, config) -> Entry:
        value = getattr(config, self.field)
        require_choice(self.field, value, self)
        return self[value]

    def complete(self, config) -> None:
        """Fill derived defaults: the chosen entry's own (`Kind.complete`), and the value each other entry's
        fields take when that entry is not chosen (`Kind.unused_values`) where they were left unset."""
        value = getattr(config, self.field)
        if not (isinstance(value, str) and value in self):
            return  # `check` names the bad value
        chosen = self[value]
        chosen.complete(config)
        for name, unused in self._unused_values(chosen).items():
            if unused is not _DEFAULT and getattr(config, name) == field_default(config, name):
                setattr(config, name, unused)

    def forget_formerly_written(self, config_class, config_dict: dict) -> None:
        """Drop from a saved config's dict the unread values earlier versions wrote, so their folders load.

        Earlier versions wrote into every config.json fields the chosen entry does not read. Only saved files are read
        this way: a config built with such a value is refused by `check` like any other setting nothing reads."""
        value = config_dict.get(self.field, field_default(config_class, self.field))
        if not (isinstance(value, str) and value in self):
            return
        for name in self._unused_values(self[value]):
            written = tuple(v for e in self.values() for v in getattr(e, "formerly_written", {}).get(name, ()))
            if name in config_dict and config_dict[name] in written:
                del config_dict[name]

    def _unused_values(self, chosen) -> dict[str, Any]:
        """Field -> the one value it may hold under `chosen`, for the fields only other entries read."""
        values = {}
        for entry in self.values():
            if entry is chosen:
                continue
            for name in getattr(entry, "fields", ()):
                if name not in getattr(chosen, "fields", ()):
                    values[name] = getattr(entry, "unused_values", {}).get(name, _DEFAULT)
        return values

    def check(self, config) -> None:
        chosen = self.of(config)
        for name, unused in self._unused_values(chosen).items():
            expected = field_default(config, name) if unused is _DEFAULT else unused
            value = getattr(config, name)
            if value != expected:
                owners = " or ".join(f"`{self.field}={e.name!r}`" for e in self.values()
                                     if e is not chosen and name in getattr(e, "fields", ()))  # (MLA's: mla or dsa)
                raise ValueError(
                    f"`{name}`={value!r} only applies to {owners}; with "
                    f"`{self.field}={chosen.name!r}` leave it at {expected!r}."
                )
        chosen.validate(config)


_DEFAULT = object()  # "the field's dataclass default"


class Kind:
    """Base of a registry entry: a name, the fields only it reads, and its validation."""

    name: str = ""
    fields: tuple[str, ...] = ()
    # The value some of `fields` hold when another kind is chosen, where it is not their default (a field
    # whose default means "this kind picks it" can still read as "off" to code outside the model).
    unused_values: dict[str, Any] = {}
    # Fields outside `fields` that this kind reads and some other kind of its axis does not (MLA's latent heads
    # have no `head_dim`): the contract table shows a field only where the chosen kinds read it.
    reads: tuple[str, ...] = ()
    # Values that earlier versions saved for some of `fields` in every config.json, the kind chosen or not:
    # where another kind is chosen, a saved file's value is dropped (`Registry.forget_formerly_written`).
    formerly_written: dict[str, tuple] = {}

    def complete(self, config) -> None:
        """Fill the defaults of this kind's own fields that derive from other fields (before validation)."""

    def reads_for(self, config) -> tuple[str, ...]:
        """Those of `reads` that `config` makes this kind read (all of them unless a kind says otherwise)."""
        return self.reads

    def validate(self, config) -> None:
        """Raise `ValueError` naming the field when `config` is not a valid use of this kind."""


class AttentionKind(Kind):
    """A value of `attention_type`: the module every layer builds and what the model needs of it."""

    module: type[nn.Module]
    module_name = "self_attn"  # the block attribute that holds it
    reads = ("head_dim", "num_key_value_heads")  # per-head queries, keys and values
    # `ModularDecoderCache` implementations this kind stores (see `cache_layer`)
    cache_implementations: tuple[str, ...] = ("dynamic", "static")
    # the attending values of `layer_types` its layers may take
    layer_types: tuple[str, ...] = ("full_attention", "sliding_attention", "chunked_attention")

    def build(self, config, layer_idx: int) -> nn.Module:
        """The attention of layer `layer_idx`."""
        return self.module(config, layer_idx)

    def default_head_dim(self, config) -> int | None:
        """`head_dim` where the config leaves it unset (`None`: hidden_size / num_attention_heads)."""
        return None

    def rope_head_dim(self, config, layer_type: str | None = None) -> int:
        """The head width RoPE sees (transformers' init functions apply `partial_rotary_factor` to it); with
        `layer_type`, that of a layer of that type (its own RoPE table)."""
        raise NotImplementedError

    def rotary_dim(self, config) -> int:
        """The rotated width of each q/k head."""
        return int(self.rope_head_dim(config) * config.partial_rotary_factor)

    def describe_rope_head_dim(self, config) -> str:
        """The fields that set `rope_head_dim`, for errors: `head_dim`, and the sizes it defaults from."""
        head_dim = config.head_dim
        if head_dim * config.num_attention_heads == config.hidden_size:
            return (f"`head_dim`={head_dim} (`hidden_size`={config.hidden_size} / "
                    f"`num_attention_heads`={config.num_attention_heads})")
        return f"`head_dim`={head_dim}"

    def backend_features(self, config) -> set[str]:
        """Features of `backend_features.FEATURE_FIELDS` a backend needs to run this kind."""
        return set()

    def cache_layer(self, config, layer_type: str, implementation: str, max_cache_len: int | None):
        """The cache layer (transformers' `CacheLayerMixin`) a layer of `layer_type` stores."""
        raise NotImplementedError

    def parameters(self, config) -> int:
        """Parameters of one layer's attention, from the config alone."""
        raise NotImplementedError

    def bytes_per_token(self, config, element_bytes: int, quantization: str | None = None) -> int:
        """Bytes one layer caches per token (`quantization="int8"` where the kind supports it)."""
        raise NotImplementedError

    def layer_parameters(self, config, layer_idx: int) -> int:
        """Parameters of layer `layer_idx`'s attention, where a kind's layers differ (`parameters` otherwise)."""
        return self.parameters(config)

    def layer_bytes_per_token(self, config, element_bytes: int, quantization: str | None, layer_idx: int) -> int:
        """Bytes layer `layer_idx` caches per token, where a kind's layers differ (`bytes_per_token` otherwise)."""
        return self.bytes_per_token(config, element_bytes, quantization)

    def cached_bytes(self, config, layer_idx: int, layer_type: str, kept_tokens: int, context: int,
                     element_bytes: int, quantization: str | None = None) -> int:
        """One sequence's bytes in layer `layer_idx` (of `layer_type`) after `context` tokens, of which its window
        keeps `kept_tokens` (`contract.cached_tokens`): `layer_bytes_per_token` for each (a kind that keeps more
        than its tokens' keys, e.g. compressed entries, counts them here)."""
        return self.layer_bytes_per_token(config, element_bytes, quantization, layer_idx) * kept_tokens

    def rollback_error(self, config) -> str | None:
        """Why this config's cache cannot be rolled back to an earlier token (assisted decoding refused), or None."""
        return None

    def describe(self, config) -> str:
        """A short tag for cards and tables (`mha`, `gqa`, `mqa`, `mla`, ...)."""
        return self.name

    def fp32_modules(self, config) -> tuple[str, ...]:
        """Name patterns of modules that stay fp32 when the model loads in fp16 (transformers'
        `_keep_in_fp32_modules`; bf16 loads them in bf16)."""
        return ()

    def tp_plan(self, config) -> dict[str, str]:
        """transformers tensor-parallel styles of the attention's modules, keyed by their names in a block
        (`"self_attn.q_proj"`); the config prefixes them with `layers.*.`."""
        return {}


class Feature(Kind):
    """A mechanism a config switches on through its own fields rather than by choosing among alternatives
    (chunked attention: `attention_chunk_size`). Its `validate` checks its fields wherever it is off too (they
    must then keep their defaults), and `in_use` says whether the config uses it (the contract table shows its
    fields only then, except `switch`, the field that turns it on where setting that alone is allowed)."""

    switch: str | None = None

    def in_use(self, config) -> bool:
        raise NotImplementedError


class FeatureSet(tuple):
    """The `Feature`s a config may switch on; the config completes and checks each, as it does a registry's
    chosen entry."""

    def complete(self, config) -> None:
        for feature in self:
            feature.complete(config)

    def check(self, config) -> None:
        for feature in self:
            feature.validate(config)

    def forget_formerly_written(self, config_class, config_dict: dict) -> None:
        """Nothing: no release wrote these fields into every config.json."""


def require_unset_unless(config, used: bool, fields, why: str) -> None:
    """Raise `ValueError` naming the first of `fields` that differs from its default while `used` is false: a
    setting nothing would read (`why` says what reads it)."""
    if used:
        return
    for name in fields:
        value = getattr(config, name)
        if value != field_default(config, name):
            raise ValueError(f"`{name}`={value!r} only applies {why}; leave it unset.")


LINEAR_ATTENTION = "linear_attention"  # the `layer_types` value of a linear-attention layer (transformers' own)
# A layer whose attention and linear-attention mixers run in parallel on the same input, their outputs summed
# (transformers' own value, Falcon-H1's and Zamba 2's layers): the layer types of its mixers
HYBRID = "hybrid"
MIXERS_OF_LAYER_TYPE = {HYBRID: ("full_attention", LINEAR_ATTENTION)}


def mixer_layer_types(layer_type: str) -> tuple[str, ...]:
    """The layer types of the mixers a layer of `layer_type` runs: its own, or a hybrid layer's two."""
    return MIXERS_OF_LAYER_TYPE.get(layer_type, (layer_type,))


def attention_layer_type(layer_type: str) -> str | None:
    """The attending mixer's layer type in a layer of `layer_type` (its mask and positions), or `None`."""
    return next((t for t in mixer_layer_types(layer_type) if t != LINEAR_ATTENTION), None)


class LinearAttentionKind(Kind):
    """A value of `linear_attention_type`: the module its layers build, their cache layer and arithmetic.

    The `"linear_attention"` layers of `layer_types` build the module (as `linear_attn`, transformers' name). Its
    fields apply only where some layer
    is a linear-attention layer; elsewhere they keep their defaults (`validate` refuses a setting nothing reads)."""

    module: type[nn.Module]
    module_name = "linear_attn"

    def in_use(self, config) -> bool:
        """Whether any layer of `config` runs a linear-attention mixer (alone, or in a hybrid layer)."""
        return isinstance(config.layer_types, list) and any(
            LINEAR_ATTENTION in mixer_layer_types(t) for t in config.layer_types if isinstance(t, str))

    def build(self, config, layer_idx: int) -> nn.Module:
        return self.module(config, layer_idx)

    def validate(self, config) -> None:
        if self.in_use(config):
            return
        for name in self.fields:
            if getattr(config, name) != field_default(config, name):
                raise ValueError(f"`{name}`={getattr(config, name)!r} only applies to layers of type "
                                 f"'{LINEAR_ATTENTION}' or '{HYBRID}', and `layer_types` has none; leave it unset.")

    def cache_layer(self, config, implementation: str, max_cache_len: int | None):
        """The cache layer (a transformers `LinearAttentionCacheLayerMixin`) of one linear-attention layer."""
        raise NotImplementedError

    def parameters(self, config) -> int:
        """Parameters of one linear-attention layer, from the config alone."""
        raise NotImplementedError

    def state_bytes(self, config, element_bytes: int) -> int:
        """Bytes one layer caches per sequence, whatever the context length."""
        raise NotImplementedError

    def describe(self, config) -> str:
        return self.name

    def tp_plan(self, config) -> dict[str, str]:
        """Tensor-parallel styles keyed by module names in a block (`"linear_attn.out_proj"`)."""
        return {}


class FeedForwardKind(Kind):
    """A value of `mlp_type`: the feed-forward module of every block and its arithmetic."""

    module: type[nn.Module]
    reads = ("intermediate_size", "mlp_bias")
    # whether its layers have routers (whose logits the model can return and train with router losses)
    routed: bool = False

    def build(self, config, layer_idx: int) -> nn.Module:
        """The feed-forward of block `layer_idx`."""
        return self.module(config)

    def parameters(self, config, layer_idx: int) -> int:
        """Parameters of block `layer_idx`'s feed-forward, from the config alone."""
        raise NotImplementedError

    def active_parameters(self, config, layer_idx: int) -> int:
        """Parameters block `layer_idx`'s feed-forward applies to one token (all of them unless routed)."""
        return self.parameters(config, layer_idx)

    def backend_features(self, config) -> set[str]:
        """Features of `backend_features.FEATURE_FIELDS` an engine running the whole model needs for this kind."""
        return set()

    def tp_plan(self, config) -> dict[str, str]:
        """transformers tensor-parallel styles of the feed-forward's modules and parameters, keyed by their
        names in a block (`"mlp.up_proj"`), for the layers this config builds."""
        return {}

    def ep_plan(self, config) -> dict[str, str]:
        """transformers expert-parallel styles, keyed like `tp_plan` (empty without routed experts)."""
        return {}

    def fp32_parameters(self, config) -> tuple[str, ...]:
        """Name patterns of parameters and buffers that stay fp32 when the model loads in half precision."""
        return ()


# ---------------------------------------------------------------------------------------------
# Field rules: each raises `ValueError` naming the field, the value and what is allowed.


def require_int(name: str, value, minimum: int | None = None, maximum: int | None = None,
                optional: bool = False) -> None:
    """An integer (not a bool, not a float) in [minimum, maximum]; `None` too when `optional`."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"`{name}` must be an integer, got {value!r}.")
    if minimum is not None and value < minimum:
        raise ValueError(f"`{name}` must be at least {minimum}, got {value}.")
    if maximum is not None and value > maximum:
        raise ValueError(f"`{name}` must be at most {maximum}, got {value}.")


def require_number(name: str, value, above: float | None = None, at_least: float | None = None,
                   below: float | None = None, at_most: float | None = None, optional: bool = False) -> None:
    """A finite real number (int or float, not a bool) within the given bounds; `None` too when `optional`."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"`{name}` must be a finite number, got {value!r}.")
    for bound, holds, relation in ((above, lambda b: value > b, "greater than"),
                                   (at_least, lambda b: value >= b, "at least"),
                                   (below, lambda b: value < b, "less than"),
                                   (at_most, lambda b: value <= b, "at most")):
        if bound is not None and not holds(bound):
            raise ValueError(f"`{name}` must be {relation} {bound}, got {value}.")


def require_bool(name: str, value, optional: bool = False) -> None:
    """`True` or `False` (a string such as "no" is refused rather than read as true)."""
    if value is None and optional:
        return
    if not isinstance(value, bool):
        raise ValueError(f"`{name}` must be true or false, got {value!r}.")


def require_per_layer(name: str, value, config, what: str = "one entry") -> None:
    """A list of one entry per layer (`config.num_hidden_layers` of them); `what` says what each entry is."""
    layers = config.num_hidden_layers
    if not isinstance(value, list) or len(value) != layers:
        raise ValueError(f"`{name}` must list {what} per layer (`num_hidden_layers`={layers}), got {value!r}.")


def require_choice(name: str, value, allowed) -> None:
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"`{name}`={value!r} is not one of the allowed values {sorted(allowed)}.")


__all__ = ["require_int", "require_number", "require_bool", "require_choice", "require_per_layer", "Registry", "Kind",
           "AttentionKind", "FeedForwardKind", "LinearAttentionKind", "LINEAR_ATTENTION", "HYBRID", "field_default",
           "mixer_layer_types", "attention_layer_type", "Feature", "FeatureSet", "require_unset_unless"]
