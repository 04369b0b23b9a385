"""What every reshape transformation shares: a derived config, a model built from a state dict without
random initialisation, and the record (`Change`) each transformation leaves for the report and for healing.

Not model code (never shipped as remote code).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from modular_decoder.configuration_modular_decoder import ModularDecoderConfig

# What `to_dict` carries that is bookkeeping, not contract (transformers re-derives it on construction).
_NOT_FIELDS = ("transformers_version", "auto_map", "_name_or_path")


@dataclass
class Change:
    """One transformation's record: what it did (`details`, JSON-ready), which parameters it made or
    changed (`changed`: name prefixes in the new model, the modules healing trains) and, once measured,
    how far it moved the logits (`measured`, `measures.logit_change`: the only ground for "exact")."""

    name: str
    keeps: str  # the parts it leaves untouched
    approximates: str  # what it changes by design (empty: nothing, if the measurement agrees)
    changed: list[str] = field(default_factory=list)
    details: dict = field(default_factory=dict)
    measured: dict | None = None

    def as_dict(self) -> dict:
        record = {"transformation": self.name, "keeps": self.keeps, "approximates": self.approximates, **self.details}
        if self.measured is not None:
            record["measured"] = self.measured
        return record


def derived_config(config: ModularDecoderConfig, **changes) -> ModularDecoderConfig:
    """A new config equal to `config` but for `changes`, validated as any config is (a bad combination
    raises the config's own `ValueError` naming the field)."""
    fields = {k: v for k, v in config.to_dict().items() if k not in _NOT_FIELDS}
    fields.update(changes)
    new = ModularDecoderConfig.from_dict(fields)
    new._attn_implementation = config._attn_implementation
    if hasattr(config, "_experts_implementation"):
        new._experts_implementation = getattr(config, "_experts_implementation", None)
    return new


def model_from_state(config: ModularDecoderConfig, state: dict[str, torch.Tensor], like,
                     copy: bool = True) -> torch.nn.Module:
    """A `ModularDecoderForCausalLM` of `config` holding exactly `state`, on `like`'s device and in its dtype.

    With `copy`, every tensor of `state` that shares storage with `like` is cloned, so the result never
    shares a parameter with its source (the chain of `reshape` passes `copy=False` for the intermediate
    models it owns). It is built without random initialisation: the empty parameters are never touched
    before being replaced, so building costs no more memory than the new tensors themselves.
    """
    from transformers.initialization import no_init_weights

    from modular_decoder.modeling_modular_decoder import ModularDecoderForCausalLM

    first = next(like.parameters())
    with no_init_weights():  # on `like`'s device: the buffers (rotary tables) are not in `state`
        model = ModularDecoderForCausalLM(config).to(device=first.device, dtype=first.dtype)
    head, embed = "lm_head.weight", "model.embed_tokens.weight"
    state = {name: tensor.detach() for name, tensor in state.items() if not (config.tie_word_embeddings and name == head)}
    if copy:
        source = {tensor.untyped_storage().data_ptr() for tensor in like.state_dict().values()}
        state = {name: tensor.clone() if tensor.untyped_storage().data_ptr() in source else tensor
                 for name, tensor in state.items()}
    if config.tie_word_embeddings:
        state[head] = state[embed]
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    model.generation_config = like.generation_config
    return model.train(like.training)


def require_positive_int(name: str, value, minimum: int = 1) -> int:
    """`value` as an int >= `minimum`, else a `ValueError` naming the option."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"`{name}` must be an integer >= {minimum}, got {value!r}.")
    return value
