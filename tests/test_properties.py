"""Property-based tests over the whole config space (strategies in tests/strategies.py).

Valid configs (eval, the eager reference backend) keep four properties: causality (fp32, exact),
cached decoding = the full forward (prefill, then single tokens and chunks through
`ModularDecoderCache`), a left-padded row = the row alone (both float64 at 1e-5: see
`COMPARISON_DTYPE`), and save/load = identical logits (fp32, exact). Broken configs (one field made
invalid) raise a `ValueError` naming the field, and no other exception.

Targeted checks against independent references: sinusoidal positions against the closed form,
ALiBi slopes for head counts that are not powers of two against BLOOM's, and MLA's absorbed
sliding-window mask against the eager expanded forward.

The example budget comes from the hypothesis profile (tests/conftest.py): `ci` by default (fixed,
derandomized), `HYPOTHESIS_PROFILE=thorough` for many more examples.
"""

from __future__ import annotations

import math
import tempfile

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st
from torch import nn
from transformers.models.bloom.modeling_bloom import build_alibi_tensor

from modular_decoder import ModularDecoderCache, ModularDecoderConfig, ModularDecoderForCausalLM
from modular_decoder.mla import MultiHeadLatentAttention, set_decode_mode
from modular_decoder.norms import LayerNorm, RMSNorm
from modular_decoder.positions import alibi_slopes
from modular_decoder.tools.validate import batch_invariant_experts
from strategies import MAX_SEQ, REGISTRIES, broken_config_kwargs, config_kwargs, make_config

pytestmark = pytest.mark.usefixtures("one_thread")

ATOL = 1e-5  # cached / padded vs full forward (the variant matrix's tolerance)


# The cached-decoding and left-padding properties compare runs whose arithmetic differs in order
# (other matrix shapes; MLA's absorbed scores against its cache vs the expanded full forward). In fp32
# that rounding, amplified by some valid configs' conditioning (norms over one or two features, norms
# on sublayer outputs), exceeds 1e-5 with no bug involved: measured up to 1.1e-5 with standard
# attention (head_dim=1, output norms) and 1e-4 with MLA. In float64 the same runs agree to 3e-14 over
# 800 draws, so these two properties run in float64 and any deviation past ATOL is a real one. The
# tolerance stays; the precision rises. (fp32 at 1e-5 on fixed configs: test_variant_matrix.py,
# test_mla.py; causality and save/load below stay fp32 and exact.)
COMPARISON_DTYPE = torch.float64


def _budget(factor: float) -> settings:
    """The loaded profile's example budget, scaled for a property that is cheaper or dearer than most."""
    return settings(max_examples=max(1, int(settings().max_examples * factor)))


# ---------------------------------------------------------------------------------------------
# models and inputs


def _scramble(model: nn.Module) -> nn.Module:
    """Weights large enough that attention is far from uniform and norms are not the identity, so a
    wrong mask, position or cache entry moves the logits far past the tolerance."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.weight.copy_(torch.randn_like(module.weight) * module.weight.shape[1] ** -0.5)
                if module.bias is not None:
                    module.bias.copy_(0.1 * torch.randn_like(module.bias))
            elif isinstance(module, nn.Embedding):
                module.weight.copy_(0.3 * torch.randn_like(module.weight))
            elif isinstance(module, (RMSNorm, LayerNorm)):
                offset = 0.0 if module.unit_offset else 1.0
                module.weight.copy_(offset + 0.3 * torch.randn_like(module.weight))
                if getattr(module, "bias", None) is not None:
                    module.bias.copy_(0.1 * torch.randn_like(module.bias))
    return model.eval()


def _model(config: ModularDecoderConfig, seed: int, backend: str = "eager",
           dtype: torch.dtype = torch.float32) -> ModularDecoderForCausalLM:
    torch.manual_seed(seed)
    model = _scramble(ModularDecoderForCausalLM._from_config(config, attn_implementation=backend))
    return model if dtype == torch.float32 else model.to(dtype)


def _ids(vocab: int, batch: int, length: int):
    row = st.lists(st.integers(0, vocab - 1), min_size=length, max_size=length)
    return st.lists(row, min_size=batch, max_size=batch).map(torch.tensor)


@st.composite
def model_cases(draw, min_length: int = 2):
    """(config, weight seed, input ids (B, T)) with 1 <= B <= 2 and min_length <= T <= MAX_SEQ."""
    config = make_config(draw(config_kwargs()))
    length = draw(st.integers(min_length, MAX_SEQ))
    ids = draw(_ids(config.vocab_size, draw(st.integers(1, 2)), length))
    return config, draw(st.integers(0, 2**16)), ids


def _describe(config) -> None:
    """Hypothesis events (`--hypothesis-show-statistics`): which variants the examples covered."""
    event(f"attention={config.attention_type}, positions={config.position_embedding_type}")
    event(f"norm={config.norm_type}/{'parallel' if config.parallel_block else config.norm_position}, "
          f"mlp={config.mlp_type}")
    if config.uses_rope:
        tables = config.rope_parameters.values() if config.rope_is_nested else [config.rope_parameters]
        for table in tables:
            event(f"rope_type={table['rope_type']}")
    event(f"layers={','.join(t[:4] for t in config.layer_types)}")


@torch.no_grad()
def _logits(model, ids, **kwargs) -> torch.Tensor:
    return model(ids, use_cache=False, **kwargs).logits


def test_strategies_cover_every_registry_entry():
    """The strategy draws every value of every registry; a new entry must be added to it."""
    for field, (registry, drawn) in REGISTRIES.items():
        assert sorted(registry) == sorted(drawn), field


# ---------------------------------------------------------------------------------------------
# properties of valid configs


@given(case=model_cases(), data=st.data())
def test_causality(case, data):
    """Changing future tokens never changes the logits before them (exactly)."""
    config, seed, ids = case
    _describe(config)
    split = data.draw(st.integers(1, ids.shape[1] - 1), label="split")
    changed = ids.clone()
    changed[:, split:] = data.draw(_ids(config.vocab_size, ids.shape[0], ids.shape[1] - split), label="future")
    model = _model(config, seed)
    with batch_invariant_experts(model):  # grouped experts round a token by what shares its expert
        before, after = _logits(model, ids), _logits(model, changed)
    torch.testing.assert_close(after[:, :split], before[:, :split], rtol=0, atol=0)


@st.composite
def _schedule(draw, length: int) -> tuple[int, list[int]]:
    """A prefill length and the chunk sizes (1 = token by token) that feed the rest."""
    prefill = draw(st.integers(1, length - 1))
    chunks, left = [], length - prefill
    while left:
        chunks.append(draw(st.integers(1, min(left, 4))))
        left -= chunks[-1]
    return prefill, chunks


@given(case=model_cases(), data=st.data())
def test_cached_decoding_equals_full_forward(case, data):
    """Prefill, then single tokens and chunks through a dynamic `ModularDecoderCache`: every step's
    logits equal the no-cache forward's at the same positions."""
    config, seed, ids = case
    _describe(config)
    prefill, chunks = data.draw(_schedule(ids.shape[1]), label="prefill, chunks")
    model = _model(config, seed, dtype=COMPARISON_DTYPE)
    full = _logits(model, ids)
    cache = ModularDecoderCache(config)
    start, end = 0, prefill
    with torch.no_grad():
        for size in [prefill] + chunks:
            end = start + size
            step = model(ids[:, start:end], cache=cache, use_cache=True).logits
            torch.testing.assert_close(step, full[:, start:end], rtol=0, atol=ATOL,
                                       msg=lambda m: f"positions {start}..{end - 1}: {m}")
            start = end


@given(case=model_cases(), data=st.data())
def test_left_padded_row_equals_row_alone(case, data):
    """A left-padded row of a batch gets, at its real positions, the logits it gets alone (the pad
    tokens' ids are arbitrary), and the unpadded row is unaffected by its neighbour's padding."""
    config, seed, ids = case
    _describe(config)
    length = ids.shape[1]
    pads = data.draw(st.integers(1, length - 1), label="pads")
    real = ids[-1, pads:]
    padded = torch.cat([data.draw(_ids(config.vocab_size, 1, pads), label="pad ids")[0], real])
    full_row = ids[0] if ids.shape[0] == 2 else data.draw(_ids(config.vocab_size, 1, length), label="other row")[0]
    batch = torch.stack([full_row, padded])
    mask = torch.ones_like(batch)
    mask[1, :pads] = 0
    model = _model(config, seed, dtype=COMPARISON_DTYPE)
    together = _logits(model, batch, attention_mask=mask)
    torch.testing.assert_close(together[1, pads:], _logits(model, real[None])[0], rtol=0, atol=ATOL)
    torch.testing.assert_close(together[0], _logits(model, full_row[None])[0], rtol=0, atol=ATOL)


def _torch_allocated(model: nn.Module) -> nn.Module:
    """Every parameter and buffer copied into storage of torch's own allocator (64-byte aligned).

    safetensors hands out loaded tensors at arbitrary byte offsets of its read buffer, and CPU BLAS
    may round a product with an unaligned operand differently (one ulp, measured up to 4e-7 in the
    logits): a property of where the bytes sit, not of what was saved, which is compared bit for bit."""
    with torch.no_grad():
        for param in model.parameters():  # tied weights are one Parameter: copied once, still tied
            param.data = param.data.clone()
        for module in model.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[name] = buffer.clone()
    return model


@_budget(0.6)
@given(case=model_cases())
def test_save_and_load_give_identical_logits(case):
    """`save_pretrained` then `from_pretrained`: the same tensors (names, dtypes, bits, ties) and the
    same logits, bit for bit."""
    config, seed, ids = case
    _describe(config)
    model = _model(config, seed)
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        loaded = ModularDecoderForCausalLM.from_pretrained(folder, attn_implementation="eager")
    saved, restored = model.state_dict(), loaded.state_dict()
    assert sorted(saved) == sorted(restored)
    for name, tensor in saved.items():
        assert restored[name].dtype == tensor.dtype and torch.equal(restored[name], tensor), name
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == config.tie_word_embeddings
    assert torch.equal(_logits(_torch_allocated(loaded).eval(), ids), _logits(model, ids))


# ---------------------------------------------------------------------------------------------
# invalid configs


@_budget(8)
@given(case=broken_config_kwargs())
def test_invalid_config_raises_value_error_naming_the_field(case):
    """One broken field (wrong type, not finite, out of range, unknown choice, a field of another
    kind, an incomplete rope dict, ...) is a `ValueError` whose message names it: never another
    exception, never accepted."""
    kwargs, field = case
    with pytest.raises(ValueError) as error:
        make_config(kwargs)
    assert field in str(error.value), f"{field!r} not named in: {error.value}"


class SubclassedConfig(ModularDecoderConfig):
    """A user's subclass declaring nothing: it inherits the fields, and must inherit their checks."""


@pytest.mark.parametrize("config_class", [ModularDecoderConfig, SubclassedConfig], ids=["class", "subclass"])
@pytest.mark.parametrize("value", ["16", 4.5, True])
@pytest.mark.parametrize("field", ModularDecoderConfig.integer_fields())
def test_a_non_integer_size_is_refused_under_its_own_name(field, value, config_class):
    """Types are checked before any rule derives one field from another: MLA's `head_dim` is computed
    from `kv_lora_rank`, which once turned `kv_lora_rank="16"` into a TypeError and 4.5 into an error
    naming `head_dim`; a subclass read only its own (empty) annotations and lost every check."""
    assert config_class.integer_fields() == ModularDecoderConfig.integer_fields()
    with pytest.raises(ValueError, match=f"^`{field}` must be an integer, got {value!r}"):
        config_class(**{**MLA_MOE, field: value})


# MLA and routed experts: the kinds that derive sizes from the most fields
MLA_MOE = dict(vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=32,
               attention_type="mla", kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5,
               mlp_type="moe", num_experts=4, num_experts_per_tok=2)


# ---------------------------------------------------------------------------------------------
# sinusoidal positions, ALiBi slopes, MLA's absorbed sliding window


@pytest.mark.parametrize("hidden", [2, 7, 8, 16, 33, 48])
def test_sinusoidal_positions_match_the_closed_form(hidden):
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d)), computed here in
    float64, is what the model adds to the token embeddings (seen at the first block's input).

    Tolerance: the model forms the angle pos·inv_freq in fp32, so each angle carries a rounding error
    of a few ulps of pos (< 64·2^-22 ≈ 1.5e-5 for positions below 64); sin/cos pass it on unchanged."""
    positions = torch.arange(64)
    expected = torch.zeros(64, hidden, dtype=torch.float64)
    for pos in range(64):
        for feature in range(hidden):
            angle = pos / 10000 ** (2 * (feature // 2) / hidden)
            expected[pos, feature] = math.sin(angle) if feature % 2 == 0 else math.cos(angle)
    config = ModularDecoderConfig(vocab_size=16, hidden_size=hidden, num_attention_heads=1, num_hidden_layers=1,
                                  intermediate_size=4, max_position_embeddings=64,
                                  position_embedding_type="sinusoidal")
    model = ModularDecoderForCausalLM(config).eval()
    seen = {}
    model.model.layers[0].register_forward_pre_hook(lambda module, args: seen.setdefault("input", args[0]))
    with torch.no_grad():
        model(inputs_embeds=torch.zeros(1, 64, hidden), position_ids=positions[None], use_cache=False)
    torch.testing.assert_close(seen["input"][0].double(), expected, rtol=0, atol=64 * 2**-22)


@pytest.mark.parametrize("heads", [1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 80])
def test_alibi_slopes_match_bloom(heads):
    """The model's ALiBi slopes and bias against BLOOM's `build_alibi_tensor`, also for head counts
    that are not powers of two (the interleaved extension).

    Tolerance: BLOOM raises an fp32 base to integer powers up to k (the largest power of two <= H),
    so its slope h carries a relative error up to about k·2^-24 from the base's rounding; ours are
    computed in float64 and rounded once."""
    reference = build_alibi_tensor(torch.ones(1, 2, dtype=torch.long), heads, torch.float32)[:, 0, 1]  # slope·1
    closest = 2 ** math.floor(math.log2(heads))
    rtol = 2 * closest * 2**-24
    torch.testing.assert_close(alibi_slopes(heads), reference, rtol=rtol, atol=0)
    config = ModularDecoderConfig(vocab_size=16, hidden_size=heads, num_attention_heads=heads, num_hidden_layers=1,
                                  intermediate_size=4, position_embedding_type="alibi")
    alibi = ModularDecoderForCausalLM(config).model.alibi
    torch.testing.assert_close(alibi.slopes, reference, rtol=rtol, atol=0)
    # BLOOM adds slope·j to the scores of key j; ours, -slope·(i - j): the same up to slope·i per query
    # row, which softmax ignores. Over the causal (j <= i) part of a 7-token square:
    seq = 7
    bloom = build_alibi_tensor(torch.ones(1, seq, dtype=torch.long), heads, torch.float32)[:, 0]  # (H, T_k)
    ours = alibi(seq, seq, torch.float32)[0]  # (H, T_q, T_k)
    rows = torch.arange(seq, dtype=torch.float32)[None, :, None] * alibi.slopes[:, None, None]
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    expected = bloom[:, None, :].expand(-1, seq, -1)
    torch.testing.assert_close((ours + rows)[:, causal], expected[:, causal], rtol=rtol, atol=1e-6)


MLA = dict(vocab_size=61, hidden_size=32, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4,
           max_position_embeddings=32, attention_type="mla", kv_lora_rank=12, qk_nope_head_dim=6,
           qk_rope_head_dim=4, v_head_dim=5, layer_types=["sliding_attention", "full_attention", "sliding_attention"])


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("window", [2, 3, 5])
@pytest.mark.parametrize("q_lora_rank", [None, 8])
def test_mla_absorbed_sliding_window_matches_eager(window, backend, q_lora_rank):
    """MLA with sliding layers: the absorbed path (scores against the latents, its own mask from
    `eager_attention.explicit_mask`) decoding through the latent cache, token by token and in chunks longer
    than the window, and over a left-padded batch without a cache, equals the eager expanded forward."""
    config = ModularDecoderConfig(**MLA, sliding_window=window, q_lora_rank=q_lora_rank)
    reference = _model(config, seed=0)
    set_decode_mode(reference, "expanded")
    model = _model(config, seed=0, backend=backend)
    set_decode_mode(model, "absorbed")
    ids = torch.randint(0, config.vocab_size, (2, 14), generator=torch.Generator().manual_seed(window))
    full = _logits(reference, ids)

    expansions = []
    for module in model.modules():
        if isinstance(module, MultiHeadLatentAttention):
            # counted on `expand_kv`, not by a hook on `kv_b_proj`: a hooked projection is no longer plain,
            # which moves decoding to the expanded path that calls it
            module.expand_kv = lambda *args, _expand=module.expand_kv: expansions.append(1) or _expand(*args)
    cache, start = ModularDecoderCache(config), 0
    with torch.no_grad():
        for size in (3, 1, 1, window + 1, 1, 2, 14 - 9 - window):
            if size <= 0:
                continue
            step = model(ids[:, start:start + size], cache=cache, use_cache=True).logits
            torch.testing.assert_close(step, full[:, start:start + size], rtol=0, atol=ATOL)
            start += size
    assert start == 14 and expansions == []  # every step scored against the latents

    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    padded = _logits(reference, ids, attention_mask=mask)
    absorbed = _logits(model, ids, attention_mask=mask)
    torch.testing.assert_close(absorbed[0], padded[0], rtol=0, atol=ATOL)
    torch.testing.assert_close(absorbed[1, 4:], padded[1, 4:], rtol=0, atol=ATOL)
    torch.testing.assert_close(absorbed[1, 4:], _logits(reference, ids[1:, 4:])[0], rtol=0, atol=ATOL)


# ---------------------------------------------------------------------------------------------
# regressions: bugs the properties found


def test_mla_with_an_odd_head_dim_is_valid():
    """MLA rotates `qk_rope_head_dim`; its (unused) `head_dim` = hidden / heads may be odd. transformers'
    rope validation read `head_dim` as the rotated width and refused the config, at construction and
    again in `save_pretrained`."""
    config = ModularDecoderConfig(**{**MLA, "hidden_size": 15, "num_attention_heads": 3, "layer_types": None,
                                     "head_dim": 5})
    assert config.head_dim == 5 and config.rotary_dim == 4
    model = _model(config, seed=0)
    ids = torch.tensor([[1, 2, 3]])
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        loaded = ModularDecoderForCausalLM.from_pretrained(folder, attn_implementation="eager")
    assert torch.equal(_logits(loaded, ids), _logits(model, ids))


_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


@pytest.mark.parametrize("rope_parameters", [
    "default", [1.0], 10000.0,
    {"full_attention": "default"},
    {"full_attention": dict(_ROPE), "sliding_attention": 10000.0},
    # a table for a layer type no layer has is validated too (here: linear without its factor)
    {"full_attention": dict(_ROPE), "sliding_attention": {"rope_type": "linear", "rope_theta": 10000.0}},
], ids=["str", "list", "float", "nested_str", "nested_float", "unused_table_incomplete"])
def test_malformed_rope_parameters_raise_value_error(rope_parameters):
    """Not a dict (or a nested entry not a dict) failed inside transformers' standardisation with an
    AttributeError / TypeError; an unused nested table skipped transformers' key check."""
    with pytest.raises(ValueError, match="rope_parameters"):
        ModularDecoderConfig(vocab_size=16, hidden_size=8, num_attention_heads=2, num_hidden_layers=1,
                             rope_parameters=rope_parameters)


@pytest.mark.parametrize("layer_types, rope_parameters", [
    (["full_attention"] * 2, {"full_attention": {"rope_type": "default", "rope_theta": 500.0}}),
    (["sliding_attention"] * 2, {"full_attention": {"rope_type": "default", "rope_theta": 500.0},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": 20.0}}),
    (["sliding_attention", "full_attention"], {"full_attention": {"rope_type": "default", "rope_theta": 500.0},
                                               "sliding_attention": {"rope_type": "default", "rope_theta": 20.0}}),
], ids=["full_table_only", "table_no_layer_has", "both_used"])
def test_rope_tables_nested_by_layer_type_build_save_and_load(tmp_path, layer_types, rope_parameters):
    """A dict nested by layer type holding only the types the layers have, or a table no layer has: 5.16-5.17
    read a table for every type (a KeyError for `full_attention` alone) and validated a dict whose keys were
    not all among `layer_types` as one flat dict, writing a `rope_type` beside the nested ones (then the
    config failed its own check on a copy, `from_pretrained` among them). The tables are the closed form,
    and a save / load keeps the dict and the logits."""
    config = ModularDecoderConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_attention_heads=2,
                                  num_hidden_layers=2, layer_types=layer_types, sliding_window=2,
                                  rope_parameters={key: dict(value) for key, value in rope_parameters.items()})
    assert set(config.rope_parameters) == set(rope_parameters)
    for key, given in rope_parameters.items():
        assert config.rope_parameters[key]["rope_theta"] == given["rope_theta"]
    assert ModularDecoderConfig(**config.to_dict()).rope_parameters == config.rope_parameters
    model = _model(config, seed=0)
    for layer_type in set(layer_types):
        theta, width = rope_parameters[layer_type]["rope_theta"], config.head_dim
        closed_form = 1.0 / theta ** (torch.arange(0, width, 2, dtype=torch.float64) / width)
        table = getattr(model.model.rotary_emb, f"{layer_type}_inv_freq")
        torch.testing.assert_close(table.double(), closed_form, rtol=1e-6, atol=0)
    model.save_pretrained(tmp_path)
    loaded = ModularDecoderForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert loaded.config.rope_parameters == config.rope_parameters
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    assert torch.equal(_logits(loaded, ids), _logits(model, ids))


@pytest.mark.parametrize("attention", [{}, {k: MLA[k] for k in ("attention_type", "kv_lora_rank", "qk_nope_head_dim",
                                                                  "qk_rope_head_dim", "v_head_dim")}],
                         ids=["standard", "mla"])
def test_float64_left_padding_gives_no_nan(attention):
    """A float64 model on eager: the softmax ran in fp32, where the mask fill finfo(float64).min is
    -inf, so a padding query (no key to see) became NaN and reached the real tokens through its values."""
    config = ModularDecoderConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=2,
                                  num_attention_heads=2, **attention)
    model = _model(config, seed=0, dtype=torch.float64)
    ids, mask = torch.tensor([[1, 2, 3], [0, 4, 5]]), torch.tensor([[1, 1, 1], [0, 1, 1]])
    together = _logits(model, ids, attention_mask=mask)
    assert torch.isfinite(together[1, 1:]).all()
    torch.testing.assert_close(together[1, 1:], _logits(model, ids[1:, 1:])[0], rtol=0, atol=1e-12)


@pytest.mark.parametrize("hidden_act", ["xielu", "prelu"])
def test_activation_parameters_follow_the_model_dtype(hidden_act):
    """transformers' xIELU creates its parameters in bfloat16: an fp32 model computed them in bf16 and
    a save / load rounded fp32 values to bf16 (different logits after the round trip)."""
    config = ModularDecoderConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                  num_attention_heads=2, mlp_type="dense", hidden_act=hidden_act)
    model = _model(config, seed=0)
    act = model.model.layers[0].mlp.act_fn
    assert all(t.dtype == torch.float32 for t in [*act.parameters(), *act.buffers()])
    with torch.no_grad():
        for param in act.parameters():
            param.add_(1e-4)  # not a bfloat16 value
    ids = torch.tensor([[1, 2, 3, 4]])
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        loaded = ModularDecoderForCausalLM.from_pretrained(folder, attn_implementation="eager")
    assert torch.equal(_logits(loaded, ids), _logits(model, ids))
