"""Model cards rendered from a config: Hub metadata, a usage snippet and the architecture contract.

`render_model_card(config, base_model=...)` is what `save_for_hub` and the conversion package
write as `README.md`; `write_preset_cards(folder)` regenerates `model_cards/` (one card per
preset plus `TEMPLATE.md`), and `python -m modular_decoder.tools.cards [folder]` runs it.
Not a remote-code file: the model modules never import it.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from string import Template

import yaml

from modular_decoder.attention_shapes import shapes_vary
from modular_decoder.configuration_modular_decoder import ModularDecoderConfig
from modular_decoder.contract import contract_table
from modular_decoder.tools.presets import PRESETS, preset_config

DEFAULT_LICENSE = "apache-2.0"

CARD_TEMPLATE = Template("""\
---
$metadata---

# $title

$description

This is a `modular_decoder` checkpoint: one `transformers` model family whose
whole decoder-only design space is configuration. The code ships in this repository, so it loads
without installing anything beyond `transformers`:

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("$repo_id", trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained("$repo_id", trust_remote_code=True)  # it reads config.json
inputs = tokenizer("The decoder-only transformer", return_tensors="pt")
print(tokenizer.decode(model.generate(**inputs, max_new_tokens=20)[0]))
```

$adapters

## Architecture contract

Every field that changes the math, the parameter count by component and the KV-cache cost,
computed from the config by `modular_decoder.contract`.

$contract
""")


ADAPTERS = """LoRA / DoRA adapters use the Llama module names (`q_proj`, `k_proj`, `v_proj`, `o_proj`,
`gate_proj`, `up_proj`, `down_proj`) as `target_modules`."""
# PEFT wraps 3-D parameters only when named in `target_parameters` (no Linear modules to target there)
EXPERT_ADAPTERS = """

The routed experts are 3-D parameters and the router a plain weight: PEFT adapts them through
`target_parameters` (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`, `mlp.gate.weight`), which
merge back into the same tensors."""
# DeepSeek Sparse Attention: the indexer's projections are Linear modules like any other, but run without autograd
INDEXER_ADAPTERS = """

The lightning indexer (`attention_type="dsa"`: `index_n_heads` heads of width `index_head_dim` choosing each
query's `index_topk` keys) is `self_attn.indexer.{wq_b, wk, k_norm, weights_proj}`. An adapter on its projections
changes which keys are chosen, but it is not trained by the language-model loss: the choice carries no gradient,
as in transformers' `DeepseekV32`."""


# Shared key = value attention (DeepSeek-V4): its projections' names beside Llama's
SHARED_KV_ADAPTERS = """

Shared key = value attention (`attention_type="shared_kv"`) projects its queries through `q_a_proj` and `q_b_proj`,
its one key = value head through `kv_proj`, and its output through the grouped `o_a_proj` (not an `nn.Linear`:
PEFT adapts it through `target_parameters`) and `o_b_proj`; `LoraConfig()`'s defaults pick `q_b_proj` and
`kv_proj`."""


def variant_tags(config: ModularDecoderConfig) -> list[str]:
    """Hub tags naming the value of every variant axis, so the Hub can filter by design choice."""
    tags = [
        f"norm-{config.norm_type}",
        f"norm-position-{config.norm_position}",
        "parallel-block" if config.parallel_block else "serial-block",
        f"mlp-{config.mlp_type}",
        f"activation-{config.hidden_act}",
        f"positions-{config.position_embedding_type}",
        f"attention-{config.attention_kind.describe(config)}",
    ]
    if config.mlp_kind.routed:
        tags += ["mixture-of-experts", f"router-{config.router_type}"]
    if config.qk_norm != "none":
        tags.append(f"qk-norm-{config.qk_norm}")
    if "sliding_attention" in config.layer_types:
        tags.append("sliding-window")
    if any(t in ("compressed_sparse_attention", "heavily_compressed_attention") for t in config.layer_types):
        tags.append("compressed-attention")
    if config.residual_stream != "single":
        tags.append(f"residual-{config.residual_stream}")
    if config.mlp_kind.routed and config.num_hash_layers:
        tags.append("hash-routing")
    if "chunked_attention" in config.layer_types:
        tags.append("chunked-attention")
    if config.linear_attention_kind.in_use(config):
        tags += ["hybrid-linear-attention", f"linear-attention-{config.linear_attention_type}"]
    if config.block_types is not None and any(kind != "mixer_mlp" for kind in config.block_types):
        tags.append("single-sublayer-layers")
    if "hybrid" in config.layer_types:
        tags.append("parallel-mixers")
    if config.attn_output_gate:
        tags.append("gated-attention")
    if config.attention_sinks:
        tags.append("attention-sinks")
    if config.no_rope_layers is not None and not all(config.no_rope_layers):
        tags.append("nope-layers")
    if config.attn_temperature_tuning:
        tags.append("nope-temperature-tuning" if config.attn_temperature_layers == "nope" else "query-temperature")
    if config.mlp_kind.routed and config.apply_router_weight_on_input:
        tags.append("router-weight-on-input")
    if config.mlp_kind.routed and config.parallel_dense_mlp:
        tags.append("dense-mlp-beside-experts")
    tags += [tag for tag, used in (
        ("per-layer-attention-shapes", config.attention_type == "standard" and shapes_vary(config)),
        ("k-eq-v", config.attention_k_eq_v), ("kv-sharing", config.num_kv_shared_layers),
        ("per-layer-embeddings", config.hidden_size_per_layer_input), ("layer-scalars", config.layer_scalar),
        ("laurel", config.laurel_rank), ("activation-sparsity", any(config.activation_sparsity_pattern or ())),
        (f"residual-stream-{config.residual_stream}", config.residual_stream != "single")) if used]
    if config.mlp_kind.routed and config.swiglu_limit is not None:
        tags.append("clamped-swiglu")
    if config.attn_logit_softcapping or config.final_logit_softcapping:
        tags.append("logit-softcapping")
    if config.tie_word_embeddings:
        tags.append("tied-embeddings")
    return [tag.replace("_", "-") for tag in tags]


def card_metadata(config: ModularDecoderConfig, base_model: str | None = None, license: str = DEFAULT_LICENSE,
                  tags: list[str] | tuple[str, ...] = ()) -> dict:
    """The YAML front matter of a card (Hub model-card metadata)."""
    metadata = {
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "license": license,
        "tags": ["modular-decoder", "custom_code", *variant_tags(config), *tags],
    }
    if base_model:
        metadata["base_model"] = base_model
    return metadata


def render_model_card(
    config: ModularDecoderConfig,
    base_model: str | None = None,
    *,
    title: str | None = None,
    description: str | None = None,
    repo_id: str = "<user>/<repo>",
    license: str = DEFAULT_LICENSE,
    tags: list[str] | tuple[str, ...] = (),
) -> str:
    """A Hub model card (`README.md`) for a checkpoint of `config`.

    Args:
        config: The checkpoint's contract.
        base_model: The Hub id the weights were converted / fine-tuned from; goes into the metadata.
        title, description: Heading and first paragraph; defaults name the base model if any.
        repo_id: Shown in the usage snippet.
        license: A Hub license id.
        tags: Extra Hub tags, after the variant tags.
    """
    if title is None:
        title = f"{base_model.split('/')[-1]} (modular_decoder)" if base_model else "modular_decoder checkpoint"
    if description is None:
        description = (f"The weights of [{base_model}](https://huggingface.co/{base_model}), converted to the "
                       "modular_decoder family." if base_model else "A modular_decoder checkpoint.")
    metadata = yaml.safe_dump(card_metadata(config, base_model, license, tags), sort_keys=False)
    adapters = ADAPTERS + (EXPERT_ADAPTERS if config.mlp_kind.routed else "")
    adapters += INDEXER_ADAPTERS if config.attention_type == "dsa" else ""
    adapters += SHARED_KV_ADAPTERS if config.attention_type == "shared_kv" else ""
    return CARD_TEMPLATE.substitute(metadata=metadata, title=title, description=description, repo_id=repo_id,
                                    adapters=adapters, contract=contract_table(config))


def preset_card(name: str) -> str:
    """The card of preset `name` at its published sizes (a layout: the weights are not included)."""
    return render_model_card(
        preset_config(name),
        title=f"modular_decoder preset `{name}`",
        description=(f"The `{name}` layout (`modular_decoder.preset_config({name!r})`) at its published sizes. "
                     "This card documents the layout; convert public weights with `modular-decoder convert`."),
        repo_id=f"<user>/modular-decoder-{name}",
    )


def write_preset_cards(folder: str | Path) -> list[Path]:
    """Write `TEMPLATE.md` and `<preset>.md` for every preset into `folder`; returns the paths."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = [folder / "TEMPLATE.md"]
    written[0].write_text(CARD_TEMPLATE.template)
    for name in sorted(PRESETS):
        path = folder / f"{name}.md"
        path.write_text(preset_card(name))
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Regenerate the preset model cards.")
    parser.add_argument("folder", nargs="?", default="model_cards")
    for path in write_preset_cards(parser.parse_args(argv).folder):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
