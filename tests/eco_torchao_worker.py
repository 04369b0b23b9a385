"""Worker of `test_ecosystem.test_torchao_int8_weight_only`: torchao's int8 weight-only quantization of a
transformers checkpoint and of ours with the same weights, both ways torchao is used:

- `quantize_(model, Int8WeightOnlyConfig())` after `from_pretrained`;
- `from_pretrained(..., quantization_config=TorchAoConfig(Int8WeightOnlyConfig()))`.

    python tests/eco_torchao_worker.py LLAMA OURS   (torchao on PYTHONPATH)

Two torch threads: the few-row product split (split_products.py) runs only with more than one, and must leave the
quantized weights to torchao. Prints one JSON line: per side and way, the weight class, the last logits of a
forward and the greedy tokens. It also reports whether importing modular_decoder and loading a model imported
PEFT (the LoRA defaults are registered without importing it).
"""

from __future__ import annotations

import json
import sys
import warnings

import torch

warnings.filterwarnings("ignore")
torch.set_num_threads(2)
import modular_decoder  # noqa: E402,F401  (registers the Auto classes: the default load path)
from modular_decoder.split_products import set_split_products  # noqa: E402
from modular_decoder.tuning import set_tuning  # noqa: E402

set_tuning(min_split_weight=0)  # tiny weights: the split path is what must leave quantized weights alone
set_split_products("always")  # whatever a timing would say on this machine
from transformers import AutoModelForCausalLM  # noqa: E402

folders = {"llama": sys.argv[1], "ours": sys.argv[2]}
peft_imported = "peft" in sys.modules
AutoModelForCausalLM.from_pretrained(folders["ours"])
peft_imported = peft_imported or "peft" in sys.modules

from torchao.quantization import Int8WeightOnlyConfig, quantize_  # noqa: E402
from transformers import TorchAoConfig  # noqa: E402

IDS = torch.tensor([[5, 6, 7, 8, 9, 10]])


def exercise(model) -> dict:
    model.eval()
    with torch.no_grad():
        logits = model(IDS).logits[0]
        step = model(IDS[:, :1]).logits[0, -1]  # one row: the few-row product path
    tokens = model.generate(IDS, max_new_tokens=6, do_sample=False)[0].tolist()
    return {"weight": type(model.model.layers[0].self_attn.q_proj.weight).__name__,
            "head_weight": type(model.lm_head.weight).__name__,
            "logits": logits.tolist(), "step": step.tolist(), "tokens": tokens}


result = {"threads": torch.get_num_threads(), "peft_imported": peft_imported}
for side, folder in folders.items():
    with torch.no_grad():
        result[f"{side}/fp32"] = AutoModelForCausalLM.from_pretrained(folder).eval()(IDS).logits[0].tolist()
    model = AutoModelForCausalLM.from_pretrained(folder)
    quantize_(model, Int8WeightOnlyConfig())
    result[f"{side}/quantize_"] = exercise(model)
    config = TorchAoConfig(Int8WeightOnlyConfig())
    result[f"{side}/TorchAoConfig"] = exercise(AutoModelForCausalLM.from_pretrained(folder, quantization_config=config))
print(json.dumps(result))
