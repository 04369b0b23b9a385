"""The contract table (`modular-decoder demo`, the model cards) shows what the model computes: every field it
leaves out can be set to any value the config accepts without changing the model (same tensors, same logits),
and the fields the chosen kinds read are shown."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from decoding import prompt

from modular_decoder import ModularDecoderConfig, ModularDecoderForCausalLM, contract_table, preset_config
from modular_decoder.contract import _NON_CONTRACT

pytestmark = pytest.mark.usefixtures("one_thread")

# preset -> fields left out of its table that the config accepts changed (the others it refuses)
PRESETS = {"smollm2": {"norm_bias"}, "gpt2": set(), "gptj": set(), "olmo2": {"norm_bias"},
           "mixtral": {"norm_bias", "intermediate_size"}, "deepseek_v3": {"norm_bias", "head_dim", "num_key_value_heads"}}


def _shown(table: str) -> set[str]:
    return {line.split("`")[1] for line in table.splitlines() if line.startswith("| `")}


def _alternatives(value) -> list:
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        return [1, 2 * value, value + 8]
    if isinstance(value, float):
        return [value / 2, value + 1.0]
    return []


def _logits(config, ids, state=None):
    torch.manual_seed(0)
    model = ModularDecoderForCausalLM(config).eval()
    if state is not None:
        model.load_state_dict(state)
    with torch.no_grad():
        return model(ids).logits, model.state_dict()


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_fields_left_out_do_not_change_the_model(name):
    config = preset_config(name, tiny=True)
    shown = _shown(contract_table(config))
    ids = prompt(1, 6, vocab=config.vocab_size)
    reference, state = _logits(config, ids)
    changed = []
    for field in dataclasses.fields(ModularDecoderConfig):
        if field.name in shown or field.name in _NON_CONTRACT:
            continue
        current = getattr(config, field.name)
        for value in [v for v in _alternatives(current) if v != current]:
            try:
                other = preset_config(name, tiny=True, **{field.name: value})
            except ValueError:
                continue  # refused: a setting nothing would read
            shapes = {k: v.shape for k, v in state.items()}
            with torch.device("meta"):
                assert {k: v.shape for k, v in ModularDecoderForCausalLM(other).state_dict().items()} == shapes, field.name
            logits, _ = _logits(other, ids, state)
            torch.testing.assert_close(logits, reference, rtol=0, atol=0, msg=f"{field.name}={value!r}")
            changed.append(field.name)
    assert set(changed) == PRESETS[name]  # the check ran on the fields left out that can change


@pytest.mark.parametrize("name, shown, left_out", [
    ("smollm2", {"norm_eps", "head_dim", "num_key_value_heads", "rope_parameters"}, {"norm_bias", "parallel_norms"}),
    ("gpt2", {"norm_bias", "mlp_bias", "learned_position_offset"}, {"rope_parameters", "parallel_norms"}),
    ("gptj", {"parallel_norms", "partial_rotary_factor"}, set()),
    ("deepseek_v3", {"kv_lora_rank", "router_type", "intermediate_size", "mlp_bias"}, {"head_dim", "num_key_value_heads"}),
    ("mixtral", {"num_experts", "mlp_bias"}, {"intermediate_size", "kv_lora_rank"}),
])
def test_fields_the_kinds_read_are_shown(name, shown, left_out):
    table = _shown(contract_table(preset_config(name, tiny=True)))
    assert shown <= table and not left_out & table
