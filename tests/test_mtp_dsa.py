"""DeepSeek-V3.2's multi-token-prediction layer (`model.layers.{num_hidden_layers}` in the Hub's files, config.json's
`num_nextn_predict_layers`): ours with a module (a DSA block with its indexer and experts, as the model's last)
exports to DeepSeek's layout, transformers' `MtpModel` loads those files by its own conversion mapping and drafts
what ours drafts, and the folder converts back bit for bit; `generate(use_mtp=True)` gives plain greedy's tokens."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import DeepseekV32Config, DeepseekV32ForCausalLM
from transformers.cache_utils import MtpCache
from transformers.masking_utils import LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING

from modular_decoder import ModularDecoderConfig, ModularDecoderForCausalLM
from modular_decoder.cache import ModularDecoderCache
from modular_decoder.conversion import convert, export
from modular_decoder.mtp import MtpDrafter
from mtp_cases import mtp_file_tensors
from test_dsa import V32, _scramble

pytestmark = pytest.mark.usefixtures("one_thread")
LAYERS = V32["num_hidden_layers"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(ours with one scrambled MTP module, its export to DeepSeek-V3.2's layout, that folder converted back)."""
    root = tmp_path_factory.mktemp("v32_mtp")
    torch.manual_seed(0)
    _scramble(DeepseekV32ForCausalLM(DeepseekV32Config(**V32))).save_pretrained(root / "src")
    convert(root / "src", root / "converted", progress=False)
    base = ModularDecoderForCausalLM.from_pretrained(root / "converted")
    config = ModularDecoderConfig(**{**base.config.to_dict(), "num_mtp_layers": 1})
    model = ModularDecoderForCausalLM(config)
    model.load_state_dict(base.state_dict(), strict=False)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.mtp.named_parameters():
            param.copy_((1.0 + 0.3 * torch.randn_like(param)) if "norm" in name else
                        torch.randn_like(param) * (param.shape[-1] ** -0.5 if param.dim() >= 2 else 0.1))
        for name, buffer in model.mtp.named_buffers():
            if "e_score_correction_bias" in name:
                buffer.normal_(0.0, 0.1)
    model.eval().save_pretrained(root / "ours")
    export(root / "ours", root / "hub", family="deepseek_v32", progress=False)
    convert(root / "hub", root / "back", progress=False)
    return model, root


def test_exports_in_deepseeks_layout_and_converts_back_bit_for_bit(folders):
    model, root = folders
    config = json.loads((root / "hub" / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and config["num_hidden_layers"] == LAYERS
    files = mtp_file_tensors(root / "hub", LAYERS)
    prefix = f"model.layers.{LAYERS}."
    assert {prefix + name for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                                       "embed_tokens.weight", "shared_head.head.weight",
                                       "self_attn.indexer.wq_b.weight", "mlp.experts.0.gate_proj.weight")} <= set(files)
    back = ModularDecoderForCausalLM.from_pretrained(root / "back")
    assert back.config.num_mtp_layers == 1 and back.mtp.layer_type == model.mtp.layer_type
    theirs = dict(back.mtp.state_dict())
    for name, tensor in model.mtp.state_dict().items():
        assert torch.equal(theirs[name], tensor), name


def test_the_module_drafts_as_transformers_mtp_model_loads_it(folders):
    from transformers.modeling_layers import MtpModel

    model, root = folders
    reference = DeepseekV32ForCausalLM.from_pretrained(root / "hub", dtype=torch.float32).eval()
    # transformers finds the MTP layer by the Hub checkpoint's index (61, `_keys_to_ignore_on_load_unexpected`)
    reference._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{LAYERS}\..*"]
    # what transformers' `MtpModel` reads and DeepSeek-V3.2's config class lacks: the count and the layer's kinds
    reference.config.num_mtp_layers = 1
    reference.config.mtp_layer_types = reference.config.layer_types[-1:]
    reference.config.mtp_mlp_layer_types = reference.config.mlp_layer_types[-1:]
    reference_mtp = MtpModel.from_pretrained(reference, device_map={"": "cpu"}).eval()
    layer_type = reference.config.layer_types[-1]

    def masks(layer_idx, inputs_embeds, mtp_cache, position_ids):
        # transformers' `create_masks_for_mtp_layer` builds an indexed layer's mask, then has no argument name for
        # it (a KeyError on 5.25): the same mask, under the name its decoder layer reads
        build = LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING[layer_type]
        return {"attention_mask": build(config=reference_mtp.config, inputs_embeds=inputs_embeds, attention_mask=None,
                                        cache=mtp_cache, position_ids=position_ids, layer_idx=layer_idx)}

    reference_mtp.create_masks_for_mtp_layer = masks
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]])  # longer than index_topk: the selection is in play
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    with torch.no_grad():
        theirs_hidden = reference(ids, output_hidden_states=True).hidden_states[-1]
        ours_hidden = model(ids, output_hidden_states=True).hidden_states[-1]
        torch.testing.assert_close(ours_hidden, theirs_hidden, rtol=1e-5, atol=1e-5)
        theirs = reference_mtp(input_ids=ids[:, 1:], last_hidden_states=theirs_hidden[:, :-1], attention_mask=None,
                               position_ids=positions[:, 1:],
                               mtp_cache=MtpCache(config=reference.config.get_mtp_config()))
        mine = MtpDrafter(model)(ids[:, 1:], ours_hidden[:, :-1], None, positions[:, 1:],
                                 ModularDecoderCache(model.mtp.block_config))
    assert torch.equal(mine[0], theirs[0])
    torch.testing.assert_close(mine[1], theirs[1], rtol=1e-5, atol=1e-5)


def test_drafting_gives_plain_greedy_tokens(folders):
    model, _ = folders
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10]])
    kwargs = dict(max_new_tokens=8, do_sample=False, attention_mask=torch.ones_like(prompt), pad_token_id=0)
    assert torch.equal(model.generate(prompt, use_mtp=True, **kwargs), model.generate(prompt, **kwargs))
