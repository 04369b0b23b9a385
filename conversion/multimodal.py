"""Multimodal releases: the language model of a released folder converts, and the rest is kept beside it.

Most 2025-26 releases ship their language model inside a multimodal folder (a vision tower, a projector, a processor
and a wrapper class such as `Gemma3ForConditionalGeneration`). `convert` reads such a folder's language model through
its text family (`gemma3_text`, `mistral`, `qwen3_5_text`, `qwen3_5_moe_text`,
`gemma4_text`, `llama4_text`, `gemma3n_text`) and writes everything else,
untouched, into OUT's `multimodal/` folder: the release's `config.json`, every other tensor under its own name (copied
file tensor by file tensor, never through a model), the processor, tokenizer and other files, and
`modular_decoder.json` (which release, which text family, where its files keep the language model, the contract it
converted to). `export --family <release>` writes the language model back under the release's names beside those
tensors, so that the wrapper class loads the folder.

A release is one `Wrapper` entry: its `model_type`, the text families its `text_config` may name, and where its files
keep the language model (`layouts`). transformers reads two layouts: the Llava-era one (`language_model.model.*`,
`language_model.lm_head.*`), which its "llava" conversion mapping renames on load and writes back on save (Gemma 3,
Mistral 3; Llama 4's wrapper holds its language model under these names itself), and the modules' own names
(`model.language_model.*`, `lm_head.*`: Qwen3.5, Gemma 4, Gemma 3n).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from .core import Rule, RuleInstance
from .io import TOKENIZER_FILES, copy_side_files
from .sources import SourceTensor, safetensors_tensors
from .stream import BLOCK_BYTES, Sink
from .tensor_files import INDEX_NAME

logger = logging.getLogger(__name__)

# Where a release's files keep its language model: file-name prefix -> the name a text-only checkpoint gives it
LLAVA = {"language_model.model.": "model.", "language_model.lm_head.": "lm_head."}
MODULES = {"model.language_model.": "model.", "lm_head.": "lm_head."}
QWEN3_5 = {**MODULES, "mtp.": "mtp."}  # and its multi-token-prediction module, which the wrapper class skips

KEPT_FOLDER = "multimodal"  # OUT/multimodal: the release without its language model's weights
MANIFEST = "modular_decoder.json"
# Files that hold weights: never copied into `multimodal/` whole (the tensors the source's index names are copied
# one by one; any other weight file, such as Mistral's `consolidated.safetensors`, is named and left out)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pth", ".pt", ".gguf", ".ckpt", ".h5", ".msgpack", ".onnx")


@dataclass(frozen=True)
class Wrapper:
    """A multimodal release whose language model converts through a text family.

    Args:
        model_type: The release's config `model_type` (what `export --family` names).
        text_families: The `text_config.model_type`s that convert inside it (each a registered text family).
        layouts: Where its files may keep the language model, each {file-name prefix: the prefix a text-only
            checkpoint of the family uses}; a folder uses exactly one, and export writes the one it was read from.
        unapplied: Text config fields the wrapper class does not apply though the text class does (Gemma 3's wrapper
            computes no final logit softcap): a release that sets one is refused, its function being ambiguous.
        embedded_apart: Sub-configs whose token ids (`vocab_offset` up to `vocab_offset + vocab_size`) the wrapper
            class embeds through embedders of its own, kept in `multimodal/` (Gemma 3n's `embed_vision` and
            `embed_audio`: its image and audio tokens), not through the language model's table. The converted model
            embeds them through its table, as the text class does; `convert` names them in a warning, the manifest
            and the model card.
        read_as_pad: Config fields naming placeholder token ids (Gemma 4's image, video and audio tokens) that the
            wrapper class embeds as the text config's pad token, in the embedding and the per-layer inputs, before
            its encoders' features take their place. The converted model embeds them through their own rows, as the
            text class does; `convert` names them in a warning, the manifest and the model card.
        builds_with: Python packages transformers needs to build the wrapper class (Gemma 3n's vision tower is timm's
            MobileNetV5): `--verify`, which runs the wrapper class, is refused by name without them.
    """

    model_type: str
    text_families: tuple[str, ...]
    layouts: tuple[dict[str, str], ...]
    unapplied: tuple[str, ...] = ()
    embedded_apart: tuple[str, ...] = ()
    read_as_pad: tuple[str, ...] = ()
    builds_with: tuple[str, ...] = ()


WRAPPERS: dict[str, Wrapper] = {
    "qwen3_5": Wrapper("qwen3_5", ("qwen3_5_text",), (QWEN3_5,)),
    "gemma3": Wrapper("gemma3", ("gemma3_text",), (LLAVA, MODULES), unapplied=("final_logit_softcapping",)),
    # Mistral Small 3.1 / 3.2 (`mistral`), Ministral 3 (`ministral3`)
    "mistral3": Wrapper("mistral3", ("mistral", "ministral3"), (LLAVA, MODULES)),
    "qwen3_5_moe": Wrapper("qwen3_5_moe", ("qwen3_5_moe_text",), (QWEN3_5,)),
    "gemma4": Wrapper("gemma4", ("gemma4_text",), (MODULES,),
                      read_as_pad=("image_token_id", "video_token_id", "audio_token_id")),
    "llama4": Wrapper("llama4", ("llama4_text",), (LLAVA,)),
    "gemma3n": Wrapper("gemma3n", ("gemma3n_text",), (MODULES,), embedded_apart=("vision_config", "audio_config"),
                       builds_with=("timm",)),
}


def get_wrapper(model_type: str) -> Wrapper:
    """The release entry for config `model_type`."""
    return WRAPPERS[model_type]


@dataclass
class OpenedRelease:
    """A release folder split in two: its language model's tensors under a text-only checkpoint's names, and the
    tensors kept aside under their own."""

    src: Path
    wrapper: Wrapper
    config: object  # the release's transformers config
    text_config: object
    layout: dict[str, str]
    language_model: dict[str, SourceTensor]
    kept: dict[str, SourceTensor]


def open_release(src: Path, config, files: dict[str, SourceTensor]) -> OpenedRelease:
    """Split release folder `src` (its config, its file tensors): refuses a text model this entry does not convert,
    a field the wrapper class does not apply, and files where no layout (or more than one) finds the language model."""
    wrapper = get_wrapper(config.model_type)
    text = getattr(config, "text_config", None)
    kind = getattr(text, "model_type", None)
    if kind not in wrapper.text_families:
        raise ValueError(f"{src}: this {wrapper.model_type} release's language model is {kind!r}, which does not "
                         f"convert inside a {wrapper.model_type} folder yet (converts: {list(wrapper.text_families)}).")
    set_fields = [name for name in wrapper.unapplied if getattr(text, name, None) is not None]
    if set_fields:
        raise ValueError(f"{src}: `text_config.{set_fields[0]}` is set, which {wrapper.model_type}'s wrapper class "
                         "does not apply and its text class does: what this release computes is ambiguous.")
    found = [layout for layout in wrapper.layouts if any(name.startswith(next(iter(layout))) for name in files)]
    if len(found) != 1:
        what = "holds no language model under" if not found else "mixes the layouts"
        prefixes = [next(iter(layout)) for layout in (found or wrapper.layouts)]
        raise ValueError(f"{src}: this {wrapper.model_type} folder {what} {prefixes}.")
    layout = found[0]
    language_model, kept = {}, {}
    for name, tensor in files.items():
        prefix = next((p for p in layout if name.startswith(p)), None)
        if prefix is None:
            kept[name] = tensor
        else:
            text_name = layout[prefix] + name[len(prefix):]
            language_model[text_name] = dataclasses.replace(tensor, name=text_name)
    for sentence in text_differences(wrapper, config):
        logger.warning(f"{src}: {sentence}")
    return OpenedRelease(src, wrapper, config, text, layout, language_model, kept)


def ids_embedded_apart(wrapper: Wrapper, config) -> dict[str, list[int]]:
    """{sub-config: [first id, end]} of the token ids release `config`'s wrapper class embeds through embedders of its
    own (`Wrapper.embedded_apart`)."""
    ranges = {}
    for name in wrapper.embedded_apart:
        sub = getattr(config, name)
        ranges[name] = [sub.vocab_offset, sub.vocab_offset + sub.vocab_size]
    return ranges


def ids_read_as_pad(wrapper: Wrapper, config) -> dict[str, int]:
    """{config field: token id} of the placeholders release `config`'s wrapper class embeds as its pad token
    (`Wrapper.read_as_pad`), for the fields the release sets."""
    ids = {name: getattr(config, name, None) for name in wrapper.read_as_pad}
    return {name: token for name, token in ids.items() if token is not None}


def text_differences(wrapper: Wrapper, config) -> list[str]:
    """Sentences for the convert warning and the model card: the token ids on which the converted language model
    computes other logits than the release's wrapper class, and why."""
    sentences = []
    apart = ids_embedded_apart(wrapper, config)
    if apart:
        spans = " and ".join(f"{first}-{end - 1} (`{name}`)" for name, (first, end) in apart.items())
        sentences.append(f"{wrapper.model_type}'s wrapper class embeds token ids {spans} through embedders of its "
                         f"own, kept in `{KEPT_FOLDER}/`; the converted language model embeds them through its own "
                         "table, as its text class does (its logits are the wrapper's on every other id).")
    as_pad = ids_read_as_pad(wrapper, config)
    if as_pad:
        ids = ", ".join(f"{token} (`{name}`)" for name, token in as_pad.items())
        sentences.append(f"{wrapper.model_type}'s wrapper class embeds the placeholder token ids {ids} as its pad "
                         "token; the converted language model embeds them through their own rows, as its text class "
                         "does (its logits are the wrapper's on every other id).")
    return sentences


def text_difference_ids(wrapper: Wrapper, config) -> dict:
    """The manifest's entries for `text_differences`: `ids_embedded_apart` and `ids_read_as_pad`, where set."""
    entries = {"ids_embedded_apart": ids_embedded_apart(wrapper, config),
               "ids_read_as_pad": ids_read_as_pad(wrapper, config)}
    return {key: value for key, value in entries.items() if value}


def check_wrapper_builds(wrapper: Wrapper) -> None:
    """Refuse `--verify` (which runs the wrapper class) where a package transformers builds that class with does
    not import."""
    for package in wrapper.builds_with:
        try:
            importlib.import_module(package)
        except (ImportError, RuntimeError, OSError) as error:  # timm raises RuntimeError where torchvision fails
            reason = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
            raise ValueError(f"`--verify` runs {wrapper.model_type}'s wrapper class, which transformers builds with "
                             f"`{package}`, and `import {package}` fails here ({reason}): install it, or convert "
                             "without `--verify`.") from None


def effective_tie(release: OpenedRelease, tensors: dict[str, SourceTensor], embed: str, head: str) -> bool:
    """Whether the wrapper class ties its head to the embedding: its top-level `tie_word_embeddings` (what it reads,
    not the text config's), unless the files hold a head that differs from the embedding, which it then keeps apart
    (transformers' `tie_weights` does so with a warning; Mistral Small 3.1's config leaves the flag at its default,
    true, beside an untied head)."""
    tied = bool(getattr(release.config, "tie_word_embeddings", False))
    if head not in tensors:
        if not tied:
            raise ValueError(f"{release.src}: `tie_word_embeddings` is false and the files hold no `{head}`: the "
                             f"{release.wrapper.model_type} class would start from a random head.")
        return True
    return tied and same_values(tensors[head], tensors[embed])


def same_values(a: SourceTensor, b: SourceTensor) -> bool:
    """Whether two source tensors hold the same values, compared a block of rows at a time where both read so."""
    if (a.shape, a.dtype) != (b.shape, b.dtype):
        return False
    if not a.shape or a.read_rows is None or b.read_rows is None:
        return torch.equal(a.read(), b.read())
    rows = a.shape[0]
    step = max(1, BLOCK_BYTES // max(1, a.nbytes // max(1, rows)))
    return all(torch.equal(a.read_rows(i, min(i + step, rows)), b.read_rows(i, min(i + step, rows)))
               for i in range(0, rows, step))


def copy_plan(tensors: dict[str, SourceTensor]):
    """Every tensor of `tensors` copied under its own name: (plan, {name: (dtype, shape)}, {name: [Sink]})."""
    plan = [RuleInstance(Rule(name, name), (name,), (name,)) for name in tensors]
    planned = {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}
    return plan, planned, {name: [Sink(name)] for name in tensors}


def parameters(tensors: dict[str, SourceTensor]) -> int:
    return sum(math.prod(tensor.shape) for tensor in tensors.values())


def copy_release_files(src: Path, folder: Path, read_files) -> None:
    """Every top-level file of `src` that holds no weights, untouched, into `folder`; weight files other than those
    read (`read_files`) and subfolders are named in a warning, not copied."""
    left_out = []
    for path in sorted(src.iterdir()):
        if path.is_dir() and path.name.startswith("."):
            continue  # `hf download --local-dir`'s `.cache/`, a repository's `.git/`
        if path.is_file() and not path.name.endswith(WEIGHT_SUFFIXES) and path.name != INDEX_NAME:
            shutil.copy2(path, folder / path.name)
        elif path.name not in read_files and path.name != INDEX_NAME:
            left_out.append(path.name + ("/" if path.is_dir() else ""))
    if left_out:
        logger.warning(f"{src}: not kept in {KEPT_FOLDER}/ (weights transformers does not read from this folder, or "
                       f"subfolders): {left_out}.")


def write_manifest(folder: Path, release: OpenedRelease, family: str, cfg) -> None:
    """`modular_decoder.json`: which release, which text family, where its files keep the language model, the
    contract it converted to (export compares the model it writes back with it), and the token ids the wrapper class
    embeds otherwise than the language model does, where it does."""
    values = cfg.to_dict()
    contract = {name: values[name] for name in type(cfg).declared_fields() if name in values}
    manifest = {"release": release.wrapper.model_type, "text_family": family, "language_model": release.layout,
                "contract": contract}
    manifest.update(text_difference_ids(release.wrapper, release.config))
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def copy_kept_release(src: Path, dst: Path) -> None:
    """Carry a converted folder's `multimodal/` into a folder made from it (`reshape`), so that it exports back."""
    if (Path(src) / KEPT_FOLDER).is_dir():
        shutil.copytree(Path(src) / KEPT_FOLDER, Path(dst) / KEPT_FOLDER)


# ---------------------------------------------------------------------------------------------------------
# Export: the (possibly changed) language model back into the release kept in `multimodal/`


@dataclass
class KeptRelease:
    """A converted folder's `multimodal/`: the release's config (`raw`, as its config.json holds it) and manifest."""

    folder: Path
    wrapper: Wrapper
    manifest: dict
    raw: dict

    @property
    def text_family(self) -> str:
        return self.manifest["text_family"]


def open_kept(src: Path, name: str) -> KeptRelease:
    """`src`'s kept release, to export into release `name`; refused where there is none, where it is another
    release's, or where the release was published quantized."""
    from modular_decoder.checkpoint_checks import read_json_file

    wrapper = get_wrapper(name)
    folder = src / KEPT_FOLDER
    if not (folder / MANIFEST).is_file():
        raise ValueError(f"{src} has no {KEPT_FOLDER}/{MANIFEST}: the rest of the {name} release (vision tower, "
                         f"projector, processor) that `convert` kept is not here. Copy the `{KEPT_FOLDER}/` folder "
                         f"`convert` wrote into {src}, or export the language model alone (`--family "
                         f"{wrapper.text_families[0]}`).")
    manifest = read_json_file(folder / MANIFEST)
    if manifest.get("release") != name:
        raise ValueError(f"{folder} keeps the parts of a {manifest.get('release')!r} release, not of a {name!r} one: "
                         f"export with `--family {manifest.get('release')}`.")
    raw = read_json_file(folder / "config.json")
    if raw.get("quantization_config"):
        method = raw["quantization_config"].get("quant_method")
        raise ValueError(f"The {name} release in {folder} was published quantized ({method!r}): `convert` dequantized "
                         "its language model and kept the rest as published, which its `quantization_config` no "
                         f"longer describes as one folder; export the language model alone (`--family "
                         f"{manifest['text_family']}`).")
    return KeptRelease(folder, wrapper, manifest, raw)


def check_fits(kept: KeptRelease, cfg, original) -> None:
    """The kept parts were made for the original language model: refuse a width they cannot feed, and token ids
    (image, video, boundary tokens) past the vocabulary."""
    name = kept.wrapper.model_type
    if cfg.hidden_size != original.hidden_size:
        raise ValueError(f"This model's `hidden_size` is {cfg.hidden_size}; the {name} release's vision tower and "
                         f"projector kept in {KEPT_FOLDER}/ feed a language model of width {original.hidden_size}, so "
                         f"they cannot go back beside it. Export the language model alone (`--family "
                         f"{kept.text_family}`).")
    past = [f"{key}={value}" for key, value in sorted(kept.raw.items())
            if key.endswith(("token_id", "token_index")) and isinstance(value, int) and value >= cfg.vocab_size]
    if past:
        raise ValueError(f"The {name} release's {', '.join(past)} lie past this model's `vocab_size` "
                         f"{cfg.vocab_size}: the release cannot use it.")


def release_config(kept: KeptRelease, cfg, original, base: dict | None, new: dict | None) -> dict:
    """The release's config.json for contract `cfg`: the kept one untouched where the language model's function is
    unchanged (`base` None), else with only the text config's entries that differ between `base` (the text config
    the original contract gives) and `new` (this one's) changed, and the wrapper's `tie_word_embeddings` where tying
    changed."""
    if base is None:
        return kept.raw
    raw = dict(kept.raw, text_config=_updated(kept.raw["text_config"], base, new))
    if cfg.tie_word_embeddings != original.tie_word_embeddings:
        raw["tie_word_embeddings"] = cfg.tie_word_embeddings
    return raw


def _updated(raw: dict, base: dict, new: dict) -> dict:
    """`raw` with the entries that differ between `base` and `new` set to `new`'s (nested dicts entry by entry)."""
    out = dict(raw)
    for key, value in new.items():
        old = base.get(key, _ABSENT)
        if old == value:
            continue
        nested = isinstance(value, dict) and isinstance(old, dict) and isinstance(raw.get(key), dict)
        out[key] = _updated(raw[key], old, value) if nested else value
    return out


_ABSENT = object()


def parsed_config(kept: KeptRelease, raw: dict):
    """The release's transformers config from its config.json's entries; a field its wrapper class does not apply
    (`Wrapper.unapplied`) is refused."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = CONFIG_MAPPING[raw["model_type"]].from_dict(json.loads(json.dumps(raw)))
    set_fields = [f for f in kept.wrapper.unapplied if getattr(config.text_config, f, None) is not None]
    if set_fields:
        raise ValueError(f"The {kept.wrapper.model_type} format cannot express this checkpoint's `{set_fields[0]}`: "
                         "its wrapper class does not apply it.")
    return config


def release_names(layout: dict[str, str], planned: dict, sinks: dict) -> tuple[dict, dict]:
    """Export's planned file tensors and sinks with a text-only checkpoint's names put back under the release's
    (`layout`, as the manifest recorded it)."""
    inverse = sorted(((text, file) for file, text in layout.items()), key=lambda pair: -len(pair[0]))

    def named(name: str) -> str:
        for text, file in inverse:
            if name.startswith(text):
                return file + name[len(text):]
        raise ValueError(f"`{name}` lies outside the release's language model ({sorted(layout.values())}).")

    return ({named(name): value for name, value in planned.items()},
            {name: [dataclasses.replace(sink, file=named(sink.file)) for sink in parts] for name, parts in sinks.items()})


def with_kept_tensors(kept: KeptRelease, plan: list, tensors: dict, planned: dict, sinks: dict):
    """Export's plan, tensors, planned file tensors and sinks for the language model under the release's names, with
    the kept tensors copied beside it (first, as the wrapper's state dict orders them), and the kept parameters."""
    planned, sinks = release_names(kept.manifest["language_model"], planned, sinks)
    kept_tensors = safetensors_tensors(kept.folder)
    clash = sorted(set(kept_tensors) & (set(planned) | set(tensors) | set(sinks)))
    if clash:
        raise ValueError(f"{kept.folder} keeps tensors the language model writes too: {clash[:5]}.")
    kept_plan, kept_planned, kept_sinks = copy_plan(kept_tensors)
    return (kept_plan + plan, {**kept_tensors, **tensors}, {**kept_planned, **planned}, {**kept_sinks, **sinks},
            parameters(kept_tensors))


def write_release_files(kept: KeptRelease, raw: dict, src: Path, folder: Path) -> None:
    """The release's config.json (`raw`; the kept file itself where unchanged) and the kept release's other files
    (processor, generation config, ...) into the export `folder`, then the model's tokenizer files over the release's
    copy (a fine-tune may have changed them)."""
    if raw is kept.raw:
        shutil.copy2(kept.folder / "config.json", folder / "config.json")
    else:
        (folder / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    for path in sorted(kept.folder.iterdir()):
        weights = path.name.endswith(WEIGHT_SUFFIXES) or path.name == INDEX_NAME
        if path.is_file() and not weights and path.name not in ("config.json", MANIFEST):
            shutil.copy2(path, folder / path.name)
    copy_side_files(src, folder, TOKENIZER_FILES, replace=True)
