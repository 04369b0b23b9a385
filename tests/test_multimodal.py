"""Multimodal releases (Gemma 3, Mistral 3, Qwen3.5, Gemma 4, Llama 4, Gemma 3n folders) made with transformers' own
wrapper classes and a tiny vision tower: the language model converts with the wrapper class's text logits and greedy
tokens, the rest is kept untouched in `multimodal/`, and `export --family <release>` writes every tensor of the release
back bit for bit, which the wrapper class loads with the same logits. A changed language model (LoRA merged; a layer
dropped by `reshape`) exports back into the release; a width the kept vision tower cannot feed is refused.

Gemma 3n's wrapper builds its vision tower through timm (MobileNetV5), and timm imports torchvision, whose wheels on the
package index do not load beside this CPU build of torch: its release is built by the wrapper class with that tower
left empty (`no_vision_tower`; the class's text path never calls it), and the tower's tensors are written into the
folder by hand under timm's names. Everything else is the wrapper class's own: the language model, the audio tower,
the image and audio token embedders, the tied head."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import shutil
from pathlib import Path
from unittest import mock

import pytest
import torch
import transformers as tf
from conversion_cases import CASES as TEXT_CASES
from conversion_cases import MINISTRAL3_ROPE, perturbed
from mtp_cases import QWEN_LAYERS, save_qwen3_next_with_mtp
from packaging.version import Version
from safetensors.torch import load_file, save_file
from tiny_tokenizer import tiny_tokenizer
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText
from transformers.models.gemma3n import modeling_gemma3n

import modular_decoder  # noqa: F401  (registers the family with the Auto classes)
from modular_decoder.commands import main
from modular_decoder.conversion import convert, export, get_family
from modular_decoder.conversion.multimodal import KEPT_FOLDER, MANIFEST

V, D = 96, 32
TEXT = dict(vocab_size=V, hidden_size=D, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=128)
PROMPT = torch.tensor([[5, 17, 3, 42, 8, 61, 23, 11, 2, 80, 33, 7], [9, 1, 64, 12, 40, 5, 77, 18, 26, 3, 50, 14]])
PROCESSOR = {"image_processor_type": "SiglipImageProcessor", "size": {"height": 28, "width": 28}}


def _qwen3_5_text(family: str = "qwen3_5_text") -> dict:
    """Qwen3.5's (or Qwen3.5-MoE's: `family`) text model as the hybrid conversion cases build it, 3:1 as released,
    with its MTP module declared."""
    text = TEXT_CASES[family][1]().to_dict()
    text.update(layer_types=QWEN_LAYERS, num_hidden_layers=len(QWEN_LAYERS), mtp_num_hidden_layers=1,
                max_position_embeddings=128)
    return text


RELEASES = {
    "gemma3": lambda: tf.Gemma3Config(
        text_config=dict(TEXT, model_type="gemma3_text", sliding_window=8, query_pre_attn_scalar=16),
        vision_config=dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32,
                           num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14),
        mm_tokens_per_image=4, boi_token_index=92, eoi_token_index=93, image_token_index=94),
    # untied, as Mistral Small 3.1 is
    "mistral3": lambda: tf.Mistral3Config(
        text_config=dict(TEXT, model_type="mistral", sliding_window=None), tie_word_embeddings=False,
        vision_config=dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, image_size=28, patch_size=14, head_dim=8),
        image_token_index=94, spatial_merge_size=2),
    "qwen3_5": lambda: tf.Qwen3_5Config(
        text_config=_qwen3_5_text(),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=D, patch_size=4,
                           spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16),
        image_token_id=94, video_token_id=95, vision_start_token_id=92, vision_end_token_id=93),
    "qwen3_5_moe": lambda: tf.Qwen3_5MoeConfig(
        text_config=_qwen3_5_text("qwen3_5_moe_text"),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=D, patch_size=4,
                           spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16),
        image_token_id=94, video_token_id=95, vision_start_token_id=92, vision_end_token_id=93),
}
# Gemma 3 4B's config.json as published (transformers 4.50's keys: `rope_scaling`, `sliding_window_pattern`, the rest
# left to Gemma3TextConfig's defaults), at this test's sizes
GEMMA3_AS_PUBLISHED = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 92, "eoi_token_index": 93,
    "eos_token_id": [1, 6], "image_token_index": 94, "initializer_range": 0.02, "mm_tokens_per_image": 4,
    "model_type": "gemma3", "torch_dtype": "float32", "transformers_version": "4.50.0.dev0",
    "text_config": {"hidden_size": D, "intermediate_size": 64, "model_type": "gemma3_text", "num_hidden_layers": 2,
                    "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 8,
                    "sliding_window_pattern": 2, "vocab_size": V, "num_attention_heads": 4, "num_key_value_heads": 2,
                    "head_dim": 8, "query_pre_attn_scalar": 8},
    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 16, "intermediate_size": 32,
                      "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 28, "patch_size": 14},
}
RELEASES["gemma3-published-config"] = lambda: tf.Gemma3Config.from_dict(GEMMA3_AS_PUBLISHED)
# Ministral 3: its text model `ministral3` (YaRN, the query temperature stepping every 4 positions here)
RELEASES["mistral3-ministral3"] = lambda: tf.Mistral3Config(
    text_config=dict(TEXT, model_type="ministral3", sliding_window=None, rope_parameters=dict(MINISTRAL3_ROPE)),
    tie_word_embeddings=False,
    vision_config=dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, image_size=28, patch_size=14, head_dim=8),
    image_token_index=94, spatial_merge_size=2)
# Gemma 4: its text model as the conversion cases build it (per-layer embeddings, shared keys and values, k = v) beside
# a one-layer vision tower, no audio tower; Llama 4: chunked attention and a NoPE layer, experts every other layer
TINY_VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
RELEASES["gemma4"] = lambda: tf.Gemma4Config(
    text_config=TEXT_CASES["gemma4_text"][1]().to_dict(), audio_config=None,
    vision_config=dict(TINY_VISION, num_key_value_heads=2, head_dim=8, patch_size=4, position_embedding_size=64,
                       pooling_kernel_size=2),
    boi_token_id=89, eoi_token_id=90, image_token_id=91, video_token_id=92, boa_token_id=93, eoa_token_index=94,
    audio_token_id=95)
RELEASES["llama4"] = lambda: tf.Llama4Config(
    text_config=TEXT_CASES["llama4_text"][1]().to_dict(),
    vision_config=dict(TINY_VISION, image_size=28, patch_size=14, vision_output_dim=D, projector_input_dim=D,
                       projector_output_dim=D),
    boi_token_index=92, eoi_token_index=93, image_token_index=94)
# Gemma 3n: its text model as the conversion cases build it (AltUp, LAUREL, per-layer embeddings, shared keys and
# values), its vocabulary laid out as released: the text tokens, then the image tokens (`vision_config.vocab_offset`,
# where the per-layer table ends), then the audio tokens, each of which the wrapper embeds through its own embedder;
# a one-layer audio tower
GEMMA3N_IMAGE_IDS, GEMMA3N_AUDIO_IDS = range(96, 104), range(104, 112)
RELEASES["gemma3n"] = lambda: tf.Gemma3nConfig(
    text_config=dict(TEXT_CASES["gemma3n_text"][1]().to_dict(), vocab_size=112, vocab_size_per_layer_input=96),
    vision_config=dict(model_type="gemma3n_vision", hidden_size=16, vocab_size=8, vocab_offset=96,
                       label_names=["LABEL_0", "LABEL_1"]),
    audio_config=dict(hidden_size=16, vocab_size=8, vocab_offset=104, input_feat_size=8, conf_num_hidden_layers=1,
                      conf_num_attention_heads=2, sscp_conv_channel_size=[4, 4]),
    boi_token_id=94, boa_token_id=95, eoi_token_id=96, image_token_id=97, eoa_token_id=104, audio_token_id=105)
# MobileNetV5's tensors as Gemma 3n's releases name them (`model.vision_tower.timm_model.*`), at tiny shapes
GEMMA3N_VISION_TENSORS = {"conv_stem.conv.weight": (8, 3, 3, 3), "conv_stem.bn.weight": (8,),
                          "conv_stem.bn.running_mean": (8,), "msfa.ffn.pw_exp.conv.weight": (32, 8, 1, 1),
                          "msfa.norm.weight": (16,)}
# greedy decoding on text: Gemma 3n's image and audio tokens are not text (see test_gemma3n_image_and_audio_tokens_...)
TEXT_ONLY = {"gemma3n": dict(suppress_tokens=[*GEMMA3N_IMAGE_IDS, *GEMMA3N_AUDIO_IDS])}
# case -> what its folder is: as transformers' `save_pretrained` writes the release, or as a published one differs
CASES = {
    "gemma3": "the Llava-era names transformers writes (`language_model.model.*`), tied head",
    "gemma3-modules": "the modules' own names (`model.language_model.*`, `model.vision_tower.*`)",
    "gemma3-published-config": "Gemma 3 4B's config.json as published (linear RoPE scaling on its global layers)",
    "mistral3": "an untied head beside a config.json without `tie_word_embeddings` (its default, true), as published",
    "mistral3-ministral3": "Ministral 3's language model (`ministral3`: the query temperature) inside a mistral3 folder",
    "qwen3_5": "an MTP module in the files (`mtp.*`), which the wrapper class skips",
    "qwen3_5_moe": "Qwen3.5-MoE's language model (experts beside a gated shared expert) and its MTP module",
    "gemma4": "the modules' own names, a tied head, per-layer embeddings in the language model",
    "llama4": "the Llava-era names as Llama 4's wrapper holds them, an untied head",
    "gemma3n": "the modules' own names, a tied head, AltUp and per-layer embeddings, audio and (timm's) vision towers",
}


class _AutoModelWithoutVisionTower:
    """transformers' `AutoModel` as Gemma 3n's wrapper calls it, with the vision tower (timm's MobileNetV5) an empty
    module."""

    @staticmethod
    def from_config(config, **kwargs):
        return torch.nn.Module() if config.model_type == "gemma3n_vision" else AutoModel.from_config(config, **kwargs)


def no_vision_tower():
    """Gemma 3n's wrapper class built without timm (see the module's docstring)."""
    return mock.patch.object(modeling_gemma3n, "AutoModel", _AutoModelWithoutVisionTower)


def make_release(case: str, path: Path) -> Path:
    """A tiny random release folder of `case` saved by transformers' wrapper class, every parameter perturbed, with a
    tokenizer, a chat template and a processor config beside it."""
    torch.manual_seed(0)
    config = RELEASES.get(case, RELEASES[case.split("-")[0]])()
    with no_vision_tower():
        perturbed(AutoModelForImageTextToText.from_config(config)).save_pretrained(path)
    tiny_tokenizer(vocab_size=90).save_pretrained(path)  # its ids below the special tokens
    (path / "preprocessor_config.json").write_text(json.dumps(PROCESSOR, indent=2) + "\n")
    weights = path / "model.safetensors"
    if case == "gemma3-modules":
        moved = {"language_model.model.": "model.language_model.", "vision_tower.": "model.vision_tower.",
                 "multi_modal_projector.": "model.multi_modal_projector."}
        tensors = {next((new + k[len(old):] for old, new in moved.items() if k.startswith(old)), k): v
                   for k, v in load_file(weights).items()}
        save_file(tensors, weights, metadata={"format": "pt"})
    if case == "gemma3-published-config":
        (path / "config.json").write_text(json.dumps(GEMMA3_AS_PUBLISHED, indent=2))
    if case == "mistral3":
        config = json.loads((path / "config.json").read_text())
        del config["tie_word_embeddings"]
        (path / "config.json").write_text(json.dumps(config, indent=2))
    if case == "gemma3n":
        tensors = load_file(weights)
        tensors.update({f"model.vision_tower.timm_model.{name}": torch.randn(shape)
                        for name, shape in GEMMA3N_VISION_TENSORS.items()})
        save_file(tensors, weights, metadata={"format": "pt"})
    if case in ("qwen3_5", "qwen3_5_moe"):
        holder = save_qwen3_next_with_mtp(path.parent / "mtp-holder", family=case + "_text")
        tensors = load_file(weights)
        tensors.update({k: v for k, v in load_file(holder / "model.safetensors").items() if k.startswith("mtp.")})
        save_file(tensors, weights, metadata={"format": "pt"})
    return path


def wrapper(path):
    with no_vision_tower():
        return AutoModelForImageTextToText.from_pretrained(path).eval()


def greedy(model, ids, **kwargs):
    out = model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0, **kwargs)
    return out[:, ids.shape[1]:]


def assert_same_tensors(before: dict, after: dict) -> None:
    assert sorted(after) == sorted(before)
    for name in before:
        assert after[name].dtype == before[name].dtype and torch.equal(after[name], before[name]), name


def non_weight_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file() and not p.name.endswith(".safetensors")}


@pytest.mark.parametrize("case", sorted(CASES))
def test_release_converts_and_exports_back_bit_for_bit(case, tmp_path):
    src = make_release(case, tmp_path / "src")
    release_name = case.split("-")[0]
    convert(src, tmp_path / "md", progress=False)
    release = wrapper(src)
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "md").eval()
    assert ours.config.model_type == "modular_decoder"
    with torch.no_grad():
        expected = release(input_ids=PROMPT).logits
        torch.testing.assert_close(ours(PROMPT).logits, expected, atol=1e-5, rtol=0)
    text_only = TEXT_ONLY.get(release_name, {})
    assert torch.equal(greedy(ours, PROMPT[:1], **text_only), greedy(release, PROMPT[:1], **text_only))
    assert ours.config.tie_word_embeddings == (case.startswith(("gemma3", "gemma4")))
    assert ours.config.num_mtp_layers == (1 if case.startswith("qwen3_5") else 0)

    kept = tmp_path / "md" / KEPT_FOLDER
    source_files = non_weight_files(src)
    assert {k: v for k, v in non_weight_files(kept).items() if k != MANIFEST} == source_files  # untouched
    manifest = json.loads((kept / MANIFEST).read_text())
    assert manifest["release"] == release_name
    held = load_file(src / "model.safetensors")
    kept_tensors = load_file(kept / "model.safetensors")
    assert kept_tensors and not any(name.startswith(tuple(manifest["language_model"])) for name in kept_tensors)
    assert_same_tensors({k: v for k, v in held.items() if k in kept_tensors}, kept_tensors)
    assert (tmp_path / "md" / "tokenizer.json").exists()
    assert f"`multimodal/`; `modular-decoder export THIS BACK --family {release_name}`" in (
        tmp_path / "md" / "README.md").read_text()

    export(tmp_path / "md", tmp_path / "back", family=release_name, progress=False)
    assert_same_tensors(held, load_file(tmp_path / "back" / "model.safetensors"))
    assert non_weight_files(tmp_path / "back") == source_files  # config.json byte for byte: nothing changed
    with torch.no_grad():
        assert torch.equal(wrapper(tmp_path / "back")(input_ids=PROMPT).logits, expected)


@pytest.mark.parametrize("case", ["gemma3", "gemma4", "llama4", "gemma3n"])
def test_a_left_padded_batch_gives_the_wrappers_tokens(case, tmp_path):
    """The wrapper on a left-padded batch (its mask per layer kind, positions from the mask) against ours."""
    src = make_release(case, tmp_path / "src")
    convert(src, tmp_path / "md", progress=False)
    ids = PROMPT.clone()
    mask = torch.ones_like(ids)
    ids[1, :4], mask[1, :4] = 0, 0
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "md").eval()
    kwargs = dict(attention_mask=mask, **TEXT_ONLY.get(case, {}))
    assert torch.equal(greedy(ours, ids, **kwargs), greedy(wrapper(src), ids, **kwargs))


def test_gemma3n_image_and_audio_tokens_embed_through_the_language_models_table(tmp_path, caplog):
    """Gemma 3n's wrapper embeds its image and audio token ids (`vision_config` / `audio_config`'s `vocab_offset` on)
    through `embed_vision` / `embed_audio`, kept in `multimodal/`; the converted language model embeds them through its
    own table, as `Gemma3nForCausalLM` does: its logits are that class's on a prompt holding them, and the wrapper's
    up to the first of them. `convert` says so in a warning, the manifest and the model card."""
    src = make_release("gemma3n", tmp_path / "src")
    with caplog.at_level(logging.WARNING, logger="modular_decoder.conversion.multimodal"):
        convert(src, tmp_path / "md", progress=False)
    said = "embeds token ids 96-103 (`vision_config`) and 104-111 (`audio_config`) through embedders of its own"
    assert said in caplog.text and said in (tmp_path / "md" / "README.md").read_text()
    manifest = json.loads((tmp_path / "md" / KEPT_FOLDER / MANIFEST).read_text())
    assert manifest["ids_embedded_apart"] == {"vision_config": [96, 104], "audio_config": [104, 112]}

    export(tmp_path / "md", tmp_path / "text", family="gemma3n_text", progress=False)
    text_class = AutoModelForCausalLM.from_pretrained(tmp_path / "text").eval()
    assert type(text_class).__name__ == "Gemma3nForCausalLM"
    ids = PROMPT.clone()
    ids[0, 6], ids[1, 3] = GEMMA3N_IMAGE_IDS[1], GEMMA3N_AUDIO_IDS[1]  # an image token, an audio token
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "md").eval()
    with torch.no_grad():
        got, release = ours(ids).logits, wrapper(src)(input_ids=ids).logits
        if Version(tf.__version__) >= Version("5.17"):  # 5.16's text class fails on ids past its per-layer table
            torch.testing.assert_close(got, text_class(ids).logits, atol=1e-5, rtol=0)
    for row, first in ((0, 6), (1, 3)):
        torch.testing.assert_close(got[row, :first], release[row, :first], atol=1e-5, rtol=0)
        assert (got[row, first:] - release[row, first:]).abs().amax(-1).min() > 1e-3  # every position from there


def test_gemma4_placeholder_tokens_embed_through_their_own_rows(tmp_path, caplog):
    """Gemma 4's wrapper embeds its image, video and audio placeholder ids as the text config's pad token (in the
    embedding and the per-layer inputs); the converted language model embeds them through their own rows, as
    `Gemma4ForCausalLM` does: its logits are that class's on a prompt holding them, and the wrapper's where the prompt
    holds the pad token in their place. `convert` says so in a warning, the manifest and the model card."""
    src = make_release("gemma4", tmp_path / "src")
    with caplog.at_level(logging.WARNING, logger="modular_decoder.conversion.multimodal"):
        convert(src, tmp_path / "md", progress=False)
    said = ("embeds the placeholder token ids 91 (`image_token_id`), 92 (`video_token_id`), 95 (`audio_token_id`) as "
            "its pad token")
    assert said in caplog.text and said in (tmp_path / "md" / "README.md").read_text()
    manifest = json.loads((tmp_path / "md" / KEPT_FOLDER / MANIFEST).read_text())
    assert manifest["ids_read_as_pad"] == {"image_token_id": 91, "video_token_id": 92, "audio_token_id": 95}
    assert "ids_embedded_apart" not in manifest

    export(tmp_path / "md", tmp_path / "text", family="gemma4_text", progress=False)
    text_class = AutoModelForCausalLM.from_pretrained(tmp_path / "text").eval()
    assert type(text_class).__name__ == "Gemma4ForCausalLM"
    release = wrapper(src)
    pad = release.config.text_config.pad_token_id
    ids = PROMPT.clone()
    ids[0, 6], ids[1, 3] = 91, 95  # an image placeholder, an audio placeholder
    as_pad = torch.where((ids == 91) | (ids == 95), pad, ids)
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "md").eval()
    with torch.no_grad():
        got = ours(ids).logits
        torch.testing.assert_close(got, text_class(ids).logits, atol=1e-5, rtol=0)
        torch.testing.assert_close(ours(as_pad).logits, release(input_ids=ids).logits, atol=1e-5, rtol=0)
        assert (got - release(input_ids=ids).logits).abs().amax() > 1e-3


@pytest.mark.skipif(importlib.util.find_spec("timm") is not None, reason="timm is installed: the wrapper builds")
def test_verify_of_a_gemma3n_release_without_timm_is_refused_by_name(tmp_path):
    """`--verify` runs the wrapper class, whose vision tower transformers builds through timm."""
    src = make_release("gemma3n", tmp_path / "src")
    with pytest.raises(ValueError, match="`--verify` runs gemma3n's wrapper class, which transformers builds with "
                                         "`timm`, and `import timm` fails here"):
        convert(src, tmp_path / "md", verify=True, progress=False)
    assert not (tmp_path / "md").exists()
    assert main(["convert", str(src), str(tmp_path / "md"), "--verify"]) == 2


def _tuned(md: Path, out: Path) -> torch.nn.Module:
    """The converted model with a LoRA adapter (random, so that it changes the function) merged, saved to `out` with
    the `multimodal/` folder `convert` wrote copied beside it."""
    from peft import LoraConfig, get_peft_model

    model = AutoModelForCausalLM.from_pretrained(md)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    merged = get_peft_model(model, lora).merge_and_unload().eval()
    merged.save_pretrained(out)
    shutil.copytree(md / KEPT_FOLDER, out / KEPT_FOLDER)
    return merged


@pytest.mark.parametrize("case, layers", [("mistral3", "language_model.model.layers."),
                                          ("gemma3n", "model.language_model.layers.")], ids=["mistral3", "gemma3n"])
def test_a_fine_tuned_language_model_exports_into_the_release(case, layers, tmp_path):
    src = make_release(case, tmp_path / "src")
    convert(src, tmp_path / "md", progress=False)
    tuned = _tuned(tmp_path / "md", tmp_path / "tuned")
    export(tmp_path / "tuned", tmp_path / "back", family=case, progress=False)
    back = wrapper(tmp_path / "back")
    with torch.no_grad():
        got = back(input_ids=PROMPT).logits
        torch.testing.assert_close(got, tuned(PROMPT).logits, atol=1e-5, rtol=0)
        assert (got - wrapper(src)(input_ids=PROMPT).logits).abs().max() > 1e-3  # the adapter changed the function
    held, written = load_file(src / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(written) == sorted(held)
    changed = {name for name in held if not torch.equal(held[name], written[name])}
    assert changed and all(name.startswith(layers) for name in changed)
    assert (tmp_path / "back" / "config.json").read_bytes() == (src / "config.json").read_bytes()


def test_a_reshaped_language_model_exports_into_the_release(tmp_path):
    """`reshape --drop-layers 1` carries `multimodal/` along; the release's text config changes only where the
    language model did (its depth and layer kinds), and the wrapper class loads it with the reshaped model's logits."""
    from modular_decoder.tools.reshape.folder import reshape_folder

    src = make_release("gemma3", tmp_path / "src")
    convert(src, tmp_path / "md", progress=False)
    text = tmp_path / "calibration.txt"
    text.write_text(" ".join(["the quick brown fox jumps over the lazy dog. hello world."] * 30))
    reshape_folder(tmp_path / "md", tmp_path / "shallow", drop_layers=1, calibration=text, progress=False)
    assert (tmp_path / "shallow" / KEPT_FOLDER / MANIFEST).is_file()
    export(tmp_path / "shallow", tmp_path / "back", family="gemma3", progress=False)
    shallow = AutoModelForCausalLM.from_pretrained(tmp_path / "shallow").eval()
    with torch.no_grad():
        torch.testing.assert_close(wrapper(tmp_path / "back")(input_ids=PROMPT).logits, shallow(PROMPT).logits,
                                   atol=1e-5, rtol=0)
    before, after = (json.loads((folder / "config.json").read_text()) for folder in (src, tmp_path / "back"))
    assert {k: v for k, v in after.items() if k != "text_config"} == {k: v for k, v in before.items()
                                                                      if k != "text_config"}
    changed = {k for k in after["text_config"] if after["text_config"][k] != before["text_config"].get(k)}
    assert changed == {"num_hidden_layers", "layer_types"}
    held, written = load_file(src / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    vision = {k: v for k, v in held.items() if not k.startswith("language_model.")}
    assert_same_tensors(vision, {k: v for k, v in written.items() if not k.startswith("language_model.")})


def test_a_width_the_kept_parts_cannot_feed_is_refused(tmp_path):
    src = make_release("gemma3", tmp_path / "src")
    convert(src, tmp_path / "md", progress=False)
    config = AutoConfig.from_pretrained(tmp_path / "md")
    config.hidden_size, config.embedding_multiplier = 48, 48**0.5  # Gemma's embedding scale is sqrt(width)
    modular_decoder.ModularDecoderForCausalLM(config).save_pretrained(tmp_path / "wide")
    shutil.copytree(tmp_path / "md" / KEPT_FOLDER, tmp_path / "wide" / KEPT_FOLDER)
    with pytest.raises(ValueError, match="`hidden_size` is 48.*width 32.*--family gemma3_text"):
        export(tmp_path / "wide", tmp_path / "back", family="gemma3", progress=False)
    assert not (tmp_path / "back").exists()
    export(tmp_path / "wide", tmp_path / "text", family="gemma3_text", progress=False)  # the language model alone


def test_what_cannot_go_back_is_refused_by_name(tmp_path):
    src = make_release("gemma3", tmp_path / "src")
    convert(src, tmp_path / "md", progress=False)
    shutil.copytree(tmp_path / "md", tmp_path / "alone", ignore=shutil.ignore_patterns(KEPT_FOLDER))
    with pytest.raises(ValueError, match=f"no {KEPT_FOLDER}/{MANIFEST}.*--family gemma3_text"):
        export(tmp_path / "alone", tmp_path / "back", family="gemma3", progress=False)
    with pytest.raises(ValueError, match="parts of a 'gemma3' release, not of a 'mistral3' one"):
        export(tmp_path / "md", tmp_path / "back", family="mistral3", progress=False)
    assert not (tmp_path / "back").exists()


def _edited(src: Path, out: Path, **changes) -> Path:
    shutil.copytree(src, out)
    config = json.loads((out / "config.json").read_text())
    for key, value in changes.items():
        section, _, field = key.rpartition("__")
        (config[section] if section else config)[field] = value
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_releases_that_do_not_convert_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="'qwen3_5' is a multimodal release, not a text family"):
        get_family("qwen3_5")
    gemma3 = make_release("gemma3", tmp_path / "src")
    softcapped = _edited(gemma3, tmp_path / "softcapped", text_config__final_logit_softcapping=30.0)
    with pytest.raises(ValueError, match="`text_config.final_logit_softcapping` is set, which gemma3's wrapper"):
        convert(softcapped, tmp_path / "out", progress=False)
    for name, moved in (("mixed", {"language_model.model.norm.weight": "model.language_model.norm.weight"}),
                        ("headless", {k: "text_model." + k for k in load_file(gemma3 / "model.safetensors")
                                      if k.startswith("language_model.")})):
        folder = _edited(gemma3, tmp_path / name)
        tensors = load_file(folder / "model.safetensors")
        save_file({moved.get(k, k): v for k, v in tensors.items()}, folder / "model.safetensors")
        what = "mixes the layouts" if name == "mixed" else "holds no language model under"
        with pytest.raises(ValueError, match=f"this gemma3 folder {what} \\['language_model.model.', "):
            convert(folder, tmp_path / "out", progress=False)
    mistral3 = make_release("mistral3", tmp_path / "mistral3")
    unknown = _edited(mistral3, tmp_path / "qwen3-inside", text_config__model_type="qwen3")
    with pytest.raises(ValueError, match="language model is 'qwen3', which does not convert inside a mistral3"):
        convert(unknown, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_cli_convert_verify_and_export_a_release(tmp_path, capsys):
    src = make_release("mistral3", tmp_path / "src")  # a release AutoModelForCausalLM has no class for
    assert main(["convert", str(src), str(tmp_path / "md"), "--verify"]) == 0
    printed = capsys.readouterr().out
    assert float(printed.split("largest logit difference (source vs converted, fp32):")[1].split()[0]) <= 1e-5
    assert main(["export", str(tmp_path / "md"), str(tmp_path / "back"), "--family", "mistral3"]) == 0
    assert_same_tensors(load_file(src / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors"))


def test_a_head_is_compared_with_the_embedding_a_block_of_rows_at_a_time(monkeypatch):
    """Whether a wrapper ties its head (`effective_tie`) reads both tensors in blocks: equal ones are equal, one that
    differs in its last block only is not."""
    from modular_decoder.conversion import multimodal
    from modular_decoder.conversion.sources import tensor_in_memory

    monkeypatch.setattr(multimodal, "BLOCK_BYTES", 3 * 8 * 4)  # three rows of eight float32 per block
    embed = torch.randn(10, 8)
    other = embed.clone()
    other[-1, -1] += 1
    reads = []

    def counted(name, tensor):
        source = tensor_in_memory(name, tensor)
        return dataclasses.replace(source, read_rows=lambda a, b: reads.append((a, b)) or tensor[a:b])

    assert multimodal.same_values(counted("head", embed.clone()), counted("embed", embed))
    assert reads[:4:2] == [(0, 3), (3, 6)] and len(reads) == 8  # four blocks of each
    assert not multimodal.same_values(counted("head", other), counted("embed", embed))
    assert not multimodal.same_values(counted("head", embed[:, :4].clone()), counted("embed", embed))


def test_a_release_published_in_fp8_converts_to_the_wrappers_dequantized_logits(tmp_path):
    """A release whose language model's linear weights are FP8 with block scales (its `quantization_config` is the
    release's, not the text config's) converts dequantized, to the logits of transformers' wrapper class loaded with
    `FineGrainedFP8Config(dequantize=True)`; export into it is refused, its kept config describing a quantized folder."""
    from test_conversion_quantized import QUANTIZATION, quantize_fp8
    from transformers import FineGrainedFP8Config

    src = make_release("mistral3", tmp_path / "src")
    tensors = {}
    for name, tensor in load_file(src / "model.safetensors").items():
        tensor = tensor.to(torch.bfloat16)
        if name.startswith("language_model.model.layers.") and name.endswith("proj.weight"):
            tensors[name], tensors[name + "_scale_inv"] = quantize_fp8(tensor)
        else:
            tensors[name] = tensor.contiguous()
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "quantization_config": QUANTIZATION, "dtype": "bfloat16"}))
    convert(src, tmp_path / "md", progress=False)  # into the release's compute dtype, bf16
    # both compared in float32 from their bf16 weights (transformers 5.16's dequantized load keeps bf16 weights
    # whatever `dtype` asks)
    reference = AutoModelForImageTextToText.from_pretrained(
        src, dtype=torch.bfloat16, quantization_config=FineGrainedFP8Config(dequantize=True)).float().eval()
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "md", dtype=torch.float32).eval()
    assert load_file(tmp_path / "md" / "model.safetensors")["model.embed_tokens.weight"].dtype == torch.bfloat16
    with torch.no_grad():
        torch.testing.assert_close(ours(PROMPT).logits, reference(input_ids=PROMPT).logits, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="published quantized \\('fp8'\\).*--family mistral"):
        export(tmp_path / "md", tmp_path / "back", family="mistral3", progress=False)
    assert not (tmp_path / "back").exists()
