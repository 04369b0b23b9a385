"""Every attention variant on every backend the CPU can run, against the eager reference.

Backends here: `sdpa` (torch), and `flash_attention_2/3` with a reference implementation of the
flash-attn kernel contract (`reference_flash_attn_varlen_func` / `reference_flash_attn_func` in
backend_cases.py) monkeypatched in where transformers loads the kernel — so the flash *path*
(layout, unpadding, cu_seqlens for packed batches, window / softcap / scale / ALiBi-slope
arguments, GQA without repeated K/V) is what is under test, not the CUDA kernel.
FlexAttention (compiled on CPU) is in test_backends_flex.py.

Tolerance (fp32, tiny model): logits within atol=1e-5, rtol=1e-4 of eager; a real difference in
masking, scale, softcap or bias moves them by 1e-2 or more.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from backend_cases import (
    VARIANTS,
    install_reference_kernels,
    make_config,
    make_model,
    packed_batch,
    padded_batch,
    reference_fa3_varlen_func,
)

from modular_decoder import ModularDecoderCache, ModularDecoderForCausalLM
from modular_decoder.alibi_kernels import takes_alibi_slopes
from modular_decoder.backend_features import (
    BACKEND_FEATURES,
    FEATURE_FIELDS,
    canonical_backend,
    check_backend,
    missing_features,
    required_features,
)
from modular_decoder.tools.compatibility import compatibility_table

TOL = dict(atol=1e-5, rtol=1e-4)
CPU_BACKENDS = ["sdpa", "flash_attention_2", "flash_attention_3"]


def runnable(variant: str, backend: str) -> bool:
    return not missing_features(make_config(variant), backend)


PAIRS = [(v, b) for v in VARIANTS for b in CPU_BACKENDS if runnable(v, b)]


@pytest.fixture
def kernels(monkeypatch):
    return install_reference_kernels(monkeypatch)


def logits(model, **inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs, use_cache=False).logits


def test_variants_cover_every_feature():
    covered = set().union(*(required_features(make_config(v)) for v in VARIANTS))
    assert covered == set(FEATURE_FIELDS)


@pytest.mark.parametrize("variant,backend", PAIRS, ids=[f"{v}-{b}" for v, b in PAIRS])
def test_backend_matches_eager_plain_padded_packed(variant, backend, kernels):
    eager, model = make_model(variant, "eager"), make_model(variant, backend)
    ids = torch.randint(0, 97, (2, 13), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(logits(model, input_ids=ids), logits(eager, input_ids=ids), **TOL)

    ids, mask = padded_batch()
    real = mask.bool()
    got, want = logits(model, input_ids=ids, attention_mask=mask), logits(eager, input_ids=ids, attention_mask=mask)
    torch.testing.assert_close(got[real], want[real], **TOL)

    _, ids, positions = packed_batch()
    got = logits(model, input_ids=ids, position_ids=positions)
    torch.testing.assert_close(got, logits(eager, input_ids=ids, position_ids=positions), **TOL)


@pytest.mark.parametrize("backend", ["eager"] + CPU_BACKENDS)
@pytest.mark.parametrize("variant", ["gqa", "sliding_mixed", "alibi_gqa_sliding", "mla"])
def test_packed_batch_equals_each_document_alone(variant, backend, kernels):
    if not runnable(variant, backend):
        pytest.skip(f"{backend} refuses {variant} at load")
    model = make_model(variant, backend)
    docs, ids, positions = packed_batch()
    # use_cache left at its default (True): packing must be detected with a fresh cache too
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions).logits[0]
    alone = torch.cat([logits(model, input_ids=doc[None])[0] for doc in docs])
    torch.testing.assert_close(packed, alone, **TOL)


def test_flash_packed_batch_uses_cu_seqlens_from_position_ids(kernels):
    model = make_model("gqa", "flash_attention_2")
    _, ids, positions = packed_batch(lengths=(7, 5, 9))
    logits(model, input_ids=ids, position_ids=positions)
    varlen = [c for c in kernels if c["kind"] == "varlen"]
    assert len(varlen) == model.config.num_hidden_layers and len(kernels) == len(varlen)
    for call in varlen:
        assert call["cu_seqlens_q"] == call["cu_seqlens_k"] == [0, 7, 12, 21]
        assert call["max_seqlen_q"] == 9
        assert call["q_shape"] == (21, 4, 8) and call["k_shape"] == (21, 2, 8)  # GQA: K/V heads not repeated


def test_flash_arguments_window_softcap_scale(kernels):
    model = make_model("sliding_mixed", "flash_attention_2")
    ids = torch.randint(0, 97, (1, 13))
    logits(model, input_ids=ids)
    sliding, full = kernels  # layer 0 is sliding, layer 1 full
    assert sliding["window_size"] == (4, 4) and sliding["causal"]  # window 5 = the token + 4 to its left
    assert full["window_size"] == (-1, -1)
    assert sliding["k_shape"][2] == 2  # (B, T, H_kv, D): no repeat_kv

    kernels.clear()
    model = make_model("softcap_scale", "flash_attention_2")
    logits(model, input_ids=ids)
    for call in kernels:
        assert call["softcap"] == 5.0
        assert call["softmax_scale"] == pytest.approx(12**-0.5)


def test_flash_alibi_passes_the_model_slopes_and_no_bias(kernels):
    model = make_model("alibi", "flash_attention_2")
    ids, mask = padded_batch()
    logits(model, input_ids=ids, attention_mask=mask)
    assert kernels and all(call["kind"] == "varlen" for call in kernels)  # padding -> unpadded ragged batch
    for call in kernels:
        torch.testing.assert_close(call["alibi_slopes"], model.model.alibi.slopes)
    assert takes_alibi_slopes("flash_attention_2") and not takes_alibi_slopes("sdpa")


def test_flash_alibi_refuses_a_kernel_without_slopes(monkeypatch):
    install_reference_kernels(monkeypatch, varlen=reference_fa3_varlen_func)
    model = make_model("alibi", "flash_attention_2")
    with pytest.raises(ValueError, match="alibi_slopes"):
        logits(model, input_ids=torch.randint(0, 97, (1, 6)))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("variant", ["gqa", "sliding_mixed", "alibi_gqa_sliding", "softcap_scale", "mla"])
def test_cached_decoding_matches_eager(variant, backend, kernels):
    """Prefill a left-padded batch, then decode step by step through the cache: the per-step logits
    (queries bottom-right aligned against a growing, then sliding, cache) equal eager's."""
    if not runnable(variant, backend):
        pytest.skip(f"{backend} refuses {variant} at load")
    eager, model = make_model(variant, "eager"), make_model(variant, backend)
    ids, mask = padded_batch(lengths=(6, 3))
    config = dict(max_new_tokens=5, do_sample=False, return_dict_in_generate=True, output_logits=True)
    want = eager.generate(input_ids=ids, attention_mask=mask, **config)
    got = model.generate(input_ids=ids, attention_mask=mask, **config)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), **TOL)


# --- load-time refusal ------------------------------------------------------------------------


REFUSED = [(v, b) for v in VARIANTS for b in BACKEND_FEATURES if not runnable(v, b)]


@pytest.mark.parametrize("variant,backend", REFUSED, ids=[f"{v}-{b}" for v, b in REFUSED])
def test_unhonourable_pair_raises_at_load(variant, backend):
    missing = missing_features(make_config(variant), backend)
    fields = "|".join(re.escape(FEATURE_FIELDS[f]) for f in missing)
    with pytest.raises(ValueError, match=fields):
        ModularDecoderForCausalLM._from_config(make_config(variant), attn_implementation=backend)


def test_refused_pairs_are_the_expected_ones():
    assert {(v, b) for v, b in REFUSED} == {
        ("softcap_scale", "sdpa"),
        ("alibi", "flash_attention_3"), ("alibi", "flash_attention_4"),
        ("alibi_gqa_sliding", "flash_attention_3"), ("alibi_gqa_sliding", "flash_attention_4"),
        ("mla_capped_windowed_moe", "sdpa"),  # the soft-cap
        # vLLM never passes ALiBi slopes; its latent attention has no cap, window or sink
        ("alibi", "vllm"), ("alibi_gqa_sliding", "vllm"), ("mla_capped_windowed_moe", "vllm"), ("mla_sinks", "vllm"),
        # flash-attn 2's kernels take no sink
        ("sinks_sliding", "flash_attention_2"), ("mla_sinks", "flash_attention_2"), ("gpt_oss", "flash_attention_2"),
        # vLLM's fused experts compute neither gpt-oss's clamped SwiGLU nor biases for this architecture
        ("gpt_oss", "vllm"),
        # DSA's per-query selection is a mask: the flash kernels take none, vLLM's latent attention has no indexer
        ("dsa", "flash_attention_2"), ("dsa", "flash_attention_3"), ("dsa", "flash_attention_4"), ("dsa", "vllm"),
        # vLLM's backend pages attention's K/V only: a linear layer's recurrent state has no place there
        ("hybrid", "vllm"),
        # vLLM's fused attention and MLP drop the μP multipliers
        ("mup_sublayers", "vllm"),
        # chunked attention: the flash kernels take a window, not chunks; vLLM's backend gives a layer a window or none
        ("llama4", "flash_attention_2"), ("llama4", "flash_attention_3"), ("llama4", "flash_attention_4"),
        ("llama4", "vllm"),
        # vLLM's backend allocates one head shape for every layer's cache and pages every layer's keys
        ("gemma_topology", "vllm"),
        # shared key = value attention masks its windows and entries per query: eager and SDPA only
        ("deepseek_v4", "flex_attention"), ("deepseek_v4", "flash_attention_2"), ("deepseek_v4", "flash_attention_3"),
        ("deepseek_v4", "flash_attention_4"), ("deepseek_v4", "vllm"),
    }


def test_switching_to_an_unhonourable_backend_raises():
    model = make_model("softcap_scale", "eager")
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        model.set_attn_implementation("sdpa")


def test_default_backend_is_sdpa_unless_it_cannot():
    assert ModularDecoderForCausalLM._from_config(make_config("alibi")).config._attn_implementation == "sdpa"
    assert ModularDecoderForCausalLM._from_config(make_config("softcap_scale")).config._attn_implementation == "eager"


def test_hub_kernel_names_are_held_to_their_flash_version():
    assert canonical_backend("kernels-community/flash-attn2") == "flash_attention_2"
    assert canonical_backend("paged|sdpa") == "sdpa"
    with pytest.raises(ValueError, match="alibi"):
        check_backend(make_config("alibi"), "kernels-community/flash-attn4")
    check_backend(make_config("alibi"), "my-own-registered-backend")  # user backends are trusted


# --- README -----------------------------------------------------------------------------------


def test_readme_table_is_the_generated_one():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    found = re.search(r"<!-- backends:start -->\n(.*?)\n<!-- backends:end -->", readme, re.S)
    assert found, "README.md lacks the <!-- backends:start --> ... <!-- backends:end --> section"
    assert found.group(1).strip() == compatibility_table().strip()


# --- several new tokens against a cache -------------------------------------------------------

CHUNKS = (5, 4, 1, 3)  # prefill, then chunks of several tokens and one, against a filling cache
ALL_PAIRS = [(v, b) for v in VARIANTS for b in ["eager"] + CPU_BACKENDS if runnable(v, b)]


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("implementation", ["dynamic", "static"])
@pytest.mark.parametrize("variant,backend", ALL_PAIRS, ids=[f"{v}-{b}" for v, b in ALL_PAIRS])
def test_chunked_prefill_against_a_cache_equals_the_full_forward(variant, backend, implementation, padded, kernels):
    """Chunked prefill / continuation from a cache: each chunk's queries are aligned after the cached
    keys as the backend aligns them (MLA scores such chunks on its absorbed path), so the logits of
    every chunk equal the no-cache forward's, with and without left padding."""
    if implementation == "static" and variant.startswith("alibi") and "sliding" in variant:
        pytest.skip("ALiBi with a static sliding cache is refused (ring slots are not in position order)")
    config = make_config(variant)
    if implementation not in config.attention_kind.cache_implementations:
        pytest.skip(f"{config.attention_type} stores no {implementation} cache: refused (test_deepseek_v4.py)")
    model = make_model(variant, backend)
    ids, mask = padded_batch(lengths=(sum(CHUNKS), sum(CHUNKS) - 3 if padded else sum(CHUNKS)))
    real = mask.bool()
    want = logits(model, input_ids=ids, attention_mask=mask if padded else None)
    cache = ModularDecoderCache(model.config, implementation, max_cache_len=sum(CHUNKS) + 2)
    got, start = [], 0
    with torch.no_grad():
        for size in CHUNKS:
            chunk_mask = mask[:, :start + size] if padded else None
            out = model(input_ids=ids[:, start:start + size], attention_mask=chunk_mask, cache=cache)
            got.append(out.logits)
            start += size
    got = torch.cat(got, dim=1)
    torch.testing.assert_close(got[real], want[real], **TOL)


@pytest.mark.parametrize("variant,backend", ALL_PAIRS, ids=[f"{v}-{b}" for v, b in ALL_PAIRS])
def test_assisted_and_prompt_lookup_decoding_equal_greedy(variant, backend, kernels):
    """Candidate tokens are verified several at a time against the cache, then the cache is cropped."""
    if variant == "hybrid":
        pytest.skip("a recurrent state cannot be cropped: refused (test_linear_attention.py)")
    if make_config(variant).attention_kind.rollback_error(make_config(variant)):
        pytest.skip("compressed entries cannot be cropped: refused (test_deepseek_v4.py)")
    model = make_model(variant, backend)
    prompt = torch.randint(1, 97, (1, 6), generator=torch.Generator().manual_seed(4))
    prompt = torch.cat([prompt, prompt, prompt[:, :3]], dim=1)  # repeated n-grams give lookup candidates
    kwargs = dict(max_new_tokens=10, do_sample=False, attention_mask=torch.ones_like(prompt))
    with torch.no_grad():
        greedy = make_model(variant, "eager").generate(prompt, **kwargs)
        assert torch.equal(model.generate(prompt, prompt_lookup_num_tokens=3, **kwargs), greedy)
        assistant = make_model(variant, backend)
        assert torch.equal(model.generate(prompt, assistant_model=assistant, **kwargs), greedy)
