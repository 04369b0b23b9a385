"""Runtime inputs are checked where they enter `forward` and `generate`: each malformed input is a
`ValueError` naming the argument; well-formed masks (bool, int, float 0/1, left padding, cached
decoding, static cache) still run and give the same logits as before."""

from __future__ import annotations

import pytest
import torch
from decoding import converted_twin

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

# Every call that reads a tensor's values on the host, each a device sync on an accelerator
HOST_READS = {torch.Tensor: ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu",
                             "numpy"),
              torch: ("equal", "nonzero")}


@pytest.fixture
def host_reads(monkeypatch):
    """Counts every read of a tensor's values by the host (`HOST_READS`). `on_accelerator()` makes the checks
    treat every tensor as an accelerator's (`input_checks.syncs_device`, the seam the rule goes through): on
    CPU the real sync cannot be observed."""
    from modular_decoder import input_checks

    class Reads(list):
        def on_accelerator(self):
            monkeypatch.setattr(input_checks, "syncs_device", lambda tensor: True)

    reads = Reads()
    for owner, names in HOST_READS.items():
        for name in names:
            original = getattr(owner, name)
            monkeypatch.setattr(owner, name, lambda *a, _f=original, _n=name, **k: reads.append(_n) or _f(*a, **k))
    return reads


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory):
    """transformers' `LlamaForCausalLM` and ours with its weights (through the converter)."""
    return converted_twin("Llama", tmp_path_factory.mktemp("llama"))


def _batch(padded: bool, batch: int = 4, length: int = 6):
    tokens = torch.randint(1, 128, (batch, length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(batch, length, dtype=torch.long)
    if padded:
        mask[::2, :2] = 0
        tokens[mask == 0] = 0
    return tokens, mask


def _training_step(model, batch, mask):
    model.train()
    try:
        model(input_ids=batch, attention_mask=mask, labels=batch).loss.backward()
    finally:
        model.eval()


@pytest.mark.parametrize("padded", [True, False], ids=["padded-mask", "no-mask"])
def test_a_training_step_on_an_accelerator_reads_no_more_than_llama(llama_pair, host_reads, padded):
    """A training step (forward, loss, backward) reads no more tensor values on the host than transformers' Llama
    does in the same step with the same weights: none of the input checks' reads remain on an accelerator, and
    a batch without a mask pays no search for packed documents in positions nobody passed. On CPU the mask
    check reads its values (free there: no device to wait for)."""
    batch, mask = _batch(padded)
    mask = mask if padded else None
    counts = {}
    for name, model in zip(("llama", "ours"), llama_pair):
        host_reads.clear()
        _training_step(model, batch, mask)
        counts[name, "cpu"] = list(host_reads)
    host_reads.on_accelerator()
    host_reads.clear()
    _training_step(llama_pair[1], batch, mask)
    assert host_reads == counts["llama", "cpu"], (host_reads, counts["llama", "cpu"])
    if padded:  # the CPU check reads the mask: the count sees the checks' reads
        assert len(counts["ours", "cpu"]) > len(counts["llama", "cpu"])


@pytest.mark.parametrize("padded", [True, False], ids=["left-padded", "unpadded"])
def test_generate_on_an_accelerator_reads_no_more_than_llama_per_step(llama_pair, host_reads, padded):
    """On an accelerator each step of `generate` reads no more tensor values on the host than the same step of
    transformers' Llama with the same weights (the same tokens come out), and the whole call at most one more:
    the prompt's values (mask 0/1, ids in the vocabulary), read once, together. A bad prompt is still refused
    with a `ValueError`."""
    host_reads.on_accelerator()
    prompt, mask = _batch(padded)
    reads, tokens = {}, {}
    for name, model in zip(("llama", "ours"), llama_pair):
        for steps in (1, 5):
            host_reads.clear()
            with torch.no_grad():
                tokens[name, steps] = model.generate(prompt, attention_mask=mask, max_new_tokens=steps,
                                                     min_new_tokens=steps, do_sample=False)
            reads[name, steps] = len(host_reads)
    assert torch.equal(tokens["ours", 5], tokens["llama", 5])
    per_step = {name: (reads[name, 5] - reads[name, 1]) / 4 for name in ("llama", "ours")}
    assert per_step["ours"] <= per_step["llama"], (per_step, reads)
    assert reads["ours", 5] <= reads["llama", 5] + 1, reads
    ours = llama_pair[1]
    with pytest.raises(ValueError, match="only 0"):
        ours.generate(prompt, attention_mask=torch.full(prompt.shape, 2), max_new_tokens=2)
    with pytest.raises(ValueError, match=r"must lie in \[0, vocab_size=128\); got values in \[0, 128\]"):
        ours.generate(torch.tensor([[0, 128]]), max_new_tokens=2)


def test_forward_beside_a_static_cache_on_an_accelerator_reads_no_more_than_llama(llama_pair, host_reads):
    """Direct forwards with a static cache and a left-padded 2-D mask (a prefill, then a step) read no more tensor
    values on the host than transformers' Llama in the same calls: the cache's token count, a device tensor, is
    not read for the mask-length check there. On CPU that check still runs (it reads the count for free)."""
    from transformers import StaticCache

    from modular_decoder.cache import ModularDecoderCache

    host_reads.on_accelerator()
    batch, mask = _batch(padded=True)
    llama, ours = llama_pair
    reads, logits = {}, {}
    caches = {"llama": StaticCache(config=llama.config, max_cache_len=16),
              "ours": ModularDecoderCache(ours.config, "static", max_cache_len=16)}
    for name, model in (("llama", llama), ("ours", ours)):
        host_reads.clear()
        with torch.no_grad():
            model(batch[:, :5], attention_mask=mask[:, :5], cache=caches[name])
            logits[name] = model(batch[:, 5:], attention_mask=mask, cache=caches[name]).logits
        reads[name] = list(host_reads)
    torch.testing.assert_close(logits["ours"], logits["llama"], rtol=1e-5, atol=1e-5)
    assert len(reads["ours"]) <= len(reads["llama"]), reads
