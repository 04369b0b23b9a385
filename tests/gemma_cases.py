"""What the Gemma 3n and Gemma 4 test files share: module fixtures over a family's conversion cases, the parity tests
both run against transformers' class (each file imports them, and pytest collects them there with that file's
fixtures), and the check that each mechanism carries signal."""

from __future__ import annotations

import copy

import pytest
import torch
from conversion_cases import converted_pair
from family_parity import assert_gradients_match, assert_greedy_tokens_match, assert_logits_match
from test_gpt_oss_smollm3 import IDS, assert_trainer_matches


def pair_fixtures(cases: list[str], first: str):
    """Two module fixtures: `pair`, (transformers' model with perturbed weights (eager), ours converted from its saved
    folder) for each of `cases`, and `first` (its name), that pair for `cases[0]` alone."""

    @pytest.fixture(scope="module", params=cases, name="pair")
    def pair(request, tmp_path_factory):
        return converted_pair(request.param, tmp_path_factory.mktemp(request.param), "eager")[:2]

    @pytest.fixture(scope="module", name=first)
    def first_pair(tmp_path_factory):
        return converted_pair(cases[0], tmp_path_factory.mktemp(first), "eager")[:2]

    return pair, first_pair


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_logits_and_a_left_padded_batch_match(pair, backend):
    assert_logits_match(*pair, backend)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_tokens_through_each_sides_cache_match(pair, backend, cache):
    """A left-padded batch generated greedily by each side through its own cache (transformers' dynamic one; ours
    dynamic or static), past the window of 4: the sharing layers read their sources' windows and full keys."""
    assert_greedy_tokens_match(*pair, backend, cache)


def test_trainer_steps_equal_transformers_class_padded_and_packed(pair, tmp_path):
    """`Trainer` on ours and on transformers' class from the same weights: the same loss at every step with
    right-padded batches; ours with the documents packed in one row gives the padded losses."""
    source, ours = pair
    assert_trainer_matches(source, ours, tmp_path, reference_packs=False)


def test_gradients_equal_transformers_class(pair, tmp_path):
    """A loss's gradient on every parameter, AltUp's and the per-layer embeddings' included, is transformers'."""
    assert_gradients_match(*pair, tmp_path)


def assert_each_edit_changes_logits(ours, edits: dict, atol: float) -> None:
    """Each of `edits` ({mechanism: an in-place edit of a model}) on a copy of `ours` changes its logits on `IDS` by
    more than `atol`: the parity tests would hold for a model that ignored a mechanism only if it did nothing."""
    with torch.no_grad():
        reference = ours(IDS).logits
        for name, edit in edits.items():
            changed = copy.deepcopy(ours)
            edit(changed)
            assert (changed(IDS).logits - reference).abs().max() > atol, name
