"""FlexAttention against the eager reference: our ALiBi `score_mod`, transformers' BlockMasks
(padding, packed documents, sliding window), softcap, scale, GQA and MLA widths.

On CPU, flex runs here *uncompiled* (torch's own implementation of flex semantics), patched in
where transformers calls its compiled wrapper. Reason: with torch 2.13 the inductor-compiled CPU
kernel returned wrong outputs in our probes — an 8×8 causal problem (B=2, H=4, D=16; 12..256
tokens were right) and this file's packed batch (two documents, 12 + 16 tokens: max|Δlogit| 0.22
from the second document on), while the uncompiled flex matched eager exactly, and each compile
took 1-4 minutes on 2 cores. The compiled kernel is checked on CUDA by tests/gpu/run_gpu_checks.py.

Tolerance (fp32): atol=1e-5, rtol=1e-4 on logits, as in test_backends.py.
"""

from __future__ import annotations

import pytest
import torch
from backend_cases import make_model, packed_batch, padded_batch

TOL = dict(atol=1e-5, rtol=1e-4)
VARIANTS = ["gqa", "sliding_mixed", "softcap_scale", "alibi_gqa_sliding", "mla", "sinks_sliding", "mla_sinks"]


pytestmark = pytest.mark.usefixtures("uncompiled_flex")  # conftest: why flex runs uncompiled on this CPU


def logits(model, **inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs, use_cache=False).logits


@pytest.mark.parametrize("variant", VARIANTS)
def test_flex_matches_eager_padded_and_packed(variant):
    eager, flex = make_model(variant, "eager"), make_model(variant, "flex_attention")
    ids, mask = padded_batch(lengths=(14, 12))
    real = mask.bool()
    got, want = logits(flex, input_ids=ids, attention_mask=mask), logits(eager, input_ids=ids, attention_mask=mask)
    torch.testing.assert_close(got[real], want[real], **TOL)

    docs, ids, positions = packed_batch(lengths=(12, 16))
    with torch.no_grad():
        packed = flex(input_ids=ids, position_ids=positions).logits[0]  # default use_cache: fresh cache
    torch.testing.assert_close(packed, logits(eager, input_ids=ids, position_ids=positions)[0], **TOL)
    alone = torch.cat([logits(eager, input_ids=doc[None])[0] for doc in docs])
    torch.testing.assert_close(packed, alone, **TOL)
