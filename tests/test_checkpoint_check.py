"""`from_pretrained` refuses a checkpoint whose tensors do not match its config, naming the tensors,
from the safetensors headers and before transformers builds or allocates anything; `strict=False` opts out."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModel, AutoModelForCausalLM, PreTrainedModel

from modular_decoder import ModularDecoderForCausalLM, preset_config
from modular_decoder.checkpoint_checks import read_safetensors_header

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A tiny GPT-2-style checkpoint (learned positions, pre-norm with biases, tied head)."""
    path = tmp_path_factory.mktemp("ckpt") / "gpt2"
    torch.manual_seed(0)
    ModularDecoderForCausalLM(preset_config("gpt2", tiny=True)).save_pretrained(path)
    return path


def copy_with(saved: Path, dest: Path, **config) -> Path:
    shutil.copytree(saved, dest)
    data = json.loads((dest / "config.json").read_text())
    data.update(config)
    (dest / "config.json").write_text(json.dumps(data))
    return dest


@pytest.fixture
def never_built(monkeypatch):
    """transformers' own `from_pretrained` (which builds the model and loads the weights) must not run."""
    def refuse(*args, **kwargs):
        raise AssertionError("transformers' from_pretrained ran: the check came too late")

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(refuse))


def refused(path, **kwargs) -> str:
    with pytest.raises(ValueError, match="do not match its config") as info:
        AutoModelForCausalLM.from_pretrained(path, **kwargs)
    return str(info.value)


def test_matching_checkpoints_load(saved, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(saved)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied head: absent from the file, fine
    base = AutoModel.from_pretrained(saved)  # the base model from a causal LM's checkpoint
    base.save_pretrained(tmp_path / "base")
    AutoModelForCausalLM.from_pretrained(tmp_path / "base")  # and back: the names take the prefix
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    AutoModelForCausalLM.from_pretrained(tmp_path / "sharded")


def test_missing_tensor_is_named(saved, tmp_path, never_built):
    path = copy_with(saved, tmp_path / "x")
    weights = load_file(path / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    message = refused(path)
    assert "missing (1): model.layers.1.mlp.up_proj.weight" in message and "unexpected" not in message


def test_missing_tensor_in_a_shard_is_named(saved, tmp_path, never_built, monkeypatch):
    monkeypatch.undo()  # save through transformers first
    ModularDecoderForCausalLM.from_pretrained(saved).save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    shard = tmp_path / "sharded" / index["weight_map"]["model.layers.0.self_attn.q_proj.weight"]
    weights = load_file(shard)
    del weights["model.layers.0.self_attn.q_proj.weight"]
    save_file(weights, str(shard), metadata={"format": "pt"})
    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(lambda *a, **k: pytest.fail("too late")))
    assert "missing (1): model.layers.0.self_attn.q_proj.weight" in refused(tmp_path / "sharded")


def test_one_layer_more_in_the_config(saved, tmp_path, never_built):
    message = refused(copy_with(saved, tmp_path / "x", num_hidden_layers=3, layer_types=None))
    assert "missing (16): " in message and "model.layers.2.self_attn.q_proj.weight" in message
    assert "model.layers.1." not in message


def test_one_layer_fewer_in_the_config(saved, tmp_path, never_built):
    message = refused(copy_with(saved, tmp_path / "x", num_hidden_layers=1, layer_types=None))
    assert "unexpected (16): " in message and "model.layers.1.mlp.up_proj.weight" in message
    assert "missing" not in message


def test_norm_position_changed(saved, tmp_path, never_built):
    message = refused(copy_with(saved, tmp_path / "x", norm_position="post", final_norm=None))
    assert "model.layers.0.post_attn_norm.weight" in message.split("unexpected")[0]  # missing
    assert "model.final_norm.weight" in message.split("unexpected")[1]  # post-norm has no final norm
    assert "model.layers.0.pre_attn_norm.weight" in message.split("unexpected")[1]


def test_wrong_shapes_are_named(saved, tmp_path, never_built):
    config = json.loads((saved / "config.json").read_text())
    message = refused(copy_with(saved, tmp_path / "x", intermediate_size=config["intermediate_size"] + 8))
    wide = config["intermediate_size"] + 8
    assert f"model.layers.0.mlp.up_proj.weight (checkpoint ({config['intermediate_size']}, " in message
    assert f"config ({wide}, {config['hidden_size']}))" in message


def test_absurd_learned_positions_fail_fast(saved, tmp_path, never_built):
    path = copy_with(saved, tmp_path / "x", max_position_embeddings=2 * 10**7)
    started = time.perf_counter()
    message = refused(path)
    assert time.perf_counter() - started < 10
    assert "model.embed_positions.embed.weight (checkpoint (128, 64), config (20000000, 64))" in message


def test_absurd_layer_count_fails_fast(saved, tmp_path, never_built):
    path = copy_with(saved, tmp_path / "x", num_hidden_layers=10**6, layer_types=None)
    started = time.perf_counter()
    message = refused(path)
    assert time.perf_counter() - started < 30
    assert "`num_hidden_layers`=1000000 but the checkpoint holds layers 0-1" in message


def test_strict_false_loads_a_partial_checkpoint(saved, tmp_path):
    path = copy_with(saved, tmp_path / "x", num_hidden_layers=3, layer_types=None)
    model = AutoModelForCausalLM.from_pretrained(path, strict=False)
    assert len(model.model.layers) == 3
    original = load_file(saved / "model.safetensors")
    torch.testing.assert_close(model.model.layers[0].mlp.up_proj.weight, original["model.layers.0.mlp.up_proj.weight"])


def test_ignore_mismatched_sizes_lets_shapes_through(saved, tmp_path):
    config = json.loads((saved / "config.json").read_text())
    path = copy_with(saved, tmp_path / "x", intermediate_size=config["intermediate_size"] + 8)
    model = AutoModelForCausalLM.from_pretrained(path, ignore_mismatched_sizes=True)
    assert model.model.layers[0].mlp.up_proj.weight.shape[0] == config["intermediate_size"] + 8


def test_keyword_overrides_reach_the_check(saved, never_built):
    with pytest.raises(ValueError, match=r"missing \(16\)"):
        AutoModelForCausalLM.from_pretrained(saved, num_hidden_layers=3, layer_types=["full_attention"] * 3)


def test_truncated_weights_are_named(saved, tmp_path, never_built):
    path = copy_with(saved, tmp_path / "x")
    weights = path / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size - 1)
    with pytest.raises(ValueError, match=rf"{weights} is truncated: tensor"):
        AutoModelForCausalLM.from_pretrained(path)
    with pytest.raises(ValueError, match="is truncated or damaged: its header claims"):
        read_safetensors_header(truncated_header(tmp_path / "y.safetensors"))


def truncated_header(path: Path) -> Path:
    path.write_bytes((10**6).to_bytes(8, "little") + b'{"a": ')
    return path


# --------------------------------------------------------------------------------------------------
# transformers' loading semantics, beside its Llama: what it loads by design loads here too, reported the same


def _untied_pair():
    """Our tiny Llama-architecture model and transformers' Llama of the same sizes, both with an untied head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    ours = preset_config("smollm2", tiny=True)
    ours = type(ours)(**{**ours.to_dict(), "tie_word_embeddings": False})
    llama = LlamaConfig(vocab_size=ours.vocab_size, hidden_size=ours.hidden_size,
                        intermediate_size=ours.intermediate_size, num_hidden_layers=ours.num_hidden_layers,
                        num_attention_heads=ours.num_attention_heads, num_key_value_heads=ours.num_key_value_heads,
                        tie_word_embeddings=False)
    return [(ModularDecoderForCausalLM, ours), (LlamaForCausalLM, llama)]


def _load_reported(model_class, path, **kwargs):
    from transformers.testing_utils import CaptureLogger
    from transformers.utils import logging

    with CaptureLogger(logging.get_logger("transformers.modeling_utils")) as log:
        model, info = model_class.from_pretrained(path, output_loading_info=True, **kwargs)
    return model, info, log.out


@pytest.mark.parametrize("ignore_mismatched_sizes", [False, True])
def test_base_checkpoint_into_causal_lm_adds_a_head_as_llama_does(tmp_path, ignore_mismatched_sizes):
    """transformers' `test_correct_missing_keys` / `test_base_model_prefix_loads_base_weights`: a base model's
    checkpoint loads into `ForCausalLM` with every body weight, a fresh head reported missing and a load report."""
    for model_class, config in _untied_pair():
        torch.manual_seed(0)
        base = model_class(config).model
        base.save_pretrained(tmp_path / model_class.__name__)
        model, info, log = _load_reported(model_class, tmp_path / model_class.__name__,
                                          ignore_mismatched_sizes=ignore_mismatched_sizes)
        assert info["missing_keys"] == {"lm_head.weight"}, model_class
        assert not info["unexpected_keys"] and not info["mismatched_keys"], model_class
        assert "lm_head.weight" in log and "MISSING" in log, model_class
        for name, tensor in base.state_dict().items():
            torch.testing.assert_close(model.model.state_dict()[name], tensor, rtol=0, atol=0)


def test_checkpoint_of_nothing_loads_reported_as_llama(tmp_path):
    """transformers' `test_model_weights_reload_no_missing_tied_weights`: a file holding none of the model's
    tensors loads; every parameter is reported missing (tied second names excepted), the stray tensor unexpected."""
    for model_class, config in _untied_pair():
        path = tmp_path / model_class.__name__
        model_class(config).save_pretrained(path)
        save_file({"tensor": torch.tensor([1, 2])}, str(path / "model.safetensors"), metadata={"format": "pt"})
        model, info, _ = _load_reported(model_class, path)
        assert info["missing_keys"] == set(model.state_dict()), model_class
        assert info["unexpected_keys"] == {"tensor"}, model_class


def test_a_held_part_that_does_not_match_is_still_refused(tmp_path, never_built):
    """The head is loaded fresh only where the checkpoint has none: a checkpoint holding a head of another
    shape (here a head bias the config lacks) is refused, as is a body with a layer missing."""
    (_, config), _ = _untied_pair()
    path = tmp_path / "x"
    with torch.device("meta"):
        names = ModularDecoderForCausalLM(config).state_dict()
    weights = {k: torch.zeros(v.shape) for k, v in names.items()}
    weights["lm_head.bias"] = torch.zeros(config.vocab_size)
    path.mkdir()
    config.save_pretrained(path)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    assert "unexpected (1): lm_head.bias" in refused(path)
    del weights["lm_head.bias"], weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    assert "missing (1): model.layers.1.mlp.up_proj.weight" in refused(path)
