"""`reshape --add-mtp K`: MTP modules for a checkpoint that never had them, initialised from its last block and
trained by self-distillation with the model frozen. The model stays bit for bit; the drafts it then verifies give
the tokens of plain decoding (greedy and sampled, with each of the family's caches) and are accepted."""

from __future__ import annotations

import json

import pytest
import torch

from modular_decoder import ModularDecoderConfig, ModularDecoderForCausalLM, preset_config
from modular_decoder.commands import main
from modular_decoder.mtp_generation import recorded_drafts
from modular_decoder.tools.reshape import REPORT_FILE, reshape
from modular_decoder.tools.reshape.add_mtp import add_mtp_modules, agreement, decoding_acceptance
from modular_decoder.tools.reshape.calibration import sampled_calibration

pytestmark = pytest.mark.usefixtures("one_thread")


def source(config: ModularDecoderConfig, seed: int = 0) -> ModularDecoderForCausalLM:
    torch.manual_seed(seed)
    return ModularDecoderForCausalLM(config).eval()


def small(**overrides) -> ModularDecoderConfig:
    fields = dict(vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1)
    return ModularDecoderConfig(**{**fields, **overrides})


def counting_model() -> ModularDecoderForCausalLM:
    """A small model trained to count (each token the previous + 1, mod 64): a trained model's predictions are
    what the modules learn from, and a random model's are noise (a second's training on one thread)."""
    model = source(small()).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    for _ in range(80):
        rows = (torch.randint(0, 64, (16, 1), generator=generator) + torch.arange(24)) % 64
        loss = model(input_ids=rows, labels=rows).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def counting_model_with_mtp():
    """The counting model, the same with two MTP modules trained for 30 steps on text sampled from it, and that
    text (its held-out rows unseen in training)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as `one_thread` does for each test (this fixture is set up before it)
    try:
        model = counting_model()
        calibration = sampled_calibration(model, seed=0, sequences=8, held_out=2, length=32)
        new = reshape(model, calibration.ids, add_mtp=2, heal_steps=30, heal_lr=3e-3, progress=False)
    finally:
        torch.set_num_threads(threads)
    return model, new, calibration


@pytest.fixture(scope="module")
def trained():
    return counting_model_with_mtp()


def test_the_model_stays_bit_for_bit_and_the_modules_learn(trained):
    model, new, calibration = trained
    assert new.config.num_mtp_layers == 2 and model.config.num_mtp_layers == 0
    ours = new.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(ours[name], tensor) and ours[name].data_ptr() != tensor.data_ptr(), name
    untrained, _ = add_mtp_modules(model, 2)
    before, after = agreement(untrained, calibration.held_out), agreement(new, calibration.held_out)
    assert all(a > 0.8 and a > b for a, b in zip(after, before, strict=True)), (before, after)


@pytest.mark.parametrize("case", ["dynamic", "int8", "sliding", "greedy-two-drafts-sampled"])
def test_drafted_decoding_gives_the_tokens_of_plain_decoding(trained, case):
    model, new, calibration = trained
    prompt = calibration.held_out[:1, :8]
    kwargs = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False)
    if case == "int8":
        kwargs.update(cache_implementation="quantized", cache_config={"backend": "int8"})
    if case == "sliding":  # the same weights read with a window shorter than the text
        new = ModularDecoderForCausalLM(small(num_mtp_layers=2, sliding_window=6)).eval()
        new.load_state_dict(trained[1].state_dict())
        assert new.mtp.block_config.layer_types == ["sliding_attention"] * 2
    if case.endswith("sampled"):
        kwargs.update(do_sample=True, top_k=0, temperature=1.0)
    torch.manual_seed(3)
    with recorded_drafts() as stats:
        drafted = new.generate(prompt, use_mtp=True, **kwargs)
    torch.manual_seed(3)
    plain = new.generate(prompt, **kwargs)
    if not kwargs["do_sample"]:
        assert torch.equal(drafted, plain)
        assert stats.acceptance(20) > 0.5  # drafts were accepted: the verification's roll-back ran
    else:  # speculative sampling keeps the distribution, not the random stream: the tokens are the model's samples
        assert drafted.shape == plain.shape and stats.drafted > 0


def test_mla_modules_with_the_latent_cache():
    model = source(preset_config("deepseek_v3", tiny=True, initializer_range=0.2))
    calibration = sampled_calibration(model, seed=0, sequences=4, held_out=1, length=32)
    new = reshape(model, calibration.ids, add_mtp=1, heal_steps=4, heal_lr=3e-3, progress=False)
    assert type(new.mtp.layers[0].mtp_block.self_attn) is type(model.model.layers[-1].self_attn)
    result = decoding_acceptance(new, calibration.held_out, prompt_tokens=8, new_tokens=20)
    assert result["same_tokens_as_plain_greedy"]


def test_bad_options_are_refused_naming_them(tmp_path, capsys):
    model = source(small())
    with pytest.raises(ValueError, match="heal_steps"):
        reshape(model, torch.zeros(1, 8, dtype=torch.long), add_mtp=1)
    with pytest.raises(ValueError, match="add_mtp"):
        reshape(model, torch.zeros(1, 8, dtype=torch.long), add_mtp=0, heal_steps=1)
    with pytest.raises(ValueError, match="MTP module"):
        reshape(source(small(num_mtp_layers=1)), torch.zeros(1, 8, dtype=torch.long), add_mtp=1, heal_steps=1)
    model.save_pretrained(tmp_path / "src")
    assert main(["reshape", str(tmp_path / "src"), str(tmp_path / "out"), "--add-mtp", "1"]) == 2
    assert "--heal-steps" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_cli_writes_the_modules_and_the_measured_acceptance(tmp_path, capsys):
    from test_reshape import calibration_file, saved_folder

    src = saved_folder(tmp_path / "src")
    out = tmp_path / "out"
    args = ["reshape", str(src), str(out), "--add-mtp", "1", "--calibration", str(calibration_file(tmp_path)),
            "--heal-steps", "4", "--kv-heads", "2"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / REPORT_FILE).read_text())
    assert [t["transformation"] for t in report["transformations"]] == ["kv_heads", "add_mtp"]
    assert report["transformations"][1]["measured"]["exact"] and report["transformations"][1]["measured"][
        "max_logit_change"] == 0.0
    mtp = report["mtp"]
    assert mtp["modules"] == 1 and mtp["steps"] == 4 and len(mtp["top1_agreement"]) == 1
    assert mtp["decoding"]["same_tokens_as_plain_greedy"] and 0 <= mtp["decoding"]["acceptance"] <= 1
    assert "accepted" in printed and "accepted" in (out / "README.md").read_text()
    model = ModularDecoderForCausalLM.from_pretrained(out)
    assert model.config.num_mtp_layers == 1 and model.config.num_key_value_heads == 2
    assert report["after"]["parameters"] == model.num_parameters()
    assert main(["generate", str(out), "hello world", "--max-new-tokens", "6", "--mtp"]) == 0
    assert main(["generate", str(src), "hello world", "--max-new-tokens", "6", "--mtp"]) == 2
    assert "--mtp" in capsys.readouterr().err


def test_with_a_draft_vocabulary_the_modules_learn_the_model_over_it():
    """With `mtp.draft_vocab` set, a training step's loss is KL(model ‖ module) over those ids only (both the head's
    logits there, renormalised), computed here from the whole head's columns; the head and the model get no gradient,
    and the agreement counts a module's top-1 among those ids."""
    from modular_decoder.draft_vocab import set_draft_vocab
    from modular_decoder.tools.reshape.add_mtp import _distillation_step, _teacher_inputs
    from modular_decoder.tools.reshape.healing import distillation_loss

    model, _ = add_mtp_modules(source(small()), 2)
    ids = torch.randperm(64, generator=torch.Generator().manual_seed(1))[:20]
    set_draft_vocab(model, ids)
    batch = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(2))
    ids_, hidden, embeds, positions = _teacher_inputs(model, batch)
    loss = _distillation_step(model, ids_, hidden, embeds, positions)
    expected = []
    for depth, out in enumerate(model.mtp.depths(model, hidden, embeds, None, positions, False)):
        student = model._logits(out[:, : 12 - depth - 1])[..., ids]
        teacher = model._logits(hidden[:, depth + 1:])[..., ids]
        expected.append(distillation_loss(student, teacher.detach()))
    torch.testing.assert_close(loss, torch.stack(expected).mean())
    loss.backward()
    assert model.lm_head.weight.grad is None or not model.lm_head.weight.grad.any()
    assert all(p.grad is None for n, p in model.named_parameters() if n.startswith("model."))
    assert all(p.grad is not None for p in model.mtp.parameters())

    held_out = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(3))
    hits = []
    with torch.no_grad():
        for row in held_out.split(1):
            _, h, e, p = _teacher_inputs(model, row)
            out = next(model.mtp.depths(model, h, e, None, p, False))[:, :-1]
            hits.append(ids[model._logits(out)[..., ids].argmax(-1)] == model._logits(h[:, 1:]).argmax(-1))
    assert agreement(model, held_out)[0] == pytest.approx(torch.cat(hits, 1).float().mean().item())
