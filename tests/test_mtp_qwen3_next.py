"""Qwen3-Next's, Qwen3.5's and Qwen3.5-MoE's multi-token-prediction module (`mtp.*` in the Hub's files): it converts to the contract's
`mtp.layers.0` and exports back bit for bit, and the module drafts what transformers' `MtpModel` drafts when it loads
the same files through transformers' own conversion mapping (its layout: `fc`, `pre_fc_norm_*`, `layers.0`, `norm`).
The published config names the module count `mtp_num_hidden_layers`, which transformers' `use_mtp` does not read
(its `generate(use_mtp=True)` refuses the folder); converted, the model drafts with its module beside its
linear-attention layers and gives plain greedy's tokens, and transformers' own tokens once its config is given the
count and its cache records one more state (docs/using.md, "Drafting on hybrids")."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers.cache_utils import MtpCache
from transformers.generation import candidate_generator

from modular_decoder import ModularDecoderForCausalLM
from modular_decoder.cache import ModularDecoderCache
from modular_decoder.conversion import convert, export
from modular_decoder.mtp import MtpDrafter
from modular_decoder.mtp_generation import recorded_drafts
from mtp_cases import QWEN_MTP_CLASSES, qwen3_next_mtp_reference, save_qwen3_next_with_mtp

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


GREEDY = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
# A prompt on which transformers' own `use_mtp` parts from its greedy tokens (on the digits of pi, Qwen3.5-MoE's
# reference keeps them: the state it loses moves no argmax there)
PROMPTS = {"qwen3_5_moe_text": [2, 7, 1, 8, 2, 8, 1, 8, 2, 8]}


def test_the_published_folder_drafts_with_its_module_and_gives_greedy_tokens(folders, monkeypatch):
    """`mtp_num_hidden_layers` as the Hub's config.json has it: transformers' class refuses `use_mtp` on the folder;
    converted, the module drafts (and some drafts are rejected, so the hybrid cache rolls back) and the tokens are
    plain greedy's, ours and transformers'. transformers 5.25's own `use_mtp` (its config told the count) parts from
    its greedy tokens until its cache records one more state (docs/using.md, "Drafting on hybrids")."""
    src, ours, family = folders
    ids = torch.tensor([PROMPTS.get(family, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3])])
    published = QWEN_MTP_CLASSES[family].from_pretrained(str(src), dtype=torch.float32).eval()
    assert not hasattr(published.config, "num_mtp_layers")
    with pytest.raises(ValueError, match="num_mtp_layers|stateful"):  # 5.16-5.2x refuse hybrids' drafting as such
        published.generate(ids, use_mtp=True, **GREEDY)
    greedy = published.generate(ids, **GREEDY)
    model = ModularDecoderForCausalLM.from_pretrained(ours).eval()
    with recorded_drafts() as statistics:
        drafted = model.generate(ids, use_mtp=True, **GREEDY)
    assert torch.equal(drafted, greedy) and torch.equal(model.generate(ids, **GREEDY), greedy)
    assert statistics.drafted and statistics.steps > statistics.accepted_at_least[0]  # some drafts rejected
    if hasattr(candidate_generator.MTPCandidateGenerator, "num_drafting_tokens"):  # 5.25: restores on crop
        reference, _ = qwen3_next_mtp_reference(src, family)  # transformers' class told the count
        assert not torch.equal(reference.generate(ids, use_mtp=True, **GREEDY), greedy)  # docs/using.md: fixed?
        monkeypatch.setattr(candidate_generator.MTPCandidateGenerator, "num_drafting_tokens",
                            property(lambda self: self.num_mtp_layers + 1))  # one more recorded state
        assert torch.equal(reference.generate(ids, use_mtp=True, **GREEDY), greedy)
