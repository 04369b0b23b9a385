"""Every user error of the CLI is one line `error: <message>` on stderr and exit status 2; bugs keep
their traceback; `--traceback` / MODULAR_DECODER_TRACEBACK=1 show it for user errors too."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig

import modular_decoder  # noqa: F401
from modular_decoder.commands import main

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64)


@pytest.fixture
def llama_dir(tmp_path) -> Path:
    config = LlamaConfig(**TINY, num_key_value_heads=2)
    config.architectures = None
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "llama")
    return tmp_path / "llama"


def user_error(capsys, argv: list[str]) -> str:
    """Run the CLI; assert exit status 2 and exactly one stderr line `error: ...`; return that message."""
    capsys.readouterr()  # drop what the fixtures printed
    status = main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and lines[0].startswith("error: "), (status, err)
    return lines[0][len("error: "):]


def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_missing_source(capsys, tmp_path):
    message = user_error(capsys, ["convert", str(tmp_path / "nope"), str(tmp_path / "out")])
    assert message == f"{tmp_path / 'nope'} does not exist."


def test_existing_output(capsys, llama_dir, tmp_path):
    (tmp_path / "out").mkdir()
    message = user_error(capsys, ["convert", str(llama_dir), str(tmp_path / "out")])
    assert message.startswith(f"{tmp_path / 'out'} already exists") and "--force" in message


def test_malformed_config(capsys, llama_dir, tmp_path):
    (llama_dir / "config.json").write_text('{"model_type": "llama", ')
    message = user_error(capsys, ["convert", str(llama_dir), str(tmp_path / "out")])
    assert message.startswith(f"{llama_dir / 'config.json'} is not valid JSON")


def test_unknown_model_type(capsys, llama_dir, tmp_path):
    config = json.loads((llama_dir / "config.json").read_text())
    (llama_dir / "config.json").write_text(json.dumps({**config, "model_type": "bert"}))
    assert user_error(capsys, ["convert", str(llama_dir), str(tmp_path / "out")]).startswith(
        "Unknown source family 'bert'")


def test_no_weights(capsys, llama_dir, tmp_path):
    (llama_dir / "model.safetensors").unlink()
    assert "holds no `*.safetensors`" in user_error(capsys, ["convert", str(llama_dir), str(tmp_path / "out")])


def test_legacy_bin_refused(capsys, tmp_path):
    src = tmp_path / "gpt2"
    model = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64))
    model.config.save_pretrained(src)
    torch.save(model.state_dict(), src / "pytorch_model.bin")
    assert "--allow-bin" in user_error(capsys, ["convert", str(src), str(tmp_path / "out")])


def test_read_only_output_parent(capsys, llama_dir, tmp_path, monkeypatch):
    parent = tmp_path / "read-only"
    parent.mkdir()
    parent.chmod(0o555)
    if os.geteuid() == 0:  # root may write anyway: the OS answers as it does for everyone else
        real_access = os.access
        monkeypatch.setattr(os, "access",
                            lambda path, mode, **kw: Path(path) != parent and real_access(path, mode, **kw))
    try:
        message = user_error(capsys, ["convert", str(llama_dir), str(parent / "out")])
    finally:
        parent.chmod(0o755)
    assert message == f"cannot write {parent / 'out'}: its folder {parent} is not writable."
    assert [p.name for p in parent.iterdir()] == []


def test_missing_gguf_file_flag(capsys, tmp_path):
    src = tmp_path / "gguf"
    src.mkdir()
    (src / "model.gguf").write_bytes(b"GGUF")
    message = user_error(capsys, ["convert", str(src), str(tmp_path / "out")])
    assert "--gguf-file" in message and "model.gguf" in message
    message = user_error(capsys, ["convert", str(src), str(tmp_path / "out"), "--gguf-file", "other.gguf"])
    assert message.startswith("GGUF file 'other.gguf' not found in") and "model.gguf" in message
    message = user_error(capsys, ["convert", str(src / "model.gguf"), str(tmp_path / "out")])
    assert "is a file" in message and "--gguf-file model.gguf" in message


def test_damaged_gguf(capsys, tmp_path):
    src = tmp_path / "gguf"
    src.mkdir()
    (src / "model.gguf").write_bytes(b"GGUF" + (3).to_bytes(4, "little") + bytes(10))
    message = user_error(capsys, ["convert", str(src), str(tmp_path / "out"), "--gguf-file", "model.gguf"])
    assert message.startswith(f"{src / 'model.gguf'} is truncated")


@pytest.mark.parametrize("where", ["same", "parent"])
def test_source_is_never_replaced(capsys, llama_dir, where):
    out = llama_dir if where == "same" else llama_dir.parent
    before = digest(llama_dir)
    message = user_error(capsys, ["convert", str(llama_dir), str(out), "--force"])
    assert ("is the source" if where == "same" else "contains the source") in message
    assert digest(llama_dir) == before


def test_export_into_its_source(capsys, llama_dir, tmp_path):
    assert main(["convert", str(llama_dir), str(tmp_path / "md")]) == 0
    capsys.readouterr()
    assert "is the source" in user_error(capsys, ["export", str(tmp_path / "md"), str(tmp_path / "md"),
                                                  "--family", "llama", "--force"])


def test_validate_broken_folders(capsys, tmp_path, llama_dir):
    assert user_error(capsys, ["validate", str(tmp_path / "nope")]) == f"{tmp_path / 'nope'} does not exist."
    # a preset's name typed where a folder goes (from a folder without one of that name)
    with contextlib.chdir(tmp_path):
        assert user_error(capsys, ["validate", "deepseek_v32"]) == (
            "deepseek_v32 does not exist (a preset is validated with --preset deepseek_v32 --tiny).")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "has no config.json" in user_error(capsys, ["validate", str(empty)])
    message = user_error(capsys, ["validate", str(llama_dir)])
    assert "is not a modular_decoder checkpoint (model_type='llama')" in message
    (empty / "config.json").write_text("{nope")
    assert "config.json is not valid JSON" in user_error(capsys, ["validate", str(empty)])


def test_validate_truncated_weights(capsys, tmp_path, llama_dir):
    assert main(["convert", str(llama_dir), str(tmp_path / "md")]) == 0
    capsys.readouterr()
    weights = tmp_path / "md" / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    assert user_error(capsys, ["validate", str(tmp_path / "md")]).startswith(f"{weights} is truncated")


def test_generate_and_chat_on_a_missing_path(capsys, tmp_path):
    assert user_error(capsys, ["generate", str(tmp_path / "nope"), "hello"]) == f"{tmp_path / 'nope'} does not exist."
    assert user_error(capsys, ["chat", str(tmp_path / "nope")]) == f"{tmp_path / 'nope'} does not exist."


def test_bugs_keep_their_traceback(monkeypatch):
    import modular_decoder.commands.validate as command

    def broken(args):
        raise TypeError("a bug")

    monkeypatch.setattr(command, "run", broken)
    with pytest.raises(TypeError, match="a bug"):
        main(["validate", "x"])


@pytest.mark.parametrize("how", ["flag-before", "flag-after", "env"])
def test_traceback_on_request(capsys, tmp_path, monkeypatch, how):
    """The traceback is shown for a bug report; the same user error still exits with status 2."""
    argv = ["validate", str(tmp_path / "nope")]
    if how == "flag-before":
        argv = ["--traceback", *argv]
    elif how == "flag-after":
        argv = [*argv, "--traceback"]
    else:
        monkeypatch.setenv("MODULAR_DECODER_TRACEBACK", "1")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "FileNotFoundError" in err
    assert err.strip().splitlines()[-1] == f"error: {tmp_path / 'nope'} does not exist."


def test_console_entry_prints_one_line_and_exits_2(tmp_path):
    here = str(Path(__file__).parents[1])  # this checkout, whatever the installed package points at
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1"}
    env.pop("MODULAR_DECODER_TRACEBACK", None)
    result = subprocess.run([sys.executable, "-m", "modular_decoder.commands", "convert", str(tmp_path / "nope"),
                             str(tmp_path / "out")], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"error: {tmp_path / 'nope'} does not exist."]
    result = subprocess.run([sys.executable, "-m", "modular_decoder.commands", "--traceback", "convert",
                             str(tmp_path / "nope"), str(tmp_path / "out")], capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 2 and "Traceback (most recent call last)" in result.stderr


# ------------------------------------------------------------ every command: user errors vs bugs (exit 2 vs 1)


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    """A tiny modular_decoder checkpoint with a tokenizer (with a chat template)."""
    from modular_decoder import ModularDecoderForCausalLM, preset_config
    from tiny_tokenizer import tiny_tokenizer

    folder = tmp_path / "md"
    ModularDecoderForCausalLM(preset_config("llama", tiny=True, vocab_size=128)).save_pretrained(folder)
    tiny_tokenizer(128).save_pretrained(folder)
    return folder


def bug(capsys, argv: list[str], error: type[BaseException] = ValueError, match: str = "a bug") -> None:
    """A `ValueError` our code raises outside the checks of the user's input is a bug: it propagates
    (the console entry then prints its traceback and exits 1), never a one-line user error."""
    capsys.readouterr()
    with pytest.raises(error, match=match):
        main(argv)
    assert "error:" not in capsys.readouterr().err


def _raise_a_bug(*args, **kwargs):
    raise ValueError("a bug")


def test_convert_and_export_bugs_keep_their_traceback(capsys, llama_dir, tmp_path, monkeypatch):
    from modular_decoder.conversion import api

    with monkeypatch.context() as patch:
        patch.setattr(api, "_write_weights", _raise_a_bug)  # after the source is read and checked
        bug(capsys, ["convert", str(llama_dir), str(tmp_path / "md")])
    assert main(["convert", str(llama_dir), str(tmp_path / "md")]) == 0
    monkeypatch.setattr(api, "plan_shapes", _raise_a_bug)  # export's inverse map runs after its checks
    bug(capsys, ["export", str(tmp_path / "md"), str(tmp_path / "back"), "--family", "llama"])


def test_generate_user_errors_and_bugs(capsys, checkpoint, monkeypatch):
    assert user_error(capsys, ["generate", str(checkpoint), "hi", "--top-p", "0"]) == "`--top-p`=0.0 must lie in (0, 1]."
    assert "--max-new-tokens" in user_error(capsys, ["generate", str(checkpoint), "hi", "--max-new-tokens", "0"])
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 3}))
    assert "num_key_value_heads" in user_error(capsys, ["generate", str(checkpoint), "hi"])  # config construction
    (checkpoint / "config.json").write_text(json.dumps(config))
    (checkpoint / "model.safetensors").write_bytes(b"\x00" * 4)
    assert "model.safetensors is truncated" in user_error(capsys, ["generate", str(checkpoint), "hi"])


def test_generate_bug_keeps_its_traceback(capsys, checkpoint, monkeypatch):
    from modular_decoder import ModularDecoderForCausalLM

    monkeypatch.setattr(ModularDecoderForCausalLM, "forward", _raise_a_bug)
    bug(capsys, ["generate", str(checkpoint), "hi", "--max-new-tokens", "2"])


def test_chat_without_a_template_is_a_user_error_on_stderr(capsys, checkpoint, monkeypatch):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(checkpoint)
    for name in ("chat_template.jinja", "chat_template.json"):
        (checkpoint / name).unlink(missing_ok=True)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    message = user_error(capsys, ["chat", str(checkpoint)])
    assert message == f"the tokenizer in {checkpoint} has no chat template; use `modular-decoder generate`."
    assert "error" not in capsys.readouterr().out


def test_chat_user_errors_and_bugs(capsys, checkpoint, monkeypatch):
    assert "--temperature" in user_error(capsys, ["chat", str(checkpoint), "--temperature", "-1"])
    from transformers import TextStreamer

    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    monkeypatch.setattr(TextStreamer, "put", _raise_a_bug)  # a bug while a reply streams
    bug(capsys, ["chat", str(checkpoint), "--max-new-tokens", "2"])


def test_push_incomplete_folder_is_a_user_error(capsys, tmp_path, llama_dir):
    assert user_error(capsys, ["push", str(tmp_path / "empty"), "me/model"]).endswith("missing: config.json")
    message = user_error(capsys, ["push", str(llama_dir), "me/model"])
    assert "is not a complete modular_decoder repository" in message


def test_plot_unknown_config_is_a_user_error(capsys, tmp_path):
    message = user_error(capsys, ["plot", "cache", "--config", "nope", "--out", str(tmp_path / "x.png")])
    assert message.startswith("`--config nope` is neither a preset")


def test_validate_arguments_and_bugs(capsys, checkpoint, monkeypatch):
    assert user_error(capsys, ["validate"]) == "give a checkpoint PATH or --preset NAME"
    assert "Unknown preset 'nope'" in user_error(capsys, ["validate", "--preset", "nope"])
    from modular_decoder.tools import validate

    monkeypatch.setattr(validate.Report, "table", _raise_a_bug)
    bug(capsys, ["validate", str(checkpoint), "--checks", "shapes"])


def test_experiment_arguments(capsys, tmp_path):
    out = ["--out", str(tmp_path / "exp")]
    assert user_error(capsys, ["experiment", "ablation", "--seeds", "0", *out]) == "`--seeds`=0 must be at least 1."
    assert "nope" in user_error(capsys, ["experiment", "ablation", "--variants", "nope", *out])


def test_demo_on_a_damaged_output_folder(capsys, tmp_path):
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "config.json").write_text("{nope")
    assert "config.json" in user_error(capsys, ["demo", "--out", str(tmp_path / "demo")])


# ------------------------------------------------------------ errors in the words the user typed


def test_tool_parameters_are_named_as_the_flags_typed(capsys, checkpoint, tmp_path):
    """The reshape tool names its parameters (`kv_heads`, `attention='mla'`); the CLI names the flags."""
    message = user_error(capsys, ["reshape", str(checkpoint), str(tmp_path / "out"), "--kv-heads", "3"])
    assert message.startswith("`--kv-heads`=3 must divide the 4 query heads") and "`kv_heads`" not in message
    message = user_error(capsys, ["reshape", str(checkpoint), str(tmp_path / "out"), "--attention", "mla"])
    assert message == "`--attention mla` needs `--kv-lora-rank` (the latent width d_c)."


def test_force_is_named_as_the_flag(capsys, llama_dir, tmp_path):
    (tmp_path / "out").mkdir()
    message = user_error(capsys, ["convert", str(llama_dir), str(tmp_path / "out")])
    assert message == f"{tmp_path / 'out'} already exists; pass `--force` to replace it."


def test_in_flags_rewrites_only_the_commands_options():
    import argparse

    from modular_decoder.commands import in_flags, option_flags

    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--kv-heads", type=int)
    parser.add_argument("--force", action="store_true")
    sub = parser.add_subparsers().add_parser("cache")
    sub.add_argument("--max-context", type=int)
    flags = option_flags(parser)
    assert sorted(flags) == ["force", "kv_heads", "max_context"]
    assert in_flags("`kv_heads`=3 must divide `num_attention_heads`; `out` exists", flags) == (
        "`--kv-heads`=3 must divide `num_attention_heads`; `out` exists")  # a config field and a positional stay
    assert in_flags("pass force=True or `force=True`; `max_context='8'`", flags) == (
        "pass `--force` or `--force`; `--max-context 8`")


def test_a_folder_without_a_tokenizer_says_what_to_do(capsys, checkpoint, tmp_path):
    from modular_decoder import ModularDecoderForCausalLM, preset_config

    bare = tmp_path / "bare"
    ModularDecoderForCausalLM(preset_config("llama", tiny=True, vocab_size=128)).save_pretrained(bare)
    for argv in (["generate", str(bare), "hello"], ["chat", str(bare)]):
        message = user_error(capsys, argv)
        assert message.startswith(f"{bare} has no tokenizer") and "--tokenizer DIR" in message
        assert f'save_pretrained("{bare}")' in message
    capsys.readouterr()
    assert main(["demo", "--out", str(bare)]) == 2  # demo has no --tokenizer: it converts again
    message = capsys.readouterr().err.splitlines()[-1]  # the model loaded first (its progress bar above)
    assert message.startswith(f"error: {bare} has no tokenizer") and "`--force`" in message
    assert "--tokenizer" not in message
    assert "holds no tokenizer" in user_error(capsys, ["generate", str(bare), "hi", "--tokenizer", str(tmp_path)])
    capsys.readouterr()
    assert main(["generate", str(bare), "hello", "--tokenizer", str(checkpoint), "--max-new-tokens", "2"]) == 0
    assert capsys.readouterr().out.startswith("hello")


def test_chat_ends_with_a_newline(capsys, checkpoint, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))  # one turn, then EOF
    assert main(["chat", str(checkpoint), "--max-new-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert out.endswith("> \n") and out.count("> ") == 2


def test_help_speaks_to_the_user(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    for jargon in ("seed's", "COMMANDS", "registered in"):
        assert jargon not in text
    for command in ("validate", "plot", "experiment"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "seed's" not in capsys.readouterr().out


def test_gradnorm_prints_its_numbers_once(capsys, tmp_path):
    assert main(["experiment", "gradnorm", "--hidden", "16", "--layers", "2", "--steps", "1",
                 "--out", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    table = (tmp_path / "gradnorm.md").read_text().strip()
    assert captured.out.count(table.splitlines()[2]) == 1 and table.splitlines()[2] not in captured.err
    assert captured.err.count("[1/") == 1  # progress: which condition runs, without its numbers


@pytest.mark.parametrize(("argv", "usage", "meant"), [
    (["generate", "FOLDER", "a prompt", "--max-tokens", "8"], "usage: modular-decoder generate", "`--max-new-tokens`"),
    (["plot", "cache", "--max-contxt", "64"], "usage: modular-decoder plot cache", "`--max-context`"),
    (["reshape", "SRC", "OUT", "--bogus"], "usage: modular-decoder reshape", None),
])
def test_an_unknown_option_gets_the_command_s_usage_and_the_option_meant(capsys, argv, usage, meant):
    """An option the command does not have is refused by the command's own parser (its usage, not the program's),
    with the closest option it does have, exit 2, before anything runs."""
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage), err
    last = err.strip().splitlines()[-1]
    unknown = next(arg for arg in argv if arg.startswith("--"))
    assert last.startswith(f"{usage.removeprefix('usage: ')}: error: unrecognized arguments: {unknown}")
    assert (meant in last) if meant else "did you mean" not in last


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_text"])
@pytest.mark.parametrize(("changes", "blamed"), [
    # Qwen3-Next's and Qwen3.5's configs have no sliding window: the round trip loses it
    (dict(layer_types=["linear_attention", "sliding_attention"], sliding_window=4), r"`sliding_window`=4"),
    # their MTP layer is a full-attention layer, one module sharing `mtp.fc`
    (dict(layer_types=["full_attention", "linear_attention"], num_mtp_layers=1),
     r"`num_mtp_layers`=1 after a last layer of `layer_types` 'linear_attention'"),
    (dict(num_mtp_layers=2), r"`num_mtp_layers`=2"),
], ids=["sliding-window", "mtp-after-linear-layer", "two-mtp-modules"])
def test_export_names_what_the_target_format_cannot_express(capsys, tmp_path, family, changes, blamed):
    """A refusal on export blames the target format and names the contract field it cannot hold (not a check of the
    config built for the round trip, not the contract)."""
    from modular_decoder import ModularDecoderConfig, ModularDecoderForCausalLM, preset_config

    config = ModularDecoderConfig(**{**preset_config("qwen3_5", tiny=True).to_dict(), **changes})
    ModularDecoderForCausalLM(config).save_pretrained(tmp_path / "md")
    message = user_error(capsys, ["export", str(tmp_path / "md"), str(tmp_path / "out"), "--family", family])
    assert message.startswith(f"The {family} format cannot express this checkpoint's "), message
    assert re.search(blamed, message) and "contract cannot" not in message, message
    assert not (tmp_path / "out").exists()
