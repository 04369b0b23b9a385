"""DeepSeek-V3 and GLM-4.5 with their multi-token-prediction modules (DeepSeek's file layout: module k is layer
`num_hidden_layers + k`): the folder converts with them and exports back bit for bit, and `generate(use_mtp=True)`
drafts exactly as transformers' `DeepseekV3ForCausalLM` / `Glm4MoeForCausalLM` (its `MtpModel`) does for the same
weights: every draft, its logits and every token, greedy and sampled, with one and two modules (GLM-4.5: one, as
released)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.generation import candidate_generator

from modular_decoder import ModularDecoderForCausalLM
from modular_decoder.conversion import convert, export
from modular_decoder.mtp_generation import MtpCandidateGenerator, recorded_drafts
from mtp_cases import (deepseek_v3_config, mtp_file_tensors, mtp_reference, save_deepseek_v3_with_mtp,
                       save_trained_deepseek_v3_with_mtp)

# counting (drafts accepted), then text the model never learned (drafts rejected: the MTP cache's roll-back)
PROMPTS = [torch.tensor([[5, 6, 7, 8]]), torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]])]


@pytest.fixture(scope="module", params=[("deepseek_v3", 1), ("deepseek_v3", 2), ("glm4_moe", 1)],
                ids=["one-module", "two-modules", "glm4_moe"])
def folders(request, tmp_path_factory):
    """(a folder in the Hub's layout whose model and MTP modules learned to count, its conversion, the number of
    modules, the family)."""
    family, count = request.param
    root = tmp_path_factory.mktemp(f"mtp-{family}-{count}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = save_trained_deepseek_v3_with_mtp(root, count, family=family)
        convert(src, root / "ours", progress=False)
    finally:
        torch.set_num_threads(threads)
    return src, root / "ours", count, family


def test_converts_with_the_modules_and_exports_back_bit_for_bit(folders, tmp_path):
    src, ours, count, family = folders
    config = json.loads((ours / "config.json").read_text())
    assert config["num_mtp_layers"] == count
    model = ModularDecoderForCausalLM.from_pretrained(ours)
    assert len(model.mtp.layers) == count
    # experts, as the model's last layer has (DeepSeek-V3: MLA + MoE)
    assert model.mtp.layers[0].mtp_block.mlp.experts.gate_up_proj.shape[0] == config["num_experts"]
    export(ours, tmp_path / "back", family=family, progress=False)
    before, after = mtp_file_tensors(src, 2), mtp_file_tensors(tmp_path / "back", 2)
    assert sorted(before) == sorted(after) and len(before) > 10
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name
    exported = json.loads((tmp_path / "back" / "config.json").read_text())
    assert exported.get("num_nextn_predict_layers", exported.get("num_mtp_layers")) == count


class Recorder:
    """Every draft the MTP candidate generators return: transformers' and ours."""

    def __init__(self, monkeypatch):
        self.calls: dict[str, list] = {}
        for name, generator_class in (("transformers", candidate_generator.MTPCandidateGenerator),
                                      ("ours", MtpCandidateGenerator)):
            monkeypatch.setattr(generator_class, "get_candidates", self._recording(name, generator_class.get_candidates))

    def _recording(self, name, original):
        def recorded(generator, input_ids, *args, **kwargs):
            ids, logits = original(generator, input_ids, *args, **kwargs)
            if logits is not None:
                self.calls.setdefault(name, []).append((ids[:, input_ids.shape[1]:].clone(), logits.clone()))
            return ids, logits

        return recorded


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sample"])
@pytest.mark.parametrize("prompt", [0, 1], ids=["accepted", "rejected"])
def test_drafts_and_tokens_equal_transformers(folders, sample, prompt, monkeypatch):
    src, ours, count, family = folders
    reference, model = mtp_reference(src, family), ModularDecoderForCausalLM.from_pretrained(ours).eval()
    recorder = Recorder(monkeypatch)
    # every step drafts (transformers' generator does; ours by default drafts where it pays on this machine)
    kwargs = dict(max_new_tokens=16, do_sample=sample, use_mtp=True, num_assistant_tokens_schedule="constant")
    if sample:
        kwargs.update(top_k=0, top_p=1.0, temperature=1.0)
    outputs = {}
    for name, generator in (("transformers", reference), ("ours", model)):
        torch.manual_seed(7)
        with recorded_drafts() as stats:
            outputs[name] = generator.generate(PROMPTS[prompt], **kwargs)
    assert torch.equal(outputs["ours"], outputs["transformers"])
    theirs, mine = recorder.calls["transformers"], recorder.calls["ours"]
    assert len(mine) == len(theirs) >= 3
    for (their_ids, their_logits), (my_ids, my_logits) in zip(theirs, mine, strict=True):
        assert torch.equal(my_ids, their_ids) and my_ids.shape[1] <= count
        torch.testing.assert_close(my_logits, their_logits, rtol=1e-5, atol=1e-5)
    if prompt == 0 and not sample:  # the counting prompt's drafts were accepted
        assert stats.acceptance(16) > 0.5
    if not sample:  # lossless: the tokens of greedy decoding without drafts
        assert torch.equal(outputs["ours"], model.generate(PROMPTS[prompt], max_new_tokens=16, do_sample=False))


def test_a_folder_without_the_modules_converts_as_before(tmp_path):
    import transformers as tf

    from conversion_cases import perturbed

    config = deepseek_v3_config(1)  # transformers' default declares one module; the files hold none
    perturbed(tf.DeepseekV3ForCausalLM(config)).save_pretrained(tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "ours", progress=False)
    model = ModularDecoderForCausalLM.from_pretrained(tmp_path / "ours")
    assert model.config.num_mtp_layers == 0 and model.mtp is None
    assert not any("mtp" in name for name in load_file(str(tmp_path / "ours" / "model.safetensors")))
    with pytest.raises(ValueError, match="`use_mtp=True`.*`num_mtp_layers`=0"):
        model.generate(PROMPTS[0], use_mtp=True, max_new_tokens=2)


def test_files_that_disagree_with_the_config_are_refused(tmp_path):
    src = save_deepseek_v3_with_mtp(tmp_path / "src", 1)
    config = json.loads((src / "config.json").read_text())
    key = "num_nextn_predict_layers" if "num_nextn_predict_layers" in config else "num_mtp_layers"
    (src / "config.json").write_text(json.dumps({**config, key: 2}))
    with pytest.raises(ValueError, match="declares 2 multi-token-prediction module"):
        convert(src, tmp_path / "out", progress=False)
    (src / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.layers.2.shared_head.head.weight"] = tensors["model.layers.2.shared_head.head.weight"] + 1
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="shared_head.head.weight` should be a copy of `lm_head.weight"):
        convert(src, tmp_path / "out2", progress=False)
    del tensors["model.layers.2.shared_head.head.weight"]  # without it, the embedding's copy is still checked
    tensors["model.layers.2.embed_tokens.weight"] = tensors["model.layers.2.embed_tokens.weight"] * 2
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="embed_tokens.weight` should be a copy of `model.embed_tokens.weight"):
        convert(src, tmp_path / "out3", progress=False)
    assert not any((tmp_path / name).exists() for name in ("out", "out2", "out3"))


@pytest.mark.parametrize("dropped", [("embed_tokens",), ("shared_head.head",), ("embed_tokens", "shared_head.head")])
def test_a_folder_without_the_modules_copies_of_embedding_and_head_reads_the_main_ones(tmp_path, dropped):
    """DeepSeek's files repeat the embedding and the head in each MTP module (`model.layers.{n + k}.embed_tokens`,
    `.shared_head.head`); transformers' `MtpModel` uses the main ones, so a folder without the copies converts to the
    same model, and export writes them back (DeepSeek's published layout: vLLM's DeepSeek MTP loads each module's
    head from its `shared_head.head`)."""
    src = save_deepseek_v3_with_mtp(tmp_path / "src", 2)
    full = convert(src, tmp_path / "full", progress=False)
    tensors = load_file(str(src / "model.safetensors"))
    removed = [f"model.layers.{n}.{part}.weight" for n in (2, 3) for part in dropped]
    save_file({k: v for k, v in tensors.items() if k not in removed}, str(src / "model.safetensors"),
              metadata={"format": "pt"})
    stripped = convert(src, tmp_path / "stripped", progress=False)
    assert (stripped / "model.safetensors").read_bytes() == (full / "model.safetensors").read_bytes()
    back = export(stripped, tmp_path / "back", family="deepseek_v3", progress=False)
    written = load_file(str(back / "model.safetensors"))
    assert sorted(written) == sorted(tensors)
    assert all(torch.equal(written[name], tensor) for name, tensor in tensors.items())
