"""pipeline("text-generation") and chat templates on a converted checkpoint equal the source model's;
device_map="auto" with CPU + disk offload generates the same tokens as the plain load."""

from __future__ import annotations

import pytest
import torch
from tiny_tokenizer import tiny_tokenizer
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, pipeline

from modular_decoder import ModularDecoderForCausalLM, preset_config
from modular_decoder.conversion import convert


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))
    llama.save_pretrained(root / "src")
    tiny_tokenizer().save_pretrained(root / "src")
    convert(root / "src", root / "out", progress=False)
    return root / "src", root / "out"


def test_text_generation_pipeline_matches_source(converted):
    src, out = converted
    ours = pipeline("text-generation", model=str(out), trust_remote_code=True)
    theirs = pipeline("text-generation", model=str(src))
    assert isinstance(ours.model, ModularDecoderForCausalLM)
    assert ours.tokenizer.chat_template == theirs.tokenizer.chat_template is not None
    chat = [{"role": "user", "content": "hello world"}]
    for prompt in ("the quick brown", chat):
        got = ours(prompt, max_new_tokens=10, do_sample=False)
        assert got == theirs(prompt, max_new_tokens=10, do_sample=False)
    assert got[0]["generated_text"][-1]["role"] == "assistant"


def test_offloaded_device_map_auto_generates_the_same(tmp_path):
    model = ModularDecoderForCausalLM(preset_config("gemma2", tiny=True, num_hidden_layers=4)).eval()
    model.save_pretrained(tmp_path / "ckpt")
    ids = torch.tensor([[5, 7, 11, 13, 17, 19]])
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    expected = plain.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(expected, model.generate(ids, max_new_tokens=8, do_sample=False))

    # 500 KB of CPU memory for ~630 KB of fp32 weights (blocks of ~148 KB, local/global alternating):
    # the first blocks stay on the CPU, the rest are offloaded to disk.
    offloaded = AutoModelForCausalLM.from_pretrained(
        tmp_path / "ckpt", device_map="auto", max_memory={"cpu": "500KB"}, offload_folder=str(tmp_path / "offload"),
    ).eval()
    device_map = offloaded.hf_device_map
    blocks = {name: device for name, device in device_map.items() if name.startswith("model.layers.")}
    assert set(blocks) == {f"model.layers.{i}" for i in range(4)}, device_map  # `_no_split_modules`: whole blocks
    assert set(blocks.values()) == {"cpu", "disk"}, device_map
    assert torch.equal(offloaded.generate(ids, max_new_tokens=8, do_sample=False), expected)
