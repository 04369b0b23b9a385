"""`modular-decoder generate` / `chat` stream what generate() returns; `plot cache` writes a PNG
whose lines are the contract's numbers."""

from __future__ import annotations

import io

import torch
from decoding import recording_backend
from tiny_tokenizer import tiny_tokenizer

from modular_decoder import ModularDecoderForCausalLM, cache_bytes, preset_config
from modular_decoder.commands import main


def _checkpoint(tmp_path):
    model = ModularDecoderForCausalLM(preset_config("llama", tiny=True)).eval()
    tokenizer = tiny_tokenizer()
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    return model, tokenizer


def _record_compiled_graphs(monkeypatch) -> list:
    """The graphs the CLI's `--compile` hands to `torch.compile` (traced, run as traced)."""
    import modular_decoder

    graphs = []
    backend, real = recording_backend(graphs), modular_decoder.compiled_decoding
    # one backend for every call: generate reuses its compiled step only for an equal CompileConfig
    monkeypatch.setattr(modular_decoder, "compiled_decoding", lambda: real(backend=backend))
    return graphs


def test_generate_streams_the_greedy_completion(tmp_path, capsys):
    model, tokenizer = _checkpoint(tmp_path)
    assert main(["generate", str(tmp_path), "the quick brown", "--max-new-tokens", "10"]) == 0
    inputs = tokenizer("the quick brown", return_tensors="pt")
    with torch.no_grad():
        new = model.generate(**inputs, max_new_tokens=10, do_sample=False)[0, inputs["input_ids"].shape[1]:]
    expected = tokenizer.decode(new, skip_special_tokens=True)
    assert capsys.readouterr().out.strip() == ("the quick brown" + expected).strip()


def test_generate_compile_streams_the_same_completion_through_a_compiled_step(tmp_path, capsys, monkeypatch):
    """`--compile` decodes through transformers' compiled step (`compiled_decoding`); the text is eager's."""
    model, tokenizer = _checkpoint(tmp_path)
    graphs = _record_compiled_graphs(monkeypatch)
    torch._dynamo.reset()
    assert main(["generate", str(tmp_path), "the quick brown", "--max-new-tokens", "10", "--compile"]) == 0
    torch._dynamo.reset()
    assert graphs, "the decode step was not compiled"
    inputs = tokenizer("the quick brown", return_tensors="pt")
    with torch.no_grad():
        new = model.generate(**inputs, max_new_tokens=10, do_sample=False)[0, inputs["input_ids"].shape[1]:]
    expected = "the quick brown" + tokenizer.decode(new, skip_special_tokens=True)
    assert capsys.readouterr().out.strip() == expected.strip()


def test_chat_uses_the_template_and_streams(tmp_path, capsys, monkeypatch):
    model, tokenizer = _checkpoint(tmp_path)
    monkeypatch.setattr("sys.stdin", io.StringIO("hello world\n\n"))
    assert main(["chat", str(tmp_path), "--max-new-tokens", "6"]) == 0
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": "hello world"}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    with torch.no_grad():
        new = model.generate(**inputs, max_new_tokens=6, do_sample=False)[0, inputs["input_ids"].shape[1]:]
    out = capsys.readouterr().out
    assert out.startswith("> ") and tokenizer.decode(new, skip_special_tokens=True).strip() in out


def test_chat_compile_compiles_once_for_a_growing_conversation(tmp_path, capsys, monkeypatch):
    """`chat --compile`: the static cache is sized in steps of CACHE_STEP tokens, so turns that grow the
    conversation reuse the compiled step instead of compiling again each turn."""
    from modular_decoder.commands.generate import CACHE_STEP

    _checkpoint(tmp_path)
    graphs = _record_compiled_graphs(monkeypatch)
    monkeypatch.setattr("sys.stdin", io.StringIO("hello world\nthe quick brown fox\nmore words here\n\n"))
    torch._dynamo.reset()
    assert main(["chat", str(tmp_path), "--max-new-tokens", "6", "--compile"]) == 0
    torch._dynamo.reset()
    assert capsys.readouterr().out.count("> ") >= 3 and CACHE_STEP > 3 * 16
    assert len(graphs) == 1


def test_plot_cache_png(tmp_path, capsys):
    from modular_decoder.commands.plot import figure_configs

    out = tmp_path / "cache.png"
    assert main(["plot", "cache", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    printed = capsys.readouterr().out
    configs = figure_configs()
    gib = {label: cache_bytes(config, 131072) / 2**30 for label, config in configs.items()}
    mha, gqa, mqa, mla = (gib[k] for k in configs)
    assert (mha, gqa, mqa) == (64.0, 16.0, 2.0)  # 2·L·H_kv·d_h·b·T with b=2, T=128k
    assert mla == 32 * (512 + 64) * 2 * 131072 / 2**30  # L·(d_c + d_R)·b·T
    assert f"{mla:.2f} GiB" in printed
    assert main(["plot", "cache", "--config", "mistral", "--config", "gemma3", "--log", "--out", str(out)]) == 0
