"""Hub repositories: save_for_hub writes a complete remote-code folder (sharded weights, auto_map,
code, generation config, tokenizer, card) that loads without the package; `modular-decoder push`
checks it and calls create_repo + upload_folder."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import torch
from huggingface_hub import ModelCard
from tiny_tokenizer import tiny_tokenizer

from modular_decoder import ModularDecoderForCausalLM, preset_config
from modular_decoder.commands import main
from modular_decoder.tools.hub import check_hub_folder, save_for_hub

CHILD = textwrap.dedent("""
    import json, sys
    sys.modules["modular_decoder"] = None  # the package cannot be imported here
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
    assert "transformers_modules" in type(model).__module__
    tokenizer = AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code=True)
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": "hello world"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    print(json.dumps(out[0].tolist()))
""")


def _hub_folder(tmp_path):
    model = ModularDecoderForCausalLM(preset_config("qwen3", tiny=True)).eval()
    tokenizer = tiny_tokenizer()
    folder = save_for_hub(model, tmp_path / "repo", tokenizer, base_model="Qwen/Qwen3-0.6B", repo_id="me/tiny",
                          max_shard_size="100KB")
    return model, tokenizer, folder


def test_save_for_hub_writes_a_loadable_repo(tmp_path):
    model, tokenizer, folder = _hub_folder(tmp_path)
    names = {p.name for p in folder.iterdir()}
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and shards <= names  # sharded above 100KB
    assert set(index["weight_map"]) == set(model.state_dict()) - {"lm_head.weight"}  # tied head not stored
    config = json.loads((folder / "config.json").read_text())
    assert set(config["auto_map"]) == {"AutoConfig", "AutoModel", "AutoModelForCausalLM"}
    assert {"configuration_modular_decoder.py", "modeling_modular_decoder.py", "attention.py", "cache.py",
            "generation_config.json", "tokenizer.json", "tokenizer_config.json", "README.md"} <= names
    assert not {"cards.py", "hub.py", "cli.py"} & names  # tooling is not remote code
    card = ModelCard.load(folder / "README.md")
    assert card.data.base_model == "Qwen/Qwen3-0.6B" and card.data.library_name == "transformers"
    assert check_hub_folder(folder, need_tokenizer=True) == []

    result = subprocess.run([sys.executable, "-c", CHILD, str(folder)], capture_output=True, text=True,
                            timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": "hello world"}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    with torch.no_grad():
        expected = model.generate(**inputs, max_new_tokens=8, do_sample=False)[0].tolist()
    assert json.loads(result.stdout.strip().splitlines()[-1]) == expected


class FakeApi:
    calls: list = []

    def __init__(self, token=None):
        FakeApi.calls.append(("init", token))

    def create_repo(self, repo_id, **kwargs):
        FakeApi.calls.append(("create_repo", repo_id, kwargs))
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, **kwargs):
        FakeApi.calls.append(("upload_folder", kwargs))

    def upload_file(self, **kwargs):
        FakeApi.calls.append(("upload_file", kwargs))


def test_push_command_up_to_upload(tmp_path, monkeypatch):
    import modular_decoder.commands.push as push

    monkeypatch.setattr(push, "HfApi", FakeApi)
    FakeApi.calls = []
    model = ModularDecoderForCausalLM(preset_config("gpt2", tiny=True))
    model.save_pretrained(tmp_path / "ckpt")  # a plain save: no card yet
    assert main(["push", str(tmp_path / "ckpt"), "me/gpt2-md", "--private", "--base-model", "openai-community/gpt2"]) == 0
    assert ModelCard.load(tmp_path / "ckpt" / "README.md").data.base_model == "openai-community/gpt2"
    kinds = [call[0] for call in FakeApi.calls]
    assert kinds == ["init", "create_repo", "upload_folder", "upload_file"]
    card = FakeApi.calls[3][1]
    assert card["path_in_repo"] == "README.md"
    assert card["path_or_fileobj"] == (tmp_path / "ckpt" / "README.md").read_bytes()  # the card pushed is kept
    assert FakeApi.calls[1][1] == "me/gpt2-md" and FakeApi.calls[1][2]["private"] is True
    upload = FakeApi.calls[2][1]
    assert upload["folder_path"] == str(tmp_path / "ckpt") and upload["repo_id"] == "me/gpt2-md"


def test_push_refuses_an_incomplete_folder(tmp_path, monkeypatch, capsys):
    import modular_decoder.commands.push as push

    monkeypatch.setattr(push, "HfApi", FakeApi)
    FakeApi.calls = []
    ModularDecoderForCausalLM(preset_config("gpt2", tiny=True)).save_pretrained(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "modeling_modular_decoder.py").unlink()
    capsys.readouterr()  # the save's progress bar
    assert main(["push", str(tmp_path / "ckpt"), "me/x"]) == 2  # a user error: one line on stderr
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "modeling_modular_decoder.py" in err[0]
    assert FakeApi.calls == []


class OfflineApi(FakeApi):
    def create_repo(self, repo_id, **kwargs):
        raise OSError("Cannot reach https://huggingface.co: offline")


def test_push_that_fails_writes_nothing_into_the_folder(tmp_path, monkeypatch, capsys):
    import modular_decoder.commands.push as push

    monkeypatch.setattr(push, "HfApi", OfflineApi)
    ModularDecoderForCausalLM(preset_config("gpt2", tiny=True)).save_pretrained(tmp_path / "ckpt")  # no card
    before = sorted(path.name for path in (tmp_path / "ckpt").iterdir())
    capsys.readouterr()
    assert main(["push", str(tmp_path / "ckpt"), "me/x"]) == 2
    assert "offline" in capsys.readouterr().err
    assert sorted(path.name for path in (tmp_path / "ckpt").iterdir()) == before
