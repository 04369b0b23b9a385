"""The benchmark suite runs end to end in quick mode (tiny shapes); speed is not asserted."""

from __future__ import annotations

import json

import pytest

from benchmarks import run
from benchmarks.families import CONFIGS


def test_suite_quick_writes_table_and_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert run.main(["--quick", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert set(results["families"]) == set(CONFIGS)
    assert results["copy_bandwidth_gb_s"] > 0
    for family in results["families"].values():
        assert family["roofline_b1_tok_s"] > 0
        for key in run.ROWS:
            row = family["metrics"][key]
            for name in run.MODELS:
                assert len(row[name]["all"]) == 1
            if run.ROWS[key][1]:  # a rate: positive on both sides
                assert row["transformers"]["median"] > 0 and row["ours"]["median"] > 0
    table = capsys.readouterr().out
    assert "| family | metric |" in table and "decode b2 tok/s" in table


def test_step_clock_counts_every_decode_step():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.measure import decode

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2)).eval()
    with torch.inference_mode():
        result = decode(model, torch.randint(0, 64, (2, 4)), new_tokens=6, window=2)
    assert result["tokens_per_s"] > 0 and result["step_ms_start"] > 0 and result["step_ms_end"] > 0


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_quick_pairs_agree(tmp_path, name):
    """The pairs the suite times compute the same function (else the ratio compares different work)."""
    import torch

    from benchmarks.families import build_pair

    reference, ours, _ = build_pair(name, tmp_path, quick=True)
    ids = torch.randint(0, reference.config.get_text_config().vocab_size, (2, 12))
    with torch.inference_mode():
        torch.testing.assert_close(ours(ids).logits, reference(ids).logits, atol=1e-4, rtol=1e-4)
