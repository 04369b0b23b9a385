"""`convert`, `export` and `verify`: the public entry points the CLI and the demo use."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from . import get_family
from .core import Family, apply_rules, check_shapes, count_mtp_layers, rename_prefixes
from .io import (add_safetensors_shard, atomic_folder, check_destination, copy_side_files, read_gguf,
                 read_safetensors_folder)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Contract fields that do not change the function a checkpoint computes (compared on export).
_NOT_MATH = {"initializer_range", "use_cache", "attention_dropout", "hidden_dropout", "pad_token_id",
             "bos_token_id", "eos_token_id", "max_position_embeddings", "mtp_loss_scaling_factor"}
VERIFY_PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"


def _dtype(dtype) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"`dtype`={dtype!r} is not one of {sorted(DTYPES)}.")
    return DTYPES[dtype]


def _model_names(state: dict, family: Family) -> dict:
    """File names -> the transformers model's names: old prefixes renamed as transformers does on load,
    the causal-LM prefix (`transformer.`, `model.`) added where a base model was saved, and per-expert
    tensors stacked into the model's 3-D experts tensors."""
    state = rename_prefixes(state, family.renames)
    keep = (family.prefix, *family.head) if family.prefix else None
    if keep is not None:
        state = {k if k.startswith(keep) else family.prefix + k: v for k, v in state.items()}
    for stack in family.experts:
        state = stack.stack(state)
    return state


def _drop_ignored(state: dict, family: Family) -> dict:
    """Buffers that old checkpoints saved but that carry no weights (causal masks, rotary tables)."""
    return {k: v for k, v in state.items() if not any(k.endswith(suffix) for suffix in family.ignore)}


def _untie(state: dict, tied: bool, embed_key: str, head_key: str, where: str) -> dict:
    """Drop a tied head (checked equal to the embedding first); a tied contract never stores it."""
    if tied and head_key in state:
        if not torch.equal(state[head_key], state[embed_key]):
            raise ValueError(f"{where}: `tie_word_embeddings` is set but `{head_key}` differs from `{embed_key}`.")
        state = {k: v for k, v in state.items() if k != head_key}
    return state


def _meta_model(build):
    with torch.device("meta"):
        return build()


def _load_assigned(model, state: dict, head_key: str, embed_key: str, tied: bool) -> None:
    """Put real tensors into a meta-initialised model (no random init anywhere)."""
    state = dict(state)
    if tied:
        state[head_key] = state[embed_key]
    model.load_state_dict(state, strict=True, assign=True)
    if tied:
        model.tie_weights()


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
    get_family(raw["model_type"])  # an unknown family is refused by name before transformers is asked
    return AutoConfig.from_pretrained(str(src))


def _read_source(src: Path, gguf_file: str | None, allow_bin: bool):
    _check_source(src, gguf_file)
    if gguf_file is not None:
        state, src_cfg, tokenizer, generation_config = read_gguf(src, gguf_file)
        return state, src_cfg, tokenizer, generation_config
    src_cfg = _source_config(src)
    return read_safetensors_folder(src, allow_bin=allow_bin), src_cfg, None, None


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
    from tqdm.auto import tqdm

    from modular_decoder import ModularDecoderConfig, ModularDecoderForCausalLM
    from modular_decoder.tools.cards import render_model_card

    src, out = Path(src_dir), Path(out_dir)
    embed, head = "model.embed_tokens.weight", "lm_head.weight"
    with input_checks():
        check_destination(out, force, sources=(src,))  # before any work: never the source, nor a folder holding it
        torch_dtype = _dtype(dtype)
        state, src_cfg, tokenizer, generation_config = _read_source(src, gguf_file, allow_bin)
        family = get_family(src_cfg.model_type)
        state = _drop_ignored(_model_names(state, family), family)
        cfg = ModularDecoderConfig(**_with_mtp_layers(family.to_contract(src_cfg), family, src_cfg, state, src))
        with tqdm(total=len(state), desc=f"converting {family.name}", unit="tensor", disable=not progress) as bar:
            ours = apply_rules(family.rules(src_cfg), state, cfg, progress=bar.update)
        ours = _untie(ours, cfg.tie_word_embeddings, embed, head, "source")
    cfg.architectures = ["ModularDecoderForCausalLM"]
    if torch_dtype is None:
        torch_dtype = ours[embed].dtype
    ours = {k: v.to(torch_dtype) if v.is_floating_point() else v for k, v in ours.items()}
    cfg.dtype = torch_dtype

    model = _meta_model(lambda: ModularDecoderForCausalLM(cfg))
    expected = {k: v.shape for k, v in model.state_dict().items() if not (cfg.tie_word_embeddings and k == head)}
    with input_checks():
        check_shapes(ours, expected, f"converting {src}")
    _load_assigned(model, ours, head, embed, cfg.tie_word_embeddings)

    with atomic_folder(out, force=force, sources=(src,)) as tmp:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if generation_config is not None:
            generation_config.save_pretrained(tmp)
        copy_side_files(src, tmp)
        (tmp / "README.md").write_text(render_model_card(cfg, base_model=base_model))
    if verify:
        diff = compare_with_source(src, out, gguf_file=gguf_file)
        print(f"largest logit difference (source vs converted, fp32): {diff:.3e}")
    return out


def export(src_dir, out_dir, family: str, force: bool = False, progress: bool = True,
           input_checks=contextlib.nullcontext) -> Path:
    """Write a modular_decoder folder back in `family`'s own transformers format (the inverse map).

    Raises `ValueError` naming the contract fields the family cannot express. `input_checks`: as
    for `convert`.
    """
    from tqdm.auto import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM

    from modular_decoder import ModularDecoderConfig

    src, out = Path(src_dir), Path(out_dir)
    embed, head = "model.embed_tokens.weight", "lm_head.weight"
    with input_checks():
        check_destination(out, force, sources=(src,))
        fam = get_family(family)
        _check_source(src)
        cfg = AutoConfig.from_pretrained(str(src))
        if not isinstance(cfg, ModularDecoderConfig):
            raise ValueError(f"{src} is not a modular_decoder checkpoint (model_type={cfg.model_type!r}).")
        src_cfg = fam.from_contract(cfg)
        _check_round_trip(cfg, ModularDecoderConfig(**fam.to_contract(src_cfg)), fam.name)
        state = _untie(read_safetensors_folder(src), cfg.tie_word_embeddings, embed, head, str(src))
    with tqdm(total=len(state), desc=f"exporting {fam.name}", unit="tensor", disable=not progress) as bar:
        theirs = apply_rules(fam.rules(src_cfg), state, cfg, direction="inverse", progress=bar.update)
    theirs, mtp = _split_mtp(theirs, fam, cfg)
    src_cfg.architectures = None
    model = _meta_model(lambda: AutoModelForCausalLM.from_config(src_cfg))
    their_embed_key = _param_name(model, model.get_input_embeddings().weight)
    their_head_key = _param_name(model, model.get_output_embeddings().weight, exclude=their_embed_key)
    tied = cfg.tie_word_embeddings
    expected = {k: v.shape for k, v in model.state_dict().items() if not (tied and k == their_head_key)}
    check_shapes(theirs, expected, f"exporting to {fam.name}")
    src_cfg.dtype = theirs[their_embed_key].dtype
    _load_assigned(model, theirs, their_head_key, their_embed_key, tied)
    with atomic_folder(out, force=force, sources=(src,)) as tmp:
        model.save_pretrained(tmp)
        if mtp:
            add_safetensors_shard(tmp, mtp)
        copy_side_files(src, tmp)
    return out


def _with_mtp_layers(fields: dict, family: Family, src_cfg, state: dict, src: Path) -> dict:
    """The contract's `num_mtp_layers`: the MTP modules the source's files hold (a folder without them converts
    without them, whatever config.json declares); files holding another number than it declares are refused."""
    if family.mtp_layers is None:
        return fields
    held = count_mtp_layers(state, family.mtp_layers, src_cfg.num_hidden_layers)
    declared = fields.get("num_mtp_layers", 0)
    if held and held != declared:
        raise ValueError(f"{src}: config.json declares {declared} multi-token-prediction module(s) "
                         f"(`num_mtp_layers` / `num_nextn_predict_layers`) and the files hold {held} (from layer "
                         f"{src_cfg.num_hidden_layers} on): fix config.json.")
    return {**fields, "num_mtp_layers": held}


def _split_mtp(theirs: dict, family: Family, cfg) -> tuple[dict, dict]:
    """(the tensors the family's transformers model holds, the MTP modules' tensors it does not hold): those are
    written beside `save_pretrained`'s files, one tensor per expert as the files of the model's layers are."""
    if family.mtp_layers is None or not cfg.num_mtp_layers:
        return theirs, {}
    prefixes = tuple(family.mtp_layers.format(mtp_layer=cfg.num_hidden_layers + k) for k in range(cfg.num_mtp_layers))
    mtp = {k: v for k, v in theirs.items() if k.startswith(prefixes)}
    for stack in family.experts:
        mtp = stack.unstack(mtp)
    return {k: v for k, v in theirs.items() if not k.startswith(prefixes)}, mtp


def _param_name(model, param, exclude: str | None = None) -> str:
    return next(name for name, p in model.named_parameters(remove_duplicate=False) if p is param and name != exclude)


def _check_round_trip(cfg, back, family: str) -> None:
    """Export may not change the math: the family's config must translate back to the same contract."""
    ours, theirs = cfg.to_dict(), back.to_dict()
    unread = _NOT_MATH | _unread_fields(cfg)
    fields = [name for name in type(cfg).__annotations__ if name not in unread]
    differ = [f"{name}={ours.get(name)!r} (the {family} config gives {theirs.get(name)!r})"
              for name in fields if ours.get(name) != theirs.get(name)]
    if differ:
        raise ValueError(f"The {family} format cannot express this checkpoint's " + "; ".join(differ) + ".")


def _unread_fields(cfg) -> set[str]:
    """Fields no module of this config reads: the dense width of a model whose layers are all sparse
    (families such as Mixtral name only the experts' width)."""
    kinds = getattr(cfg, "mlp_layer_types", None)
    return {"intermediate_size"} if kinds and "dense" not in kinds else set()


@torch.no_grad()
def compare_with_source(src_dir, converted_dir, gguf_file: str | None = None, prompt: str = VERIFY_PROMPT) -> float:
    """Largest |logit| difference between the source (transformers' own class) and the converted model
    on a fixed prompt, both in fp32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from modular_decoder import ModularDecoderForCausalLM  # noqa: F401  (registers the family)

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    source = AutoModelForCausalLM.from_pretrained(str(src_dir), dtype=torch.float32, **kwargs).eval()
    converted = AutoModelForCausalLM.from_pretrained(str(converted_dir), dtype=torch.float32).eval()
    try:
        ids = AutoTokenizer.from_pretrained(str(converted_dir))(prompt, return_tensors="pt").input_ids
    except (OSError, ValueError, TypeError):
        ids = torch.arange(16).unsqueeze(0) % converted.config.vocab_size
    ids = ids[:, : converted.config.max_position_embeddings]
    return (source(ids).logits.float() - converted(ids).logits.float()).abs().max().item()
