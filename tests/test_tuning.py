"""The thresholds chosen from measurements are settings (`modular_decoder.tuning`): changed without monkeypatching,
validated where they are set (a `ValueError` naming the setting or the environment variable), and honoured by
the code that reads them: MLA's scoring path and query block, the split products' weight threshold."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import modular_decoder.mla as mla
from modular_decoder import ModularDecoderForCausalLM, preset_config
from modular_decoder.split_products import takes_split_branch
from modular_decoder.tuning import ENVIRONMENT, Tuning, set_tuning, tuned, tuning

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(("name", "value"), [("absorbed_max_new_tokens", -1), ("absorbed_query_block", 0),
                                             ("min_split_weight", 1.5), ("absorbed_query_block", True),
                                             ("absorbed_max_new_tokens", "64")])
def test_a_bad_value_is_refused_naming_the_setting(name, value):
    before = tuning()
    with pytest.raises(ValueError, match=f"^`{name}` must be an integer of at least"):
        set_tuning(**{name: value})
    assert tuning() is before


def test_an_unknown_setting_is_refused_and_tuned_restores():
    with pytest.raises(ValueError, match="`query_block` is not a tuning setting"):
        set_tuning(query_block=4)
    with tuned(absorbed_query_block=2, min_split_weight=0) as inside:
        assert (inside.absorbed_query_block, inside.min_split_weight) == (2, 0)
    assert tuning() == Tuning()  # the shipped defaults (no environment variable set in the tests)


def _import_with(variable: str, value: str) -> subprocess.CompletedProcess:
    code = "from modular_decoder.tuning import tuning; print(tuning())"
    env = {**os.environ, variable: value}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_environment_variables_set_and_are_validated():
    done = _import_with(ENVIRONMENT["absorbed_max_new_tokens"], "128")
    assert done.returncode == 0 and "absorbed_max_new_tokens=128" in done.stdout, done.stderr
    done = _import_with(ENVIRONMENT["absorbed_query_block"], "eight")
    assert done.returncode != 0
    assert "ValueError: `MODULAR_DECODER_ABSORBED_QUERY_BLOCK` must be an integer of at least 1, got 'eight'" in done.stderr


def _mla_layer():
    torch.manual_seed(0)
    return ModularDecoderForCausalLM(preset_config("deepseek_v3", tiny=True)).eval().model.layers[0].self_attn


def test_absorbed_max_new_tokens_moves_the_scoring_path():
    layer = _mla_layer()
    assert layer.scoring_path(1, 100, None) == layer.scoring_path(64, 100, None) == "absorbed"
    with tuned(absorbed_max_new_tokens=0):
        assert layer.scoring_path(1, 100, None) == "expanded"  # never absorbed
    with tuned(absorbed_max_new_tokens=100):
        assert layer.scoring_path(99, 100, None) == "absorbed"


def test_absorbed_query_block_sets_the_scores_per_pass(monkeypatch):
    shapes = []
    monkeypatch.setattr(mla, "attention_probs", lambda module, scores, *a, _f=mla.attention_probs, **k:
                        shapes.append(tuple(scores.shape)) or _f(module, scores, *a, **k))
    torch.manual_seed(0)
    model = ModularDecoderForCausalLM(preset_config("deepseek_v3", tiny=True, attn_implementation="sdpa")).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 12))
    with torch.no_grad(), tuned(absorbed_query_block=3):
        cache = model(ids[:, :5]).cache
        shapes.clear()
        model(ids[:, 5:], cache=cache)  # 7 new tokens: blocks of 3, 3, 1
    heads = model.config.num_attention_heads
    assert shapes == [(1, heads, rows, 12) for rows in (3, 3, 1)] * model.config.num_hidden_layers


def test_min_split_weight_sets_which_products_split():
    """With two threads the threshold decides; with one there is nothing to split over, whatever it says."""
    layer, x = nn.Linear(64, 64), torch.randn(1, 64)
    with tuned(min_split_weight=64 * 64):
        assert not takes_split_branch(layer, x)  # (this module runs on one thread)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with tuned(min_split_weight=64 * 64):
            assert takes_split_branch(layer, x)
        with tuned(min_split_weight=64 * 64 + 1):
            assert not takes_split_branch(layer, x)
    finally:
        torch.set_num_threads(threads)
    assert dataclasses.asdict(tuning()) == dataclasses.asdict(Tuning())
