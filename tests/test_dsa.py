"""DeepSeek Sparse Attention (`attention_type="dsa"`): parity with transformers' `DeepseekV32ForCausalLM` through the
conversion package (logits on every backend, greedy tokens through each side's cache, a left-padded batch, chunked
prefill against the cache, beams and prompt lookup, the export round trip), cached decoding against the uncached
forward on every path (gathered, masked, expanded in blocks; dynamic and static caches; LoRA and a hook), the
indexer cache's bytes, and the config's refusals."""

from __future__ import annotations

import pytest
import torch
from decoding import right_padded, steps_against_full
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from transformers import DeepseekV32Config, DeepseekV32ForCausalLM
from transformers.cache_utils import DynamicIndexedLayer, StaticIndexedLayer

import modular_decoder.lightning_indexer as lightning_indexer
import modular_decoder.sparse_attention as sparse_attention
from modular_decoder import ModularDecoderConfig, ModularDecoderForCausalLM, parameter_count, preset_config
from modular_decoder.cache import ModularDecoderCache
from modular_decoder.contract import cache_bytes, cache_bytes_per_token
from modular_decoder.conversion import convert, export
from modular_decoder.mla import ABSORBED_MAX_NEW_TOKENS, ABSORBED_QUERY_BLOCK, MultiHeadLatentAttention, set_decode_mode
from modular_decoder.sparse_attention import SparseLatentAttention

TOP_K = 5
# DeepSeek-V3.2 scaled down: MLA with a query latent, 8 indexer heads keeping 5 keys, YaRN, a dense first layer
# and routed experts after it
V32 = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
           num_key_value_heads=4, max_position_embeddings=64, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
           v_head_dim=6, q_lora_rank=12, index_n_heads=8, index_head_dim=8, index_topk=TOP_K,
           first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
           moe_intermediate_size=12, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                      "original_max_position_embeddings": 16, "beta_fast": 32,
                                                      "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8})
OURS = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=96, attention_type="dsa", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
            v_head_dim=6, q_lora_rank=12, index_n_heads=8, index_head_dim=8, index_topk=TOP_K, rope_interleaved=True)
BACKENDS = ["eager", "sdpa", "flex_attention"]

pytestmark = pytest.mark.usefixtures("uncompiled_flex")  # conftest: why flex runs uncompiled on this CPU


def _scramble(model):
    """Weights large enough that attention is far from uniform and every norm moves its input."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
            elif param.dim() >= 2:
                param.copy_(torch.randn_like(param) * (0.3 if "embed" in name else param.shape[-1] ** -0.5))
            else:
                param.copy_(0.1 * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if "e_score_correction_bias" in name:
                buffer.normal_(0.0, 0.1)
    return model.eval()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """transformers' DeepSeek-V3.2 (scrambled, saved) and the folder `convert` makes of it."""
    path = tmp_path_factory.mktemp("v32")
    torch.manual_seed(0)
    ref = _scramble(DeepseekV32ForCausalLM(DeepseekV32Config(**V32)))
    ref.save_pretrained(path / "src")
    convert(path / "src", path / "ours", progress=False)
    return ref, path


def _ours(path, backend="sdpa"):
    return ModularDecoderForCausalLM.from_pretrained(path / "ours", attn_implementation=backend).eval()


@pytest.fixture
def no_boundary_ties(monkeypatch):
    """Fails the test if any query's k-th and (k+1)-th visible scores are equal: there `torch.topk` (transformers)
    and `top_k_earliest` (ours) may choose different keys, and the comparison would mean nothing."""
    choose = lightning_indexer.top_k_earliest

    def checked(scores, k):
        if k < scores.shape[-1]:
            top = scores.topk(k + 1, dim=-1).values
            tied = (top[..., k - 1] == top[..., k]) & torch.isfinite(top[..., k]) & (top[..., k] > -1e30)
            assert not tied.any(), "a tie at the k-th place: the test's scores do not pin one choice"
        return choose(scores, k)

    monkeypatch.setattr(lightning_indexer, "top_k_earliest", checked)


def _ids(batch, length, seed=3):
    return torch.randint(0, 97, (batch, length), generator=torch.Generator().manual_seed(seed))


# --- parity with transformers' DeepseekV32ForCausalLM ----------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_logits_and_left_padded_batch_match_deepseek_v32(pair, backend, no_boundary_ties):
    ref, path = pair
    ours = _ours(path, backend)
    assert ours.config.attention_type == "dsa" and ours.config.index_topk == TOP_K
    ids = _ids(2, 24)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    with torch.no_grad():
        expected, got = ref(ids).logits, ours(ids).logits
        padded, ours_padded = ref(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits
    assert expected.abs().max() > 1.0
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
    torch.testing.assert_close(ours_padded[0], padded[0], rtol=0, atol=1e-4)
    torch.testing.assert_close(ours_padded[1, 5:], padded[1, 5:], rtol=0, atol=1e-4)


def test_the_selection_changes_the_logits(pair):
    """The parity above is not that of dense MLA: the same weights attending to every key differ."""
    ref, path = pair
    ours, dense = _ours(path), _ours(path)
    for module in dense.modules():
        if isinstance(module, SparseLatentAttention):
            module.indexer.top_k = 10_000
    ids = _ids(1, 24)
    with torch.no_grad():
        assert (ours(ids).logits - dense(ids).logits).abs().max() > 0.1


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_tokens_through_each_sides_cache_match(pair, backend, no_boundary_ties):
    """A batch whose second row is left-padded, generated greedily by each side through its own cache."""
    ref, path = pair
    ours = _ours(path, backend)
    prompt = _ids(2, 7, seed=4)
    mask = torch.ones_like(prompt)
    prompt[1, :3], mask[1, :3] = 0, 0
    kwargs = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, attention_mask=mask)
    with torch.no_grad():
        assert torch.equal(ours.generate(prompt, **kwargs), ref.generate(prompt, **kwargs))


def test_prefill_chunked_prefill_and_decode_against_the_cache_match(pair, no_boundary_ties):
    """Steps of several lengths, each side through its own cache: a prefill shorter than `index_topk` (dense), a
    chunk that crosses it, decode steps, a second chunk."""
    ref, path = pair
    ours = _ours(path)
    ids = _ids(2, 26, seed=5)
    ref_cache, our_cache = None, None
    start = 0
    with torch.no_grad():
        for size in (4, 9, 1, 1, 7, 1, 3):
            chunk = ids[:, start : start + size]
            expected = ref(chunk, cache=ref_cache, use_cache=True)
            got = ours(chunk, cache=our_cache, use_cache=True)
            ref_cache, our_cache = expected.cache, got.cache
            torch.testing.assert_close(got.logits, expected.logits, rtol=0, atol=1e-4)
            start += size
    assert all(isinstance(layer, DynamicIndexedLayer) for layer in our_cache.layers)
    assert our_cache.layers[0].indexer_keys.shape == (2, 26, V32["index_head_dim"])


def test_beam_search_and_prompt_lookup_match_deepseek_v32(pair):
    """Beam reorder and batch repeat (beams), crop (prompt lookup) and the static cache, on the indexer cache too."""
    ref, path = pair
    ours = _ours(path)
    prompt = _ids(1, 6, seed=6)
    prompt = torch.cat([prompt, prompt[:, :4]], dim=1)  # repeated n-grams give prompt lookup candidates
    mask = torch.ones_like(prompt)
    with torch.no_grad():
        beams = dict(max_new_tokens=10, num_beams=3, num_return_sequences=2, do_sample=False, attention_mask=mask)
        assert torch.equal(ours.generate(prompt, **beams), ref.generate(prompt, **beams))
        greedy = dict(max_new_tokens=14, do_sample=False, attention_mask=mask)
        expected = ref.generate(prompt, **greedy)
        assert torch.equal(ours.generate(prompt, prompt_lookup_num_tokens=3, **greedy), expected)
        assert torch.equal(ours.generate(prompt, cache_implementation="static", **greedy), expected)


def test_export_round_trip_is_bit_for_bit_and_loads_in_the_source_class(pair, tmp_path):
    ref, path = pair
    export(path / "ours", tmp_path / "back", family="deepseek_v32", progress=False)
    before, after = load_file(path / "src" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(after) == sorted(before) and any(".indexer.weights_proj." in name for name in after)
    for name in before:
        assert torch.equal(after[name], before[name]), name
    back = DeepseekV32ForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32).eval()
    ids = _ids(1, 20)
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ref(ids).logits, rtol=0, atol=0)


def test_export_refuses_what_deepseek_v32_cannot_express(tmp_path):
    model = ModularDecoderForCausalLM(ModularDecoderConfig(**dict(OURS, rope_interleaved=False)))
    model.save_pretrained(tmp_path / "halves")
    with pytest.raises(ValueError, match="rope_interleaved"):
        export(tmp_path / "halves", tmp_path / "a", family="deepseek_v32", progress=False)
    mla = {k: v for k, v in OURS.items() if not k.startswith("index_")}
    ModularDecoderForCausalLM(ModularDecoderConfig(**dict(mla, attention_type="mla"))).save_pretrained(tmp_path / "mla")
    with pytest.raises(ValueError, match="attention_type='dsa'"):
        export(tmp_path / "mla", tmp_path / "b", family="deepseek_v32", progress=False)
    with pytest.raises(ValueError, match="attention_type='mla'"):
        export(tmp_path / "halves", tmp_path / "c", family="deepseek_v3", progress=False)
    assert not any((tmp_path / name).exists() for name in "abc")


# --- our model against itself: every path, cached and not ------------------------------------------------------

def _model(backend="sdpa", **overrides) -> ModularDecoderForCausalLM:
    torch.manual_seed(0)
    return _scramble(ModularDecoderForCausalLM._from_config(ModularDecoderConfig(**{**OURS, **overrides}),
                                                             attn_implementation=backend))


# A prefill shorter than `index_topk`, a long step (chunked prefill), an absorbed step of several query blocks, a
# few-token step, decode steps, a long step
CHUNKS = [3, ABSORBED_MAX_NEW_TOKENS + 2, 2 * ABSORBED_QUERY_BLOCK + 3, 2, 1, 1, ABSORBED_MAX_NEW_TOKENS + 1]
PATHS = {"gathered", "masked_absorbed", "expanded"}


STEP_CASES = [("eager", None, True), ("eager", "lora_kv_b", False), ("sdpa", None, False), ("sdpa", None, True),
              ("sdpa", "lora_kv_b", True), ("sdpa", "lora_indexer", True), ("sdpa", "hook", False),
              ("flex_attention", None, True)]


@pytest.mark.parametrize("backend, adapter, padded", STEP_CASES,
                         ids=[f"{b}-{a or 'plain'}-{'left_padded' if p else 'unpadded'}" for b, a, p in STEP_CASES])
def test_steps_against_a_cache_match_the_full_forward(backend, adapter, padded, monkeypatch):
    """Steps of every length against a growing cache give the no-cache forward's logits. A plain `kv_b_proj`
    takes the gathered decode path (eager: the masked one), a LoRA or a hook on it only the expanded path, which
    calls it (a decode step then up-projects only the chosen keys); a LoRA on the indexer's projections changes
    the choice on both sides alike."""
    length = sum(CHUNKS)
    model = _model(backend, max_position_embeddings=length)
    if adapter in ("lora_kv_b", "lora_indexer"):
        targets = ["kv_b_proj"] if adapter == "lora_kv_b" else ["wq_b", "wk", "weights_proj"]
        model = get_peft_model(model, LoraConfig(target_modules=targets, init_lora_weights=False)).eval()
    elif adapter == "hook":
        for module in model.modules():
            if isinstance(module, SparseLatentAttention):
                module.kv_b_proj.register_forward_hook(lambda mod, args, out: out * 1.5)
    paths = []
    for name, label in (("gathered_attention", "gathered"), ("absorbed_attention", "masked_absorbed"),
                        ("sparse_expanded", "expanded"), ("gathered_expanded", "gathered_expanded")):
        method = getattr(SparseLatentAttention, name)
        monkeypatch.setattr(SparseLatentAttention, name,
                            lambda self, *a, _m=method, _l=label: paths.append(_l) or _m(self, *a))
    ids = _ids(2, length, seed=7)
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :3] = 0
    cached, full = steps_against_full(model, ids, mask, CHUNKS)
    torch.testing.assert_close(cached[0], full[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(cached[1, 3:], full[1, 3:], rtol=0, atol=1e-5)
    if backend == "eager":  # the reference masks on every path
        assert set(paths) == ({"expanded"} if adapter in ("lora_kv_b", "hook") else {"expanded", "masked_absorbed"})
    elif adapter in ("lora_kv_b", "hook") or backend == "flex_attention":  # called kv_b_proj / flex's BlockMask:
        assert set(paths) == {"expanded", "gathered_expanded"}  # expanded, the chosen keys only at decode steps
    else:
        assert set(paths) == {"expanded", "gathered"}


@pytest.mark.parametrize("backend", ["sdpa", "flex_attention"])
def test_backends_match_eager(backend):
    """Whole sequences (left-padded batch included) through each backend equal the eager reference."""
    eager, other = _model("eager"), _model(backend)
    ids = _ids(2, 30)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    with torch.no_grad():
        for kwargs in ({}, {"attention_mask": mask}):
            expected, got = eager(ids, **kwargs).logits, other(ids, **kwargs).logits
            torch.testing.assert_close(got[0], expected[0], rtol=0, atol=1e-5)
            torch.testing.assert_close(got[1, 4:], expected[1, 4:], rtol=0, atol=1e-5)


@pytest.mark.parametrize("implementation", ["dynamic", "static"])
def test_dynamic_and_static_caches_decode_as_the_full_forward(implementation):
    model = _model()
    ids = _ids(2, 20)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        cache = ModularDecoderCache(model.config, implementation, max_cache_len=24)
        steps = [model(ids[:, :3], cache=cache).logits]
        for t in range(3, 20):
            steps.append(model(ids[:, t : t + 1], cache=cache).logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)
    expected = StaticIndexedLayer if implementation == "static" else DynamicIndexedLayer
    assert all(isinstance(layer, expected) for layer in cache.layers)


def test_bounded_blocks_give_the_same_logits(monkeypatch):
    """With budgets small enough that the indexer scores one query per pass and a long step attends in blocks of
    a few queries, the logits do not move; the indexer's per-pass scores stay within the budget."""
    model = _model()
    ids = _ids(2, 40)
    with torch.no_grad():
        expected = model(ids).logits
    heads, keys = OURS["index_n_heads"], 40
    monkeypatch.setattr(lightning_indexer, "INDEX_SCORE_BYTES", 4 * 2 * heads * keys)  # one query per pass
    monkeypatch.setattr(sparse_attention, "SELECTION_MASK_BYTES", 2 * 40 * 7)  # 7 queries per block
    shapes, matmul = [], torch.Tensor.__matmul__
    monkeypatch.setattr(torch.Tensor, "__matmul__",
                        lambda a, b: shapes.append(tuple(b.shape)) or matmul(a, b))
    blocks = []
    interface = sparse_attention.ALL_ATTENTION_FUNCTIONS.get_interface("sdpa", None)
    monkeypatch.setattr(sparse_attention.ALL_ATTENTION_FUNCTIONS, "get_interface", lambda name, default:
                        lambda m, q, *a, **k: blocks.append(q.shape[2]) or interface(m, q, *a, **k))
    with torch.no_grad():
        got = model(ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert blocks == [7] * 5 + [5] + [7] * 5 + [5]  # two layers


def test_decode_step_scores_only_the_chosen_keys(monkeypatch):
    """A decode step against a long cache scores each query's k chosen latents, (B·t, k, d_c): never all the
    cached ones, and never runs `kv_b_proj` on the cache."""
    model = _model()
    ids = _ids(1, 40)
    keys = []
    monkeypatch.setattr(sparse_attention.MultiHeadLatentAttention, "_latent_probs",
                        lambda self, q, q_rot, latents, *a, _f=MultiHeadLatentAttention._latent_probs:
                        keys.append(tuple(latents.shape)) or _f(self, q, q_rot, latents, *a))
    kv_b = {id(m.kv_b_proj) for m in model.modules() if isinstance(m, SparseLatentAttention)}
    calls, forward = [], torch.nn.Linear.forward
    monkeypatch.setattr(torch.nn.Linear, "forward", lambda self, x: calls.append(id(self)) or forward(self, x))
    with torch.no_grad():
        cache = model(ids[:, :39]).cache
        keys.clear(), calls.clear()
        step = model(ids[:, 39:], cache=cache).logits
        assert keys == [(1, TOP_K, OURS["kv_lora_rank"])] * 2 and not kv_b & set(calls)
        torch.testing.assert_close(step[:, -1], model(ids).logits[:, -1], rtol=0, atol=1e-5)


def test_decode_under_an_adapter_up_projects_only_the_chosen_keys():
    """With a LoRA on `kv_b_proj` (which must be called, not read), a decode step calls it on each query's k
    chosen latents, not on the whole cache, and gives the no-cache forward's logits."""
    model = get_peft_model(_model(), LoraConfig(target_modules=["kv_b_proj"], init_lora_weights=False)).eval()
    rows = []
    for module in model.modules():
        if isinstance(module, SparseLatentAttention):
            module.kv_b_proj.register_forward_pre_hook(lambda mod, args: rows.append(tuple(args[0].shape)))
    ids = _ids(1, 40)
    with torch.no_grad():
        cache = model(input_ids=ids[:, :39]).cache
        rows.clear()
        step = model(input_ids=ids[:, 39:], cache=cache).logits
        assert rows == [(1, TOP_K, OURS["kv_lora_rank"])] * OURS["num_hidden_layers"]
        torch.testing.assert_close(step[:, -1], model(input_ids=ids).logits[:, -1], rtol=0, atol=1e-5)


def test_a_short_context_is_dense_mla(monkeypatch):
    """While a query sees at most `index_topk` keys, DSA is MLA with the same weights and the indexer only
    caches its keys (never scores)."""
    dsa = _model(index_topk=16)
    mla_config = {k: v for k, v in OURS.items() if not k.startswith("index_")}
    mla = ModularDecoderForCausalLM(ModularDecoderConfig(**dict(mla_config, attention_type="mla")))
    mla.load_state_dict({k: v for k, v in dsa.state_dict().items() if ".indexer." not in k})
    scored = []
    monkeypatch.setattr(lightning_indexer.LightningIndexer, "select", lambda *a: scored.append(1))
    ids = _ids(2, 16)
    with torch.no_grad():
        torch.testing.assert_close(dsa(ids).logits, mla.eval()(ids).logits, rtol=0, atol=1e-6)
    assert not scored


def test_earliest_key_wins_a_tie():
    """Equal scores at the k-th place are taken earliest first, whatever follows the row (a decode step and the
    prefill it continues choose alike), and without a tie the choice is `topk`'s."""
    scores = torch.tensor([[0.0, 3.0, 0.0, 0.0, 2.0, 0.0]])
    assert lightning_indexer.top_k_earliest(scores, 3).sort().values.tolist() == [[0, 1, 4]]
    longer = torch.cat([scores, torch.full((1, 50), float("-inf"))], dim=1)
    assert lightning_indexer.top_k_earliest(longer, 3).sort().values.tolist() == [[0, 1, 4]]
    distinct = torch.randn(4, 30)
    assert torch.equal(lightning_indexer.top_k_earliest(distinct, 7).sort().values,
                       distinct.topk(7).indices.sort().values)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_a_query_scoring_every_key_zero_decodes_as_the_full_forward(backend, monkeypatch):
    """A token whose embedding is all zero (a zeroed pad row) has an all-zero indexer query in the first layer: it
    scores every key 0, a tie among all of them. Earliest keys win, so each decode step keeps the keys the uncached
    forward keeps; `torch.topk` (transformers' choice) picks other keys for the decode step's row than for the same
    row with the later keys masked, and the logits part."""
    model = _model(backend, max_position_embeddings=32)
    zero = 96
    with torch.no_grad():
        model.model.embed_tokens.weight[zero] = 0
    ids = _ids(1, 14, seed=5)
    ids[0, [9, 11, 13]] = zero  # decode steps, each with more than `index_topk` keys before it
    chunks = [8, 1, 1, 1, 1, 1, 1]
    with torch.no_grad():
        cached, full = steps_against_full(model, ids, torch.ones_like(ids), chunks)
        torch.testing.assert_close(cached, full, rtol=0, atol=1e-5)
        monkeypatch.setattr(lightning_indexer, "top_k_earliest", lambda scores, k: scores.topk(k, dim=-1).indices)
        cached, full = steps_against_full(model, ids, torch.ones_like(ids), chunks)
    assert (cached - full).abs().amax() > 1e-2


# --- cache, contract and refusals ------------------------------------------------------------------------------

@pytest.mark.parametrize("implementation", ["dynamic", "static"])
def test_cache_bytes_count_the_indexer_keys(implementation):
    config = ModularDecoderConfig(**OURS)
    per_layer = (OURS["kv_lora_rank"] + OURS["qk_rope_head_dim"] + OURS["index_head_dim"]) * 4
    assert cache_bytes_per_token(config, torch.float32) == OURS["num_hidden_layers"] * per_layer
    model = _model()
    batch, tokens = 3, 11
    cache = ModularDecoderCache(config, implementation, max_cache_len=32)
    with torch.no_grad():
        model(_ids(batch, tokens), cache=cache)
    assert cache.payload_bytes() == cache_bytes(config, tokens, batch, torch.float32) == batch * tokens * (
        OURS["num_hidden_layers"] * per_layer)
    assert cache.allocated_bytes() >= cache.payload_bytes()


def test_dynamic_indexer_cache_grows_in_place_and_resets():
    model = _model()
    ids = _ids(1, 12)
    with torch.no_grad():
        cache = model(ids[:, :6]).cache
        layer = cache.layers[0]
        storage = layer.indexer_keys.data_ptr()
        model(ids[:, 6:7], cache=cache)
        assert layer.indexer_keys.data_ptr() == storage and layer.indexer_keys.shape[1] == 7
        cache.reset()
        assert layer.get_seq_length() == 0 and layer.indexer_keys is None
        again = model(ids[:, :6], cache=cache).logits
        torch.testing.assert_close(again, model(ids[:, :6]).logits, rtol=0, atol=0)
        assert layer.indexer_keys.shape[1] == 6


def test_parameter_count_matches_the_formula():
    config = ModularDecoderConfig(**OURS)
    assert ModularDecoderForCausalLM(config).num_parameters() == parameter_count(config)["total"]
    full = preset_config("deepseek_v32")
    mla = full.to_dict()
    assert parameter_count(full)["total"] - parameter_count(preset_config("deepseek_v3"))["total"] == 61 * (
        1536 * 64 * 128 + 7168 * 128 + 2 * 128 + 7168 * 64)
    assert mla["index_topk"] == 2048


@pytest.mark.parametrize("overrides, field", [
    (dict(index_topk=None), "index_topk"),
    (dict(index_topk=0), "index_topk"),
    (dict(index_n_heads=None), "index_n_heads"),
    (dict(index_head_dim="8"), "index_head_dim"),
    (dict(index_head_dim=2), "index_head_dim"),
    (dict(q_lora_rank=None), "q_lora_rank"),
    (dict(sliding_window=4, layer_types=["sliding_attention", "full_attention"]), "sliding_window"),
    (dict(position_embedding_type="alibi"), "position_embedding_type"),
    (dict(attention_type="mla"), "index_n_heads"),
])
def test_bad_combinations_raise(overrides, field):
    with pytest.raises(ValueError, match=field):
        ModularDecoderConfig(**{**OURS, **overrides})


@pytest.mark.parametrize("backend", ["flash_attention_2", "flash_attention_3"])
def test_backends_without_a_mask_are_refused_by_name(backend):
    with pytest.raises(ValueError, match="index_topk"):
        ModularDecoderForCausalLM._from_config(ModularDecoderConfig(**OURS), attn_implementation=backend)


def test_vllm_is_refused_by_name():
    from modular_decoder.backend_features import check_backend

    with pytest.raises(ValueError, match="vLLM.*index_topk"):
        check_backend(ModularDecoderConfig(**OURS), "vllm")


def test_fp16_keeps_the_indexer_weights_in_fp32(tmp_path):
    _model().save_pretrained(tmp_path)
    half = ModularDecoderForCausalLM.from_pretrained(tmp_path, dtype=torch.float16)
    bf16 = ModularDecoderForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    indexer = half.model.layers[0].self_attn.indexer
    assert indexer.weights_proj.weight.dtype == torch.float32 and indexer.wk.weight.dtype == torch.float16
    assert bf16.model.layers[0].self_attn.indexer.weights_proj.weight.dtype == torch.bfloat16  # as transformers
    with torch.no_grad():
        assert torch.isfinite(half(_ids(1, 12)).logits).all()


def test_set_decode_mode_reaches_dsa_layers():
    model = _model()
    set_decode_mode(model, "expanded")
    assert {m.decode_mode for m in model.modules() if isinstance(m, SparseLatentAttention)} == {"expanded"}


# --- training ----------------------------------------------------------------------------------------------------

def _documents(n=12, seed=0):
    lengths = torch.randint(6, 14, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    return [{"input_ids": _ids(1, length, seed=seed + i)[0].tolist()} for i, length in enumerate(lengths)]


@pytest.mark.parametrize("batches", ["padded", "packed"])
def test_trainer_trains_on_padded_and_packed_batches(batches, tmp_path):
    """Both batch layouts train (documents longer than `index_topk`: the selection is in play); the indexer
    gets no gradient from the loss, as in transformers, and its weights do not move."""
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    model = _model()
    model.train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    collator = right_padded if batches == "padded" else DataCollatorWithFlattening(return_position_ids=True)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, learning_rate=1e-2,
                             use_cpu=True, report_to=[], save_strategy="no", remove_unused_columns=False)
    result = Trainer(model=model, args=args, train_dataset=_documents(), data_collator=collator).train()
    assert torch.isfinite(torch.tensor(result.training_loss))
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert moved and not any(".indexer." in n for n in moved) and any("kv_b_proj" in n for n in moved)


def test_packed_documents_equal_each_alone():
    """A packed row's mask keeps each query's choice inside its own document."""
    from transformers import DataCollatorWithFlattening

    model = _model()
    docs = [d["input_ids"] for d in _documents(3, seed=9)]
    batch = DataCollatorWithFlattening(return_position_ids=True)([{"input_ids": d} for d in docs])
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
        start = 0
        for doc in docs:
            alone = model(input_ids=torch.tensor([doc])).logits[0]
            torch.testing.assert_close(packed[start : start + len(doc)], alone, rtol=0, atol=1e-5)
            start += len(doc)


@pytest.mark.parametrize("backend", ["sdpa", "flex_attention"])
def test_attention_sinks_compose_with_the_selection(backend):
    """gpt-oss's sinks on a DSA layer: the sink joins the softmax over the chosen keys, on every path and backend,
    equal to eager and, through the cache, to the uncached forward."""
    eager, other = _model("eager", attention_sinks=True), _model(backend, attention_sinks=True)
    for model in (eager, other):
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, SparseLatentAttention):
                    module.sinks.copy_(torch.linspace(-1.0, 2.0, module.sinks.numel()))
    ids = _ids(2, 30)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    with torch.no_grad():
        expected = eager(ids, attention_mask=mask).logits
        got = other(ids, attention_mask=mask).logits
        without = _model("eager")(ids, attention_mask=mask).logits
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(got[1, 4:], expected[1, 4:], rtol=0, atol=1e-5)
    assert (expected - without).abs().max() > 1e-2
    cached, full = steps_against_full(other, ids, mask, [3, 9, 1, 1, 16])
    torch.testing.assert_close(cached[0], full[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(cached[1, 4:], full[1, 4:], rtol=0, atol=1e-5)


# --- reshape -----------------------------------------------------------------------------------------------------

def test_reshape_refuses_by_name_what_it_cannot_transform_and_drops_dsa_layers():
    """Pooling K/V heads and TransMLA convert standard attention: a DSA model is refused naming its kind. Dropping a
    block works as for any kind: the indexer and its cache go with the layer."""
    from modular_decoder.tools.reshape import check_options, reshape

    config = preset_config("deepseek_v32", tiny=True, num_hidden_layers=3,
                           mlp_layer_types=["dense", "sparse", "sparse"])
    for options in (dict(kv_heads=1), dict(attention="mla", kv_lora_rank=8)):
        with pytest.raises(ValueError, match="attention_type='dsa'"):
            check_options(config, **options)
    torch.manual_seed(0)
    model = ModularDecoderForCausalLM(config).eval()
    smaller = reshape(model, _ids(2, 16).remainder(config.vocab_size), drop_layers=1, progress=False)
    assert smaller.config.attention_type == "dsa" and smaller.config.num_hidden_layers == 2
    assert cache_bytes_per_token(smaller.config, torch.float32) == 2 * (32 + 8 + 16) * 4
    ids = _ids(1, 12).remainder(config.vocab_size)
    with torch.no_grad():
        cached, full = steps_against_full(smaller, ids, torch.ones_like(ids), [5, 1, 1, 5])
    torch.testing.assert_close(cached, full, rtol=0, atol=1e-5)


def test_a_multi_token_prediction_layer_config_json_does_not_declare_is_refused(pair, tmp_path):
    """The published checkpoints hold their MTP module as layer `num_hidden_layers` and declare it in config.json
    (`num_nextn_predict_layers`; it converts: tests/test_mtp_dsa.py); files holding one config.json does not declare
    are refused naming both, and nothing is written."""
    from safetensors.torch import save_file

    ref, path = pair
    state = load_file(path / "src" / "model.safetensors")
    mtp = f"model.layers.{V32['num_hidden_layers']}"
    state.update({f"{mtp}.eh_proj.weight": torch.zeros(32, 64), f"{mtp}.enorm.weight": torch.ones(32)})
    (tmp_path / "src").mkdir()
    save_file(state, str(tmp_path / "src" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "src" / "config.json").write_text((path / "src" / "config.json").read_text())
    with pytest.raises(ValueError, match=r"declares 0 multi-token-prediction module\(s\) and the files hold 1"):
        convert(tmp_path / "src", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_cli_convert_verify_and_export(pair, tmp_path, capsys):
    """What a user types: `convert --verify` prints the largest logit difference against transformers' class, and
    `export --family deepseek_v32` writes the source's tensors back."""
    from modular_decoder.commands import main

    ref, path = pair
    assert main(["convert", str(path / "src"), str(tmp_path / "md"), "--verify"]) == 0
    printed = capsys.readouterr().out
    assert float(printed.split("largest logit difference (source vs converted, fp32):")[1].split()[0]) <= 1e-4
    assert main(["export", str(tmp_path / "md"), str(tmp_path / "back"), "--family", "deepseek_v32"]) == 0
    before, after = load_file(path / "src" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(before) == sorted(after) and all(torch.equal(before[k], after[k]) for k in before)
    assert "index_topk" in (tmp_path / "md" / "README.md").read_text()  # the card names the fields


def test_compiled_static_decode_equals_dynamic_cache():
    """generate()'s compiled decode step (static cache, `fullgraph=True`; traced only, backend "eager", to keep it
    short) runs the indexer and the gathered path in one graph and gives the dynamic cache's tokens."""
    from decoding import greedy_no_cache, prompt, tiny_model

    from modular_decoder import compiled_decoding

    torch._dynamo.reset()
    model = tiny_model("deepseek_v32")
    ids = prompt(2, 6)
    dynamic = model.generate(ids, max_new_tokens=8, do_sample=False)
    config = compiled_decoding(mode="default", backend="eager", dynamic=False)["compile_config"]
    compiled = model.generate(ids, max_new_tokens=8, do_sample=False, cache_implementation="static",
                              compile_config=config)
    assert hasattr(model, "_compiled_call")  # generate() did take the compiled path
    assert torch.equal(compiled, dynamic) and torch.equal(dynamic, greedy_no_cache(model, ids, 8))


@pytest.mark.parametrize("layout", ["contiguous", "prefix_of_storage", "transposed"])
def test_gather_rows_equals_advanced_indexing(layout):
    """The row gather reads the cache's storage directly where its rows lie one after another (a growing layer's
    prefix view, a static layer), and falls back to advanced indexing elsewhere: the same rows either way."""
    from modular_decoder.sparse_attention import gather_rows

    store = torch.randn(3, 20, 6)
    cache = {"contiguous": store, "prefix_of_storage": store[:, :13],
             "transposed": torch.randn(3, 6, 13).transpose(1, 2)}[layout]
    indices = torch.randint(0, cache.shape[1], (3, 4, 5))
    expected = cache[torch.arange(3)[:, None, None], indices]
    assert torch.equal(gather_rows(cache, indices), expected)
