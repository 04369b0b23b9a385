"""Cache bytes per token of a published layout, ours against transformers' class, counted from the tensors each
side's cache holds after a prefill of C tokens.

On the meta device (`device="meta"`) both models and the prefill cost neither memory nor compute: each cache tensor
has its real shape and dtype and no data, so a 30-layer model at 32k tokens is counted in seconds. The benchmarks'
smoke tests run the same count on the CPU with real tensors and require the same bytes.

Counted per layer (`held_bytes`): every tensor a cache layer holds (attributes, and those inside dicts, tuples and
lists: DeepSeek-V4's compressor states), each storage once, at its allocated size (spare capacity included); and
ours' `payload_bytes` (what the next step can attend to, what `contract.cache_bytes` predicts).
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from modular_decoder import ModularDecoderCache, ModularDecoderForCausalLM, preset_config
from modular_decoder.cache import _parts
from modular_decoder.conversion import get_family


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)


def held_bytes(layer) -> int:
    """Every tensor one cache layer holds, each storage once, at the size allocated (a view counts its storage)."""
    storages = {}
    for value in vars(layer).values():
        for tensor in _tensors(value):
            storage = tensor.untyped_storage()
            storages[storage._cdata] = storage.nbytes()  # (a storage's identity: data_ptr is 0 on meta)
    return sum(storages.values())


def models(preset: str, family: str, *, dtype: torch.dtype, device: str, tiny: bool = False):
    """(transformers' model, ours) of `preset` (transformers' config: `family`'s export of ours), in eval mode on
    `device` with random weights (none on meta)."""
    config = preset_config(preset, tiny=tiny)
    with torch.device(device):
        theirs = AutoModelForCausalLM.from_config(get_family(family).from_contract(config), dtype=dtype)
        ours = ModularDecoderForCausalLM(config).to(dtype)
    for model in (theirs, ours):
        model.eval().config._attn_implementation = "sdpa"
    return theirs, ours


def layer_groups(config) -> list[str]:
    """Each layer's row: its type, "shared " before it where the layer reads an earlier layer's keys and values."""
    types, shared = list(config.layer_types), getattr(config, "num_kv_shared_layers", 0) or 0
    return [("shared " if index >= len(types) - shared else "") + kind for index, kind in enumerate(types)]


def _count(cache, groups: list[str]) -> dict[str, int]:
    counts = dict.fromkeys(groups, 0)
    for group, layer in zip(groups, cache.layers):
        counts[group] += sum(held_bytes(part) for part in _parts(layer))
    return counts


@torch.inference_mode()
def bytes_per_token(preset: str, family: str, contexts: list[int], *, dtype: torch.dtype = torch.bfloat16,
                    device: str = "meta", tiny: bool = False) -> list[dict]:
    """Per context C, each side through its own cache: the bytes per token held after a prefill of C tokens (in
    all), and after one decode step more (per layer group (`layer_groups`) and in all, divided by C + 1: the state a
    decoding model keeps), and ours' payload then."""
    theirs, ours = models(preset, family, dtype=dtype, device=device, tiny=tiny)
    groups = layer_groups(ours.config)
    rows = []
    for context in contexts:
        ids = torch.randint(0, ours.config.vocab_size, (1, context + 1), generator=torch.Generator().manual_seed(0))
        ids = ids.to(device)
        caches = {"transformers": DynamicCache(config=theirs.config), "ours": ModularDecoderCache(ours.config)}
        steps = {"transformers": lambda piece: theirs(piece, past_key_values=caches["transformers"], use_cache=True,
                                                      logits_to_keep=1),
                 "ours": lambda piece: ours(piece, cache=caches["ours"], use_cache=True, logits_to_keep=1)}
        after_prefill, decoding = {}, {}
        for side, step in steps.items():
            step(ids[:, :context])
            after_prefill[side] = sum(_count(caches[side], groups).values()) / context
            step(ids[:, context:])
            decoding[side] = {group: count / (context + 1) for group, count in _count(caches[side], groups).items()}
        rows.append({"context": context, "after_prefill_per_token": after_prefill, "decoding_per_token": decoding,
                     "decoding_total_per_token": {side: sum(counts.values()) for side, counts in decoding.items()},
                     "ours_payload_per_token": caches["ours"].payload_bytes() / (context + 1)})
    return rows


def rows_markdown(name: str, rows: list[dict], baseline: tuple[str, str] | None = None) -> list[str]:
    """Per context: a line per layer group while decoding, then all layers while decoding (ours' payload beside),
    the `baseline` (its label, and its row key: a payload per token) and all layers after the prefill:
    transformers' bytes per token, ours."""
    lines = []
    for row in rows:
        decoding, total, prefill = row["decoding_per_token"], row["decoding_total_per_token"], \
            row["after_prefill_per_token"]
        head = f"| {name} | {row['context']:,} |"
        lines += [f"{head} {group} | {decoding['transformers'][group]:,.1f} | {decoding['ours'][group]:,.1f} | |"
                  for group in decoding["ours"]]
        lines.append(f"{head} **all layers** | {total['transformers']:,.1f} | {total['ours']:,.1f} | "
                     f"{row['ours_payload_per_token']:,.1f} |")
        if baseline is not None:
            lines.append(f"{head} all layers, {baseline[0]} | | | {row[baseline[1]]:,.1f} |")
        lines.append(f"{head} all layers, right after the prefill | {prefill['transformers']:,.1f} | "
                     f"{prefill['ours']:,.1f} | |")
    return lines


TABLE_HEAD = ["| layout | context | layers | transformers B/token | ours B/token | ours payload B/token |",
              "|---|---:|---|---:|---:|---:|"]
