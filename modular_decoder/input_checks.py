"""Checks at the door of `forward` and `generate`: the tensors they receive (ids, embeddings, mask), each
failure a `ValueError` naming the argument, read without a device sync where the sync rule below says so.

Part of the remote-code files (imported relatively by the modeling file): standard library and torch only.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

# The sync rule. Shapes and dtypes are read for free. Reading a tensor's values on the host (a mask's
# 0/1, the range of token ids, a static cache's length) waits for the device that holds it, so:
# - on CPU tensors a value check runs in every `forward` (no device to wait for; `syncs_device`), the id
#   range only after the embedding's own bounds error;
# - on an accelerator the prompt of a `generate` call is read once, in one host read (`check_generate_inputs`),
#   and nothing is read in `forward`: not in a training step, not in a decode step, as transformers' Llama
#   reads nothing there. A direct `forward` takes its mask's values as given, an id outside the vocabulary
#   is the device's own assert (as in transformers' models), and a 2-D mask beside a static cache is checked
#   against the cache's capacity but not against the count of cached tokens, which the cache keeps on the
#   device (a mask too short for them is then the device's index assert, where the new tokens' columns are read).

_ID_DTYPES = (torch.int64, torch.int32)  # what `nn.Embedding` accepts
# True inside `generate` once its prompt passed `check_generate_inputs`: the masks of the steps are
# that mask with columns of ones appended by generate itself, so their values are not read again.
_GENERATING = contextvars.ContextVar("modular_decoder_generating", default=False)


def syncs_device(tensor: torch.Tensor) -> bool:
    """Whether reading `tensor`'s values on the host waits for a device (the sync rule above): anything
    not on the CPU."""
    return tensor.device.type != "cpu"


@contextlib.contextmanager
def generating():
    """Mark the forwards inside this block as steps of a `generate` whose prompt was checked."""
    token = _GENERATING.set(True)
    try:
        yield
    finally:
        _GENERATING.reset(token)


def check_inputs(config, input_ids=None, attention_mask=None, inputs_embeds=None, cache=None) -> None:
    """Raise a `ValueError` naming the argument when the inputs of `forward` cannot be what they claim.

    `input_ids`: a 2-D (batch, seq) tensor of int64/int32 ids, neither dimension 0. `inputs_embeds`: a
    floating (batch, seq, hidden_size) tensor. `attention_mask`: a 2-D (batch, past + seq) tensor of
    0/1 (bool, int or float), where `past` is what `cache` holds (beside a static cache it may be padded
    with zeros up to the cache's length, as transformers pads it; see `_check_mask_length`); 4-D masks and
    the per-layer-type dict generate() builds are passed through as they are.

    Shapes and dtypes cost nothing (no device work). The one data-dependent check, that a 2-D mask
    holds only 0 and 1, is a single reduction done only when a mask is given (a mask of 2s would
    otherwise shift every position, since positions count the mask), under the sync rule above: on a
    CPU mask only; never while compiling nor in the steps of a `generate` whose prompt mask was checked
    on entry (`generating`).
    """
    mask = _checked_shapes(config, input_ids, attention_mask, inputs_embeds, cache)
    read_values = not (torch.compiler.is_compiling() or _GENERATING.get())  # dynamo cannot read a ContextVar
    if mask is not None and read_values and not syncs_device(mask) and not _zeros_and_ones(mask):
        raise _mask_values_error(mask)


def _checked_shapes(config, input_ids, attention_mask, inputs_embeds, cache) -> torch.Tensor | None:
    """The shape and dtype checks of `check_inputs`; returns the 2-D mask whose values are still to check
    (None for no mask, a bool mask, a 4-D mask or generate's per-layer dict)."""
    if input_ids is not None:
        batch, seq = _check_ids(input_ids)
    elif inputs_embeds is not None:
        batch, seq = _check_embeds(config, inputs_embeds)
    else:
        return None
    _check_cache_batch(cache, batch)
    if attention_mask is None or isinstance(attention_mask, dict):
        return None
    if not isinstance(attention_mask, torch.Tensor):
        raise ValueError(
            f"`attention_mask` must be a torch tensor of shape (batch, seq), got {type(attention_mask).__name__}."
        )
    if attention_mask.dim() == 4:  # a custom (batch, 1, q, kv) mask: used as given
        return None
    if attention_mask.dim() != 2:
        raise ValueError(
            f"`attention_mask` must be 2-D (batch, seq) with 1 for tokens to attend to and 0 for padding, got "
            f"shape {tuple(attention_mask.shape)}."
        )
    if attention_mask.shape[0] != batch:
        raise ValueError(
            f"`attention_mask` has batch size {attention_mask.shape[0]} but the input has {batch} "
            f"(mask shape {tuple(attention_mask.shape)}, input (batch, seq) = ({batch}, {seq}))."
        )
    _check_mask_length(attention_mask, seq, cache)
    return None if attention_mask.dtype == torch.bool else attention_mask


def _check_cache_batch(cache, batch: int) -> None:
    """A cache holds the states of one batch: reused with another batch size it is refused by name (what it holds
    is read off shapes, no device work; `ModularDecoderCache.held_batch_size`)."""
    held = cache.held_batch_size() if hasattr(cache, "held_batch_size") else None
    if held is not None and held != batch:
        raise ValueError(
            f"`cache` (a {type(cache).__name__}) holds the states of a batch of {held} sequences, and the input has "
            f"{batch}: a cache belongs to one batch. Pass a new cache (generate builds one by itself) or call "
            "`cache.reset()` first."
        )


def _mask_values_error(mask: torch.Tensor) -> ValueError:
    return ValueError(
        f"`attention_mask` must hold only 0 (padding) and 1 (token), got other values: {_few_values(mask)}."
    )


def check_generate_inputs(config, input_ids=None, attention_mask=None, inputs_embeds=None) -> None:
    """`check_inputs` for a prompt given to `generate`, values included wherever the prompt lies: a mask
    of 0/1 and ids in [0, vocab_size), read in one host read (one device sync per `generate` call, none
    per step). An empty prompt is refused with a hint."""
    if input_ids is not None and inputs_embeds is None and isinstance(input_ids, torch.Tensor) \
            and input_ids.dim() == 2 and input_ids.shape[1] == 0:
        raise ValueError(
            f"`input_ids` is an empty prompt (shape {tuple(input_ids.shape)}): generate needs at least one token "
            "per row, e.g. the BOS token."
        )
    if input_ids is not None and inputs_embeds is not None:
        # a prompt given both ways: the embeddings are what the first step runs on
        _check_embeds(config, inputs_embeds)
        input_ids = None
    mask = _checked_shapes(config, input_ids, attention_mask, inputs_embeds, cache=None)
    flags = {}  # what would be refused -> a 0-d bool tensor: whether the prompt holds it
    if mask is not None:
        flags["mask"] = _not_zero_or_one(mask).any()
    if input_ids is not None:
        flags["ids"] = ((input_ids < 0) | (input_ids >= config.vocab_size)).any()
    if not flags:
        return
    device = next(iter(flags.values())).device
    found = dict(zip(flags, torch.stack([flag.to(device) for flag in flags.values()]).tolist()))  # the one read
    if found.get("mask"):
        raise _mask_values_error(mask)
    if found.get("ids"):
        check_token_ids(config, input_ids)


def check_token_ids(config, input_ids: torch.Tensor) -> None:
    """Refuse ids outside [0, vocab_size) with a `ValueError` naming the range (reads the ids' values)."""
    if input_ids.numel() == 0:
        return
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= config.vocab_size:
        raise ValueError(f"`input_ids` must lie in [0, vocab_size={config.vocab_size}); got values in [{low}, {high}].")


def _check_ids(input_ids) -> tuple[int, int]:
    if not isinstance(input_ids, torch.Tensor):
        raise ValueError(f"`input_ids` must be a torch tensor of shape (batch, seq), got {type(input_ids).__name__}.")
    if input_ids.dim() != 2:
        hint = " (add a batch dimension: `input_ids[None]`)" if input_ids.dim() == 1 else ""
        raise ValueError(f"`input_ids` must be 2-D (batch, seq), got shape {tuple(input_ids.shape)}{hint}.")
    if input_ids.dtype not in _ID_DTYPES:
        raise ValueError(f"`input_ids` must hold integer token ids (torch.long or torch.int), got {input_ids.dtype}.")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(
            f"`input_ids` is empty (shape {tuple(input_ids.shape)}): it needs at least one row and one token."
        )
    return input_ids.shape[0], input_ids.shape[1]


def _check_embeds(config, inputs_embeds) -> tuple[int, int]:
    if not isinstance(inputs_embeds, torch.Tensor):
        raise ValueError(f"`inputs_embeds` must be a torch tensor, got {type(inputs_embeds).__name__}.")
    if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != config.hidden_size:
        raise ValueError(
            f"`inputs_embeds` must have shape (batch, seq, hidden_size={config.hidden_size}), got "
            f"{tuple(inputs_embeds.shape)}."
        )
    if not inputs_embeds.is_floating_point():
        raise ValueError(f"`inputs_embeds` must be a floating-point tensor, got {inputs_embeds.dtype}.")
    if inputs_embeds.shape[0] == 0 or inputs_embeds.shape[1] == 0:
        raise ValueError(f"`inputs_embeds` is empty (shape {tuple(inputs_embeds.shape)}).")
    return inputs_embeds.shape[0], inputs_embeds.shape[1]


def _check_mask_length(attention_mask: torch.Tensor, seq: int, cache) -> None:
    """A 2-D mask covers the cached and the new tokens, column j for token j. Beside a static cache it may
    also be padded with zeros up to the cache's length (`max_cache_len` of its full-attention layers), as
    transformers' mask builders pad it themselves: column j is then slot j, and any length in between is
    read that way. The cached tokens are counted only where that is free (`_cached_tokens`)."""
    length = attention_mask.shape[1]
    static = cache is not None and getattr(cache, "is_compileable", False)
    capacity = _static_capacity(cache) if static else None
    if capacity is not None and length > capacity:
        raise ValueError(
            f"`attention_mask` has length {length} but the static cache holds at most {capacity} tokens "
            "(its `max_cache_len`): a mask covers the cached and new tokens, optionally padded with zeros to it."
        )
    past = _cached_tokens(cache)
    if past is None:
        return
    if length < past + seq or (length > past + seq and not static):
        covers = f"the {past} cached and {seq} new tokens ({past + seq})" if past else f"the input's {seq} tokens"
        padded = f", or those padded with zeros to the static cache's {capacity} slots" if capacity else ""
        raise ValueError(f"`attention_mask` has length {length} but must cover {covers}{padded}.")


def _static_capacity(cache) -> int | None:
    """The longest 2-D mask a static cache takes: the length of its full-attention layers. A sliding layer is
    a ring of `sliding_window` slots that reads the mask by token position, so it bounds nothing: a cache
    whose layers all slide (Mistral's) takes a mask of any length, as transformers' models take it. A
    linear-attention layer holds a fixed-size state of no length (-1) and bounds nothing either."""
    full = [length for layer in cache.layers
            if not getattr(layer, "is_sliding", False) and (length := layer.get_max_length()) >= 0]
    return min(full) if full else None


def _cached_tokens(cache) -> int | None:
    """The count of tokens `cache` holds, or None where reading it would cost a device sync (the sync rule):
    a static cache counts on the device, and inside a compiled graph or `generate`'s steps it is not read."""
    if cache is None:
        return 0
    if getattr(cache, "is_compileable", False) and (torch.compiler.is_compiling() or _GENERATING.get()):
        return None
    past = cache.get_seq_length()
    if isinstance(past, torch.Tensor):
        if syncs_device(past):
            return None
        past = int(past)
    return past


def _zeros_and_ones(mask: torch.Tensor) -> bool:
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        return not bool(_not_zero_or_one(mask).any())
    # integers: one min/max reduction (the cheapest form on CPU)
    low, high = torch.aminmax(mask)
    return low.item() >= 0 and high.item() <= 1


def _not_zero_or_one(mask: torch.Tensor) -> torch.Tensor:
    """Where `mask` holds a value other than 0 and 1 (a bool tensor of its shape)."""
    return (mask != 0) & (mask != 1)


def _few_values(mask: torch.Tensor) -> str:
    bad = mask[_not_zero_or_one(mask)]
    return ", ".join(str(v) for v in bad.unique()[:5].tolist())
