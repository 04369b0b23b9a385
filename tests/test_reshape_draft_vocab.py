"""`reshape(..., draft_vocab=N)` / `reshape SRC OUT --add-mtp K --draft-vocab N`: the ranking by the model's own
argmax predictions (against a count written out here), the coverage, the result drafting among those ids with plain
decoding's tokens, and the refusals."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from modular_decoder import ModularDecoderForCausalLM
from modular_decoder.commands import main
from modular_decoder.tools.reshape import REPORT_FILE, reshape
from modular_decoder.tools.reshape.draft_vocab import coverage, rank_by_prediction
from test_reshape_add_mtp import counting_model, small, source

pytestmark = pytest.mark.usefixtures("one_thread")


def text(sequences: int = 3, length: int = 12, seed: int = 0) -> torch.LongTensor:
    return torch.randint(0, 64, (sequences, length), generator=torch.Generator().manual_seed(seed))


def test_ranking_is_by_predictions_then_the_texts_counts_then_id():
    model = source(small())
    ids = text()
    with torch.no_grad():
        predicted = Counter(model(input_ids=ids).logits.argmax(-1).flatten().tolist())
    seen = Counter(ids.flatten().tolist())
    expected = sorted(range(64), key=lambda token: (-predicted[token], -seen[token], token))
    assert rank_by_prediction(model, ids).tolist() == expected
    top = torch.tensor(expected[:5])
    assert coverage(model, ids, top) == pytest.approx(sum(predicted[t] for t in expected[:5]) / ids.numel())


def test_reshape_sets_the_ranking_and_drafts_give_plain_greedy_tokens():
    model = counting_model()
    calibration = (torch.arange(4).unsqueeze(1) * 7 + torch.arange(24)) % 64
    new, report = reshape(model, calibration, add_mtp=1, draft_vocab=40, heal_steps=10, heal_lr=3e-3,
                          progress=False, with_report=True)
    assert new.config.mtp_draft_vocab_size == 40
    assert torch.equal(new.mtp.draft_vocab, rank_by_prediction(new, calibration[:-1])[:40])
    assert report["draft_vocab"]["size"] == 40 and 0 < report["draft_vocab"]["coverage"] <= 1
    prompt = torch.tensor([[10, 11, 12, 13]])
    kwargs = dict(max_new_tokens=16, do_sample=False, attention_mask=torch.ones_like(prompt), pad_token_id=0)
    assert torch.equal(new.generate(prompt, use_mtp=True, **kwargs), new.generate(prompt, **kwargs))


def test_a_model_with_modules_takes_a_draft_vocabulary_alone():
    model = source(small(num_mtp_layers=1))
    new = reshape(model, text(), draft_vocab=8, progress=False)
    assert new.config.mtp_draft_vocab_size == 8 and new.mtp.draft_vocab.shape == (8,)
    assert model.mtp.draft_vocab is None and model.config.mtp_draft_vocab_size == 0  # the source is left as it was


def test_other_transformations_carry_the_ranking():
    from modular_decoder.draft_vocab import set_draft_vocab

    model = source(small(num_mtp_layers=1))
    set_draft_vocab(model, torch.tensor([7, 3, 9]))
    new = reshape(model, text(), kv_heads=1, progress=False)
    assert new.config.num_key_value_heads == 1 and new.config.mtp_draft_vocab_size == 3
    assert torch.equal(new.mtp.draft_vocab, torch.tensor([7, 3, 9]))


def test_bad_values_are_refused_naming_them(tmp_path, capsys):
    model = source(small())
    for value in (0, -3, 65, 2.0):
        with pytest.raises(ValueError, match="draft_vocab"):
            reshape(model, text(), add_mtp=1, heal_steps=1, draft_vocab=value)
    with pytest.raises(ValueError, match="draft_vocab.*MTP"):
        reshape(model, text(), draft_vocab=8)
    model.save_pretrained(tmp_path / "src")
    for args in (["--add-mtp", "1", "--heal-steps", "1", "--draft-vocab", "0"], ["--draft-vocab", "8"]):
        assert main(["reshape", str(tmp_path / "src"), str(tmp_path / "out"), *args]) == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
        assert len(errors) == 1 and "--draft-vocab" in errors[0] and not (tmp_path / "out").exists()


def test_cli_writes_the_ranking_and_its_coverage(tmp_path, capsys):
    from test_reshape import calibration_file, saved_folder

    src, out = saved_folder(tmp_path / "src"), tmp_path / "out"
    args = ["reshape", str(src), str(out), "--add-mtp", "1", "--draft-vocab", "16", "--calibration",
            str(calibration_file(tmp_path)), "--heal-steps", "2"]
    assert main(args) == 0
    report = json.loads((out / REPORT_FILE).read_text())
    assert report["options"]["draft_vocab"] == 16 and 0 <= report["draft_vocab"]["coverage"] <= 1
    assert report["mtp"]["decoding"]["same_tokens_as_plain_greedy"]
    assert "Draft vocabulary" in capsys.readouterr().out and "Draft vocabulary" in (out / "README.md").read_text()
    model = ModularDecoderForCausalLM.from_pretrained(out)
    assert model.config.mtp_draft_vocab_size == 16 and model.mtp.draft_vocab.shape == (16,)
    assert main(["generate", str(out), "hello world", "--max-new-tokens", "6", "--mtp"]) == 0
