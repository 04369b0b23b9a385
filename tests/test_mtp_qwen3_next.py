"""Qwen3-Next's, Qwen3.5's and Qwen3.5-MoE's multi-token-prediction module (`mtp.*` in the Hub's files): it converts to the contract's
`mtp.layers.0` and exports back bit for bit, and the module drafts what transformers' `MtpModel` drafts when it loads
the same files through transformers' own conversion mapping (its layout: `fc`, `pre_fc_norm_*`, `layers.0`, `norm`).
transformers' Qwen3-Next config has no `num_mtp_layers`, so its `generate(use_mtp=True)` cannot run there; and
decoding that drafts is refused beside linear-attention layers (a recurrent state is not rolled back)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers.cache_utils import MtpCache

from modular_decoder import ModularDecoderForCausalLM
from modular_decoder.cache import ModularDecoderCache
from modular_decoder.conversion import convert, export
from modular_decoder.mtp import MtpDrafter
from mtp_cases import qwen3_next_mtp_reference, save_qwen3_next_with_mtp

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"])
def folders(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    src = save_qwen3_next_with_mtp(root / "src", family=request.param)
    return src, convert(src, root / "ours", progress=False), request.param


def _files(folder) -> dict:
    index = folder / "model.safetensors.index.json"
    names = set(json.loads(index.read_text())["weight_map"].values()) if index.exists() else {"model.safetensors"}
    return {k: v for name in names for k, v in load_file(str(folder / name)).items()}


def test_converts_with_the_module_and_exports_back_bit_for_bit(folders, tmp_path):
    src, ours, family = folders
    model = ModularDecoderForCausalLM.from_pretrained(ours)
    assert model.config.num_mtp_layers == 1 and model.mtp.layer_type == "full_attention"
    assert model.mtp.layers[0].mtp_block.self_attn.qk_norm is not None  # the gated full attention, with QK-norm
    export(ours, tmp_path / "back", family=family, progress=False)
    before = {k: v for k, v in _files(src).items() if k.startswith("mtp.")}
    after = {k: v for k, v in _files(tmp_path / "back").items() if k.startswith("mtp.")}
    assert sorted(before) == sorted(after) and "mtp.fc.weight" in before
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert json.loads((tmp_path / "back" / "config.json").read_text())["mtp_num_hidden_layers"] == 1


def test_the_module_drafts_as_transformers_mtp_model(folders):
    src, ours, family = folders
    reference, reference_mtp = qwen3_next_mtp_reference(src, family)
    model = ModularDecoderForCausalLM.from_pretrained(ours).eval()
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]])
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    with torch.no_grad():
        theirs_hidden = reference(ids, output_hidden_states=True).hidden_states[-1]
        ours_hidden = model(ids, output_hidden_states=True).hidden_states[-1]
        theirs = reference_mtp(input_ids=ids[:, 1:], last_hidden_states=theirs_hidden[:, :-1], attention_mask=None,
                               position_ids=positions[:, 1:], mtp_cache=MtpCache(config=reference.config.get_mtp_config()))
        mine = MtpDrafter(model)(ids[:, 1:], ours_hidden[:, :-1], None, positions[:, 1:],
                                 ModularDecoderCache(model.mtp.block_config))
    assert torch.equal(mine[0], theirs[0])
    torch.testing.assert_close(mine[1], theirs[1], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="`use_mtp` is set: A linear_attention layer"):
        model.generate(ids, use_mtp=True, max_new_tokens=2)
