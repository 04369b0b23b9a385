"""Checks a checkpoint's tensors against its config before `from_pretrained` builds anything.

Its safetensors headers are read (names, dtypes, shapes; nothing else) and its tensors compared with what its
config implies; its config.json is read with a `ValueError` naming a file that is not JSON.

Each failure is a `ValueError` naming the file or the tensors. Part of the remote-code files (imported
relatively by the modeling file): standard library, torch and transformers only.
"""

from __future__ import annotations

import json
import os
import re

import torch

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
    _, tensors = read_safetensors_layout(path)
    return {name: (dtype, shape) for name, (dtype, shape, _) in tensors.items()}


def read_safetensors_layout(path) -> tuple[int, dict[str, tuple[str, tuple[int, ...], tuple[int, int]]]]:
    """(byte where the data starts, {tensor name: (dtype, shape, (start, end) within the data)}) from a
    `.safetensors` file's header, checked as `read_safetensors_header` says."""
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
            tensors[name] = (info["dtype"], tuple(int(n) for n in info["shape"]), (int(start), int(end)))
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"{path} is damaged: its safetensors header cannot be read ({error}).") from None
    return 8 + length, tensors


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
    """Raise a `ValueError` naming the missing, unexpected and mis-shaped tensors of a checkpoint that does not fit
    its config.

    Done before anything is built or read beyond the headers. `kwargs` are `from_pretrained`'s keyword arguments.

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
