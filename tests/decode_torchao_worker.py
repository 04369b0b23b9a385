"""Worker of `test_decode_adapters.test_torchao_int8_weight_only_on_every_projection`: torchao's int8 weight-only
quantization of every `nn.Linear`, then cached decoding against the quantized model's uncached forward, for every
attention kind and recurrent mixer of `test_decode_adapters.KINDS`. Runs with torchao on PYTHONPATH (`.venv/isolated-clients`), two
threads. Prints one JSON line: per kind, the linear weights' classes and the largest logit differences.
"""

from __future__ import annotations

import json
import warnings

import torch

warnings.filterwarnings("ignore")
torch.set_num_threads(2)
from torchao.quantization import Int8WeightOnlyConfig, quantize_  # noqa: E402

from test_decode_adapters import KINDS, _ids, _model, cached_and_uncached  # noqa: E402

from modular_decoder.tuning import set_tuning  # noqa: E402

set_tuning(min_split_weight=0)  # tiny weights: the split path is what must leave quantized weights alone

result = {}
for kind in KINDS:
    model = _model(kind)
    ids = _ids(model)
    with torch.no_grad():
        fp32 = model(input_ids=ids, use_cache=False).logits
    quantize_(model, Int8WeightOnlyConfig())
    cached, uncached = cached_and_uncached(model, ids)
    result[kind] = {
        "threads": torch.get_num_threads(),
        "weights": sorted({type(m.weight).__name__ for m in model.modules() if isinstance(m, torch.nn.Linear)}),
        "quantized_vs_fp32": (uncached - fp32).abs().max().item(),
        "cached_vs_uncached": (cached - uncached).abs().max().item(),
    }
print(json.dumps(result))
