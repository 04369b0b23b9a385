"""gpt-oss (sinks, alternating windows, the biased top-k-then-softmax router, experts with biases and the clamped
SwiGLU) and SmolLM3 (NoPE layers, sliding NoPE layers) against transformers' `GptOssForCausalLM` and
`SmolLM3ForCausalLM`, with the weights carried by the conversion package: logits on our eager and SDPA backends
against theirs, a left-padded batch, greedy tokens through each side's own cache (ours dynamic and static), and
`Trainer` steps with padded and packed batches.
test_conversion.py proves the export round trip bit for bit, test_moe_model.py gpt-oss's router logits and losses,
test_transformers_versions.py all of this on the oldest and newest declared transformers."""

from __future__ import annotations

import copy

import pytest
import torch
from conversion_cases import CASES, perturbed
from transformers import AutoModelForCausalLM, DataCollatorWithFlattening, GptOssConfig, Trainer, TrainingArguments

from modular_decoder.conversion import convert

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ["gpt_oss", "smollm3", "smollm3-sliding"]
IDS = torch.tensor([[5, 17, 3, 42, 8, 61, 23, 11, 2, 90, 33, 7, 19, 4], [9, 1, 64, 12, 40, 5, 77, 18, 26, 3, 50, 14, 6, 8]])


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    """(transformers' model with perturbed weights, ours converted from its saved folder)."""
    folder = tmp_path_factory.mktemp(request.param)
    _, build = CASES[request.param]
    config = build()
    config.architectures = None
    torch.manual_seed(0)
    source = perturbed(AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval())
    with torch.no_grad():  # sinks of order 1, so that a dropped sink shows in the logits
        for module in source.modules():
            if getattr(module, "sinks", None) is not None:
                module.sinks.normal_(0.0, 1.5)
    source.save_pretrained(folder / "src")
    convert(folder / "src", folder / "ours", progress=False)
    return source, AutoModelForCausalLM.from_pretrained(folder / "ours").eval()


def left_padded() -> tuple[torch.Tensor, torch.Tensor]:
    mask = torch.ones_like(IDS)
    mask[1, :5] = 0
    return IDS, mask


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_logits_and_a_left_padded_batch_match(pair, backend):
    source, ours = pair
    ours.set_attn_implementation(backend)
    ids, mask = left_padded()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, source(ids).logits, rtol=0, atol=1e-4)
        got, want = ours(ids, attention_mask=mask).logits, source(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=1e-4)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_tokens_through_each_sides_cache_match(pair, backend, cache):
    """A batch whose second row is left-padded, past the sliding window, generated greedily by each side through
    its own cache (transformers' dynamic one; ours dynamic or static)."""
    source, ours = pair
    ours.set_attn_implementation(backend)
    ids, mask = left_padded()
    kwargs = dict(attention_mask=mask, max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = source.generate(ids, **kwargs)
        got = ours.generate(ids, cache_implementation=None if cache == "dynamic" else "static", **kwargs)
    assert torch.equal(got, want)


def test_the_sinks_and_the_nope_layers_change_the_function(pair):
    """The proofs above would hold for a model that ignored them only if they did nothing: they do not."""
    _, ours = pair
    without = copy.deepcopy(ours)
    without.config.no_rope_layers = None  # every layer rotates
    with torch.no_grad():
        for module in without.modules():
            if getattr(module, "sinks", None) is not None:
                module.sinks.fill_(-1e4)  # no mass to the sinks
        assert (ours(IDS).logits - without(IDS).logits).abs().max() > 1e-2


def _padded(features: list[dict]) -> dict:
    """Right-padded rows, padding masked out and left out of the loss (what a tokenizer's padding collator makes)."""
    width = max(len(f["input_ids"]) for f in features)
    ids = torch.tensor([f["input_ids"] + [0] * (width - len(f["input_ids"])) for f in features])
    mask = torch.tensor([[1] * len(f["input_ids"]) + [0] * (width - len(f["input_ids"])) for f in features])
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _trainer_losses(model, collator, folder) -> list[float]:
    """Three SGD steps of `Trainer` on a copy of `model` (so the updates are the gradients): the loss at each."""
    args = TrainingArguments(output_dir=str(folder), max_steps=3, per_device_train_batch_size=4, learning_rate=0.05,
                             optim="sgd", use_cpu=True, report_to=[], logging_steps=1, save_strategy="no",
                             remove_unused_columns=False, seed=0, data_seed=0)
    data = [{"input_ids": [(7 * i + 3 * j) % 96 for j in range(6 + 3 * (i % 4))]} for i in range(12)]
    trainer = Trainer(model=copy.deepcopy(model).train(), args=args, train_dataset=data, data_collator=collator)
    trainer.train()
    moved = [not torch.equal(p, q) for p, q in zip(trainer.model.parameters(), model.parameters())]
    assert sum(moved) > len(moved) // 2  # the steps trained (the sinks and expert biases too)
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def assert_trainer_matches(source, ours, folder, reference_packs: bool) -> None:
    """`Trainer` on transformers' class and on ours from the same weights: three steps of right-padded batches give
    the same losses, and ours with the same documents packed in one row (`DataCollatorWithFlattening`) gives them
    too; so does the reference packed where its mask reads `position_ids` (`reference_packs`)."""
    packed = DataCollatorWithFlattening(return_position_ids=True)
    theirs_padded = _trainer_losses(source, _padded, folder / "theirs_padded")
    assert len(theirs_padded) == 3
    assert _trainer_losses(ours, _padded, folder / "ours_padded") == pytest.approx(theirs_padded, rel=1e-5)
    assert _trainer_losses(ours, packed, folder / "ours_packed") == pytest.approx(theirs_padded, rel=1e-5)
    if reference_packs:
        assert _trainer_losses(source, packed, folder / "theirs_packed") == pytest.approx(theirs_padded, rel=1e-5)


def test_trainer_steps_equal_transformers_classes_padded_and_packed(pair, tmp_path):
    """`Trainer` on ours and on transformers' class from the same weights, with right-padded batches and with the
    same documents packed into one row (`DataCollatorWithFlattening`): the same loss at every step. Packed documents
    must each see only themselves, which gives the padded batches' losses; transformers' SmolLM3 finds the documents
    from `position_ids` as ours does, its gpt-oss does not (its mask ignores `position_ids`: it attends across the
    documents of a row), so there the padded run is the reference."""
    source, ours = pair
    assert_trainer_matches(source, ours, tmp_path, reference_packs=not isinstance(source.config, GptOssConfig))
