"""Checks at the door: the tensors `forward` / `generate` receive, and a checkpoint's tensors against
its config before `from_pretrained` builds anything.

Each failure is a `ValueError` naming the argument or the tensors. Part of the remote-code files
(imported relatively by the modeling file): standard library, torch and transformers only.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import re

import torch

# --------------------------------------------------------------------------------------------------
# runtime inputs
#
# The sync rule. Shapes and dtypes are read for free. Reading a tensor's values on the host (a mask's
# 0/1, the range of token ids) waits for the device that holds it, so a value check runs:
# - on CPU tensors in every `forward` (no device to wait for; `syncs_device`), the id range only after
#   the embedding's own bounds error;
# - on an accelerator once per `generate` call, on its prompt (`check_generate_inputs`), and never in
#   `forward` otherwise: not in a training step, not in a decode step, as transformers' Llama reads
#   none. There a direct `forward` takes its mask's values as given, and an id outside the vocabulary
#   is the device's own assert, as in transformers' models.

_ID_DTYPES = (torch.int64, torch.int32)  # what `nn.Embedding` accepts
# True inside `generate` once its prompt passed `check_generate_inputs`: the masks of the steps are
# that mask with columns of ones appended by generate itself, so their values are not read again.
_PROMPT_CHECKED = contextvars.ContextVar("modular_decoder_prompt_checked", default=False)


def syncs_device(tensor: torch.Tensor) -> bool:
    """Whether reading `tensor`'s values on the host waits for a device (the sync rule above): anything
    not on the CPU."""
    return tensor.device.type != "cpu"


@contextlib.contextmanager
def prompt_checked():
    """Mark the forwards inside this block as steps of a `generate` whose prompt was checked."""
    token = _PROMPT_CHECKED.set(True)
    try:
        yield
    finally:
        _PROMPT_CHECKED.reset(token)


def check_inputs(config, input_ids=None, attention_mask=None, inputs_embeds=None, cache=None, prompt=False) -> None:
    """Raise a `ValueError` naming the argument when the inputs of `forward` cannot be what they claim.

    `input_ids`: a 2-D (batch, seq) tensor of int64/int32 ids, neither dimension 0. `inputs_embeds`: a
    floating (batch, seq, hidden_size) tensor. `attention_mask`: a 2-D (batch, past + seq) tensor of
    0/1 (bool, int or float), where `past` is what `cache` holds (beside a static cache it may be padded with
    zeros up to the cache's length, as transformers pads it; see `_check_mask_length`); 4-D masks and the per-layer-type dict
    generate() builds are passed through as they are.

    Shapes and dtypes cost nothing (no device work). The one data-dependent check, that a 2-D mask
    holds only 0 and 1, is a single reduction done only when a mask is given (a mask of 2s would
    otherwise shift every position, since positions count the mask), under the sync rule above: on a
    CPU mask, or on any mask when `prompt` (`generate`'s prompt); never while compiling nor in the
    steps of a `generate` whose prompt mask was checked on entry (`prompt_checked`).
    """
    if input_ids is not None:
        batch, seq = _check_ids(input_ids)
    elif inputs_embeds is not None:
        batch, seq = _check_embeds(config, inputs_embeds)
    else:
        return
    if attention_mask is None or isinstance(attention_mask, dict):
        return
    if not isinstance(attention_mask, torch.Tensor):
        raise ValueError(
            f"`attention_mask` must be a torch tensor of shape (batch, seq), got {type(attention_mask).__name__}."
        )
    if attention_mask.dim() == 4:  # a custom (batch, 1, q, kv) mask: used as given
        return
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
    read_values = prompt or not (_PROMPT_CHECKED.get() or syncs_device(attention_mask))
    if (attention_mask.dtype != torch.bool and read_values and not torch.compiler.is_compiling()
            and not _zeros_and_ones(attention_mask)):
        raise ValueError(
            "`attention_mask` must hold only 0 (padding) and 1 (token), got other values: "
            f"{_few_values(attention_mask)}."
        )


def check_generate_inputs(config, input_ids=None, attention_mask=None, inputs_embeds=None) -> None:
    """`check_inputs` for a prompt given to `generate`; an empty prompt is refused with a hint."""
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
    check_inputs(config, input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds, prompt=True)
    if input_ids is not None and syncs_device(input_ids):  # on CPU the embedding's bounds error leads to it
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
    also be padded with zeros up to the cache's length (`max_cache_len`), as transformers' mask builders
    pad it themselves: column j is then slot j, and any length in between is read that way."""
    length = attention_mask.shape[1]
    static = cache is not None and getattr(cache, "is_compileable", False)
    if static:
        capacity = cache.get_max_length()
        if length > capacity:
            raise ValueError(
                f"`attention_mask` has length {length} but the static cache holds at most {capacity} tokens "
                "(its `max_cache_len`): a mask covers the cached and new tokens, optionally padded with zeros to it."
            )
        if torch.compiler.is_compiling() or _PROMPT_CHECKED.get():
            return  # a static cache keeps its length on the device: read once per direct call, not per step
        past = int(cache.get_seq_length())
    else:
        past = cache.get_seq_length() if cache is not None else 0
    if length < past + seq or (length > past + seq and not static):
        covers = f"the {past} cached and {seq} new tokens ({past + seq})" if past else f"the input's {seq} tokens"
        padded = f", or those padded with zeros to the static cache's {cache.get_max_length()} slots" if static else ""
        raise ValueError(f"`attention_mask` has length {length} but must cover {covers}{padded}.")


def _zeros_and_ones(mask: torch.Tensor) -> bool:
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        return not bool(((mask != 0) & (mask != 1)).any())
    # integers: one min/max reduction (the cheapest form measured on CPU: ~6 us for a decode step's mask)
    low, high = torch.aminmax(mask)
    return low.item() >= 0 and high.item() <= 1


def _few_values(mask: torch.Tensor) -> str:
    bad = mask[(mask != 0) & (mask != 1)]
    return ", ".join(str(v) for v in bad.unique()[:5].tolist())


# --------------------------------------------------------------------------------------------------
# checkpoint tensors against the config

# transformers' `from_pretrained` keywords that download or locate files
_DOWNLOAD_KWARGS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder", "proxies")
_HEADER_LIMIT = 100 * 2**20  # a safetensors header larger than this is damage, not metadata
_LIST = 8  # tensor names listed per category in the error


def read_json_file(path):
    """The parsed JSON of `path` (a config.json); a file that is not valid JSON raises a `ValueError` naming it."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON ({error}).") from None


def read_safetensors_header(path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor name: (dtype, shape)} from a `.safetensors` file's header, reading nothing else.

    A file too short for its header, a header that is not JSON, or tensors whose data lie past the end
    of the file raise a `ValueError` naming the file and saying it is truncated or damaged.
    """
    path = os.fspath(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path} is truncated: {size} bytes, shorter than a safetensors header.")
        length = int.from_bytes(head, "little")
        if length > min(size - 8, _HEADER_LIMIT):
            raise ValueError(
                f"{path} is truncated or damaged: its header claims {length} bytes but the file has {size} bytes."
            )
        raw = f.read(length)
    try:
        header = json.loads(raw)
        data = size - 8 - length
        tensors = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            if end > data:
                raise ValueError(
                    f"{path} is truncated: tensor {name!r} needs {end} bytes of data but the file holds {data}."
                )
            tensors[name] = (info["dtype"], tuple(int(n) for n in info["shape"]))
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"{path} is damaged: its safetensors header cannot be read ({error}).") from None
    return tensors


def _weight_files(folder: str, variant: str | None, kwargs: dict) -> list[str] | None:
    """The safetensors files `from_pretrained` reads for `folder` (local or a Hub id), or None where
    there are none to read (a `.bin` or GGUF checkpoint, or nothing resolvable: transformers reports it)."""
    def named(name: str) -> str:
        if not variant:
            return name
        parts = name.split(".")
        return ".".join([*parts[:-1], variant, parts[-1]])

    local = os.path.join(folder, kwargs.get("subfolder") or "")
    if os.path.isdir(local):
        def resolve(name: str) -> str | None:
            path = os.path.join(local, name)
            return path if os.path.isfile(path) else None
    else:
        from transformers.utils import cached_file

        download = {k: kwargs[k] for k in _DOWNLOAD_KWARGS if k in kwargs}

        def resolve(name: str) -> str | None:  # downloads what `from_pretrained` downloads next anyway
            try:
                return cached_file(folder, name, **download)  # a missing file raises OSError
            except (OSError, ValueError):
                return None

    single = resolve(named("model.safetensors"))
    if single is not None:
        return [single]
    index = resolve(named("model.safetensors.index.json"))
    if index is None:
        return None
    try:
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"{index} is damaged: cannot read its `weight_map` ({error}).") from None
    files = [resolve(name) for name in shards]
    missing = [name for name, path in zip(shards, files) if path is None]
    if missing:
        raise ValueError(f"{index} names shard(s) that cannot be found: {missing}.")
    return files


def _config_for(model_class, pretrained, kwargs: dict):
    config = kwargs.get("config")
    if config is not None and not isinstance(config, (str, os.PathLike)):
        return config
    download = {k: kwargs[k] for k in _DOWNLOAD_KWARGS if k in kwargs}
    config = model_class.config_class.from_pretrained(config if config is not None else pretrained, **download)
    # keyword overrides reach the config as in `from_pretrained` (e.g. `num_hidden_layers=2`)
    for key, value in kwargs.items():
        if key not in _NOT_CONFIG and hasattr(config, key):
            setattr(config, key, value)
    return config


_NOT_CONFIG = {"config", "state_dict", "dtype", "torch_dtype", "device_map", "attn_implementation", "key_mapping",
               "quantization_config", "gguf_file", "variant", "use_safetensors", "ignore_mismatched_sizes",
               *_DOWNLOAD_KWARGS}


def _layer_indices(names) -> set[int]:
    return {int(m.group(1)) for name in names if (m := re.search(r"(?:^|\.)layers\.(\d+)\.", name))}


def _align_prefix(names: dict, expected: dict, prefix: str) -> dict:
    """Checkpoint names as the model names them: a base model saved without `prefix.` loaded into the
    causal LM, or a causal LM's checkpoint loaded into the base model (its head is then not loaded)."""
    if not prefix:
        return names
    dot = prefix + "."
    ours = any(k.startswith(dot) for k in expected)
    theirs = any(k.startswith(dot) for k in names)
    if ours and not theirs:
        return {dot + k: v for k, v in names.items()}
    if theirs and not ours:
        return {k[len(dot):]: v for k, v in names.items() if k.startswith(dot)}
    return names


def _natural(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _listed(items: list[str]) -> str:
    more = f", ... and {len(items) - _LIST} more" if len(items) > _LIST else ""
    return ", ".join(items[:_LIST]) + more


def check_checkpoint(model_class, pretrained, kwargs: dict) -> None:
    """Refuse, before anything is built or read beyond the headers, a checkpoint whose tensors do not
    match what its config implies: raise a `ValueError` naming the missing, unexpected and mis-shaped
    tensors. `kwargs` are `from_pretrained`'s keyword arguments.

    What is refused is what would load silently wrong, and nothing transformers loads by design: the
    model is checked part by part (the base model under `base_model_prefix`, and each other top-level
    module, the head), and a part the checkpoint holds must match its config exactly (a config with one
    layer more, or another `norm_position`, would leave some of a trained body random). A part the
    checkpoint does not hold at all is transformers' to load: a base model's checkpoint loaded into
    `ForCausalLM` gets a fresh `lm_head`, reported in `missing_keys` (`output_loading_info=True`) and
    in transformers' load report, as for every transformers model.

    The names and shapes come from the safetensors headers (single file or shards) and from the model
    built on the meta device (no memory; tied weights and tensors never saved may be absent; non-persistent
    buffers are not in a state dict). A config whose layer count far exceeds the checkpoint's is refused
    without building it, so an absurd `num_hidden_layers` fails at once. Checkpoints this cannot read
    cheaply (GGUF, pre-quantized, legacy `.bin`, unresolvable Hub ids) are left to transformers.
    `ignore_mismatched_sizes=True` lets mis-shaped tensors through, as transformers defines it.
    """
    if kwargs.get("gguf_file") or kwargs.get("quantization_config") is not None:
        return
    if kwargs.get("use_safetensors") is False:
        return
    state_dict = kwargs.get("state_dict")
    if state_dict is not None:
        found = {k: tuple(v.shape) for k, v in state_dict.items()}
        where = "the given `state_dict`"
    elif pretrained is None:
        return
    else:
        files = _weight_files(os.fspath(pretrained), kwargs.get("variant"), kwargs)
        if not files:
            return
        found = {}
        for file in files:
            found.update({k: shape for k, (_, shape) in read_safetensors_header(file).items()})
        where = os.fspath(pretrained)
    config = _config_for(model_class, pretrained, kwargs)
    if getattr(config, "quantization_config", None) is not None:
        return
    for pattern, replacement in (kwargs.get("key_mapping") or {}).items():
        found = {re.sub(pattern, replacement, k): v for k, v in found.items()}

    layers = config.num_hidden_layers
    have = _layer_indices(found)
    if isinstance(layers, int) and layers > len(have) + 64:
        # building even a meta model of, say, 10**6 layers takes minutes: the counts alone decide
        held = f"layers 0-{max(have)}" if have else "no layers"
        raise ValueError(
            f"{where}: the checkpoint's tensors do not match its config. `num_hidden_layers`={layers} but the "
            f"checkpoint holds {held}: every tensor of layers {len(have)}-{layers - 1} is missing. Fix config.json, "
            "or pass `strict=False` to load what there is (the rest randomly initialised)."
        )

    with torch.device("meta"):
        model = model_class(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    optional = _optional_names(model)
    prefix = getattr(model_class, "base_model_prefix", "")
    found = _align_prefix(found, expected, prefix)
    # a head model's parts: its base model (every name under `prefix.`) and each other top-level module
    has_base = bool(prefix) and any(k.startswith(prefix + ".") for k in expected)

    def _part_of(name: str) -> str:
        return name.split(".", 1)[0] if has_base else ""
    ignore_missing = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_missing", None) or ()]
    ignore_unexpected = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]

    # the parts the checkpoint holds: only their tensors are compared (see the docstring)
    held = {_part_of(k) for k in expected if k in found}
    # listed in the model's order (layer by layer), the checkpoint's extras in natural order
    missing = [k for k in expected if k not in found and k not in optional and _part_of(k) in held
               and not any(p.search(k) for p in ignore_missing)]
    unexpected = sorted((k for k in found if k not in expected and _part_of(k) in held
                         and not any(p.search(k) for p in ignore_unexpected)), key=_natural)
    wrong = [] if kwargs.get("ignore_mismatched_sizes") else [
        f"{k} (checkpoint {found[k]}, config {expected[k]})" for k in expected if k in found and found[k] != expected[k]
    ]
    problems = []
    if missing:
        problems.append(f"missing ({len(missing)}): {_listed(missing)}")
    if unexpected:
        problems.append(f"unexpected ({len(unexpected)}): {_listed(unexpected)}")
    if wrong:
        problems.append(f"wrong shape ({len(wrong)}): {_listed(wrong)}")
    if problems:
        raise ValueError(
            f"{where}: the checkpoint's tensors do not match its config. " + "; ".join(problems) + ". Loading it "
            "would leave weights randomly initialised: fix config.json or the weights, or pass `strict=False` to "
            "load the matching tensors anyway."
        )


def _optional_names(model) -> set[str]:
    """Names a checkpoint may omit: second names of tied (shared) parameters, and `_keys_to_ignore_on_save`."""
    seen, optional = set(), set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            optional.add(name)
        seen.add(id(param))
    optional.update(getattr(model, "_keys_to_ignore_on_save", None) or ())
    return optional
