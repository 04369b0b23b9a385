"""Runtime inputs are checked where they enter `forward` and `generate`: each malformed input is a
`ValueError` naming the argument; well-formed masks (bool, int, float 0/1, left padding, cached
decoding, static cache) still run and give the same logits as before."""

from __future__ import annotations

import pytest
import torch

from modular_decoder import ModularDecoderForCausalLM, preset_config

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return ModularDecoderForCausalLM(preset_config("llama", tiny=True)).eval()


def ids(model, *shape):
    return torch.randint(0, model.config.vocab_size, shape)


FORWARD_CASES = {
    "empty sequence": (lambda m: dict(input_ids=ids(m, 1, 0)), r"`input_ids` is empty \(shape \(1, 0\)\)"),
    "empty batch": (lambda m: dict(input_ids=ids(m, 0, 5)), r"`input_ids` is empty \(shape \(0, 5\)\)"),
    "1-D ids": (lambda m: dict(input_ids=ids(m, 5)), r"`input_ids` must be 2-D \(batch, seq\), got shape \(5,\)"),
    "3-D ids": (lambda m: dict(input_ids=ids(m, 1, 2, 3)), r"`input_ids` must be 2-D"),
    "float ids": (lambda m: dict(input_ids=ids(m, 2, 5).float()), r"`input_ids` must hold integer token ids"),
    "bool ids": (lambda m: dict(input_ids=ids(m, 2, 5) > 3), r"`input_ids` must hold integer token ids"),
    "list ids": (lambda m: dict(input_ids=[[1, 2, 3]]), r"`input_ids` must be a torch tensor"),
    "short mask": (lambda m: dict(input_ids=ids(m, 2, 5), attention_mask=torch.ones(2, 4, dtype=torch.long)),
                   r"`attention_mask` has length 4 but must cover the input's 5 tokens"),
    "long mask": (lambda m: dict(input_ids=ids(m, 2, 5), attention_mask=torch.ones(2, 6, dtype=torch.long)),
                  r"`attention_mask` has length 6"),
    "mask of another batch": (lambda m: dict(input_ids=ids(m, 2, 5), attention_mask=torch.ones(3, 5, dtype=torch.long)),
                              r"`attention_mask` has batch size 3 but the input has 2"),
    "1-D mask": (lambda m: dict(input_ids=ids(m, 2, 5), attention_mask=torch.ones(5, dtype=torch.long)),
                 r"`attention_mask` must be 2-D \(batch, seq\)"),
    "mask of 2s": (lambda m: dict(input_ids=ids(m, 2, 5), attention_mask=torch.full((2, 5), 2)),
                   r"`attention_mask` must hold only 0 \(padding\) and 1 \(token\), got other values: 2"),
    "negative mask": (lambda m: dict(input_ids=ids(m, 1, 3), attention_mask=torch.tensor([[1, -1, 1]])),
                      r"`attention_mask` must hold only 0 .* -1"),
    "float mask of halves": (lambda m: dict(input_ids=ids(m, 1, 3), attention_mask=torch.tensor([[1.0, 0.5, 1.0]])),
                             r"`attention_mask` must hold only 0 .* 0.5"),
    "2-D embeds": (lambda m: dict(inputs_embeds=torch.randn(5, m.config.hidden_size)),
                   r"`inputs_embeds` must have shape \(batch, seq, hidden_size=64\), got \(5, 64\)"),
    "narrow embeds": (lambda m: dict(inputs_embeds=torch.randn(1, 5, 7)), r"`inputs_embeds` must have shape"),
    "integer embeds": (lambda m: dict(inputs_embeds=torch.ones(1, 5, m.config.hidden_size, dtype=torch.long)),
                       r"`inputs_embeds` must be a floating-point tensor"),
    "empty embeds": (lambda m: dict(inputs_embeds=torch.randn(1, 0, m.config.hidden_size)),
                     r"`inputs_embeds` is empty"),
}


@pytest.mark.parametrize("case", list(FORWARD_CASES))
def test_forward_refuses(model, case):
    make, message = FORWARD_CASES[case]
    with pytest.raises(ValueError, match=message):
        model(**make(model))
    with pytest.raises(ValueError, match=message):  # the base model is where the check sits
        model.model(**make(model))


def test_mask_length_counts_the_cache(model):
    prompt = ids(model, 1, 6)
    with torch.no_grad():
        cache = model(prompt, use_cache=True).cache
        step = ids(model, 1, 1)
        model(step, attention_mask=torch.ones(1, 7, dtype=torch.long), cache=cache)  # 6 cached + 1 new
        with pytest.raises(ValueError, match=r"must cover the 7 cached and 1 new tokens \(8\)"):
            model(step, attention_mask=torch.ones(1, 1, dtype=torch.long), cache=cache)


@pytest.mark.parametrize("dtype", [torch.long, torch.int32, torch.bool, torch.float32])
def test_valid_masks_run_and_agree(model, dtype):
    prompt = ids(model, 2, 6)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        reference = model(prompt, attention_mask=mask).logits
        got = model(prompt, attention_mask=mask.to(dtype)).logits
    torch.testing.assert_close(got, reference, rtol=0, atol=0)


@pytest.mark.parametrize("case, kwargs, message", [
    ("empty prompt", lambda m: dict(inputs=ids(m, 1, 0)), r"`input_ids` is an empty prompt"),
    ("empty prompt (keyword)", lambda m: dict(input_ids=ids(m, 2, 0)), r"`input_ids` is an empty prompt"),
    ("1-D prompt", lambda m: dict(inputs=ids(m, 5)), r"`input_ids` must be 2-D"),
    ("mask of 2s", lambda m: dict(inputs=ids(m, 2, 5), attention_mask=torch.full((2, 5), 2)), r"only 0 .* and 1"),
    ("short mask", lambda m: dict(inputs=ids(m, 2, 5), attention_mask=torch.ones(2, 3, dtype=torch.long)),
     r"`attention_mask` has length 3"),
    ("float ids", lambda m: dict(inputs=ids(m, 1, 5).float()), r"`input_ids` must hold integer token ids"),
])
def test_generate_refuses(model, case, kwargs, message):
    with pytest.raises(ValueError, match=message):
        model.generate(**kwargs(model), max_new_tokens=2, do_sample=False)


@pytest.mark.parametrize("cache_implementation", [None, "static"])
def test_generate_with_masks_still_runs(model, cache_implementation):
    prompt = ids(model, 2, 5)
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    out = model.generate(prompt, attention_mask=mask, max_new_tokens=4, do_sample=False,
                         cache_implementation=cache_implementation)
    alone = model.generate(prompt[1:], attention_mask=mask[1:], max_new_tokens=4, do_sample=False,
                           cache_implementation=cache_implementation)
    assert out.shape == (2, 9) and torch.equal(out[1], alone[0])


def test_generate_from_embeddings(model):
    embeds = model.get_input_embeddings()(ids(model, 1, 4))
    out = model.generate(inputs_embeds=embeds, max_new_tokens=3, do_sample=False)
    assert out.shape[-1] == 3
    with pytest.raises(ValueError, match=r"`inputs_embeds` must have shape"):
        model.generate(inputs_embeds=embeds[0], max_new_tokens=3)


def test_mask_values_are_checked_again_after_generate(model):
    """generate() skips re-reading the mask of its own steps; a forward after it checks again."""
    prompt = ids(model, 1, 4)
    model.generate(prompt, attention_mask=torch.ones(1, 4, dtype=torch.long), max_new_tokens=2, do_sample=False)
    with pytest.raises(ValueError, match="only 0"):
        model(prompt, attention_mask=torch.full((1, 4), 2))


# ------------------------------------------------------------------------------------ host reads (the sync rule)

HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")


@pytest.fixture
def host_reads(monkeypatch):
    """Counts every read of a tensor's values by the host (`.item()`, `.tolist()`, `bool()`, `int()`, ...): each is a
    device sync on an accelerator. `on_accelerator()` makes the checks treat every tensor as an accelerator's
    (`input_checks.syncs_device`, the seam the rule goes through): on CPU the real sync cannot be observed."""
    from modular_decoder import input_checks

    class Reads(list):
        def on_accelerator(self):
            monkeypatch.setattr(input_checks, "syncs_device", lambda tensor: True)

    reads = Reads()
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _f=original, _n=name: reads.append(_n) or _f(self, *a))
    return reads


def _llama_twin(model):
    from transformers import LlamaConfig, LlamaForCausalLM

    c = model.config
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, rope_parameters=c.rope_parameters,
    ))


def _training_step(model, batch, mask):
    model.train()
    try:
        model(input_ids=batch, attention_mask=mask, labels=batch).loss.backward()
    finally:
        model.eval()


def test_a_training_step_on_an_accelerator_reads_what_llamas_reads(model, host_reads):
    """A training step (forward with a padded mask, loss, backward) reads no more tensor values on the host than
    transformers' Llama does in the same step: none of the input checks' reads remain on an accelerator. On CPU
    the mask check reads its values (free there: no device to wait for)."""
    batch = ids(model, 2, 6)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0
    llama = _llama_twin(model)
    host_reads.clear()
    _training_step(llama, batch, mask)
    llamas = list(host_reads)
    host_reads.clear()
    _training_step(model, batch, mask)
    on_cpu = list(host_reads)
    host_reads.on_accelerator()
    host_reads.clear()
    _training_step(model, batch, mask)
    assert host_reads == llamas, (host_reads, llamas)
    assert len(on_cpu) > len(llamas)  # the CPU check reads the mask: the count sees the checks' reads


def test_generate_on_an_accelerator_checks_its_prompt_once(model, host_reads, monkeypatch):
    """On an accelerator `generate` reads its prompt's values once (mask 0/1 and the ids' range), whatever the
    number of steps, and still refuses a bad prompt with a `ValueError`."""
    from modular_decoder import input_checks

    host_reads.on_accelerator()
    calls = []
    for name in ("_zeros_and_ones", "check_token_ids"):
        original = getattr(input_checks, name)
        monkeypatch.setattr(input_checks, name, lambda *a, _f=original, _n=name: calls.append(_n) or _f(*a))
    prompt, mask = ids(model, 2, 4), torch.ones(2, 4, dtype=torch.long)
    counts = {}
    for steps in (1, 5):
        calls.clear()
        model.generate(prompt, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
        counts[steps] = list(calls)
    assert counts[1] == counts[5] == ["_zeros_and_ones", "check_token_ids"]
    with pytest.raises(ValueError, match="only 0"):
        model.generate(prompt, attention_mask=torch.full((2, 4), 2), max_new_tokens=2)
    with pytest.raises(ValueError, match=r"must lie in \[0, vocab_size=128\); got values in \[0, 128\]"):
        model.generate(torch.tensor([[0, 128]]), max_new_tokens=2)
