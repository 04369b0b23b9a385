"""How many tokens `generate(use_mtp=True)` drafts per step (`draft_schedule.py`), and drafting into a static cache.

The schedule against simulated decoding (step costs of a CPU, where verifying drafts costs much more than a plain
step, and of a GPU, where it costs little; Bernoulli acceptance): it never loses against plain decoding by more
than the few steps it spends measuring, and keeps drafting where drafting pays. The generator against a no-cache
recomputation of every draft, whatever mix of plain and drafting steps the schedule picks (plain steps leave the
modules' cache behind; the next drafting step reads those positions). The private parts of transformers'
`generate` this relies on are named in `compat.GENERATION_HOOKS` and checked here on the installed release."""

from __future__ import annotations

import inspect
import itertools
import random

import pytest
import torch
from transformers import GenerationMixin
from transformers.cache_utils import StaticLayer

from modular_decoder import ModularDecoderConfig, ModularDecoderForCausalLM, compat
from modular_decoder.cache import ModularDecoderCache
from modular_decoder.draft_schedule import FIRST_SAMPLES, DraftSchedule
from modular_decoder.mtp_generation import DraftStatistics, MtpCandidateGenerator, recorded_drafts
from mtp_cases import drafted_steps, reference_drafts
from test_mtp_draft_tokens import _tiny_random as _tiny
from test_reshape_add_mtp import counting_model_with_mtp

pytestmark = pytest.mark.usefixtures("one_thread")

# step seconds per drafted count, relative to a plain step: this CPU's SmolLM2 (a 2-token verify 1.33x a 1-token
# forward, drafts 0.08x; benchmarks/results_mtp_decode.json) and a GPU where verifying a few tokens costs about one
CPU = {0: 1.0, 1: 1.41, 2: 1.63, 3: 1.62}
GPU = {0: 1.0, 1: 1.06, 2: 1.1, 3: 1.14}


def simulate(schedule: DraftSchedule, cost: dict, acceptance: float, tokens: int, seed: int = 0) -> float:
    """Tokens per second of decoding `tokens` tokens where each draft is accepted with probability `acceptance`
    (the drafts after a rejected one are not), a step drafting c tokens taking `cost[c]` seconds."""
    rng, made, seconds = random.Random(seed), 0, 0.0
    while made < tokens:
        count = schedule.next_count()
        accepted = next((j for j in range(count) if rng.random() >= acceptance), count)
        schedule.timed(count, cost[count])
        if count:
            schedule.verified(count, accepted)
        made, seconds = made + accepted + 1, seconds + cost[count]
    return made / seconds


@pytest.mark.parametrize("tokens", [64, 512])
@pytest.mark.parametrize("acceptance", [0.0, 0.27, 0.4])
def test_where_drafting_does_not_pay_decoding_keeps_plain_speed(tokens, acceptance):
    """On the CPU's costs a draft pays only above 41% acceptance: the schedule measures, then stops drafting and
    probes now and then; at least 0.95x plain decoding (1 token per second here), seeds averaged."""
    rates = [simulate(DraftSchedule(1), CPU, acceptance, tokens, seed) for seed in range(20)]
    assert sum(rates) / len(rates) >= 0.95
    constant = [simulate(DraftSchedule(1, adaptive=False), CPU, acceptance, tokens, seed) for seed in range(20)]
    assert sum(rates) > sum(constant)  # drafting every step loses here


@pytest.mark.parametrize("acceptance", [0.5, 0.8])
def test_where_drafting_pays_the_schedule_keeps_drafting(acceptance):
    """On the GPU's costs drafting three tokens pays: the schedule ends within 5% of drafting three every step."""
    constant = sum(simulate(DraftSchedule(3, adaptive=False), GPU, acceptance, 512, seed) for seed in range(10))
    adaptive = sum(simulate(DraftSchedule(3), GPU, acceptance, 512, seed) for seed in range(10))
    assert constant > 10 * 1.2 and adaptive >= 0.95 * constant


def test_the_break_even_rule_from_the_measured_values():
    schedule = DraftSchedule(2, fewest=2)  # drafts two or none
    for drafted, accepted in [(2, 2), (2, 1), (2, 0), (2, 2)]:
        schedule.verified(drafted, accepted)
    # position 1 reached 4 times, accepted 3; position 2 reached 3 times, accepted 2 (one of each added)
    q1, q2 = (3 + 1) / (4 + 2), (2 + 1) / (3 + 2)
    assert schedule.tokens_per_step(0) == 1.0
    assert schedule.tokens_per_step(2) == pytest.approx(1 + q1 + q1 * q2)
    assert schedule.step_seconds(2) is None  # nothing measured
    for _ in range(FIRST_SAMPLES):
        schedule.timed(0, 1.0)
        schedule.timed(2, 2.0)
    assert schedule.step_seconds(1) == pytest.approx(1.5)  # interpolated between the plain and the most drafts
    # 1 + q1 + q1 q2 = 2.07 tokens in 2 s against 1 token in 1 s: drafting two pays
    assert schedule.next_count() == 2
    for _ in range(3):
        schedule.timed(2, 2.5)  # the median of the last 5 step times is now 2.5 s: drafting no longer pays
    assert schedule.next_count() == 0
    # allowed to draft one: 1 + q1 = 1.67 tokens in an interpolated 1.75 s is less than plain decoding's too;
    # at 1.5 s (one draft's step measured) it pays, and more per second than two drafts (2.07 in 2.5 s)
    schedule.fewest = 1
    assert schedule.next_count() == 0
    schedule.timed(1, 1.5)
    assert schedule.next_count() == 1


def test_constant_drafts_the_most_every_step():
    schedule = DraftSchedule(3, adaptive=False)
    for _ in range(10):
        schedule.timed(3, 100.0)
        schedule.verified(3, 0)
    assert {schedule.next_count() for _ in range(10)} == {3}


# ---------------------------------------------------------------------------------------------
# the generator: any mix of plain and drafting steps drafts what the modules compute without a cache


@pytest.fixture(scope="module")
def counting():
    """The counting model with two trained MTP modules (drafts often accepted) and a held-out prompt."""
    _, model, calibration = counting_model_with_mtp()
    return model, calibration.held_out[:1, :8]


def scripted(counts):
    """A `DraftSchedule._choose` that returns `counts` in turn, then its last over and over."""
    counts = iter(counts)
    last = [None]

    def choose(self):
        last[0] = next(counts, last[0])
        return last[0]

    return choose


@pytest.mark.parametrize(("modules", "most", "counts"), [
    (1, 1, [1, 0, 0, 1, 0, 1, 1, 0, 0, 0, 1]),
    (1, 3, [3, 0, 1, 2, 0, 0, 3, 1, 0, 2]),
    (2, 2, [2, 0, 2, 0, 0, 2, 2, 0, 2]),
    (2, 3, [3, 0, 0, 3, 2, 0, 3, 2]),
])
def test_plain_steps_between_drafting_steps_keep_every_draft_exact(counting, modules, most, counts, monkeypatch):
    """Plain steps leave positions unread by the modules, and two modules' rows drafted from rejected tokens wait
    across them: each drafting step's drafts equal the chain recomputed from the verified text without a cache, and
    the tokens are plain greedy decoding's."""
    model, prompt = counting
    if modules == 1:
        model = _first_module_only(model)
    kwargs = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False, attention_mask=torch.ones_like(prompt),
                  pad_token_id=0)
    for start in (prompt, torch.tensor([[63, 62, 61, 60, 59]])):  # drafts accepted; drafts rejected (wraps at 63)
        monkeypatch.setattr(DraftSchedule, "_choose", scripted(counts))
        kwargs["attention_mask"] = torch.ones_like(start)
        output, steps, statistics = drafted_steps(model, start, mtp_draft_tokens=most,
                                                  num_assistant_tokens_schedule=None, **kwargs)
        assert torch.equal(output, model.generate(start, **kwargs))
        assert len(steps) == statistics.steps < statistics.forwards - 1  # some steps were plain
        for verified, drafted, logits in steps:
            expected = reference_drafts(model, verified, drafted)
            torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
            assert torch.equal(drafted, expected.argmax(-1))


def _first_module_only(model):
    one = ModularDecoderForCausalLM(ModularDecoderConfig(**{**model.config.to_dict(), "num_mtp_layers": 1})).eval()
    one.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("mtp.layers.1.")})
    return one


@pytest.mark.parametrize("case", ["sliding", "mla", "int8"])
def test_plain_steps_between_drafting_steps_on_each_cache(case, monkeypatch):
    """Random weights (drafts mostly rejected), two modules drafting three tokens, plain steps between: windows
    shorter than the text, MLA latents, int8 K/V (whose drafts read quantized K/V: tokens only)."""
    model = _tiny("deepseek_v3", num_mtp_layers=2, eos_token_id=None) if case == "mla" else \
        _tiny(num_mtp_layers=2, **({"sliding_window": 4} if case == "sliding" else {}))
    monkeypatch.setattr(DraftSchedule, "_choose", scripted([3, 0, 0, 3, 3, 0, 3, 0, 0, 0, 3]))
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]]) % model.config.vocab_size
    kwargs = dict(max_new_tokens=14, min_new_tokens=14, do_sample=False, attention_mask=torch.ones_like(prompt),
                  pad_token_id=0)
    if case == "int8":
        kwargs.update(cache_implementation="quantized", cache_config={"backend": "int8"})
    output, steps, _ = drafted_steps(model, prompt, mtp_draft_tokens=3, num_assistant_tokens_schedule=None, **kwargs)
    assert torch.equal(output, model.generate(prompt, **kwargs))
    for verified, drafted, logits in steps if case != "int8" else ():
        torch.testing.assert_close(logits, reference_drafts(model, verified, drafted), rtol=1e-4, atol=1e-4)


def test_the_default_schedule_gives_plain_tokens_and_counts_what_it_did(counting):
    """Whatever this machine's timings make the schedule choose, greedy tokens are plain decoding's, sampling with a
    seed repeats, and the statistics add up: each forward yields its accepted drafts plus one token."""
    model, prompt = counting
    kwargs = dict(max_new_tokens=32, min_new_tokens=32, attention_mask=torch.ones_like(prompt), pad_token_id=0)
    with recorded_drafts() as statistics:
        drafted = model.generate(prompt, use_mtp=True, mtp_draft_tokens=3, do_sample=False, **kwargs)
    assert torch.equal(drafted, model.generate(prompt, do_sample=False, **kwargs))
    assert 32 - statistics.forwards == sum(statistics.accepted_at_least)  # the prefill's forward yields one token
    assert statistics.drafted == sum(statistics.drafted_at_least) and statistics.steps >= FIRST_SAMPLES
    torch.manual_seed(3)
    sampled = model.generate(prompt, use_mtp=True, do_sample=True, **kwargs)
    torch.manual_seed(3)
    assert torch.equal(sampled, model.generate(prompt, use_mtp=True, do_sample=True, **kwargs))


def test_statistics_per_position_count_the_steps_that_drafted_it():
    statistics = DraftStatistics()
    for drafted, accepted in [(3, 1), (1, 1), (3, 3), (2, 0)]:
        statistics.record_step(drafted, accepted)
    assert statistics.drafted_at_least == [4, 3, 2] and statistics.accepted_at_least == [3, 1, 1]
    assert statistics.position_acceptance() == [3 / 4, 1 / 3, 1 / 2]


# ---------------------------------------------------------------------------------------------
# drafting into a static cache (transformers sizes it for `max_length`; a step writes its drafts past that)

STATIC_CROPS = getattr(StaticLayer, "is_croppable", False)  # transformers' static layers crop from 5.2x


@pytest.mark.parametrize("drafting", [
    dict(use_mtp=True, mtp_draft_tokens=1), dict(use_mtp=True, mtp_draft_tokens=3),
    dict(use_mtp=True, mtp_draft_tokens=2, num_assistant_tokens_schedule="constant"),
    dict(prompt_lookup_num_tokens=3), "assistant",
], ids=["mtp-1", "mtp-3", "mtp-2-constant", "prompt-lookup", "assistant"])
@pytest.mark.parametrize("new_tokens", [1, 2, 7, 12])
def test_drafting_into_a_static_cache_gives_plain_tokens(drafting, new_tokens):
    """Every length: the cache holds the last step's drafts; where this release's static layers cannot crop, one
    `ValueError` naming the static cache, before any forward."""
    model = _tiny(num_mtp_layers=2, eos_token_id=None)
    if drafting == "assistant":
        drafting = dict(assistant_model=model)
    prompt = torch.tensor([[3, 1, 4, 1, 3, 1, 4, 1]])
    kwargs = dict(max_new_tokens=new_tokens, do_sample=False, attention_mask=torch.ones_like(prompt), pad_token_id=0)
    if not STATIC_CROPS:
        with pytest.raises(ValueError, match="cache_implementation=\"static\""):
            model.generate(prompt, cache_implementation="static", **drafting, **kwargs)
        return
    plain = model.generate(prompt, **kwargs)
    assert torch.equal(model.generate(prompt, cache_implementation="static", **drafting, **kwargs), plain)


@pytest.mark.skipif(not STATIC_CROPS, reason="this transformers release's static cache layers cannot crop")
def test_static_cache_refusals_name_the_cache():
    """A sliding layer's ring shorter than the cache cannot crop back (refused before any forward: transformers
    would refuse after the prefill); a static cache passed too short for the drafts is named with its length."""
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    kwargs = dict(max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(prompt), pad_token_id=0)
    sliding = _tiny(num_mtp_layers=1, sliding_window=4)
    with pytest.raises(ValueError, match="window is shorter than the cache"):
        sliding.generate(prompt, use_mtp=True, cache_implementation="static", **kwargs)
    wide = _tiny(num_mtp_layers=1, sliding_window=32)  # the window holds the whole text: crops
    assert torch.equal(wide.generate(prompt, use_mtp=True, cache_implementation="static", **kwargs),
                       wide.generate(prompt, **kwargs))
    model = _tiny(num_mtp_layers=1)
    # 8 prompt tokens and 8 new: the last step verifies one draft after the 15th token
    short = ModularDecoderCache(model.config, "static", max_cache_len=15)
    with pytest.raises(ValueError, match="static `cache` holds 15 tokens; drafting writes up to 16"):
        model.generate(prompt, use_mtp=True, cache=short, **kwargs)
    enough = ModularDecoderCache(model.config, "static", max_cache_len=16)
    assert torch.equal(model.generate(prompt, use_mtp=True, cache=enough, **kwargs), model.generate(prompt, **kwargs))


# ---------------------------------------------------------------------------------------------
# the private parts of transformers' generate this relies on


def test_the_private_generation_hooks_are_where_compat_names_them():
    """Fails when transformers moves what `generate(use_mtp=True)` overrides or how its assisted-decoding loop calls
    a drafter that reads the model's outputs (`compat.GENERATION_HOOKS`; docs/contract.md)."""
    from modular_decoder.modeling_modular_decoder import ModularDecoderForCausalLM as Ours

    for name in compat.GENERATION_HOOKS["overridden"]:
        theirs = getattr(GenerationMixin, name)
        assert list(inspect.signature(getattr(Ours, name)).parameters)[:4] == \
            list(inspect.signature(theirs).parameters)[:4], name
    loop, words = compat.GENERATION_HOOKS["assisted_loop"]
    source = inspect.getsource(getattr(GenerationMixin, loop))
    assert all(word in source for word in words), [w for w in words if w not in source]
    assert "_get_candidate_generator(" in source
    assert issubclass(MtpCandidateGenerator, __import__("transformers").generation.CandidateGenerator)
    assert list(itertools.islice(inspect.signature(MtpCandidateGenerator.get_candidates).parameters, 6)) == \
        ["self", "input_ids", "model_kwargs", "model_outputs", "is_first_iteration", "n_last_matches"]
