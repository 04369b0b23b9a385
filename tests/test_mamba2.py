"""What is Mamba-2's own (`linear_attention_type="mamba2"`): the scan kernels against transformers' reference
kernels, the gated norm, the rules defined where transformers' classes differ (padding with projection biases, the
step-size clamp in decode), the cache's shapes, the refusals and the GPU kernel dispatch (with stand-ins: mamba_ssm
and causal-conv1d need CUDA, which the test machines lack). What every hybrid shares (logits and every generate() path
against transformers' class through each side's cache, the cache's arithmetic, packed documents, training): its
families are cases of test_linear_attention.py and test_hybrid_ecosystem.py."""

from __future__ import annotations

import pytest
import torch
from conversion_cases import perturbed, preset_parameter_counts
from kernel_stand_ins import TensorShapes, use_causal_conv1d
from test_hybrid_ecosystem import DOCUMENTS
from test_linear_attention import GREEDY, IDS, MASK, PADDED, _states, converted_pair
from transformers.models.bamba import modeling_bamba as bamba
from transformers.models.falcon_h1 import modeling_falcon_h1 as falcon_h1

from modular_decoder import ModularDecoderCache, ModularDecoderConfig, ModularDecoderForCausalLM, compat, mamba2_scan
from modular_decoder.mamba2 import GroupedGatedRMSNorm

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ["bamba", "bamba-grouped", "falcon_h1"]


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    """(transformers' model, ours converted from its checkpoint), both fp32 and eval."""
    return converted_pair(request.param, tmp_path_factory)


def _tiny(**overrides) -> ModularDecoderForCausalLM:
    """A tiny Mamba-2 / attention / Mamba-2 model of ours, its scan parameters and norms perturbed."""
    fields = dict(vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  layer_types=["linear_attention", "full_attention", "linear_attention"],
                  linear_attention_type="mamba2", mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=8,
                  mamba_chunk_size=8, pad_token_id=0)
    torch.manual_seed(0)
    return perturbed(ModularDecoderForCausalLM(ModularDecoderConfig(**{**fields, **overrides}))).eval()


# --- the kernels --------------------------------------------------------------------------------


def _scan_inputs(length: int, seed: int = 0):
    torch.manual_seed(seed)
    batch, heads, width, groups, size = 2, 6, 4, 2, 8
    raw_dt, dt_bias = torch.randn(batch, length, heads), torch.randn(heads)
    return dict(x=torch.randn(batch, length, heads, width), dt=torch.randn(batch, length, heads),
                A=-torch.rand(heads) * 3 - 0.1, B=torch.randn(batch, length, groups, size),
                C=torch.randn(batch, length, groups, size), D=torch.randn(heads)), raw_dt, dt_bias, \
        torch.randn(batch, heads, width, size)


@pytest.mark.parametrize("length", [1, 5, 64, 130])
@pytest.mark.parametrize("with_state", [False, True])
def test_scans_equal_transformers_reference_kernels(length, with_state):
    """The chunked and the recurrent scan equal transformers' `mamba2_chunk_scan` (softplus and bias inside it) and,
    token by token, its `mamba2_selective_state_update`: grouped B / C, chunk boundaries crossed or not, from a
    zero or a given state; and each other."""
    inputs, raw_dt, dt_bias, state = _scan_inputs(length)
    inputs["dt"] = torch.nn.functional.softplus(raw_dt + dt_bias)
    state = state if with_state else None
    chunked = mamba2_scan.chunked_scan(**inputs, initial_state=state, chunk_size=16)
    recurrent = mamba2_scan.recurrent_scan(**inputs, initial_state=state)
    x, A, B, C, D = (inputs[k] for k in "xABCD")
    theirs = bamba.mamba2_chunk_scan(x, raw_dt, A, B, C, 16, D=D, dt_bias=dt_bias, initial_states=state,
                                     dt_softplus=True, return_final_states=True)
    for ours in (chunked, recurrent):
        torch.testing.assert_close(ours[0], theirs[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours[1], theirs[1], rtol=1e-5, atol=1e-5)
    heads, width, size = x.shape[2], x.shape[3], B.shape[-1]
    running = torch.zeros(x.shape[0], heads, width, size) if state is None else state.clone()
    for t in range(length):
        out = bamba.mamba2_selective_state_update(
            running, x[:, t], raw_dt[:, t, :, None].expand(-1, -1, width), A[:, None, None].expand(-1, width, size),
            B[:, t], C[:, t], D[:, None].expand(-1, width), dt_bias=dt_bias[:, None].expand(-1, width),
            dt_softplus=True)
        torch.testing.assert_close(recurrent[0][:, t], out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(recurrent[1], running, rtol=1e-5, atol=1e-5)


def test_a_zero_step_neither_decays_nor_writes():
    """dt = 0 at a token (padding) leaves the state as it was, in both forms."""
    inputs, _, _, state = _scan_inputs(9)
    inputs["dt"] = torch.rand(2, 9, 6)
    kept = dict(inputs, dt=inputs["dt"].clone())
    kept["dt"][:, 4:] = 0
    for scan in (mamba2_scan.recurrent_scan, lambda **kw: mamba2_scan.chunked_scan(**kw, chunk_size=4)):
        _, before = scan(**{k: v[:, :4] if k in ("x", "dt", "B", "C") else v for k, v in inputs.items()},
                         initial_state=state)
        _, after = scan(**kept, initial_state=state)
        torch.testing.assert_close(after, before, rtol=1e-6, atol=1e-6)


def test_chunked_scan_holds_no_sequence_by_sequence_tensor():
    """O(T·chunk) per head: over 1,024 tokens no intermediate has two dimensions as long as the sequence, only
    (chunk x chunk) blocks."""
    inputs, _, _, _ = _scan_inputs(1024)
    inputs["dt"] = torch.rand(2, 1024, 6)
    with TensorShapes() as mode:
        mamba2_scan.chunked_scan(**inputs, chunk_size=64)
    assert not [shape for shape in mode.shapes if sum(dim >= 1024 for dim in shape) >= 2]
    assert max(max(shape[-2:], default=0) for shape in mode.shapes if len(shape) >= 2) >= 64


def test_a_sequence_shorter_than_the_chunk_is_one_unpadded_chunk():
    """Shorter than `chunk_size`: one chunk of the sequence's length (no padded tokens in the (chunk x chunk) blocks),
    equal to the token-by-token recurrence."""
    inputs, _, _, state = _scan_inputs(9)
    inputs["dt"] = torch.rand(2, 9, 6)
    with TensorShapes() as mode:
        out, final = mamba2_scan.chunked_scan(**inputs, initial_state=state, chunk_size=256)
    assert max(max(shape[-2:], default=0) for shape in mode.shapes if len(shape) >= 2) < 256
    expected, expected_state = mamba2_scan.recurrent_scan(**inputs, initial_state=state)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, expected_state, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("norm_before_gate", [False, True])
def test_grouped_gated_norm_equals_transformers_norms(norm_before_gate):
    """Gate then norm per group (Bamba / Granite / Nemotron-H, transformers 5.25's `BambaRMSNormGated`) and norm per
    group then gate (Falcon-H1's `FalconH1RMSNormGated` with `mamba_norm_before_gate`)."""
    torch.manual_seed(0)
    x, z, weight = torch.randn(2, 5, 24), torch.randn(2, 5, 24), torch.randn(24)
    ours = GroupedGatedRMSNorm(24, groups=3, eps=1e-5, norm_before_gate=norm_before_gate)
    if norm_before_gate:
        theirs = falcon_h1.FalconH1RMSNormGated(24, eps=1e-5, n_groups=3, norm_before_gate=True)
    else:
        theirs = bamba.BambaRMSNormGated(24, group_size=8, eps=1e-5)
    with torch.no_grad():
        ours.weight.copy_(weight)
        theirs.weight.copy_(weight)
    torch.testing.assert_close(ours(x, z), theirs(x, z), rtol=1e-6, atol=1e-6)


# --- the rules this project defines where transformers' classes differ --------------------------------------


def test_a_left_padded_row_computes_what_it_computes_alone_with_projection_biases():
    """With biases on `in_proj` transformers' masking (zeros into the projection) still lets padding reach the
    convolution; here padding gives the convolution zeros and dt = 0, so the row equals the row alone."""
    model = _tiny(mamba_proj_bias=True)
    with torch.no_grad():
        padded = model(PADDED, attention_mask=MASK).logits[1, 5:]
        alone = model(IDS[1:, 5:]).logits[0]
    torch.testing.assert_close(padded, alone, rtol=1e-5, atol=1e-5)
    assert torch.equal(model.generate(PADDED, attention_mask=MASK, **GREEDY)[1, 5:],
                       model.generate(IDS[1:, 5:], **GREEDY)[0])


def test_a_binding_step_limit_is_applied_in_decode_as_in_prefill():
    """`time_step_limit` clamps dt in the recurrent step too, so decoding through the cache gives the logits of the
    no-cache forward (mamba_ssm's and transformers' decode steps skip the clamp their prefill applies)."""
    model = _tiny(time_step_limit=[0.05, 0.3])
    with torch.no_grad():
        full = model(IDS, use_cache=False).logits
        cache = ModularDecoderCache(model.config)
        steps = [model(IDS[:, :4], cache=cache).logits]
        steps += [model(IDS[:, t:t + 1], cache=cache).logits for t in range(4, IDS.shape[1])]
        unclamped = _tiny()(IDS, use_cache=False).logits
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(full, unclamped, atol=1e-3)  # the limit binds


# --- the cache ------------------------------------------------------------------------------------


def test_the_cache_holds_the_conv_window_and_an_fp32_state_per_head(pair):
    """(B, H·P + 2·G·N, K) in the model's dtype and (B, H, P, N) in fp32, whatever the context (their bytes against
    the contract: test_linear_attention.py)."""
    _, ours = pair
    config = ours.config
    with torch.no_grad():
        cache = getattr(ours(IDS, use_cache=True), compat.CACHE_NAME)
    layer = _states(cache)[0]
    heads, width, size = config.mamba_n_heads, config.mamba_d_head, config.mamba_d_state
    assert layer.recurrent_state.shape == (2, heads, width, size) and layer.recurrent_state.dtype == torch.float32
    assert layer.conv_state.shape == (2, heads * width + 2 * config.mamba_n_groups * size, config.mamba_d_conv)


# --- the contract ---------------------------------------------------------------------------------


LINEAR = dict(layer_types=["linear_attention", "full_attention"], linear_attention_type="mamba2")


@pytest.mark.parametrize("kwargs, field", [
    (dict(mamba_n_heads=4), "mamba_n_heads"),  # no linear layer reads it
    (dict(LINEAR, linear_attention_type="gated_deltanet", mamba_d_state=4), "mamba_d_state"),  # GDN's do not
    (dict(LINEAR, mamba_n_heads=4, mamba_n_groups=3), "mamba_n_groups"),
    (dict(LINEAR, mamba_n_heads=0), "mamba_n_heads"),
    (dict(LINEAR, time_step_limit=[0.5, 0.1]), "time_step_limit"),
    (dict(LINEAR, time_step_limit=[-1.0, 0.1]), "time_step_limit"),
    (dict(LINEAR, ssm_multipliers=[1.0, 2.0]), "ssm_multipliers"),
    (dict(LINEAR, mamba_rms_norm=False, mamba_norm_before_gate=True), "mamba_norm_before_gate"),
    (dict(LINEAR, mamba_hidden_act="nope"), "mamba_hidden_act"),
    (dict(LINEAR, ssm_out_multiplier=0.0), "ssm_out_multiplier"),
    # the topologies
    (dict(block_types=["mlp", "mlp"]), "block_types"),  # no token mixer anywhere
    (dict(block_types=["mixer", "sliding"]), "block_types"),
    (dict(LINEAR, block_types=["mlp", "mixer"]), "block_types"),  # a feed-forward-only layer given a state
    (dict(block_types=["mixer", "mlp"], parallel_block=True), "parallel_block"),
    (dict(block_types=["mixer_mlp", "mixer"], num_mtp_layers=1), "num_mtp_layers"),
    (dict(layer_types=["hybrid", "hybrid"], linear_attention_type="mamba2", num_mtp_layers=1), "num_mtp_layers"),
    (dict(key_multiplier=0.5, attention_type="mla", kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4,
          v_head_dim=8), "key_multiplier"),  # standard attention's
    (dict(mlp_type="dense", mlp_multipliers=[1.0, 2.0]), "mlp_multipliers"),  # the gated MLP's
    (dict(mlp_type="moe", num_experts=4, num_experts_per_tok=2, moe_mlp_type="swiglu"), "moe_mlp_type"),
])
def test_bad_settings_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"`{field}"):
        ModularDecoderConfig(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, **kwargs)


# --- the GPU kernels' dispatch, with stand-ins ----------------------------------------------------


def _fake_mamba_chunk_scan_combined(calls):
    """mamba_ssm's `mamba_chunk_scan_combined` as its documentation states it (x (b, T, H, P), dt final here, A (H,),
    B / C (b, T, G, N), D (H,); `seq_idx` restarts the state, `cu_seqlens` with `return_varlen_states` returns each
    sequence's final state)."""

    def kernel(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
               cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False,
               return_varlen_states=False):
        assert z is None and dt_bias is None and not dt_softplus and dt_limit == (0.0, float("inf"))
        assert all(t.is_contiguous() for t in (x, dt, B, C))
        calls.append("mamba_chunk_scan_combined")
        if seq_idx is None:
            out, state = mamba2_scan.chunked_scan(x, dt, A, B, C, D, initial_states, chunk_size)
            return (out.to(x.dtype), state) if return_final_states else out.to(x.dtype)
        assert x.shape[0] == 1 and initial_states is None and return_varlen_states and seq_idx.dtype == torch.int32
        calls.append("seq_idx")
        bounds = cu_seqlens.tolist()
        assert torch.equal(seq_idx[0], torch.repeat_interleave(torch.arange(len(bounds) - 1),
                                                               torch.tensor(bounds).diff()).int())
        parts = [mamba2_scan.chunked_scan(x[:, a:b], dt[:, a:b], A, B[:, a:b], C[:, a:b], D, None, chunk_size)
                 for a, b in zip(bounds[:-1], bounds[1:])]
        return torch.cat([o for o, _ in parts], dim=1).to(x.dtype), torch.cat([s for _, s in parts])

    return kernel


def _fake_selective_state_update(calls):
    """mamba_ssm's `selective_state_update`: one token, per-channel dt / A / D, the state updated in place."""

    def kernel(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False):
        assert z is None and dt_bias is None and not dt_softplus
        calls.append("selective_state_update")
        out, new = mamba2_scan.recurrent_scan(x[:, None], dt[:, None, :, 0], A[:, 0, 0], B[:, None], C[:, None],
                                              D[:, 0], state)
        state.copy_(new)
        return out[:, 0].to(x.dtype)

    return kernel


@pytest.fixture
def stand_ins(monkeypatch):
    """mamba_ssm and causal-conv1d reported available (stand-ins computing what the libraries document), this device
    counted as theirs; the calls recorded."""
    calls = []
    monkeypatch.setattr(compat, "mamba_ssm_kernels", lambda: (_fake_mamba_chunk_scan_combined(calls),
                                                              _fake_selective_state_update(calls)))
    monkeypatch.setattr(mamba2_scan, "_MAMBA_SSM_DEVICES", ("cpu",))
    use_causal_conv1d(monkeypatch, calls)
    yield calls
    monkeypatch.undo()
    mamba2_scan._kernels_for.cache_clear()


def test_gpu_kernels_are_dispatched_where_available(pair, stand_ins):
    """The chunked kernel for prefill, the fused state update and the in-place conv update for decode; the tokens
    stay those of the PyTorch path (with a conv bias: Bamba's)."""
    _, ours = pair
    mamba2_scan._kernels_for.cache_clear()
    expected = _torch_path(lambda: ours.generate(PADDED, attention_mask=MASK, **GREEDY))
    assert mamba2_scan.kernels_for(torch.device("cpu")).name == "mamba_ssm+causal-conv1d"
    assert torch.equal(ours.generate(PADDED, attention_mask=MASK, **GREEDY), expected)
    assert {"mamba_chunk_scan_combined", "selective_state_update", "conv", "conv_update"} <= set(stand_ins)


def test_gpu_kernels_take_packed_documents_by_seq_idx(pair, stand_ins):
    """Packed documents on the GPU path: mamba_ssm's kernel gets `seq_idx` and `cu_seqlens` (batch 1); each
    document's logits stay those it has alone."""
    _, ours = pair
    ids = torch.tensor([sum(DOCUMENTS, [])])
    positions = torch.tensor([sum((list(range(len(d))) for d in DOCUMENTS), [])])
    alone = _torch_path(lambda: [ours(torch.tensor([d])).logits[0] for d in DOCUMENTS])
    with torch.no_grad():
        packed = ours(input_ids=ids, position_ids=positions).logits[0]
    assert {"seq_idx", "conv"} <= set(stand_ins)
    torch.testing.assert_close(packed, torch.cat(alone), rtol=1e-5, atol=1e-5)


def _torch_path(run):
    """`run()` with the PyTorch kernels, inside a test whose stand-ins are installed."""
    saved = mamba2_scan._MAMBA_SSM_DEVICES, mamba2_scan._CAUSAL_CONV1D_DEVICES
    mamba2_scan._MAMBA_SSM_DEVICES = mamba2_scan._CAUSAL_CONV1D_DEVICES = ()
    mamba2_scan._kernels_for.cache_clear()
    try:
        with torch.no_grad():
            return run()
    finally:
        mamba2_scan._MAMBA_SSM_DEVICES, mamba2_scan._CAUSAL_CONV1D_DEVICES = saved
        mamba2_scan._kernels_for.cache_clear()


def test_without_an_accelerator_transformers_reports_no_gpu_kernels():
    assert compat.mamba_ssm_kernels() is None
    assert mamba2_scan.kernels_for(torch.device("cpu")).name == "torch"


# --- the presets ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name, family, total", [("bamba", "bamba", 9_780_235_392),
                                                 ("granite_4_h_tiny", "granitemoehybrid", 6_939_037_248),
                                                 ("nemotron_h", "nemotron_h", 8_100_852_736),
                                                 ("falcon_h1", "falcon_h1", 7_585_513_568)])
@pytest.mark.parametrize("tiny", [False, True])
def test_presets_have_the_parameters_of_their_family_class(name, family, total, tiny):
    """Each preset (and its tiny form) exported to its family's config and built by transformers' class on the meta
    device has the contract's parameter count and ours; the full ones the totals of their releases."""
    theirs, count, ours = preset_parameter_counts(name, family, tiny)
    assert theirs == count == ours
    assert tiny or count == total


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
@pytest.mark.parametrize("case", ["granitemoehybrid", "nemotron_h"])
def test_router_logits_and_experts_match_the_family(case, implementation, tmp_path_factory):
    """Granite 4.0-H's top-k softmax router and experts beside the shared MLP, Nemotron-H's sigmoid router with groups
    and latent relu² experts: every sparse layer's router logits and the logits equal transformers' class, with
    either experts implementation."""
    source, ours = converted_pair(case, tmp_path_factory)
    source.set_experts_implementation(implementation)
    ours.set_experts_implementation(implementation)
    with torch.no_grad():
        theirs, got = source(IDS, output_router_logits=True), ours(IDS, output_router_logits=True)
    torch.testing.assert_close(got.logits, theirs.logits, rtol=0, atol=1e-5)
    assert len(got.router_logits) == ours.config.mlp_layer_types.count("sparse") == len(theirs.router_logits) > 0
    for a, b in zip(got.router_logits, theirs.router_logits):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
