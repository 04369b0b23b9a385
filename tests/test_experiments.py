"""The seed experiments: gradient norms equal transformers' own GPT-1 / GPT-2 classes on the same
weights and batch; the 8d/3 rule agrees with the built modules and with published configs; the
ablation runs (smoke-sized only: the real run is a CLI command, see the README)."""

import pytest
import torch
import transformers

from modular_decoder import preset_config
from modular_decoder.commands import main
from modular_decoder.conversion import export
from modular_decoder.tools.experiments import ablation, ffn_budget, gradnorm
from modular_decoder.tools.experiments.gradnorm import Condition, decoder_model, layer_grad_norms

REFERENCES = {"post": ("openai-gpt", transformers.OpenAIGPTLMHeadModel),
              "pre": ("gpt2", transformers.GPT2LMHeadModel)}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("init", ["normal", "xavier"])
@pytest.mark.parametrize("layout", ["post", "pre"])
def test_gradient_norms_equal_transformers_reference(layout, init, tmp_path):
    """The experiment's model (GPT-1 / GPT-2 layout), exported with the conversion package and
    loaded into transformers' own class: the same per-layer FFN gradient norms on the same batch."""
    family, reference_class = REFERENCES[layout]
    model = decoder_model(Condition(layout, init, layers=3, hidden=64, seq=16))
    model.save_pretrained(tmp_path / "ours")
    export(tmp_path / "ours", tmp_path / "reference", family=family)
    reference = reference_class.from_pretrained(tmp_path / "reference").eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 16))

    reference(ids, labels=ids).loss.backward()
    for weight, name in (("up", "c_fc"), ("down", "c_proj")):
        ours = layer_grad_norms(model, ids, weight)
        theirs = [getattr(block.mlp, name).weight.grad.norm().item() for block in reference.transformer.h]
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-5, atol=0)
    assert len(set(round(n, 6) for n in ours)) == 3  # three distinct layers were measured


def test_measure_runs_every_kind_of_condition():
    for condition in (Condition("post", "xavier", "down", "decoder", layers=2, hidden=32, steps=2, warmup=2,
                                batch=2, seq=8),
                      Condition("pre", "normal", "up", "encdec", layers=2, hidden=32, steps=1, batch=2, seq=8),
                      Condition("post", "normal", "up", "decoder", layers=3, hidden=32, batch=2, seq=8,
                                data="random")):
        norms = gradnorm.measure(condition)
        assert len(norms) == condition.layers and all(n > 0 for n in norms)


def test_gradnorm_report_and_plot(tmp_path):
    rows = [{"condition": Condition(layout), "norms": norms, "ratio": gradnorm.ratio(norms)}
            for layout, norms in (("post", [0.05, 0.2, 1.25]), ("pre", [0.2, 0.2, 0.2]))]
    assert "| 25.00 |" in gradnorm.markdown(rows)
    gradnorm.plot(rows, tmp_path / "g.png")
    assert (tmp_path / "g.png").read_bytes()[:4] == b"\x89PNG"


def test_eight_thirds_rule_matches_published_configs_and_built_modules():
    text, ok = ffn_budget.table()
    assert ok, text
    # Llama 2 7B and SmolLM2-135M chose exactly the rounded 8d/3 width
    assert ffn_budget.gated_width(4096, multiple_of=256) == preset_config("llama").intermediate_size == 11008
    assert ffn_budget.gated_width(576, multiple_of=256) == preset_config("smollm2").intermediate_size == 1536
    built, formula = ffn_budget.built_parameters(768, 2048, "gated")
    assert built == formula == 8 * 768 * 768  # 8d/3 exactly integral: the budgets are equal


def test_ffn_budget_cli(capsys):
    assert main(["experiment", "ffn-budget"]) == 0
    assert "| 4096 | 16384 | 134,217,728 | 10922.67 | 11008 |" in capsys.readouterr().out


def test_ablation_smoke(tmp_path, capsys):
    """Two seeds per row (mean, min-max), a dense vs MoE pair, the plot, the JSON and the page (command, table,
    plot, how to read it)."""
    import json

    out = tmp_path / "out"
    variants = ["SwiGLU (8d/3)", "MQA (1 kv head)", "MoE 8 experts top-2, half width"]
    assert main(["experiment", "ablation", "--tokens", "1024", "--seeds", "2", "--out", str(out),
                 "--variants", *variants]) == 0
    table = (out / "ablation.md").read_text()
    assert table.startswith("# Ablation") and "experiment ablation --tokens 1024 --seeds 2 --variants" in table
    assert f"--out {out}" in table
    assert "![Training loss against tokens" in table and "(ablation.png)" in table
    assert "| MQA (1 kv head) |" in table and "| MoE 8 experts top-2, half width | 2,413,696 | 828,544 |" in table
    assert "2 seeds (0, 1)" in table and "min–max" in table
    assert (out / "ablation.png").read_bytes()[:4] == b"\x89PNG"
    written = json.loads((out / "ablation.json").read_text())
    results = written["results"]
    assert [r["name"] for r in results] == variants
    record = written["provenance"]
    assert record["command"] in table and record["versions"]["torch"] == torch.__version__
    assert f"at commit `{record['commit'][:10]}`" in table and record["machine"]["cpu_count"] >= 1
    for row in results:
        assert row["seeds"] == [0, 1] and len(row["runs"]) == 2
        for key in ("train_loss", "held_out_loss", "tokens_per_s"):
            stats = row[key]
            assert stats["min"] <= stats["mean"] <= stats["max"] and len(stats["all"]) == 2
            assert f"{row[key]['mean']:.3f} ({stats['min']:.3f}–{stats['max']:.3f})" in table or key == "tokens_per_s"
        assert row["runs"][0]["losses"] != row["runs"][1]["losses"]  # the seeds differ
        assert all(0 < loss < 10 for run in row["runs"] for loss in run["losses"])  # cross-entropy, not +router losses
    mha, mqa = ablation.config_for("pre-norm (base)"), ablation.config_for("MQA (1 kv head)")
    assert f"| {ablation.cache_bytes_per_token(mqa):,} |" in table
    assert ablation.cache_bytes_per_token(mha) == 4 * ablation.cache_bytes_per_token(mqa)  # H / H_kv


def test_ablation_moe_rows_match_the_dense_active_parameters():
    """Each MoE variant's active parameters per token are the dense SwiGLU variant's plus its router."""
    from modular_decoder import parameter_count

    dense = parameter_count(ablation.config_for(ablation.MOE_BASELINE))
    assert dense["active"] == dense["total"]
    for name in ("MoE 4 experts top-1", "MoE 8 experts top-2, half width"):
        config = ablation.config_for(name)
        counts = parameter_count(config)
        router = ablation.LAYERS * config.num_experts * ablation.D
        assert counts["active"] == dense["active"] + router
        assert config.num_experts_per_tok * config.moe_intermediate_size == ablation.GATED
        assert counts["total"] > 2.5 * dense["total"]
    assert "+0.25%" in ablation.moe_arithmetic(list(ablation.VARIANTS))


def test_ablation_summary_and_plot_of_given_runs(tmp_path):
    runs = [{"name": "MQA (1 kv head)", "seed": s, "params": 1, "active_params": 1, "cache_bytes_per_token": 512,
             "state_bytes_per_sequence": 0, "steps": 3, "train_loss": loss, "held_out_loss": loss + 0.1,
             "tokens_per_s": 100.0 * (s + 1),
             "losses": [3.0, 2.5, loss]} for s, loss in ((0, 2.0), (1, 2.4), (2, 2.2))]
    row = ablation.summarise(runs)
    assert row["train_loss"]["mean"] == pytest.approx(2.2) and row["train_loss"]["min"] == 2.0
    assert row["train_loss"]["std"] == pytest.approx(0.2) and row["seeds"] == [0, 1, 2]
    assert "2.200 (2.000–2.400)" in ablation.markdown([row], 3072)
    ablation.plot([row], tmp_path / "a.png")
    assert (tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="seeds"):
        ablation.seed_list(0)


def test_ablation_hybrid_axis(tmp_path):
    """A Gated DeltaNet 3:1 hybrid against the all-attention base: Qwen3-Next's layer pattern, nearly the base's
    parameters, the cache and state columns, and the seed-by-seed held-out difference computed from the runs."""
    import json

    hybrid = "Gated DeltaNet 3:1 hybrid"
    out = tmp_path / "out"
    assert main(["experiment", "ablation", "--tokens", "1024", "--seeds", "2", "--out", str(out),
                 "--variants", ablation.BASELINE, hybrid]) == 0
    table = (out / "ablation.md").read_text()
    base, row = json.loads((out / "ablation.json").read_text())["results"]
    config = ablation.config_for(hybrid)
    assert config.layer_types == transformers.Qwen3NextConfig(num_hidden_layers=ablation.LAYERS).layer_types
    control = ablation.config_for("Gated DeltaNet 3:1 hybrid, 1-tap conv")  # the same but the convolution
    assert control.layer_types == config.layer_types
    assert (control.linear_conv_kernel_dim, config.linear_conv_kernel_dim) == (1, 4)
    assert row["params"] == ablation.parameter_count(config)["total"]  # the built model vs the contract's count
    assert 0 < row["params"] - base["params"] < 0.01 * base["params"]
    assert f"| {hybrid} | {row['params']:,} |" in table
    assert f"| {ablation.cache_bytes_per_token(config):,} | {ablation.state_bytes_per_sequence(config):,} |" in table
    assert 4 * ablation.cache_bytes_per_token(config) == base["cache_bytes_per_token"]  # one attention layer of four
    assert f"| {base['cache_bytes_per_token']:,} | 0 |" in table
    diffs = [h["held_out_loss"] - b["held_out_loss"] for h, b in zip(row["runs"], base["runs"])]
    assert f"per seed {', '.join(f'{d:+.3f}' for d in diffs)}" in table
    assert "+0.76%" in table and f"train on {ablation.SEQ}-token sequences" in table


# per mixer layer, by hand: Mamba-2 in_proj 128·(2·128 + 2·64 + 4) + conv (4 taps + bias)·256 + A, D, dt_bias 3·4
# + norm 128 + out_proj 128²; KDA q, k, v, o 4·128·96 + conv 4·288 + f_a, g_a 2·128·32 + f_b, g_b 2·32·96 + b 128·3
# + A_log 3 + dt_bias 96 + norm 32; short convolution in_proj 3·128² + out_proj 128² + conv 4·128. The base: 820,352.
MIXER_LAYERS = {
    "Mamba-2 3:1 hybrid": ("mamba2", "3 Mamba-2 layers (4-tap convolution) of 67,468 parameters", "+0.71%"),
    "KDA 3:1 hybrid": ("kda", "3 KDA layers (4-tap convolution) of 65,155 parameters", "-0.14%"),
    "short-conv 3:1 hybrid": ("short_conv", "3 short-convolution layers (4-tap convolution) of 66,048 parameters",
                              "+0.19%")}


@pytest.mark.parametrize("name", list(MIXER_LAYERS))
def test_ablation_mixer_hybrids_match_the_base_parameters(name):
    """Each 3:1 hybrid of a newer mixer: the Gated DeltaNet hybrid's layer pattern with its own mixer, within 1% of the
    base's parameters (the built model's count equals the contract's, and each layer the count worked out by hand), a
    short run trains it, and the page names the mixer."""
    kind, layers, percent = MIXER_LAYERS[name]
    config, deltanet = ablation.config_for(name), ablation.config_for("Gated DeltaNet 3:1 hybrid")
    assert config.layer_types == deltanet.layer_types and config.linear_attention_type == kind
    base = ablation.parameter_count(ablation.config_for(ablation.BASELINE))["total"]
    row = ablation.train(name, tokens=1024, seed=0)
    assert row["params"] == ablation.parameter_count(config)["total"]
    assert abs(row["params"] - base) < 0.01 * base and row["held_out_loss"] == row["held_out_loss"]  # not NaN
    text = ablation.hybrid_arithmetic([name])
    assert layers in text and percent in text


STREAMS = {"hyper-connections (4 streams)": dict(residual_stream="hyper_connections", hc_mult=4),
           "per-layer embeddings (16 wide)": dict(residual_stream="single", hidden_size_per_layer_input=16),
           "AltUp (4 streams)": dict(residual_stream="altup", altup_num_inputs=4)}


@pytest.mark.parametrize("name", list(STREAMS))
def test_ablation_residual_streams_hold_the_base_parameters(name):
    """Each residual-stream variant is the base's pre-norm layout with its topology and an FFN whose width brings the
    total nearest the base's (one unit wider or narrower would be farther; the built model's count equals the
    contract's), and a short run trains it."""
    config = ablation.config_for(name)
    assert {field: getattr(config, field) for field in STREAMS[name]} == STREAMS[name]
    assert (config.norm_position, config.mlp_type) == ("pre", "dense")

    def total(width):
        overrides = {**ablation.BASE, **ablation.VARIANTS[name], "intermediate_size": width}
        return ablation.parameter_count(ablation.ModularDecoderConfig(**overrides))["total"]

    base = ablation.parameter_count(ablation.config_for(ablation.BASELINE))["total"]
    width = config.intermediate_size
    assert width < ablation.BASE["intermediate_size"] and total(width) == ablation.parameter_count(config)["total"]
    assert abs(total(width) - base) <= min(abs(total(width - 1) - base), abs(total(width + 1) - base))
    row = ablation.train(name, tokens=1024, seed=0)
    assert row["params"] == total(width) and row["held_out_loss"] == row["held_out_loss"]  # not NaN
    text = ablation.stream_arithmetic([name])
    assert f"{name}: adds " in text and f"512 → {width} wide" in text and f"{total(width):,} in all" in text
    control = ablation.config_for(ablation.NARROW_FFN_CONTROL)
    assert control.intermediate_size == ablation.config_for("hyper-connections (4 streams)").intermediate_size
    assert control.residual_stream == "single" and not control.hidden_size_per_layer_input


def test_hybrid_comparison_calls_a_changing_sign_noise():
    def rows(name, losses):
        return {"name": name, "runs": [{"seed": s, "held_out_loss": loss} for s, loss in enumerate(losses)]}

    base = rows(ablation.BASELINE, [2.0, 2.0, 2.0])
    text = ablation.paired_comparison([base, rows("Gated DeltaNet 1:1 hybrid", [1.9, 2.1, 1.95])])
    assert "-0.017 (per seed -0.100, +0.100, -0.050" in text and "lower in 2 of 3 seeds" in text and "noise" in text
    text = ablation.paired_comparison([base, rows("Gated DeltaNet 3:1 hybrid", [1.9, 1.8, 1.95])])
    assert "lower in every one of 3 seeds" in text
    assert ablation.paired_comparison([rows("Gated DeltaNet 3:1 hybrid", [1.9])]) == ""  # no base: nothing claimed
    text = ablation.paired_comparison([base, rows("AltUp (4 streams)", [2.1, 2.2, 2.05]),
                                       rows(ablation.NARROW_FFN_CONTROL, [2.0, 2.1, 2.0]),
                                       rows("SwiGLU (8d/3)", [1.0, 1.0, 1.0])])
    assert "AltUp (4 streams): +0.117" in text and "higher in every one of 3 seeds" in text
    assert f"{ablation.NARROW_FFN_CONTROL}: +0.033" in text and "SwiGLU" not in text  # only the paired rows


def test_swiglu_variant_is_parameter_matched():
    dense, gated = ablation.config_for("pre-norm (base)"), ablation.config_for("SwiGLU (8d/3)")
    ratio = 3 * gated.intermediate_size / (2 * dense.intermediate_size)
    assert abs(ratio - 1) < 0.02
