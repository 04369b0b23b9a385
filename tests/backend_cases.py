"""Shared fixtures for the backend tests: attention variants, input batches, and a reference
implementation of the flash-attn kernel contract to stand in for the CUDA kernel on CPU."""

from __future__ import annotations

import torch
import transformers.modeling_flash_attention_utils as fa_utils

from modular_decoder import ModularDecoderConfig, ModularDecoderForCausalLM

_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
BASE = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64, position_embedding_type="rope", rope_parameters=dict(_ROPE))

# One config per attention variant; together they cover every contract feature in backend_features.FEATURE_FIELDS.
VARIANTS: dict[str, dict] = {
    "mha": dict(num_key_value_heads=4),
    "gqa": dict(num_key_value_heads=2),
    "mqa": dict(num_key_value_heads=1),
    "sliding_mixed": dict(num_key_value_heads=2, sliding_window=5, layer_types=["sliding_attention", "full_attention"]),
    "softcap_scale": dict(num_key_value_heads=2, attn_logit_softcapping=5.0, query_pre_attn_scalar=12),
    "alibi": dict(num_key_value_heads=4, position_embedding_type="alibi", rope_parameters=None),
    "alibi_gqa_sliding": dict(num_key_value_heads=2, position_embedding_type="alibi", rope_parameters=None,
                              sliding_window=5, layer_types=["sliding_attention", "full_attention"]),
    "mla": dict(attention_type="mla", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6),
    # DeepSeek Sparse Attention keeping 4 keys per query: the selection is a mask, which the flash kernels refuse
    "dsa": dict(attention_type="dsa", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                q_lora_rank=12, index_n_heads=8, index_head_dim=8, index_topk=4),
    # gpt-oss's attention: a sink per head, sliding and full layers; and sinks on MLA (vLLM's latent attention
    # takes none)
    "sinks_sliding": dict(num_key_value_heads=2, attention_sinks=True, sliding_window=5,
                          layer_types=["sliding_attention", "full_attention"]),
    "mla_sinks": dict(attention_type="mla", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                      attention_sinks=True),
    # the whole of gpt-oss's layout: sinks, sliding and full layers, a biased top-k-then-softmax router, experts
    # with biases and the clamped SwiGLU (what vLLM's fused experts do not compute for this architecture)
    "gpt_oss": dict(num_key_value_heads=2, attention_sinks=True, sliding_window=5, attention_bias=True,
                    layer_types=["sliding_attention", "full_attention"], mlp_type="moe", num_experts=4,
                    num_experts_per_tok=2, moe_intermediate_size=16, router_type="topk_softmax", router_bias=True,
                    mlp_bias=True, swiglu_limit=1.0),
    # SmolLM3's NoPE layers (no rotary on layer 0, here the sliding one)
    "nope_sliding": dict(num_key_value_heads=2, no_rope_layers=[0, 1], sliding_window=5,
                         layer_types=["sliding_attention", "full_attention"]),
    # What transformers' backends run and vLLM's Transformers backend refuses (its "vllm" row): latent
    # scores with a cap and a window, a `head_dim` that is not the latent width, scaled logits, GELU experts
    "mla_capped_windowed_moe": dict(
        attention_type="mla", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, head_dim=8,
        attn_logit_softcapping=5.0, sliding_window=5, layer_types=["sliding_attention", "full_attention"],
        logits_scaling=2.0, mlp_type="moe", hidden_act="gelu", num_experts=4, num_experts_per_tok=2),
    # Qwen3-Next's hybrid: a Gated DeltaNet layer (a recurrent state vLLM's backend has no place for) beside a
    # gated full-attention layer; packed documents restart the linear layer's state
    "hybrid": dict(num_key_value_heads=2, layer_types=["linear_attention", "full_attention"], attn_output_gate=True,
                   linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8),
    # Llama 4's attention: chunks of 3 on the RoPE layer, the NoPE layer's temperature, the weightless QK-norm
    "llama4": dict(num_key_value_heads=2, layer_types=["chunked_attention", "full_attention"], attention_chunk_size=3,
                   no_rope_layers=[1, 0], attn_temperature_tuning=True, floor_scale=2, attn_scale=0.5,
                   attn_temperature_offset=1, attn_temperature_layers="nope",
                   qk_norm="weightless", rope_interleaved=True),
    # Gemma 4's: a full layer with its own heads (16 wide, one K/V head, values from its keys), then a layer reading
    # its keys and values; per-layer embeddings, AltUp's streams and LAUREL around both (Gemma 3n's)
    "gemma_topology": dict(num_key_value_heads=2, global_head_dim=16, num_global_key_value_heads=1,
                           attention_k_eq_v=True, value_norm=True, num_kv_shared_layers=1,
                           rope_parameters={"full_attention": dict(_ROPE)}, hidden_size_per_layer_input=4,
                           residual_stream="altup", altup_num_inputs=2, laurel_rank=4),
    # Falcon-H1's μP: multipliers on the attention's input, keys and output and on the gated MLP's gate and output
    # (vLLM's fused attention and MLP would drop them)
    "mup_sublayers": dict(num_key_value_heads=2, mlp_type="gated", attention_in_multiplier=0.5, key_multiplier=1.5,
                          attention_out_multiplier=2.0, mlp_multipliers=[0.7, 1.3]),
    # DeepSeek-V4's layout: one key = value head with sinks, a window, then a CSA layer keeping 2 of its entries per
    # query (eager and SDPA only), hyper-connections, the first layer's experts looked up by token id
    "deepseek_v4": dict(attention_type="shared_kv", num_key_value_heads=1, q_lora_rank=12, o_groups=2, o_lora_rank=8,
                        attention_sinks=True, sliding_window=4,
                        layer_types=["sliding_attention", "compressed_sparse_attention"],
                        compress_rates={"compressed_sparse_attention": 2}, index_n_heads=4, index_head_dim=8,
                        index_topk=2, residual_stream="hyper_connections", hc_mult=2, mlp_type="moe", num_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=16, router_type="sqrtsoftplus_topk",
                        num_hash_layers=1, swiglu_limit=1.0, swiglu_alpha=1.0, swiglu_up_offset=0.0),
}


def make_config(variant: str) -> ModularDecoderConfig:
    fields = dict(BASE)
    fields.update(VARIANTS[variant])
    if fields.get("rope_parameters") is None:
        fields.pop("rope_parameters")
    return ModularDecoderConfig(**fields)


def make_model(variant: str, backend: str = "eager") -> ModularDecoderForCausalLM:
    torch.manual_seed(0)
    model = ModularDecoderForCausalLM._from_config(make_config(variant), attn_implementation="eager").eval()
    with torch.no_grad():  # sinks of order 1 (they start near 0): a backend that dropped them would show
        for module in model.modules():
            if getattr(module, "sinks", None) is not None:
                module.sinks.normal_(0.0, 1.5)
    # Set directly: flash kernels are not installed on CPU, so loading through the availability
    # check is not possible; the contract check itself is tested separately.
    model.config._attn_implementation = backend
    return model


def packed_batch(lengths=(7, 5, 9), vocab: int = 97, seed: int = 1):
    """Documents packed as DataCollatorWithFlattening packs them: batch 1, position_ids restarting at 0."""
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, vocab, (n,), generator=g) for n in lengths]
    input_ids = torch.cat(docs)[None]
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    return docs, input_ids, position_ids


def padded_batch(lengths=(12, 7), vocab: int = 97, seed: int = 2, side: str = "left"):
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    input_ids = torch.zeros(len(lengths), width, dtype=torch.long)
    attention_mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        cols = slice(width - n, width) if side == "left" else slice(0, n)
        input_ids[row, cols] = torch.randint(1, vocab, (n,), generator=g)
        attention_mask[row, cols] = 1
    return input_ids, attention_mask


# ---------------------------------------------------------------------------------------------
# Reference implementation of the flash-attn 2 kernel contract (flash_attn/flash_attn_interface.py
# docstrings): q (total_q, H, D), k/v (total_k, H_k, D), H divisible by H_k; causal mask aligned to
# the bottom-right corner; window_size=(left, right) keeps keys j with
# i + T_k - T_q - left <= j <= i + T_k - T_q + right (-1: unbounded); softcap: s -> c·tanh(s/c)
# after scaling; alibi_slopes (H,) add -slope·|i + T_k - T_q - j|; a row with no key outputs 0.
# s_aux (H,): vLLM's FA3 build's attention sinks, one more logit in each head's softmax denominator.

KERNEL_CALLS: list[dict] = []


def _reference_attend(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, s_aux=None):
    t_q, heads, dim = q.shape
    t_k, kv_heads, _ = k.shape
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scale = dim**-0.5 if softmax_scale is None else softmax_scale
    s = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(t_q)[:, None]
    j = torch.arange(t_k)[None, :]
    diagonal = i + t_k - t_q
    if alibi_slopes is not None:
        s = s - alibi_slopes.float()[:, None, None] * (diagonal - j).abs()
    keep = torch.ones(t_q, t_k, dtype=torch.bool)
    if causal:
        keep &= j <= diagonal
    left, right = window_size
    if left >= 0:
        keep &= j >= diagonal - left
    if right >= 0:
        keep &= j <= diagonal + right
    s = s.masked_fill(~keep, float("-inf"))
    if s_aux is not None:
        sink = s_aux.float()[:, None, None].expand(heads, t_q, 1)
        p = torch.cat([s, sink], dim=-1).softmax(-1)[..., :-1]
    else:
        p = s.softmax(-1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", p, v.float()).to(q.dtype)


def reference_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                                     dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                                     block_table=None, s_aux=None):
    """flash_attn_varlen_func's documented semantics, in plain torch (fp32 inside); `s_aux` as vLLM's FA3 takes it."""
    assert dropout_p == 0.0
    KERNEL_CALLS.append(dict(kind="varlen", q_shape=tuple(q.shape), k_shape=tuple(k.shape),
                             cu_seqlens_q=cu_seqlens_q.tolist(), cu_seqlens_k=cu_seqlens_k.tolist(),
                             max_seqlen_q=int(max_seqlen_q), softmax_scale=softmax_scale, causal=causal,
                             window_size=tuple(window_size), softcap=softcap, alibi_slopes=alibi_slopes,
                             s_aux=s_aux))
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype)
    for b in range(len(cu_seqlens_q) - 1):
        qs, qe = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        ks, ke = int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1])
        out[qs:qe] = _reference_attend(q[qs:qe], k[ks:ke], v[ks:ke], softmax_scale, causal, tuple(window_size),
                                       softcap, alibi_slopes, s_aux)
    return out


def reference_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                              s_aux=None):
    """flash_attn_func's documented semantics: (B, T, H, D) batches of equal length."""
    assert dropout_p == 0.0
    KERNEL_CALLS.append(dict(kind="dense", q_shape=tuple(q.shape), k_shape=tuple(k.shape),
                             softmax_scale=softmax_scale, causal=causal, window_size=tuple(window_size),
                             softcap=softcap, alibi_slopes=alibi_slopes, s_aux=s_aux))
    return torch.stack([
        _reference_attend(q[b], k[b], v[b], softmax_scale, causal, tuple(window_size), softcap, alibi_slopes, s_aux)
        for b in range(q.shape[0])
    ])


def reference_fa3_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                              softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                              deterministic=False):
    """The FA3 (hopper) interface: the same maths, and no `alibi_slopes` argument."""
    return reference_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                            softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                            softcap=softcap)


def install_reference_kernels(monkeypatch, varlen=reference_flash_attn_varlen_func, dense=reference_flash_attn_func):
    """Make transformers' flash loader (`lazy_import_flash_attention`, which our ALiBi path uses
    too) return the reference kernels instead of importing flash_attn."""
    for name in ("_loaded_implementation", "_flash_fn", "_flash_varlen_fn", "_flash_with_kvcache_fn", "_pad_fn",
                 "_unpad_fn", "_process_flash_kwargs_fn", "_process_with_kvcache_kwargs_fn"):
        monkeypatch.setattr(fa_utils, name, None)
    monkeypatch.setattr(
        fa_utils, "_lazy_imports",
        lambda implementation, *args, **kwargs: (dense, varlen, None, fa_utils._pad_input, fa_utils._unpad_input),
    )
    KERNEL_CALLS.clear()
    return KERNEL_CALLS
