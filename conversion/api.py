"""`convert`, `export` and `verify`: the public entry points the CLI and the demo use."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch

from . import get_family
from .core import (Family, RuleInstance, check_duplicate, check_shapes, count_mtp_layers, duplicates, file_name,
                   is_mtp_rule, plan_rules, refuse_tensors)
from .gguf_source import open_gguf
from .io import atomic_folder, check_destination, copy_side_files
from .multimodal import (KEPT_FOLDER, WRAPPERS, KeptRelease, OpenedRelease, check_fits, check_wrapper_builds, copy_plan,
                         copy_release_files, effective_tie, open_kept, open_release, parameters, parsed_config,
                         release_config, text_differences, with_kept_tensors, write_manifest, write_release_files)
from .sources import (SourceTensor, dequantized, describe_quantization, folder_tensors, model_tensors,
                      quantization_of)
from .stream import Sink, plan_shapes, produce, write_plan
from .tensor_files import WEIGHTS_NAME, ShardedWriter, folder_files

logger = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Contract fields that do not change the function a checkpoint computes (compared on export).
_NOT_MATH = {"initializer_range", "use_cache", "attention_dropout", "hidden_dropout", "pad_token_id",
             "bos_token_id", "eos_token_id", "max_position_embeddings", "mtp_loss_scaling_factor",
             "mtp_draft_vocab_size", "mtp_draft_tokens"}
# Tensors of the contract that hold no weights of the function: drafting's token ranking (`draft_vocab.py`), which no
# family's format holds; export leaves them out (the family's model drafts over its whole vocabulary).
_NOT_EXPORTED = ("mtp.draft_vocab",)
VERIFY_PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"


def _dtype(dtype) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"`dtype`={dtype!r} is not one of {sorted(DTYPES)}.")
    return DTYPES[dtype]


def _tied_head(plan: list[RuleInstance], tensors: dict[str, SourceTensor], cfg, tied: bool, embed: str, head: str,
               where: str) -> list[RuleInstance]:
    """The plan without the instance that makes a tied head, after checking that head equal to the embedding
    (both read from the source); a tied contract never stores it."""
    makes = {name: instance for instance in plan for name in instance.outputs}
    if not tied or head not in makes:
        return plan
    if len(makes[head].outputs) != 1 or embed not in makes:
        raise ValueError(f"{where}: `tie_word_embeddings` is set but `{head}` is not a tensor of its own.")
    if not torch.equal(produce(makes[head], tensors, cfg)[head], produce(makes[embed], tensors, cfg)[embed]):
        raise ValueError(f"{where}: `tie_word_embeddings` is set but `{head}` differs from `{embed}`.")
    return [instance for instance in plan if instance is not makes[head]]


def _meta_model(build):
    with torch.device("meta"):
        return build()


def _save_model_files(model, folder: Path, dtype: torch.dtype) -> None:
    """What `save_pretrained` writes beside the weights (the config with the weights' dtype and the class, the
    generation config, the model's code where it is remote code), written by `save_pretrained` itself, on the
    meta-device model and without weights, so that a model's own `save_pretrained` (its `auto_map`) holds."""
    from transformers.utils import logging

    shown = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()  # its bar over zero shards
    try:
        model.to(dtype).save_pretrained(folder, state_dict={})
    finally:
        if shown:
            logging.enable_progress_bar()
    (folder / WEIGHTS_NAME).unlink(missing_ok=True)  # an empty weights file, where a release writes one


def _write_weights(folder: Path, plan, tensors, cfg, planned: dict, sinks: dict, total_parameters: int,
                   dtype: torch.dtype | None, desc: str, progress: bool) -> None:
    """Stream the plan's outputs into `folder`'s shards, with a progress bar over the bytes read and the count of
    source tensors done."""
    from tqdm.auto import tqdm

    sources = [tensors[name] for instance in plan for name in instance.inputs]
    total, count, done = sum(t.nbytes for t in sources), sum(len(t.files) for t in sources), 0
    with ShardedWriter(folder, planned, total_parameters) as writer, tqdm(
            total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=not progress) as bar:

        def advance(nbytes: int, finished: int) -> None:
            nonlocal done
            done += finished
            bar.set_postfix_str(f"{done}/{count} tensors", refresh=False)
            bar.update(nbytes)

        write_plan(plan, tensors, cfg, writer, sinks, dtype, advance)


def _compute_dtype(src_cfg) -> torch.dtype:
    """The dtype a quantized checkpoint computes in: its config's `dtype` where it names a float type, else bf16."""
    dtype = getattr(src_cfg, "dtype", None)
    if isinstance(dtype, str):
        dtype = DTYPES.get(dtype)
    return dtype if dtype in DTYPES.values() else torch.bfloat16


def _check_source(src: Path, gguf_file: str | None = None) -> None:
    """A source folder that exists and looks like what was asked for; else a one-line error naming it."""
    if not src.exists():
        raise FileNotFoundError(f"{src} does not exist.")
    if not src.is_dir():
        hint = f" (for a GGUF file pass its folder and `--gguf-file {src.name}`)" if src.suffix == ".gguf" else ""
        raise NotADirectoryError(f"{src} is a file, not a model folder{hint}.")
    if gguf_file is None and not (src / "config.json").exists():
        ggufs = sorted(p.name for p in src.glob("*.gguf"))
        if ggufs:
            raise ValueError(f"{src} has no config.json but holds GGUF file(s) {ggufs}: pass `--gguf-file NAME` "
                             "(`gguf_file=`) to convert one.")
        raise ValueError(f"{src} has no config.json: not a Hugging Face model folder.")


def _source_config(src: Path):
    """The source's transformers config; a malformed config.json or an unknown `model_type` is named."""
    from transformers import AutoConfig

    from modular_decoder.checkpoint_checks import read_json_file

    raw = read_json_file(src / "config.json")
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise ValueError(f"{src / 'config.json'} has no `model_type`, so its family is unknown.")
    if raw["model_type"] not in WRAPPERS:
        get_family(raw["model_type"])  # an unknown family is refused by name before transformers is asked
    return AutoConfig.from_pretrained(str(src))


def _open_source(src: Path, gguf_file: str | None, allow_bin: bool):
    """(source config, its tensors under their file names, tokenizer, generation config, the multimodal release
    they were taken from or None): a release's text config and language model's tensors, the rest kept aside."""
    _check_source(src, gguf_file)
    if gguf_file is not None:
        return (*open_gguf(src, gguf_file), None)
    src_cfg = _source_config(src)
    files = folder_tensors(src, allow_bin=allow_bin)
    if src_cfg.model_type not in WRAPPERS:
        return src_cfg, files, None, None, None
    release = open_release(src, src_cfg, files)
    return release.text_config, release.language_model, None, None, release


def convert(
    src_dir,
    out_dir,
    gguf_file: str | None = None,
    dtype=None,
    force: bool = False,
    verify: bool = False,
    allow_bin: bool = False,
    progress: bool = True,
    base_model: str | None = None,
    input_checks=contextlib.nullcontext,
) -> Path:
    """Convert a Hugging Face folder (or a GGUF file in `src_dir`) into a modular_decoder folder.

    The output is written to a temporary folder next to `out_dir` and moved into place only when
    complete; an existing `out_dir` is left alone unless `force`. Tokenizer files, chat template and
    generation config come along, and a model card (`README.md`) with the contract table naming
    `base_model` (a Hub id) when given. With `verify`, the source model (transformers' own class) runs
    beside the converted one and the largest logit difference is printed. Returns `out_dir`.

    `input_checks`: a context manager the steps that check the caller's input run inside (paths,
    files, the source's config and tensors); the CLI turns their errors into one-line user errors.
    """
    from modular_decoder import ModularDecoderConfig, ModularDecoderForCausalLM
    from modular_decoder.tools.cards import render_model_card

    src, out = Path(src_dir), Path(out_dir)
    embed, head = "model.embed_tokens.weight", "lm_head.weight"
    with input_checks():
        check_destination(out, force, sources=(src,))  # before any work: never the source, nor a folder holding it
        torch_dtype = _dtype(dtype)
        src_cfg, files, tokenizer, generation_config, release = _open_source(src, gguf_file, allow_bin)
        family = get_family(src_cfg.model_type)
        fields = family.to_contract(src_cfg)
        refuse_tensors(files, family)  # by the file's names, before any is read
        # GGUF: dequantized on reading; a release's quantization is its own config's
        quantization = quantization_of(release.config if release else src_cfg) if gguf_file is None else None
        if quantization is not None:  # dequantized straight into the dtype written
            torch_dtype = torch_dtype or _compute_dtype(src_cfg)
        tensors = model_tensors(dequantized(files, quantization, torch_dtype, str(src)), family)
        if release is not None:
            fields["tie_word_embeddings"] = effective_tie(release, tensors, embed, head)
        cfg = ModularDecoderConfig(**_with_mtp_layers(fields, family, src_cfg, tensors, src))
        plan, copies = duplicates(plan_rules(family.rules(src_cfg), tensors, cfg))
        for instance in copies:  # each read twice (its original is converted too), checked, not written
            check_duplicate(instance, *(tensors[name].read() for name in instance.inputs))
        produced = plan_shapes(plan, tensors, cfg)
        torch_dtype = torch_dtype or produced[embed].dtype
        cfg.architectures = ["ModularDecoderForCausalLM"]
        cfg.dtype = torch_dtype
        model = _meta_model(lambda: ModularDecoderForCausalLM(cfg))
        tied = cfg.tie_word_embeddings
        expected = {k: v.shape for k, v in model.state_dict().items() if not (tied and k == head)}
        check_shapes({k: v for k, v in produced.items() if not (tied and k == head)}, expected, f"converting {src}")
        if verify:
            check_verify_memory(model.num_parameters())
            if release is not None:
                check_wrapper_builds(release.wrapper)
        plan = _tied_head(plan, tensors, cfg, tied, embed, head, "source")
    planned = {k: (torch_dtype if produced[k].is_floating_point() else produced[k].dtype, tuple(produced[k].shape))
               for k in expected}  # in the model's order, as `save_pretrained` shards it
    with atomic_folder(out, force=force, sources=(src,)) as tmp:
        _save_model_files(model, tmp, torch_dtype)
        _write_weights(tmp, plan, tensors, cfg, planned, {k: [Sink(k)] for k in planned}, model.num_parameters(),
                       torch_dtype, f"converting {family.name}", progress)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if generation_config is not None:
            generation_config.save_pretrained(tmp)
        copy_side_files(src, tmp)
        if release is not None:
            _keep_release(release, tmp / KEPT_FOLDER, family.name, cfg, progress)
        dropped = [what for prefix, what in family.dropped.items() if any(name.startswith(prefix) for name in files)]
        description = _card_description(base_model, quantization, torch_dtype, release, dropped)
        (tmp / "README.md").write_text(render_model_card(cfg, base_model=base_model, description=description))
    if verify:
        diff = compare_with_source(src, out, gguf_file=gguf_file)
        print(f"largest logit difference (source vs converted, fp32): {diff:.3e}")
    return out


def export(src_dir, out_dir, family: str, force: bool = False, progress: bool = True,
           input_checks=contextlib.nullcontext) -> Path:
    """Write a modular_decoder folder back in `family`'s own transformers format (the inverse map), tensor
    by tensor as `convert` does.

    `family` may name a multimodal release (`gemma3`, `mistral3`, `qwen3_5`) that `convert` read: the language
    model goes back under the release's names beside the tensors and files kept in `multimodal/`, with the release's
    config (its text config changed only where the language model's function changed). Raises `ValueError` naming
    the contract fields the family cannot express (and, into a release, a width its kept parts cannot feed).
    `input_checks`: as for `convert`.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from modular_decoder import ModularDecoderConfig

    src, out = Path(src_dir), Path(out_dir)
    embed, head = "model.embed_tokens.weight", "lm_head.weight"
    with input_checks():
        check_destination(out, force, sources=(src,))
        kept = open_kept(src, family) if family in WRAPPERS else None
        fam = get_family(kept.text_family if kept else family)
        _check_source(src)
        cfg = AutoConfig.from_pretrained(str(src))
        if not isinstance(cfg, ModularDecoderConfig):
            raise ValueError(f"{src} is not a modular_decoder checkpoint (model_type={cfg.model_type!r}).")
        if kept is None:
            src_cfg, held = _family_config(fam, cfg), {}
        else:
            release_raw, src_cfg, held = _release_config(kept, fam, cfg)
        _check_round_trip(cfg, {**fam.to_contract(src_cfg), **held}, family)
        tensors = {k: v for k, v in folder_tensors(src).items() if k not in _NOT_EXPORTED}
        tied = cfg.tie_word_embeddings
        if tied and head in tensors:  # a tied contract's head is the embedding: checked, then not read again
            if not torch.equal(tensors[head].read(), tensors[embed].read()):
                raise ValueError(f"{src}: `tie_word_embeddings` is set but `{head}` differs from `{embed}`.")
            tensors = {k: v for k, v in tensors.items() if k != head}
    plan = plan_rules(fam.rules(src_cfg), tensors, cfg, direction="inverse")
    produced = plan_shapes(plan, tensors, cfg)
    src_cfg.architectures = None
    model = _meta_model(lambda: AutoModelForCausalLM.from_config(src_cfg))
    their_embed_key = _param_name(model, model.get_input_embeddings().weight)
    their_head_key = _param_name(model, model.get_output_embeddings().weight, exclude=their_embed_key)
    expected = {k: v.shape for k, v in model.state_dict().items() if not (tied and k == their_head_key)}
    expected.update(_mtp_tensors(plan, produced))  # written beside the model's, which does not hold them
    check_shapes(produced, expected, f"exporting to {fam.name}")
    dtype = produced[their_embed_key].dtype
    planned, sinks = file_tensors(expected, produced, fam, src_cfg)
    total = model.num_parameters()
    if kept is not None:
        plan, tensors, planned, sinks, kept_parameters = with_kept_tensors(kept, plan, tensors, planned, sinks)
        total += kept_parameters
    with atomic_folder(out, force=force, sources=(src,)) as tmp:
        if kept is None:
            _save_model_files(model, tmp, dtype)  # before the weights: it removes the empty weights file it writes
            copy_side_files(src, tmp)
        else:
            write_release_files(kept, release_raw, src, tmp)
        _write_weights(tmp, plan, tensors, cfg, planned, sinks, total, None, f"exporting {family}", progress)
    for sentence in fam.export_warnings(src_cfg) if fam.export_warnings else ():
        logger.warning(f"{out}: {sentence}")
    return out


def _keep_release(release: OpenedRelease, folder: Path, family: str, cfg, progress: bool) -> None:
    """`multimodal/`: the release's tensors other than its language model's, copied file tensor by file tensor under
    their own names, its files other than weights (config.json, processor, tokenizer), and the manifest."""
    folder.mkdir()
    if release.kept:
        plan, planned, sinks = copy_plan(release.kept)
        _write_weights(folder, plan, release.kept, None, planned, sinks, parameters(release.kept), None,
                       f"keeping {release.wrapper.model_type}'s other tensors", progress)
    read = {path.name for path in folder_files(release.src)} or {p.name for p in release.src.glob("pytorch_model*.bin")}
    copy_release_files(release.src, folder, read)
    write_manifest(folder, release, family, cfg)


def _release_config(kept: KeptRelease, family: Family, cfg):
    """(the release's config.json entries for contract `cfg`, its text config, the contract fields the folder written
    holds beside what that config says: the head tied as the model's is, its MTP modules), refusing a model its kept
    parts cannot go back beside (`check_fits`) and a release whose head the model's tying cannot follow."""
    from modular_decoder import ModularDecoderConfig

    original = ModularDecoderConfig(**kept.manifest["contract"])
    check_fits(kept, cfg, original)
    changed = bool(_differing_fields(cfg, original.to_dict()))
    base = family.from_contract(original).to_dict() if changed else None
    new = _family_config(family, cfg).to_dict() if changed else None
    raw = release_config(kept, cfg, original, base, new)
    config = parsed_config(kept, raw)
    # a tied model writes no head: the wrapper must tie (an untied one's head is written, and kept apart on load)
    if cfg.tie_word_embeddings and not config.tie_word_embeddings:
        raise ValueError(f"The {kept.wrapper.model_type} release's `tie_word_embeddings` is false and this model "
                         "ties its head to the embedding.")
    held = {"tie_word_embeddings": cfg.tie_word_embeddings}
    if family.mtp_layers is not None:  # `convert` reads the modules the files hold (`_with_mtp_layers`)
        held["num_mtp_layers"] = cfg.num_mtp_layers
    return raw, config.text_config, held


def _card_description(base_model: str | None, quantization: dict | None, dtype: torch.dtype,
                      release: OpenedRelease | None, dropped: list[str] = ()) -> str | None:
    """The model card's first paragraph where the source needs one said: published quantized, a multimodal
    release whose other parts are kept in `multimodal/`, or parts the family's model does not hold (`dropped`)."""
    if quantization is None and release is None:
        if not dropped:
            return None
        origin = f"[{base_model}](https://huggingface.co/{base_model})" if base_model else "a checkpoint"
        return (f"The weights of {origin}, converted to the modular_decoder family. Not converted: "
                f"{'; '.join(dropped)}.")
    origin = f"[{base_model}](https://huggingface.co/{base_model})" if base_model else "a checkpoint"
    text = f"The language model of {origin} (a `{release.wrapper.model_type}` release)" if release else \
        f"The weights of {origin}"
    if quantization is not None:
        text += f", published as {describe_quantization(quantization)}, dequantized to {str(dtype).split('.')[1]}"
    text += (" and" if quantization is not None else ",") + " converted to the modular_decoder family."
    if release is not None:
        text += (" Everything else in the release (its vision or audio towers, projectors, processor and config) is "
                 f"kept as published in `{KEPT_FOLDER}/`")
        text += "." if quantization is not None else \
            f"; `modular-decoder export THIS BACK --family {release.wrapper.model_type}` writes the release back."
        text += "".join(" " + sentence for sentence in text_differences(release.wrapper, release.config))
    if dropped:
        text += f" Not converted: {'; '.join(dropped)}."
    return text


def _with_mtp_layers(fields: dict, family: Family, src_cfg, names, src: Path) -> dict:
    """The contract's `num_mtp_layers`: the MTP modules the source's files hold (a folder without them converts
    without them, whatever config.json declares); files holding another number than it declares are refused."""
    if family.mtp_layers is None:
        return fields
    held = count_mtp_layers(names, family.mtp_layers, src_cfg.num_hidden_layers)
    declared = fields.get("num_mtp_layers", 0)
    if held and held != declared:
        raise ValueError(f"{src}: config.json declares {declared} multi-token-prediction module(s) and the files hold "
                         f"{held} (`{family.mtp_layers}`): fix config.json.")
    return {**fields, "num_mtp_layers": held}


def _mtp_tensors(plan: list[RuleInstance], produced: dict) -> dict:
    """{name: shape} of the exported MTP modules' tensors, what the plan's `{mtp}` rules make (the family's
    transformers model does not hold them: its `MtpModel` reads them from the files), after the model's."""
    made = [name for instance in plan if is_mtp_rule(instance.rule) for name in instance.outputs]
    return {name: produced[name].shape for name in made}


def file_tensors(names, produced: dict[str, torch.Tensor], family: Family, config=None):
    """The file tensors `save_pretrained` writes for the family's model tensors `names`, and where each goes.

    In this order: renamed back to the file's prefixes, stacked experts split into one tensor per expert, the tensors
    the files keep in parts (`family.split`, sized by the family's `config`) in those parts. Returns
    ({file name: (dtype, shape)}, {model name: [Sink]})."""
    planned, sinks = {}, {}
    for name in names:
        tensor = produced[name]
        parts = next((p for split in family.split if (p := split.pieces(name, config)) is not None), None)
        if parts is not None:
            sinks[name] = []
            for file, rows in parts:
                file = file_name(file, family, config)
                planned[file] = (tensor.dtype, (rows.stop - rows.start, *tensor.shape[1:]))
                sinks[name].append(Sink(file, rows=rows))
            continue
        pieces = next((p for stack in family.experts if (p := stack.pieces(name, tuple(tensor.shape))) is not None),
                      None)
        if pieces is None:
            file = file_name(name, family, config)
            planned[file] = (tensor.dtype, tuple(tensor.shape))
            sinks[name] = [Sink(file)]
            continue
        sinks[name] = []
        for file, expert, rows in pieces:
            file = file_name(file, family, config)
            planned[file] = (tensor.dtype, (rows.stop - rows.start, *tensor.shape[2:]))
            sinks[name].append(Sink(file, expert, rows))
    return planned, sinks


def check_verify_memory(parameters: int) -> None:
    """Raise a `ValueError` before converting where this machine's memory cannot hold what `--verify` loads.

    `--verify` runs the source and the converted model side by side in float32 (it would run out after the
    whole conversion)."""
    import psutil

    needed = 2 * 4 * parameters
    available = psutil.virtual_memory().available
    if needed > available:
        raise ValueError(
            f"`--verify` loads the source and the converted model side by side in float32, about "
            f"{needed / 2**30:.1f} GiB for {parameters:,} parameters; this machine has {available / 2**30:.1f} GiB "
            "available. Convert without `--verify` (conversion itself needs a few tensors' worth of memory), or "
            "verify on a machine with more memory."
        )


def _param_name(model, param, exclude: str | None = None) -> str:
    return next(name for name, p in model.named_parameters(remove_duplicate=False) if p is param and name != exclude)


def _family_config(family: Family, cfg):
    """The family's transformers config for contract `cfg`; where its config class refuses the values (a dense
    checkpoint has no experts for Mixtral's or gpt-oss's `num_local_experts`: a strict dataclass error, no
    `ValueError`), a `ValueError` naming the family and the field."""
    from huggingface_hub.errors import StrictDataclassError

    try:
        return family.from_contract(cfg)
    except (StrictDataclassError, TypeError) as error:  # the class's own field checks (v5 configs are strict)
        raise ValueError(f"The {family.name} format cannot express this checkpoint: {error}") from error


def _differing_fields(cfg, theirs: dict) -> list[str]:
    """The contract fields that change the math on which `cfg` and `theirs` (another config's `to_dict()`) differ."""
    ours = cfg.to_dict()
    unread = _NOT_MATH | _unread_fields(cfg)
    return [name for name in type(cfg).declared_fields() if name not in unread and ours.get(name) != theirs.get(name)]


def _check_round_trip(cfg, back_fields: dict, family: str) -> None:
    """Export may not change the math: the family's config must translate back (`back_fields`, the contract
    fields it gives) to the same contract; a `ValueError` names each field it changes."""
    ours, theirs = cfg.to_dict(), _round_trip(cfg, back_fields)
    differ = [f"`{name}`={ours.get(name)!r} (the {family} config gives {theirs.get(name)!r})"
              for name in _differing_fields(cfg, theirs)]
    if differ:
        raise ValueError(f"The {family} format cannot express this checkpoint's " + "; ".join(differ) + ".")


def _round_trip(cfg, back_fields: dict) -> dict:
    """The contract `back_fields` make, as a dict. Where the contract refuses them (sliding layers without the
    window the family's config cannot hold), the field whose value from `cfg` makes them valid is what the family
    loses: it comes back as the family gives it, so the refusal names that loss, not the config built to check it."""
    try:
        return type(cfg)(**back_fields).to_dict()
    except ValueError as refusal:
        ours = cfg.to_dict()
        for name in type(cfg).declared_fields():
            if name in ours and ours[name] != back_fields.get(name):
                try:
                    back = type(cfg)(**{**back_fields, name: ours[name]})
                except ValueError:
                    continue
                return {**back.to_dict(), name: back_fields.get(name)}
        raise refusal


def _unread_fields(cfg) -> set[str]:
    """Fields no module of this config reads: the dense width of a model whose layers are all sparse
    (families such as Mixtral name only the experts' width)."""
    kinds = getattr(cfg, "mlp_layer_types", None)
    return {"intermediate_size"} if kinds and "dense" not in kinds else set()


@torch.no_grad()
def compare_with_source(src_dir, converted_dir, gguf_file: str | None = None, prompt: str = VERIFY_PROMPT) -> float:
    """Largest |logit| difference between the source (transformers' own class) and the converted model
    on a fixed prompt, both in fp32."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    from modular_decoder import ModularDecoderForCausalLM  # noqa: F401  (registers the family)

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    source_class = AutoModelForCausalLM
    if gguf_file is None and AutoConfig.from_pretrained(str(src_dir)).model_type in WRAPPERS:
        source_class = AutoModelForImageTextToText  # the release's wrapper class, on text alone
    source = source_class.from_pretrained(str(src_dir), dtype=torch.float32, **kwargs).eval()
    converted = AutoModelForCausalLM.from_pretrained(str(converted_dir), dtype=torch.float32).eval()
    try:
        ids = AutoTokenizer.from_pretrained(str(converted_dir))(prompt, return_tensors="pt").input_ids
    except (OSError, ValueError, TypeError):
        ids = torch.arange(16).unsqueeze(0) % converted.config.vocab_size
    ids = ids[:, : converted.config.max_position_embeddings]
    return (source(ids).logits.float() - converted(ids).logits.float()).abs().max().item()
