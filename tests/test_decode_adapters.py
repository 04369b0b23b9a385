"""Cached decoding equals the uncached forward whatever wraps the projections: an unmerged LoRA, DoRA, a forward
hook that changes the output, torchao's int8 weight-only tensors (`decode_torchao_worker.py`), on every
`nn.Linear` (attention, MLP, shared experts, head, the recurrent mixers' projections), on the recurrent mixers'
convolutions (`nn.Conv1d`; torchao's weight-only configs take linear layers only) and on the experts' 3-D parameters,
for every attention kind and every recurrent mixer (Gated DeltaNet, KDA, Mamba-2, LFM2's short convolution), the
mixers also with causal-conv1d's kernels (stand-ins), which read the convolution's weight where the module is plain.

The reference is the same model's forward over the whole sequence without a cache (which for MLA is the
expanded path, the one that calls `kv_b_proj`). A path that reads a module's weight instead of calling it
(absorbed MLA decoding, the split products) would apply the adapter at prefill and skip it while decoding.
Two threads and no size threshold, so that the split products (a decode step's few rows) are in play.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kernel_stand_ins import clear_kernel_caches, use_causal_conv1d
from peft import LoraConfig, get_peft_model
from torch import nn

from modular_decoder import ModularDecoderForCausalLM, preset_config
from modular_decoder.experts import Experts

TESTS = Path(__file__).parent
ISOLATED_CLIENTS = Path(sys.prefix) / "isolated-clients"
PREFILL, LENGTH = 5, 9

# every attention kind, and experts beside two of them
KINDS = {
    "mha": lambda: preset_config("llama", tiny=True),  # 4 query heads, 4 KV heads
    "gqa_experts": lambda: preset_config("mixtral", tiny=True),  # 4 / 2 heads, every layer sparse
    "mla_q_lora_experts": lambda: preset_config("deepseek_v3", tiny=True),  # q_lora_rank=48, dense + sparse
    "mla_experts": lambda: preset_config("deepseek_v2_lite", tiny=True),  # no q_lora_rank, dense + sparse
    "dsa_experts": lambda: preset_config("deepseek_v32", tiny=True),  # the indexer's projections too; 4 keys kept
    # a recurrent layer, then an attention layer
    "gated_deltanet": lambda: preset_config("qwen3_5", tiny=True),
    "kda_mla_experts": lambda: preset_config("kimi_linear", tiny=True),  # KDA, then latent attention without RoPE
    "mamba2": lambda: preset_config("bamba", tiny=True),
    "short_conv": lambda: preset_config("lfm2", tiny=True),
}
MIXERS = ["gated_deltanet", "kda_mla_experts", "mamba2", "short_conv"]
EXPERT_PARAMETERS = ["mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


pytestmark = pytest.mark.usefixtures("two_threads")  # conftest: the split products in play


WRAPPED = (nn.Linear, nn.Conv1d)  # the modules each wrap adapts or hooks (the experts beside them)


def _wrapped_names(model: nn.Module) -> list[str]:
    return sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules() if type(module) in WRAPPED})


def _model(kind: str) -> ModularDecoderForCausalLM:
    torch.manual_seed(0)
    return ModularDecoderForCausalLM(KINDS[kind]()).eval()


def _lora(model, use_dora: bool = False):
    """An unmerged adapter on every `nn.Linear` and `nn.Conv1d` (a depthwise convolution's rank its channel count:
    PEFT's rule for grouped convolutions); LoRA also on the router and the experts' 3-D parameters (PEFT's
    `target_parameters`), which PEFT 0.21 refuses with DoRA."""
    experts = any(isinstance(module, Experts) for module in model.modules()) and not use_dora
    convolutions = {re.escape(name): module.groups for name, module in model.named_modules()
                    if type(module) is nn.Conv1d}
    config = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=_wrapped_names(model),
                        rank_pattern=convolutions, target_parameters=EXPERT_PARAMETERS if experts else None,
                        use_dora=use_dora)
    torch.manual_seed(1)
    return get_peft_model(model, config).eval()


def _hooked(model):
    """A forward hook that changes the output on every `nn.Linear`, `nn.Conv1d` and on the experts."""
    for module in model.modules():
        if type(module) in WRAPPED or isinstance(module, Experts):
            module.register_forward_hook(lambda _module, _args, output: output * 1.25 + 0.01)
    return model


WRAPS = {
    "lora": _lora,
    "dora": lambda model: _lora(model, use_dora=True),
    "hook": _hooked,
}


@torch.no_grad()
def cached_and_uncached(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of a prefill then one decode step per token through a cache, and of one uncached forward."""
    out = model(input_ids=ids[:, :PREFILL], use_cache=True)
    steps, cache = [out.logits], out.cache
    for t in range(PREFILL, ids.shape[1]):
        out = model(input_ids=ids[:, t : t + 1], cache=cache, use_cache=True)
        steps.append(out.logits)
    return torch.cat(steps, dim=1), model(input_ids=ids, use_cache=False).logits


def _ids(model) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (2, LENGTH), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("wrap", sorted(WRAPS))
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_cached_decode_equals_uncached_forward(kind, wrap):
    assert_wrapped_decode_equals_uncached(kind, wrap)


@pytest.mark.parametrize("wrap", sorted(WRAPS))
@pytest.mark.parametrize("kind", MIXERS)
def test_cached_decode_equals_uncached_forward_with_causal_conv1d(kind, wrap, monkeypatch):
    """causal-conv1d's kernels (stand-ins) take the convolution's weight: a plain model's mixers run them for the
    prompt and each decode step; with every convolution wrapped they call the module instead, and decoding stays
    the uncached forward's."""
    calls = []
    use_causal_conv1d(monkeypatch, calls)
    try:
        model = _model(kind)
        cached_and_uncached(model, _ids(model))
        assert {"conv", "conv_update"} <= set(calls)
        assert_wrapped_decode_equals_uncached(kind, wrap, kernel_calls=calls)
    finally:
        monkeypatch.undo()
        clear_kernel_caches()


def assert_wrapped_decode_equals_uncached(kind: str, wrap: str, kernel_calls: list | None = None) -> None:
    """Kind `kind`'s model under wrap `wrap` computes another function than the plain model, and its cached decoding
    equals its uncached forward (with `kernel_calls`, a kernels' record: calling none of them)."""
    model = _model(kind)
    ids = _ids(model)
    with torch.no_grad():
        plain = model(input_ids=ids, use_cache=False).logits
    wrapped = WRAPS[wrap](model)
    if wrap != "hook":
        lora_kinds = {type(m).__name__ for m in wrapped.modules() if hasattr(m, "lora_A")}
        assert "Linear" in lora_kinds and ("Conv1d" in lora_kinds) == (kind in MIXERS), lora_kinds
        assert ("ParamWrapper" in lora_kinds) == ("experts" in kind and wrap == "lora"), lora_kinds
    if kernel_calls is not None:
        kernel_calls.clear()
    cached, uncached = cached_and_uncached(wrapped, ids)
    assert not kernel_calls
    assert (uncached - plain).abs().max() > 1e-2  # the adapter / hook changes the function
    torch.testing.assert_close(cached, uncached, rtol=0, atol=1e-5)


def test_absorbed_decode_engages_only_on_a_plain_kv_b_proj(monkeypatch):
    """The gate itself: a plain model decodes absorbed (no per-head K/V for the cached tokens); each wrap of
    `kv_b_proj` alone moves decoding to the expanded path, which calls it."""
    from modular_decoder.mla import MultiHeadLatentAttention

    paths = []
    for name in ("absorbed_attention", "expand_kv"):
        original = getattr(MultiHeadLatentAttention, name)
        monkeypatch.setattr(MultiHeadLatentAttention, name,
                            lambda self, *a, _f=original, _n=name, **k: paths.append(_n) or _f(self, *a, **k))

    def decode_paths(model):
        ids = _ids(model)
        with torch.no_grad():
            cache = model(input_ids=ids[:, :PREFILL]).cache
            paths.clear()
            model(input_ids=ids[:, PREFILL : PREFILL + 1], cache=cache)
        return set(paths)

    assert decode_paths(_model("mla_experts")) == {"absorbed_attention"}
    lora = get_peft_model(_model("mla_experts"), LoraConfig(target_modules=["kv_b_proj"], init_lora_weights=False))
    assert decode_paths(lora) == {"expand_kv"}
    hooked = _model("mla_experts")
    hooked.model.layers[0].self_attn.kv_b_proj.register_forward_pre_hook(lambda *_: None)
    assert decode_paths(hooked) == {"expand_kv", "absorbed_attention"}  # layer 0 expanded, layer 1 not


def test_torchao_int8_weight_only_on_every_projection():
    """torchao's `quantize_(model, Int8WeightOnlyConfig())` (every `nn.Linear`, MLA's `kv_b_proj` included):
    cached decoding equals the quantized model's own uncached forward, for every attention kind and recurrent mixer.
    torchao quantizes `nn.Linear` weights only: the experts' 3-D parameters and the mixers' convolutions stay fp32 (it
    has no weight-only config for them)."""
    if not (ISOLATED_CLIENTS / "torchao").is_dir():
        pytest.fail(f"torchao is not installed in {ISOLATED_CLIENTS}: run `bash scripts/setup.sh`.")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, (ISOLATED_CLIENTS, TESTS, TESTS.parent))),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "OMP_NUM_THREADS": "2"}
    result = subprocess.run([sys.executable, str(TESTS / "decode_torchao_worker.py")], capture_output=True,
                            text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(out) == set(KINDS)
    for kind, value in out.items():
        assert value["threads"] == 2 and value["weights"] == ["Int8Tensor"], (kind, value)
        assert value["quantized_vs_fp32"] > 1e-4, (kind, value)  # quantized, not ignored
        assert value["cached_vs_uncached"] < 1e-5, (kind, value)
