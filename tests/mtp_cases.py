"""A tiny DeepSeek-V3 folder with its multi-token-prediction modules, in the layout of the Hub's files, made with
transformers' own classes: the model's layers, then module k as layer `num_hidden_layers + k` (a decoder layer's
tensors as transformers writes them, `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`, and copies of the embedding
and the head)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file, save_file

from conversion_cases import COMMON, MLA, perturbed
from modular_decoder.mtp import token_embeddings
from modular_decoder.mtp_generation import MtpCandidateGenerator, recorded_drafts

MTP_PARTS = ("enorm", "hnorm", "eh_proj", "post_norm")


def deepseek_v3_config(num_mtp_layers: int = 1, **overrides) -> tf.DeepseekV3Config:
    fields = dict(**COMMON, **MLA, q_lora_rank=12, first_k_dense_replace=1, n_routed_experts=16, num_experts_per_tok=4,
                  n_shared_experts=1, moe_intermediate_size=12, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                  num_mtp_layers=num_mtp_layers)
    return tf.DeepseekV3Config(**{**fields, **overrides})


def glm4_moe_config(num_mtp_layers: int = 1, **overrides) -> tf.Glm4MoeConfig:
    """A tiny GLM-4.5 (QK-norm, partial RoPE, grouped sigmoid routing, a dense first layer)."""
    from conversion_cases import GLM4_MOE

    fields = dict(**COMMON, **GLM4_MOE, n_group=4, topk_group=2, use_qk_norm=True, num_mtp_layers=num_mtp_layers)
    return tf.Glm4MoeConfig(**{**fields, **overrides})


# family -> (transformers' model class, config builder): the families whose files keep MTP module k as layer
# `num_hidden_layers + k`, in DeepSeek-V3's layout
DEEPSEEK_LAYOUT = {"deepseek_v3": (tf.DeepseekV3ForCausalLM, deepseek_v3_config),
                   "glm4_moe": (tf.Glm4MoeForCausalLM, glm4_moe_config)}


def save_deepseek_v3_with_mtp(path, num_mtp_layers: int = 1, seed: int = 0, family: str = "deepseek_v3",
                              **overrides) -> Path:
    """Save a random DeepSeek-V3 (or another family of `DEEPSEEK_LAYOUT`) and `num_mtp_layers` random MTP modules
    (transformers' `MtpModel` for it) in DeepSeek's file layout; returns `path`."""
    from transformers.modeling_layers import MtpModel

    model_class, make_config = DEEPSEEK_LAYOUT[family]
    path, scratch = Path(path), Path(path).parent / (Path(path).name + "-scratch")
    torch.manual_seed(seed)
    config = make_config(num_mtp_layers, **overrides)
    n = config.num_hidden_layers
    # the blocks as transformers initialises and writes layers: a model whose layers n, n+1, ... are the MTP blocks
    longer = perturbed(model_class(make_config(num_mtp_layers,
                                               **{**overrides, "num_hidden_layers": n + num_mtp_layers})))
    longer.save_pretrained(scratch)
    files = load_file(str(scratch / "model.safetensors"))
    main = model_class(config)
    main.load_state_dict({k: v for k, v in longer.state_dict().items()
                          if not (m := re.match(r"model\.layers\.(\d+)\.", k)) or int(m.group(1)) < n})
    mtp = MtpModel(main, num_mtp_layers)
    with torch.no_grad():
        for k, layer in enumerate(mtp.layers):
            layer.mtp_block.load_state_dict(longer.model.layers[n + k].state_dict())
            for norm in (layer.enorm, layer.hnorm, layer.post_norm):
                norm.weight.copy_(1 + 0.1 * torch.randn_like(norm.weight))
            layer.eh_proj.weight.normal_(0, 0.1)
    main.save_pretrained(path)
    tensors = load_file(str(path / "model.safetensors"))
    for k in range(num_mtp_layers):
        prefix = f"model.layers.{n + k}."
        tensors.update({name: t for name, t in files.items() if name.startswith(prefix)})
        layer = mtp.layers[k]
        tensors[prefix + "enorm.weight"] = layer.enorm.weight.detach().clone()
        tensors[prefix + "hnorm.weight"] = layer.hnorm.weight.detach().clone()
        tensors[prefix + "eh_proj.weight"] = layer.eh_proj.weight.detach().clone()
        tensors[prefix + "shared_head.norm.weight"] = layer.post_norm.weight.detach().clone()
        tensors[prefix + "embed_tokens.weight"] = main.model.embed_tokens.weight.detach().clone()
        tensors[prefix + "shared_head.head.weight"] = main.lm_head.weight.detach().clone()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def mtp_reference(path, family: str = "deepseek_v3"):
    """transformers' model of `path` (DeepSeek-V3, or another family of `DEEPSEEK_LAYOUT`), set to find its MTP
    modules: transformers names the MTP layer by the Hub checkpoint's index (DeepSeek-V3's 61, GLM-4.5's 92 and 46,
    `_keys_to_ignore_on_load_unexpected`), which a tiny model's files do not use."""
    model = DEEPSEEK_LAYOUT[family][0].from_pretrained(str(path), dtype=torch.float32).eval()
    n = model.config.num_hidden_layers
    model._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{n + k}\..*" for k in range(model.config.num_mtp_layers)]
    return model


def mtp_file_tensors(path, num_hidden_layers: int) -> dict[str, torch.Tensor]:
    """The tensors of the MTP modules in a folder's files (single file or shards)."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    tensors = {}
    for name in files:
        tensors.update(load_file(str(path / name)))
    return {k: v for k, v in tensors.items()
            if (m := re.match(r"model\.layers\.(\d+)\.", k)) and int(m.group(1)) >= num_hidden_layers}


def save_trained_deepseek_v3_with_mtp(root, num_mtp_layers: int = 1, steps: int = 60,
                                      family: str = "deepseek_v3") -> Path:
    """A tiny DeepSeek-V3 (or `family`'s, of `DEEPSEEK_LAYOUT`) folder (`root / "src"`, the Hub layout) whose model
    and MTP modules learned to count
    (each token the previous + 1): drafts are then mostly accepted, as a trained checkpoint's are. Trained through
    this family's own training loss (the LM loss plus the MTP loss) and exported back; a second or two on one
    thread."""
    from modular_decoder import ModularDecoderForCausalLM
    from modular_decoder.conversion import convert, export

    root = Path(root)
    random = save_deepseek_v3_with_mtp(root / "random", num_mtp_layers, family=family)
    convert(random, root / "random-converted", progress=False)
    model = ModularDecoderForCausalLM.from_pretrained(root / "random-converted").train()
    model.config.mtp_loss_scaling_factor = 1.0
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    for _ in range(steps):
        rows = (torch.randint(0, vocab, (16, 1), generator=generator) + torch.arange(24)) % vocab
        loss = model(input_ids=rows, labels=rows).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.config.mtp_loss_scaling_factor = 0.1
    model.eval().save_pretrained(root / "trained")
    return export(root / "trained", root / "src", family=family, progress=False)


QWEN_LAYERS = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]  # as released: 3:1


# The families whose files keep an MTP module in Qwen3-Next's layout, and transformers' model class of each
QWEN_MTP_CLASSES = {"qwen3_next": tf.Qwen3NextForCausalLM, "qwen3_5_text": tf.Qwen3_5ForCausalLM,
                    "qwen3_5_moe_text": tf.Qwen3_5MoeForCausalLM}


def save_qwen3_next_with_mtp(path, seed: int = 0, family: str = "qwen3_next") -> Path:
    """A tiny random Qwen3-Next (or Qwen3.5: `family`) with its MTP module in the Hub's layout (`mtp.fc`,
    `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.layers.0.*`, `mtp.norm`; config.json's
    `mtp_num_hidden_layers`), made with transformers' classes: its `MtpModel` for the model (transformers' config has
    no `num_mtp_layers`; `qwen3_next_mtp_reference` sets it). Returns the folder."""
    from transformers.modeling_layers import MtpModel

    from conversion_cases import CASES

    path, scratch = Path(path), Path(path).parent / (Path(path).name + "-scratch")
    torch.manual_seed(seed)
    model_class = QWEN_MTP_CLASSES[family]
    config = CASES[family][1]()
    longer = perturbed(model_class(_qwen_config(config, QWEN_LAYERS + ["full_attention"])))
    longer.save_pretrained(scratch)
    files = load_file(str(scratch / "model.safetensors"))
    main = model_class(_qwen_config(config, QWEN_LAYERS))
    n = len(QWEN_LAYERS)
    main.load_state_dict({k: v for k, v in longer.state_dict().items()
                          if not (m := re.match(r"model\.layers\.(\d+)\.", k)) or int(m.group(1)) < n})
    _allow_mtp(main.config)
    layer = MtpModel(main, 1).layers[0]
    with torch.no_grad():
        for norm in (layer.enorm, layer.hnorm, layer.post_norm):  # zero-centred: the scale is 1 + w
            norm.weight.copy_(0.1 * torch.randn_like(norm.weight))
        layer.eh_proj.weight.normal_(0, 0.1)
    main.config.mtp_num_hidden_layers = 1  # what the Hub's config.json says
    for name in ("num_mtp_layers", "mtp_layer_types"):
        delattr(main.config, name)
    main.save_pretrained(path)
    tensors = load_file(str(path / "model.safetensors"))
    tensors.update({f"mtp.layers.0.{name[len(f'model.layers.{n}.'):]}": t for name, t in files.items()
                    if name.startswith(f"model.layers.{n}.")})
    for file_name, module in (("fc", layer.eh_proj), ("pre_fc_norm_embedding", layer.enorm),
                              ("pre_fc_norm_hidden", layer.hnorm), ("norm", layer.post_norm)):
        tensors[f"mtp.{file_name}.weight"] = module.weight.detach().clone()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _qwen_config(config, layer_types):
    fields = config.to_dict()
    fields.update(layer_types=list(layer_types), num_hidden_layers=len(layer_types))
    for key in ("architectures", "transformers_version", "model_type"):
        fields.pop(key, None)
    return type(config)(**fields)


def _allow_mtp(config) -> None:
    """What transformers' `MtpModel` reads from a config and Qwen3-Next's lacks: one full-attention MTP layer."""
    config.num_mtp_layers = 1
    config.mtp_layer_types = ["full_attention"]


def qwen3_next_mtp_reference(path, family: str = "qwen3_next"):
    """(transformers' Qwen3-Next (or Qwen3.5) of `path`, its `MtpModel` loaded from the same files by transformers'
    own conversion mapping: `mtp.fc` -> `eh_proj`, `mtp.pre_fc_norm_*` -> `enorm` / `hnorm`, `mtp.norm` ->
    `post_norm`)."""
    from transformers.modeling_layers import MtpModel

    model = QWEN_MTP_CLASSES[family].from_pretrained(str(path), dtype=torch.float32).eval()
    _allow_mtp(model.config)
    return model, MtpModel.from_pretrained(model, device_map={"": "cpu"}).eval()


def reference_drafts(model, verified: torch.Tensor, drafted: torch.Tensor) -> torch.Tensor:
    """The logits of each of `drafted` (B=1, K), recomputed from the `verified` text without any cache: the model's
    last hidden states over it, module k over the whole text moved k+1 places (the earlier drafts appended), then past
    the modules the last one over its own inputs so far plus, per further draft, its own output at the last position
    and the draft before, one position on."""
    layers = model.mtp.layers
    count = drafted.shape[1]

    def run(depth, tokens, hidden, positions):
        embeds = token_embeddings(model, tokens)
        kwargs = model._mtp_block_kwargs(depth, embeds, positions, None, None, False)
        return layers[depth](embeds, hidden, **kwargs)

    with torch.no_grad():
        hidden = model.model(input_ids=verified[:, :-1], use_cache=False).last_hidden_state
        tokens, positions = verified[:, 1:], torch.arange(1, verified.shape[1]).unsqueeze(0)
        logits = []
        for depth in range(min(count, len(layers))):
            out = run(depth, tokens, hidden, positions)
            logits.append(model._logits(out[:, -1:])[:, -1])
            if depth + 1 < min(count, len(layers)):
                hidden, positions = out, positions + 1
                tokens = torch.cat([tokens[:, 1:], drafted[:, depth:depth + 1]], dim=1)
        for depth in range(len(layers), count):  # the last module again, its input one position longer each time
            hidden = torch.cat([hidden, out[:, -1:]], dim=1)
            tokens = torch.cat([tokens, drafted[:, depth - 1:depth]], dim=1)
            positions = torch.cat([positions, positions[:, -1:] + 1], dim=1)
            out = run(len(layers) - 1, tokens, hidden, positions)
            logits.append(model._logits(out[:, -1:])[:, -1])
    return torch.stack(logits, dim=1)


def drafted_steps(model, prompt, **kwargs):
    """generate(use_mtp=True, ...)'s output, each drafting step's (verified text, drafts, their logits), and its
    statistics; every step drafts unless `num_assistant_tokens_schedule` says otherwise (`constant` by default here,
    so that the steps do not depend on this machine's timings)."""
    steps = []
    original = MtpCandidateGenerator.get_candidates
    kwargs.setdefault("num_assistant_tokens_schedule", "constant")

    def recorded(generator, input_ids, *args, **kw):
        candidates, logits = original(generator, input_ids, *args, **kw)
        if logits is not None:
            steps.append((input_ids.clone(), candidates[:, input_ids.shape[1]:].clone(), logits.clone()))
        return candidates, logits

    with pytest.MonkeyPatch.context() as patch, recorded_drafts() as statistics:
        patch.setattr(MtpCandidateGenerator, "get_candidates", recorded)
        output = model.generate(prompt, use_mtp=True, **kwargs)
    return output, steps, statistics
