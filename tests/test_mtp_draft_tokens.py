"""`generate(use_mtp=True, mtp_draft_tokens=K)`: K drafts per step from fewer modules (the last one again on its own
output). Each step's drafts equal a recomputation of the chain from the verified text without any cache (so nothing
the drafting wrote from unverified tokens survives into the next step), the tokens equal plain decoding's, and the
statistics count the drafts and their acceptance per position."""

from __future__ import annotations

import pytest
import torch

from modular_decoder import ModularDecoderConfig, ModularDecoderForCausalLM, preset_config
from modular_decoder.commands import main
from mtp_cases import drafted_steps, reference_drafts
from test_reshape_add_mtp import counting_model_with_mtp, small

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def trained():
    """A model trained to count with two MTP modules trained on its own text (drafts often, not always, accepted),
    the same model with its first module only, and held-out prompts sampled from it."""
    _, two, calibration = counting_model_with_mtp()
    one = ModularDecoderForCausalLM(small(num_mtp_layers=1)).eval()
    one.load_state_dict({k: v for k, v in two.state_dict().items() if not k.startswith("mtp.layers.1.")})
    return {1: one, 2: two}, calibration.held_out


def check_every_draft(model, steps, greedy: bool, count: int) -> None:
    assert steps
    for verified, drafted, logits in steps:
        assert drafted.shape[1] == count
        expected = reference_drafts(model, verified, drafted)
        torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
        if greedy:
            assert torch.equal(drafted, expected.argmax(-1))


def check_statistics(statistics, steps, output, count: int) -> None:
    """The statistics against the steps seen: each kept the drafts up to the next step's verified text."""
    lengths = [verified.shape[1] for verified, _, _ in steps] + [output.shape[1]]
    accepted = [after - before - 1 for before, after in zip(lengths, lengths[1:])]  # the last may stop early
    assert statistics.drafted == count * len(steps) and statistics.steps == len(steps)
    expected = [sum(a > j for a in accepted[:-1]) for j in range(count)]
    assert statistics.accepted_at_least[:count] == [e + (accepted[-1] > j) for j, e in enumerate(expected)]
    assert statistics.position_acceptance() == [a / len(steps) for a in statistics.accepted_at_least]


@pytest.mark.parametrize(("modules", "count"), [(1, 1), (1, 2), (1, 4), (2, 1), (2, 3)])
def test_drafts_equal_the_chain_without_a_cache_and_tokens_stay_greedy(trained, modules, count):
    models, held_out = trained
    model = models[modules]
    seen = []
    # text sampled from the model, and prompts whose continuation wraps from 63 to 0, where drafts are rejected
    for prompt in (held_out[:1, :8], torch.tensor([[10, 20, 30, 40, 50, 60]]), torch.tensor([[63, 62, 61, 60, 59]])):
        kwargs = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False, attention_mask=torch.ones_like(prompt),
                      pad_token_id=0)
        output, steps, statistics = drafted_steps(model, prompt, mtp_draft_tokens=count, **kwargs)
        assert torch.equal(output, model.generate(prompt, **kwargs))
        check_every_draft(model, steps, greedy=True, count=count)
        check_statistics(statistics, steps, output, count)
        seen.append(statistics)
    if count > 1:  # a step kept drafts past the first, and one rejected some: the caches were rolled back
        assert sum(s.accepted_at_least[1] for s in seen) > 0
        assert sum(s.accepted_at_least[-1] for s in seen) < sum(s.steps for s in seen)


def test_sampling_with_a_seed(trained):
    """Speculative sampling keeps the model's distribution, not its random stream: each draft is the chain's
    recomputation for the tokens sampled, and a seed repeats the call."""
    model = trained[0][1]
    prompt = trained[1][:1, :8]
    kwargs = dict(max_new_tokens=12, min_new_tokens=12, do_sample=True, top_k=0, temperature=1.0,
                  attention_mask=torch.ones_like(prompt), pad_token_id=0)
    torch.manual_seed(5)
    output, steps, statistics = drafted_steps(model, prompt, mtp_draft_tokens=3, **kwargs)
    check_every_draft(model, steps, greedy=False, count=3)
    torch.manual_seed(5)
    assert torch.equal(output, model.generate(prompt, use_mtp=True, mtp_draft_tokens=3, **kwargs))
    assert output.shape[1] == prompt.shape[1] + 12 and statistics.drafted == 3 * len(steps)


def test_an_end_of_sequence_token_inside_the_drafts(trained):
    """An accepted draft that is not a step's last, made the end-of-sequence token: decoding stops at it, as plain
    decoding does, though the recursion drafted past it."""
    model = trained[0][1]
    prompt = trained[1][:1, :8]
    kwargs = dict(max_new_tokens=16, do_sample=False, attention_mask=torch.ones_like(prompt), pad_token_id=0)
    output, steps, _ = drafted_steps(model, prompt, mtp_draft_tokens=4, **kwargs)
    new = output[0, prompt.shape[1]:].tolist()
    places = [(verified.shape[1] - prompt.shape[1] + j, int(drafted[0, j]))
              for verified, drafted, _ in steps for j in range(3)]
    place, eos = next((place, token) for place, token in places
                      if place < len(new) and new[place] == token and token not in new[:place])
    plain = model.generate(prompt, eos_token_id=eos, **kwargs)
    output, steps, _ = drafted_steps(model, prompt, mtp_draft_tokens=4, eos_token_id=eos, **kwargs)
    assert torch.equal(output, plain) and output.shape[1] == prompt.shape[1] + place + 1
    assert int(output[0, -1]) == eos and any((drafted[0, :3] == eos).any() for _, drafted, _ in steps)


def _tiny_random(preset: str | None = None, **overrides) -> ModularDecoderForCausalLM:
    torch.manual_seed(0)
    if preset:
        config = preset_config(preset, tiny=True, **overrides)
    else:
        config = ModularDecoderConfig(**{**dict(vocab_size=16, hidden_size=32, num_hidden_layers=2,
                                                num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                                                max_position_embeddings=64), **overrides})
    return ModularDecoderForCausalLM(config).eval()


@pytest.mark.parametrize("case", ["dynamic", "int8", "sliding", "mla"])
def test_each_cache_gives_plain_tokens_and_recomputable_drafts(case):
    """Random weights (drafts mostly rejected): with two modules and four drafts, the modules' cache is cropped by
    transformers' generator after rejections and by the recursion each step; windows shorter than the text."""
    model = _tiny_random("deepseek_v3", num_mtp_layers=2, eos_token_id=None) if case == "mla" else \
        _tiny_random(num_mtp_layers=2, **({"sliding_window": 4} if case == "sliding" else {}))
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]]) % model.config.vocab_size
    kwargs = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(prompt),
                  pad_token_id=0)
    if case == "int8":
        kwargs.update(cache_implementation="quantized", cache_config={"backend": "int8"})
    output, steps, _ = drafted_steps(model, prompt, mtp_draft_tokens=4, **kwargs)
    assert torch.equal(output, model.generate(prompt, **kwargs))
    if case != "int8":  # the int8 cache's drafts read quantized K/V: not the no-cache forward's
        check_every_draft(model, steps, greedy=True, count=4)


def test_the_config_default_and_refusals_naming_the_option(trained):
    model = trained[0][1]
    prompt = trained[1][:1, :6]
    kwargs = dict(max_new_tokens=6, do_sample=False, attention_mask=torch.ones_like(prompt), pad_token_id=0)
    model.config.mtp_draft_tokens = 3
    try:
        _, steps, _ = drafted_steps(model, prompt, **kwargs)
        assert {drafted.shape[1] for _, drafted, _ in steps} == {3}
        _, steps, _ = drafted_steps(model, prompt, mtp_draft_tokens=2, **kwargs)  # the call's over the config's
        assert {drafted.shape[1] for _, drafted, _ in steps} == {2}
    finally:
        model.config.mtp_draft_tokens = None
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="mtp_draft_tokens"):
            model.generate(prompt, use_mtp=True, mtp_draft_tokens=bad, **kwargs)
    with pytest.raises(ValueError, match="mtp_draft_tokens"):
        model.generate(prompt, mtp_draft_tokens=2, **kwargs)  # without use_mtp
    with pytest.raises(ValueError, match="mtp_draft_tokens"):
        small(num_mtp_layers=1, mtp_draft_tokens=0)
    with pytest.raises(ValueError, match="mtp_draft_tokens"):
        small(mtp_draft_tokens=2)  # no modules
    assert small(num_mtp_layers=1, mtp_draft_tokens=4).mtp_draft_tokens == 4



def test_cli_takes_the_option_with_mtp_only(tmp_path, capsys):
    from test_reshape import saved_folder

    folder = saved_folder(tmp_path / "src", num_mtp_layers=1)
    args = ["generate", str(folder), "hello", "--max-new-tokens", "4"]
    assert main([*args, "--mtp", "--mtp-draft-tokens", "3"]) == 0
    assert main([*args, "--mtp-draft-tokens", "2"]) == 2
    assert "--mtp-draft-tokens" in capsys.readouterr().err
    assert main([*args, "--mtp", "--mtp-draft-tokens", "0"]) == 2
    assert "--mtp-draft-tokens" in capsys.readouterr().err
