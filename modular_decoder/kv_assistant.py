"""Drafting with transformers' Gemma 4 assistant: `model.generate(..., assistant_model=assistant)` where the assistant
(`Gemma4AssistantForCausalLM`) keeps no cache of its own and attends to this model's keys and values.

Each drafted token comes from the model's embedding of the last token beside the model's last hidden state, attending
to the keys and values of one layer per attention type: the last layer of that type computing its own
(`kv_sharing.drafter_kv_layers`), as its cache returned them in the model's last forward. transformers'
assisted-decoding loop asks the model for them with `return_shared_kv_states=True` and reads `shared_kv_states` and
`hidden_states[-1]` from its output; its drafter (`SinglePositionMultiTokenCandidateGenerator`) runs the assistant,
and the loop verifies the drafts as for any assistant, so the tokens are those of decoding without one.

transformers picks that drafter only for its own Gemma classes (by the target's class name); this model picks it for
the same assistants (`ModularDecoderForCausalLM._get_candidate_generator`) and hands it the embedding the first layer
sees (the table times `embedding_multiplier`, as Gemma 4's scaled embedding module returns), not the bare table. Both
are named in `compat.GENERATION_HOOKS`. A model whose keys and values such an assistant cannot read is refused by name
(`check_kv_assistant`).
"""

from __future__ import annotations

from .attention_shapes import GLOBAL_LAYER, layer_head_dim, layer_kv_heads
from .compat import GENERATION_HOOKS, kv_assistant_generator
from .kv_sharing import DRAFTER_KV_TYPES, drafter_kv_layers


def reads_model_kv(assistant_model) -> bool:
    """Whether `assistant_model` drafts from the model's keys and values (transformers' rule: its class name)."""
    prefixes = GENERATION_HOOKS["kv_assistant_classes"]
    return assistant_model is not None and type(assistant_model).__name__.startswith(prefixes)


def check_kv_assistant(config, assistant_model) -> None:
    """Raise a `ValueError` naming the field where the model cannot hand `assistant_model` (a Gemma 4 assistant) what
    it reads: per-head keys and values (`attention_type`) of both its attention types (`layer_types`), rotated
    (`position_embedding_type`), of its head shapes; a hidden state of its `backbone_hidden_size`; its vocabulary."""
    if not reads_model_kv(assistant_model):
        return
    name, assistant = type(assistant_model).__name__, assistant_model.config
    text = assistant.get_text_config()
    if config.attention_type != "standard":
        raise ValueError(f"`assistant_model` ({name}) attends to the model's per-head keys and values, and "
                         f"`attention_type`={config.attention_type!r} caches none; it drafts for 'standard' attention.")
    layers = drafter_kv_layers(config)
    for layer_type in DRAFTER_KV_TYPES:
        if layer_type not in layers:
            raise ValueError(f"`assistant_model` ({name}) reads the keys and values of a {layer_type!r} layer, and "
                             f"`layer_types` has none computing its own (before the last `num_kv_shared_layers`).")
    if config.position_embedding_type != "rope":
        raise ValueError(f"`assistant_model` ({name}) rotates its queries against the model's rotated keys, and "
                         f"`position_embedding_type`={config.position_embedding_type!r} rotates none.")
    for layer_type, (head_dim, kv_heads) in _assistant_shapes(text).items():
        ours = layer_head_dim(config, layer_type), layer_kv_heads(config, layer_type)
        if (head_dim, kv_heads) != ours:
            fields = ("`global_head_dim`, `num_global_key_value_heads`" if layer_type == GLOBAL_LAYER
                      else "`head_dim`, `num_key_value_heads`")
            raise ValueError(f"`assistant_model` ({name}) reads {layer_type!r} keys and values of width {head_dim} "
                             f"with {kv_heads} heads; the model's have width {ours[0]} with {ours[1]} ({fields}).")
    if assistant.backbone_hidden_size != config.hidden_size:
        raise ValueError(f"`assistant_model` ({name}) reads hidden states of `backbone_hidden_size`="
                         f"{assistant.backbone_hidden_size}; the model's `hidden_size` is {config.hidden_size}.")
    if text.vocab_size != config.vocab_size:
        raise ValueError(f"`assistant_model` ({name}) drafts over {text.vocab_size} tokens; the model's "
                         f"`vocab_size` is {config.vocab_size}.")


def _assistant_shapes(text_config) -> dict[str, tuple[int, int]]:
    """(head width, K/V heads) of each attention type the assistant's layers read (transformers keeps Gemma 4's per
    layer in `per_layer_config`)."""
    per_layer = getattr(text_config, "per_layer_config", None)
    shapes = {}
    for index, layer_type in enumerate(text_config.layer_types[: text_config.num_hidden_layers]):
        layer = per_layer[index] if per_layer is not None else text_config
        shapes.setdefault(layer_type, (layer.head_dim, layer.num_key_value_heads))
    return shapes


def drafter_input_embeddings(model):
    """ids -> the embedding the model's first layer sees for them (its table, `embedding_multiplier`, the embedding
    norm), what transformers' drafter takes as the target's input embeddings (Gemma 4's scales its table)."""
    base = model.model
    return lambda input_ids: base._embed(base._embed_tokens(input_ids), None)


def drafter_kv(config, layer_inputs: list[dict], hand_over: bool) -> dict | None:
    """With `hand_over`, per attention type the (keys, values) its drafter layer put in the forward's dict (the
    model's `shared_kv_states` output); else `None`."""
    if not hand_over:
        return None
    return {layer_type: layer_inputs[index]["shared_kv"][index]
            for layer_type, index in drafter_kv_layers(config).items()}


def kv_assistant_drafter(model, assistant_model, generation_config, input_ids, inputs_tensor, logits_processor,
                         model_kwargs):
    """transformers' drafter for its Gemma 4 assistants, given this model's input embeddings (the keywords its
    constructor takes on 5.16.1 to 5.25: the newer one takes the older one's extras as `**kwargs`)."""
    return kv_assistant_generator()(
        input_ids=input_ids, assistant_model=assistant_model,
        target_model_input_embeddings=drafter_input_embeddings(model), generation_config=generation_config,
        model_kwargs=model_kwargs, inputs_tensor=inputs_tensor, logits_processor=logits_processor,
    )


__all__ = ["check_kv_assistant", "drafter_input_embeddings", "drafter_kv", "kv_assistant_drafter", "reads_model_kv"]
