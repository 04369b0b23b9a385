"""Shared helpers for the cache, generate and training tests: tiny models, the no-cache reference loop, padded
batches."""

from __future__ import annotations

import torch

from modular_decoder import ModularDecoderForCausalLM, preset_config

# Presets covering every position scheme and layer kind: rope (llama), learned (gpt2), alibi
# (bloom), all-sliding (mistral), alternating local/global with soft-caps (gemma2) and routed experts (mixtral).
PRESETS = ["llama", "gpt2", "bloom", "mistral", "gemma2", "mixtral"]


def tiny_model(name: str, seed: int = 0, **overrides) -> ModularDecoderForCausalLM:
    """A tiny preset model with perturbed norms (fresh norms are the identity and hide misplacements)."""
    config = preset_config(name, tiny=True, **overrides)
    torch.manual_seed(seed)
    model = ModularDecoderForCausalLM(config).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.add_(torch.randn_like(param) * 0.3)
    model.generation_config.pad_token_id = 0
    return model


@torch.no_grad()
def greedy_no_cache(model, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """The reference: re-run the whole sequence every step, no cache at all."""
    for _ in range(new_tokens):
        logits = model(ids, use_cache=False).logits[:, -1]
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=-1)
    return ids


@torch.no_grad()
def steps_against_full(model, ids: torch.Tensor, mask: torch.Tensor, chunks: list[int]):
    """(the same tokens fed in `chunks` through one growing `ModularDecoderCache`, the no-cache forward): logits of
    each, (B, T, V). Every step gets the mask up to its end and positions counting real tokens only."""
    from modular_decoder.cache import ModularDecoderCache

    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    full = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
    cache, steps, start = ModularDecoderCache(model.config), [], 0
    for size in chunks:
        end = start + size
        steps.append(model(input_ids=ids[:, start:end], attention_mask=mask[:, :end], cache=cache,
                           position_ids=positions[:, start:end]).logits)
        start = end
    return torch.cat(steps, dim=1), full


def prompt(batch: int = 1, length: int = 6, vocab: int = 128, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (batch, length), generator=generator)


def recording_backend(graphs: list, inductor: bool = False):
    """A `torch.compile` backend that keeps every graph it is given in `graphs` (to look inside), then runs
    it as traced or, with `inductor`, compiled by inductor. Takes the mode / options `generate` passes."""

    def backend(graph_module, example_inputs, **options):
        graphs.append(graph_module)
        return torch._inductor.compile(graph_module, example_inputs) if inductor else graph_module.forward

    return backend


def converted_twin(family: str, folder, **config):
    """transformers' `{family}ForCausalLM` ("Llama", "Mistral", ...) at a tiny shape (`config` overrides it) with
    random weights, and ours converted from its saved folder by the production converter: both eval, sdpa."""
    import transformers

    from modular_decoder.conversion import convert

    shape = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0)
    config_cls, model_cls = (getattr(transformers, f"{family}{kind}") for kind in ("Config", "ForCausalLM"))
    torch.manual_seed(0)
    model_cls(config_cls(**{**shape, **config})).save_pretrained(folder / family)
    convert(folder / family, folder / "ours", progress=False)
    reference = model_cls.from_pretrained(folder / family, attn_implementation="sdpa").eval()
    ours = ModularDecoderForCausalLM.from_pretrained(folder / "ours", attn_implementation="sdpa").eval()
    for model in (reference, ours):
        model.generation_config.pad_token_id = 0
    return reference, ours


def right_padded(features: list[dict]) -> dict:
    """Right-padded rows with an attention mask and padding out of the loss (labels -100), as Trainer's padding
    collators give them."""
    width = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, feature in enumerate(features):
        ids[row, : len(feature["input_ids"])] = torch.tensor(feature["input_ids"])
        mask[row, : len(feature["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def assert_compiled_decoding_matches(ours, reference, prompt: torch.Tensor, new_tokens: int = 8) -> None:
    """`ours` through `generate(**compiled_decoding())` (a static cache, the decode step compiled with fullgraph=True):
    the step compiles, and its greedy tokens equal `ours` eager and `reference`'s (transformers' class)."""
    import warnings

    from modular_decoder import compiled_decoding

    graphs = []
    torch._dynamo.reset()
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            arguments = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            compiled = ours.generate(prompt, **arguments, **compiled_decoding(backend=recording_backend(graphs)))
            eager = ours.generate(prompt, **arguments)
            tokens = reference.generate(prompt, **arguments)
    finally:
        torch._dynamo.reset()
    assert graphs, "generate did not compile the decode step"
    assert torch.equal(compiled, eager)
    assert torch.equal(compiled, tokens)
