"""Architecture surgery: move a trained checkpoint to another point of the design space.

`reshape(model, **options) -> model` transforms the weights and the config; `reshape_folder(src, out,
**options) -> report` does it folder to folder (the `modular-decoder reshape` command) and measures what
the change bought and cost. The transformations, applied in this order when combined:

| option | module | exact when | approximates |
|---|---|---|---|
| `drop_layers=N` | `drop_layers` | never (a block is removed) | the most redundant block on calibration text |
| `kv_heads=N` | `kv_heads` | N a multiple of the K/V heads, or the pooled heads equal | fewer heads: group means |
| `experts=E, top_k=K, shared_experts=S, fine_grained=G` | `upcycling` | always, at step 0 | nothing |
| `attention="mla", kv_lora_rank=R, rope_dim=D` | `rorope`, `mla_conversion` | full rank, full RoPE width | partial RoPE, rank R |
| `add_mtp=K` (with `heal_steps`) | `add_mtp` | always (the model is untouched; modules added beside it) | nothing (they only draft) |
| `draft_vocab=N` | `draft_vocab` | always (drafting only: the model verifies every draft) | nothing |

"Exact" in a report is a measurement, never a claim: `reshape_folder` compares the logits before and
after on the calibration text (`measures.logit_change`). `heal_steps=S` then distils the source into the
changed modules (`healing`), and trains added MTP modules by self-distillation (`add_mtp`). The other
modules: `pipeline` (options checked, transformations chained), `folder` (folder in, folder out), `calibration`, `measures`, `report`, `rebuild` (a model from a state dict).
Tools, not model code: nothing here ships with a checkpoint.
"""

from __future__ import annotations

from .folder import REPORT_FILE, measure, reshape_folder
from .healing import LEARNING_RATE
from .pipeline import check_options, reshape, transform

__all__ = ["LEARNING_RATE", "REPORT_FILE", "check_options", "measure", "reshape", "reshape_folder", "transform"]
