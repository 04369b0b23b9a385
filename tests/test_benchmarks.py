"""The benchmark suite runs end to end in quick mode (tiny shapes); speed is not asserted."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from benchmarks import run
from benchmarks.families import CONFIGS, MOE_FAMILIES


def test_suite_quick_writes_table_and_json(tmp_path, capsys):
    """Every family's speed rows (the extras are covered below, on one family, to keep this fast)."""
    out = tmp_path / "bench.json"
    assert run.main(["--smoke", "--no-memory", "--no-train", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert set(results["families"]) == set(CONFIGS)
    assert results["copy_bandwidth_gb_s"] > 0
    for name, family in results["families"].items():
        assert family["roofline_b1_tok_s"] > 0
        for key in run.ROWS:
            row = family["metrics"][key]
            models = run.PAIR if key == "step_turns_1" else run.timed_models()  # (steps in turn: the pair)
            assert set(row) - {"ratio"} == set(models)
            for model in models:
                assert len(row[model]["all"]) == 1
            if run.ROWS[key][1]:  # a rate: positive on both sides
                assert row["transformers"]["median"] > 0 and row["ours"]["median"] > 0
        assert not set(family["metrics"]) & (set(run.TRAIN_ROWS) | set(run.MEMORY_ROWS))
        if name in MOE_FAMILIES:  # the roofline reads the active weights only; both sides name their experts
            assert family["moe"] and family["step_mb"] < family["weights_mb"]
            assert family["active_params_m"] < family["params_m"]
            used = family["experts_implementation"]
            for side in run.PAIR:  # the same rule on both sides: each calibrated over the same candidates
                assert used[side]["decode"] in run.EXPERTS_CANDIDATES
                assert used[side]["prefill"] == used[side]["train"] in run.PREFILL_EXPERTS
                calibration = used[side]["calibration"]
                assert set(calibration["decode_1"]) == set(run.EXPERTS_CANDIDATES)
                assert set(calibration["prefill_1"]) == set(run.PREFILL_EXPERTS)
        else:
            assert family["step_mb"] == family["weights_mb"] and "experts_implementation" not in family
    table = capsys.readouterr().out
    assert "| family | metric |" in table and "decode b2 tok/s" in table
    assert "read the active weights once" in table
    assert "experts_implementation (each side calibrated per phase, same candidates and rounds): transformers prefill `" in table


def test_one_thread_times_no_split_products_ablation():
    """With one torch thread the split products never engage, so `run` times transformers and ours only (the
    ablation would be ours again); with two, all three."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert run.timed_models() == run.PAIR
        torch.set_num_threads(2)
        assert run.timed_models() == run.MODELS
    finally:
        torch.set_num_threads(threads)


def test_choose_experts_picks_the_best_median_of_interleaved_rounds(monkeypatch):
    """`choose_experts` against timings set by the test: each phase gets the candidate whose median rate over
    the rounds is highest (not the single best round), `batched_mm` is never a prefill candidate, and the rounds
    interleave the candidates (each round times every candidate once)."""
    rates = {  # tokens/s per round; the best single round of each phase belongs to a candidate whose median loses
        "prefill": {"eager": [90, 100, 95], "grouped_mm": [200, 80, 85], "batched_mm": [1000, 1000, 1000]},
        "decode": {"eager": [10, 11, 12], "grouped_mm": [30, 5, 6], "batched_mm": [13, 14, 12]},
    }
    calls = []

    class Model:
        implementation = None

        def set_experts_implementation(self, name):
            self.implementation = name

    def timed(phase):
        def run_phase(model, ids, *args):
            warm_up = ids.shape[-1] == 32 if phase == "prefill" else args[0] == 2
            calls.append((phase, model.implementation, warm_up))
            if warm_up:
                return {"tokens_per_s": 0.0}
            done = calls.count((phase, model.implementation, False))
            return {"tokens_per_s": rates[phase][model.implementation][done - 1]}
        return run_phase

    monkeypatch.setattr(run, "prefill", timed("prefill"))
    monkeypatch.setattr(run, "decode", timed("decode"))
    args = type("Args", (), dict(experts_implementation="auto", calibration_rounds=3, calibration_tokens=4))()
    chosen = run.choose_experts(Model(), torch.zeros(1, 64, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long),
                                args)
    assert (chosen["prefill"], chosen["decode"], chosen["train"]) == ("eager", "batched_mm", "eager")
    assert chosen["calibration"] == {"prefill_1": {"eager": 95, "grouped_mm": 85},
                                     "decode_1": {"eager": 11, "grouped_mm": 6, "batched_mm": 13}}
    timed_decodes = [c for p, c, warm_up in calls if p == "decode" and not warm_up]
    rounds = [timed_decodes[i:i + 3] for i in range(0, 9, 3)]
    assert all(sorted(r) == sorted(run.EXPERTS_CANDIDATES) for r in rounds)  # every round times every candidate
    assert rounds[1] == rounds[0][::-1]  # in the reverse order every other round (measure.alternating)


def test_suite_quick_extras_memory_training_max_batch(tmp_path, capsys):
    """Memory (fresh processes), training throughput and the largest batch reach the JSON and the table;
    one MoE + MLA family keeps it short."""
    out = tmp_path / "bench.json"
    assert run.main(["--smoke", "--families", "deepseek_moe", "--max-batch-mb", "400", "--out", str(out)]) == 0
    family = json.loads(out.read_text())["families"]["deepseek_moe"]
    for key in list(run.TRAIN_ROWS) + list(run.MEMORY_ROWS):
        row = family["metrics"][key]
        assert set(row) == {"transformers", "ours", "ratio"} and set(row["ratio"]) == {"ours"}
        assert row["transformers"]["median"] > 0 and row["ours"]["median"] > 0
    training = family["training"]
    assert training["lora_trainable"]["transformers"] == training["lora_trainable"]["ours"] > 0
    assert training["full_trainable"]["transformers"] == training["full_trainable"]["ours"]
    for side, probe in family["memory"].items():
        assert probe["method"] in ("VmHWM", "sampled")
        assert probe["load_decode_peak_mb"] >= max(probe["load_peak_mb"], probe["decode_peak_mb"]) - 1e-9
        batch = probe["max_batch"]
        assert batch["capped"] and batch["batch"] == 16  # tiny model, 400 MB: the quick cap
        assert batch["cache_mb_per_sequence"] > 0
        assert all(peak <= 400 for peak in batch["peaks_mb"].values())
    for side in run.PAIR:
        assert family["memory"][side]["experts_implementation"] == family["experts_implementation"][side]["decode"]
    table = capsys.readouterr().out
    for text in ("train full FT tok/s (fwd+bwd+AdamW, 1x16)", "train LoRA tok/s (fwd+bwd+AdamW, r=8, q_b_proj,kv_b_proj)",
                 "load peak +MB (fresh process; mapped weights not yet read)",
                 "resident +MB after load, every weight read", "load + decode b2 peak +MB", "max decode batch, 64 tok in 400 MB",
                 "| ≥16 | ≥16 | — |"):
        assert text in table, text


def test_choose_experts_takes_each_phase_fastest_and_runs_it(monkeypatch):
    """`choose_experts` against known timings: a fake clock makes `grouped_mm` the fastest prefill and
    `batched_mm` the fastest decode (a decode-only candidate; the default choice, `eager`, is the slowest of both); the choice is
    then what `_select_variant` sets on each model, the same rule on both sides. `--experts-implementation
    NAME` skips the calibration and fixes NAME everywhere."""
    from types import SimpleNamespace

    # batched_mm would be the fastest prefill: it must not be a prefill candidate (minutes per 512 tokens)
    rates = {"prefill": {"eager": 1.0, "grouped_mm": 3.0, "batched_mm": 100.0}, "decode": {"eager": 1.0, "grouped_mm": 2.0, "batched_mm": 5.0}}

    class Model:
        def __init__(self):
            self.implementation = "eager"

        def set_experts_implementation(self, name):
            self.implementation = name

    def fake(phase):
        def timed(model, *args, **kwargs):
            return {"tokens_per_s": rates[phase][model.implementation]}
        return timed

    monkeypatch.setattr(run, "prefill", fake("prefill"))
    monkeypatch.setattr(run, "decode", fake("decode"))
    args = SimpleNamespace(experts_implementation="auto", calibration_rounds=2, calibration_tokens=2)
    long, short = torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long)
    models = {"transformers": Model(), "ours": Model()}
    experts = run.choose_experts_both(models["transformers"], models["ours"], long, short, args)
    for side, model in models.items():
        assert {k: experts[side][k] for k in ("prefill", "decode", "train")} == {
            "prefill": "grouped_mm", "decode": "batched_mm", "train": "grouped_mm"}
    for phase, expected in (("prefill", "grouped_mm"), ("decode", "batched_mm")):
        run._select_variant(models, "ours", phase, experts)
        assert models["transformers"].implementation == models["ours"].implementation == expected
    args.experts_implementation = "eager"
    fixed = run.choose_experts_both(Model(), Model(), long, short, args)
    assert all(fixed[side][phase] == "eager" for side in run.PAIR for phase in ("prefill", "decode", "train"))


def test_timed_runs_sample_no_memory():
    """A timed decode measures no memory (NaN) and runs no thread beside the model; the separate memory run
    records the peak (the kernel's high-water mark, or a sampling thread where its reset is refused)."""
    import threading

    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks import measure

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2)).eval()
    seen = []

    class Spy(measure._StepClock):
        def __call__(self, input_ids, scores):
            seen.append(threading.active_count())
            return super().__call__(input_ids, scores)

    ids = torch.randint(0, 64, (1, 4))
    with torch.inference_mode():
        before = threading.active_count()
        original, measure._StepClock = measure._StepClock, Spy
        try:
            timed = measure.decode(model, ids, new_tokens=3)
            during_timed = list(seen)
            sampled = measure.decode(model, ids, new_tokens=3, sample_memory=True)
        finally:
            measure._StepClock = original
    assert set(during_timed) == {before}
    assert timed["peak_mb"] != timed["peak_mb"] and sampled["peak_mb"] >= 0  # NaN: not measured


def test_peak_memory_sees_a_short_allocation_on_the_cpu():
    """`PeakMemory` on the CPU catches a 64 MB buffer that is written and freed inside the block (a peak no
    RSS read after the block would see), and only what was allocated inside it."""
    from benchmarks.measure import PeakMemory

    with PeakMemory("cpu") as idle:
        pass
    with PeakMemory("cpu") as peak:
        buffer = torch.ones(64 * 2**20 // 4)
        del buffer
    assert peak.method in ("VmHWM", "sampled")
    assert 60 <= peak.above_mb < 200 and idle.above_mb < 16


def test_alternating_warms_up_then_reverses_the_order_every_other_repeat():
    from benchmarks.measure import alternating

    calls = []
    cases = {name: (lambda name=name: calls.append(name) or len(calls)) for name in "abc"}
    values = alternating(cases, repeats=3, warmup=1)
    assert calls == list("abc") + list("abc") + list("cba") + list("abc")
    assert values == {"a": [4, 9, 10], "b": [5, 8, 11], "c": [6, 7, 12]}


def test_entry_point_lists_every_benchmark_and_refuses_an_unknown_one_in_one_line(capsys):
    from benchmarks.__main__ import main
    from benchmarks.registry import BENCHMARKS

    assert main(["--help"]) == 0
    listing = capsys.readouterr().out
    for benchmark in BENCHMARKS:
        assert f"  {benchmark.name}  " in listing, benchmark.name
    assert main(["compiled_decod"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'compiled_decod'" in err and "did you mean compiled_decode?" in err


@pytest.mark.parametrize("name", [b.name for b in __import__("benchmarks.registry").registry.BENCHMARKS])
def test_every_benchmark_takes_the_shared_flags(name, capsys):
    """Each registered module runs from `python -m benchmarks NAME` and spells the shared flags the same way."""
    import importlib

    from benchmarks.registry import BY_NAME

    benchmark = BY_NAME[name]
    module = importlib.import_module(f"benchmarks.{benchmark.module}")
    with pytest.raises(SystemExit) as done:
        module.main(["--help"])
    assert done.value.code == 0
    usage = capsys.readouterr().out
    assert usage.startswith(f"usage: python -m benchmarks {name}"), usage[:200]
    for flag in ("--out", "--smoke", "--threads"):
        assert flag in usage, (name, flag)
    if not name.startswith("reshape"):  # the reshape ones time no repeated call
        assert "--repeats" in usage, name
    from benchmarks.pages import every_section

    optional = {name for section in every_section() if section.optional for name in section.sources}
    if benchmark.writes and benchmark.writes not in optional:  # the JSON it names is committed (a GPU run may not be)
        assert (Path(__file__).parents[1] / "benchmarks" / benchmark.writes).exists()


def test_result_json_records_commit_versions_machine_and_command(tmp_path):
    from benchmarks import harness

    args = harness.parser("example", "What it measures.\n\nHow.").parse_args(["--repeats", "2", "--out",
                                                                                str(tmp_path / "r.json")])
    run = harness.begin("example", ["--repeats", "2", "--out", str(tmp_path / "r.json")], args)
    harness.write_result(args.out, {"figure": 1.5}, run)
    record = json.loads((tmp_path / "r.json").read_text())
    assert record["figure"] == 1.5
    provenance = record["provenance"]
    assert provenance["command"] == f"python -m benchmarks example --repeats 2 --out {tmp_path / 'r.json'}"
    assert len(provenance["commit"]) == 40 and isinstance(provenance["changed_files"], list)
    # whole paths (a status line's leading space is no part of the first): their folders exist, deleted or not
    assert all((harness.ROOT / path.split(" -> ")[-1]).parent.is_dir() for path in provenance["changed_files"])
    assert provenance["versions"]["torch"] == torch.__version__.split("+")[0] or \
        provenance["versions"]["torch"] == torch.__version__
    assert {"transformers", "modular-decoder", "python"} <= set(provenance["versions"])
    assert provenance["machine"]["cpu"] and provenance["machine"]["torch_threads"] == torch.get_num_threads()
    assert len(provenance["load_average_start"]) == len(provenance["load_average_end"]) == 3
    assert provenance["arguments"]["repeats"] == 2


def test_largest_batch_bisects_to_the_last_fitting_batch():
    from benchmarks.memory import largest_batch

    def probe(b):  # 100 MB of weights, 7 MB per sequence
        return 100 + 7 * b

    assert largest_batch(probe, 100 + 7 * 37, cap=1024)[0] == 37
    best, peaks = largest_batch(probe, 100 + 7 * 37 + 3, cap=1024)
    assert best == 37 and set(peaks) == {1, 2, 4, 8, 16, 32, 64, 48, 40, 36, 38, 37}
    assert largest_batch(probe, 50, cap=1024)[0] == 0
    assert largest_batch(probe, 10_000, cap=20)[0] == 20


@pytest.mark.parametrize("name", MOE_FAMILIES)
def test_active_bytes_equal_the_contract_active_count(tmp_path, name):
    """The MoE roofline's bytes per step: the contract's active parameters, less the input embedding
    (gathered a row at a time), in fp32."""
    from modular_decoder import parameter_count

    from benchmarks.families import build_pair
    from benchmarks.measure import active_bytes_read_per_step, bytes_read_per_step

    _, ours, _ = build_pair(name, tmp_path, quick=True)
    counts = parameter_count(ours.config)
    assert not ours.config.tie_word_embeddings
    assert active_bytes_read_per_step(ours) == 4 * (counts["active"] - counts["embedding"])
    assert bytes_read_per_step(ours) == 4 * (counts["total"] - counts["embedding"])


def test_step_clock_counts_every_decode_step():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.measure import decode

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2)).eval()
    with torch.inference_mode():
        result = decode(model, torch.randint(0, 64, (2, 4)), new_tokens=6, window=2)
    assert result["tokens_per_s"] > 0 and result["step_ms_start"] > 0 and result["step_ms_end"] > 0


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_quick_pairs_agree(tmp_path, name):
    """The pairs the suite times compute the same function (else the ratio compares different work)."""
    import torch

    from benchmarks.families import build_pair

    reference, ours, _ = build_pair(name, tmp_path, quick=True)
    ids = torch.randint(0, reference.config.get_text_config().vocab_size, (2, 12))
    with torch.inference_mode():
        torch.testing.assert_close(ours(ids).logits, reference(ids).logits, atol=1e-4, rtol=1e-4)


def test_compiled_decode_quick_prints_both_modes(capsys, tmp_path):
    """`benchmarks.compiled_decode` runs end to end on tiny shapes: eager and compiled rows for both models,
    and its `--json` output is what `benchmarks.pages` renders (the printed medians reappear on the page)."""
    from benchmarks import compiled_decode, pages

    torch._dynamo.reset()
    out = tmp_path / "compiled.json"
    assert compiled_decode.main(["--smoke", "--repeats", "1", "--new-tokens", "4", "--out", str(out)]) == 0
    torch._dynamo.reset()
    page = pages.compiled_section(json.loads(out.read_text()), pages.load("results.json"))
    printed = capsys.readouterr().out
    for mode in ("eager", "compiled"):
        assert next(line for line in printed.splitlines() if line.startswith(f"| {mode} |")) in page
    table = printed.split("| decode b1 tok/s (static cache)")[1]
    rows = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ")}
    assert {"eager", "compiled", "ours compiled vs transformers eager"} <= rows.keys()
    for mode in ("eager", "compiled"):
        theirs, ours = (float(cell.split("±")[0]) for cell in rows[mode].split("|")[2:4])
        assert theirs > 0 and ours > 0


def test_gpu_matrix_smoke_has_every_part(tmp_path, capsys):
    """`python -m benchmarks.gpu --smoke`: the GPU matrix's code paths on the CPU with tiny fp32 shapes. Every part
    reaches the JSON with a result or a stated skip reason (sync counting, flash kernels: CUDA only), none errors,
    the pairs generate the same greedy tokens, the training losses agree, the diagnostics (profiled generate, MLA
    step crossover) record their figures, and the README table is printed."""
    from benchmarks import gpu
    from benchmarks.gpu import diagnostics, profiler

    out = tmp_path / "gpu.json"
    assert gpu.main(["--smoke", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert {"device", "plan", "dtype"} <= set(results["meta"])
    assert {"commit", "versions", "machine", "command", "date_utc"} <= set(results["provenance"])
    assert list(results["parts"]) == list(gpu.PARTS)
    for name, part in results["parts"].items():
        assert "error" not in part, (name, part.get("traceback"))
        assert part.get("rows") or part.get("skipped"), name
    # the docs page renders from the parts, also a run cut short before its closing table was written
    from benchmarks.pages import gpu_section

    first = results["parts"]["llama_prefill"]["rows"][0]
    partial = {"provenance": results["provenance"], "meta": results["meta"],
               "parts": {"llama_prefill": results["parts"]["llama_prefill"]}}
    assert f"| {' | '.join(first)} |" in gpu_section(partial)
    parts = results["parts"]
    assert "CUDA" in parts["host_syncs"]["skipped"] and "CUDA" in parts["flash_backends"]["skipped"]
    for name in ("llama_generate", "llama_generate_dynamic_cache", "compiled_decode"):
        assert all(v["greedy_agreement"]["equal"] for k, v in parts[name].items() if k.startswith("b")), name
    profile = parts["generate_profile"]
    assert "no CUDA" in profile["note"]
    for side, _, _ in diagnostics.PROFILE_SIDES:  # per decode step: the CPU ops of every layer's attention, no CUDA
        step = profile[side]["per_decode_step"]
        # a difference of two profiled calls: its CPU time is noise on a busy 2-core machine (it can come out
        # negative), so only the whole call's is held positive
        assert step["sdpa"] and step["top_aten_self_cpu"] and math.isfinite(step["self_cpu_ms"]), side
        assert profile[side]["call"]["self_cpu_ms"] > 0, side
        assert list(step["runtime_calls"]) == list(profiler.RUNTIME_CALLS) and step["kernels"] == 0, side
        assert profile[side]["wall_s"] > 0 and profile[side]["profiled_wall_s"] > 0, side
    crossover = parts["mla_step_crossover"]["points"]
    assert len(crossover) == len(gpu.SMOKE.crossover_points)
    for point in crossover.values():
        for new in gpu.SMOKE.crossover_new_tokens:
            assert all(point[f"new{new}"][side]["ms"] > 0 for side, _, _ in diagnostics.CROSSOVER_SIDES)
        assert point["fused_probe"]["max_abs_diff"] < 1e-4 and point["fused_probe"]["sdpa_ops"]
    assert parts["llama_prefill"]["logits_max_abs_diff"] < 1e-4
    assert len(parts["mla_decode_grid"]["points"]) == 3
    assert all(entry["greedy_agreement"] == 1.0 for key, entry in parts["mla_chunked_prefill"].items()
               if key.startswith("chunk"))
    for name in ("train_llama_full", "train_llama_lora", "train_deepseek_v3_full", "train_deepseek_v3_lora"):
        for kind in ("padded", "packed"):
            run = parts[name][f"sdpa_{kind}"]
            assert run["loss_max_rel_diff"] < 1e-4 and len(run["losses"]["ours"]) == 2, (name, kind)
        assert "no backward on the CPU" in parts[name]["flex_attention"]["skipped"]
        assert len(set(parts[name]["trainable"].values())) == 1
    table = capsys.readouterr().out
    assert "| case | transformers | ours | ratio |" in table and "MLA prefill 2 x 64 in chunks of 16" in table


def test_gpu_matrix_flash_part_runs_both_sides_through_the_flash_path(tmp_path, monkeypatch):
    """The flash part of `benchmarks.gpu` on the CPU: flash-attn 2 declared available and its kernel replaced by
    the reference kernel of tests/backend_cases.py (the stand-in the flash parity tests use); both sides then go
    through transformers' flash path and generate the same greedy tokens."""
    from backend_cases import install_reference_kernels

    from benchmarks import gpu
    from benchmarks.gpu import llama_parts

    calls = install_reference_kernels(monkeypatch)
    monkeypatch.setattr(llama_parts, "flash_available", lambda: {"flash_attention_2": True, "flash_attention_3": False,
                                                         "flash_attention_4": False})
    monkeypatch.setattr(llama_parts, "use_backend", lambda model, name: setattr(model.config, "_attn_implementation", name))
    out = tmp_path / "gpu.json"
    assert gpu.main(["--smoke", "--parts", "flash_backends", "--out", str(out)]) == 0
    part = json.loads(out.read_text())["parts"]["flash_backends"]
    assert "error" not in part["flash_attention_2"], part
    assert part["flash_attention_2"]["greedy_agreement"]["equal"]
    assert part["flash_attention_2"]["prefill"]["logits_max_abs_diff"] < 1e-4
    assert calls, "the reference flash kernel was not called"
    assert [row[0] for row in part["rows"]] == ["flash_attention_2: prefill 1 x 32, `logits_to_keep=1` (ms)",
                                                "flash_attention_2 generate b1, 8-token prompt, +4 (tok/s)"]


def test_gpu_matrix_generate_stops_at_the_batch_its_guard_fired_in(monkeypatch):
    """The part guard fires once: a batch that ran past it must end the part (the next batch would run with no guard),
    keeping the batches measured before it."""
    import time

    from benchmarks.gpu import llama_parts
    from benchmarks.gpu.bench import Bench
    from benchmarks.gpu.plan import SMOKE
    from benchmarks.gpu.timing import part_guard

    batches = []

    def generate_pair(bench, label, batch, prompt_len, **kwargs):
        batches.append(batch)
        time.sleep(0.5)  # past the guard below, in the first batch
        return {}, (label, "", "", "")

    monkeypatch.setattr(llama_parts, "_generate_pair", generate_pair)
    bench = Bench(SMOKE, Path("."), "cpu")
    with part_guard(0.1):
        result = llama_parts._generate_batches(bench, "eager `generate`")
    assert batches == [1]
    assert "timeout" in result["b1"] and f"b{SMOKE.big_batch}" not in result


def test_mla_crossover_smoke_records_crossover_query_blocks_static_prefill(tmp_path):
    """`python -m benchmarks mla_crossover --smoke`: the rows behind `tuning`'s MLA settings, each present: the
    crossover, the query blocks with the absorbed scoring's own peak (`measure.TensorBytes`) and the prefill into
    an empty static cache."""
    from benchmarks import mla_crossover

    out = tmp_path / "crossover.json"
    assert mla_crossover.main(["--smoke", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["crossover"] and record["static_prefill"]
    assert all(row["absorbed"] > 0 and row["expanded"] > 0 for row in record["crossover"] + record["static_prefill"])
    assert all(row["scoring_peak"]["score_blocks"] >= 2 for row in record["query_blocks"])
    assert record["provenance"]["command"].startswith("python -m benchmarks mla_crossover --smoke")


def test_mtp_decode_smoke_renders(capsys, tmp_path):
    """`benchmarks.mtp_decode` runs end to end on tiny shapes (every case, the same tokens, the parts of a step),
    and its JSON is what `benchmarks.pages` renders (the printed table reappears on the page)."""
    from benchmarks import mtp_decode, pages

    out = tmp_path / "mtp.json"
    assert mtp_decode.main(["--smoke", "--repeats", "1", "--draft-tokens", "3", "1", "--out", str(out)]) == 0
    run = json.loads(out.read_text())
    assert set(run["cases"]) == {"transformers", "ours", "ours_mtp", "ours_mtp_constant", "ours_mtp_k1",
                                 "ours_prompt_lookup", "ours_early_exit"}
    assert all(case["same_tokens"] for case in run["cases"].values()) and run["draft_tokens"] == [3, 1]
    for case, count in (("ours_mtp", 3), ("ours_mtp_k1", 1)):
        mtp = run["cases"][case]
        assert mtp["acceptance"] is not None and len(mtp["position_acceptance"]) == count
        steady = run["cases"][mtp_decode.ceiling_case(run["draft_tokens"], count)]  # drafting `count` every step
        assert run["ceiling"][str(count)]["tokens_per_step"] == 1 + sum(steady["position_acceptance"])
        assert f"drafts_{count}" in run["step_ms"]
    assert {f"forward_{k}_tokens" for k in range(1, 5)} <= set(run["step_ms"])  # the verification of 3 drafts
    printed = capsys.readouterr().out
    page = pages.mtp_section(run)
    for case in ("ours_mtp", "ours_mtp_k1"):
        assert next(line for line in printed.splitlines() if line.startswith(f"| {case} |")) in page


def test_draft_vocab_smoke_records_and_renders(capsys, tmp_path):
    """`benchmarks.draft_vocab` and `mtp_decode --draft-vocab N` run on tiny shapes: every size timed at every thread
    count with its coverage, the drafts over the subset giving ours plain's tokens, each rendered on the page."""
    from benchmarks import draft_vocab, mtp_decode, pages

    out = tmp_path / "draft.json"
    assert draft_vocab.main(["--smoke", "--thread-counts", "1", "--out", str(out)]) == 0
    run = json.loads(out.read_text())
    assert set(run["threads"]["1"]["ms"]) == {"whole", "16", "32"} and set(run["coverage"]) == {"16", "32"}
    assert all(0 <= cover["greedy_text"] <= 1 for cover in run["coverage"].values())
    assert draft_vocab.table(run) in pages.draft_vocab_section(run)
    out = tmp_path / "mtp.json"
    assert mtp_decode.main(["--smoke", "--repeats", "1", "--draft-vocab", "32", "--out", str(out)]) == 0
    run = json.loads(out.read_text())
    assert run["draft_vocab"] == 32 and run["mtp"]["draft_vocab"]["size"] == 32
    assert all(case["same_tokens"] for case in run["cases"].values()) and "ours_mtp_whole_vocab" in run["cases"]
    assert "draft_head_one_position" in run["step_ms"] and "draft vocabulary" in pages.mtp_section(run)


def test_split_slices_smoke_records_every_variant_and_renders(tmp_path):
    """`python -m benchmarks split_slices --smoke`: a row per token count with every slice size (threads only and the
    shipped `split_slice_bytes` among them), rendered with the cost of each count against a 1-token forward."""
    from benchmarks import pages, split_slices
    from modular_decoder.tuning import Tuning

    out = tmp_path / "slices.json"
    assert split_slices.main(["--smoke", "--tokens", "1", "2", "--out", str(out)]) == 0
    run = json.loads(out.read_text())
    assert 0 in run["variants"].values() and Tuning.split_slice_bytes in run["variants"].values()
    assert [row["tokens"] for row in run["rows"]] == [1, 2]
    assert all(set(row["forward_ms"]) == set(run["variants"]) for row in run["rows"])
    page = pages.split_slices_section(run)
    assert "| 2 | " in page and "Against a 1-token forward, threads only -> shipped: 2 tokens" in page


def test_split_threshold_smoke_compares_off_fixed_and_auto_and_renders(tmp_path):
    """`python -m benchmarks split_threshold --smoke`: off, every fixed threshold and mode "auto" in one table per
    width, with what "auto" decided per product shape and what its timing cost, rendered on both pages."""
    from benchmarks import pages, split_threshold

    out = tmp_path / "auto.json"
    assert split_threshold.main(["--smoke", "--threads", "2", "--out", str(out)]) == 0
    run = json.loads(out.read_text())
    assert {"off", "auto", "auto from 0", "from 0"} <= set(run["variants"])
    assert run["variants"]["auto"] == {"mode": "auto", "min_split_weight": run["min_split_weight"]}
    for row in run["rows"]:
        assert set(row["step_ms"]) == set(run["variants"])
        assert row["auto_decisions"] and all(isinstance(d["split"], bool) for d in row["auto_decisions"])
        assert row["auto_timing_ms"] > 0
    assert "shapes split, timing" in pages.split_auto_section(run)
    assert "| 64 | " in pages.split_threshold_section(run)


def test_dsa_decode_smoke_compares_the_three_sides_on_one_cache(tmp_path):
    """`python -m benchmarks dsa_decode --smoke`: every side steps from the same cache contents (ours equals
    transformers' DeepseekV32 there, and differs from dense MLA: the selection is in play), with a time, a peak and
    the bytes per token each cache holds (DSA's count the indexer's keys)."""
    from benchmarks import dsa_decode

    out = tmp_path / "dsa.json"
    assert dsa_decode.main(["--smoke", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert [row["context"] for row in record["rows"]] == [16, 64]
    for row in record["rows"]:
        assert row["max_logit_diff_vs_transformers"] < 1e-5 and row["max_logit_diff_dense_vs_dsa"] > 1e-3
        assert set(row["seconds"]) == set(row["peak_mb"]) == {dsa_decode.OURS, dsa_decode.DENSE, dsa_decode.REFERENCE}
        per_token = row["bytes_per_token"]
        assert per_token[dsa_decode.OURS] == per_token[dsa_decode.DENSE] + 4 * record["shape"]["index_head_dim"]
        assert row["indexer_seconds"] > 0
    assert record["provenance"]["command"].startswith("python -m benchmarks dsa_decode --smoke")


def test_hybrid_smoke_measures_both_sides_and_both_layer_kinds(tmp_path):
    """`python -m benchmarks hybrid --smoke`: ours and transformers' Qwen3Next with the same logits, and the decode
    step of each layer kind at each context, the linear layer's cache the same size at both."""
    from benchmarks import hybrid

    out = tmp_path / "hybrid.json"
    assert hybrid.main(["--smoke", "--repeats", "1", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    side = record["side_by_side"]
    assert side["max_logit_diff"] < 1e-4 and side["prefill"]["median_ratio"] > 0 and side["decode"]["median_ratio"] > 0
    first, last = record["flat_in_context"]
    assert first["cache_bytes"]["linear_attention"] == last["cache_bytes"]["linear_attention"]
    assert last["cache_bytes"]["full_attention"] == 4 * first["cache_bytes"]["full_attention"]  # 256 / 64 tokens


def test_mixers_smoke_measures_each_family_each_mixer_and_the_presets(tmp_path):
    """`python -m benchmarks mixers --smoke`: each family's side with transformers' logits, each mixer's decode step
    with a cache that does not grow (the full layer's does), prompt lookup beside plain decoding, and the presets' state
    and K/V bytes."""
    from benchmarks import mixers

    out = tmp_path / "mixers.json"
    assert mixers.main(["--smoke", "--repeats", "1", "--families", "lfm2", "kimi_linear", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert set(record["side_by_side"]) <= {"lfm2", "kimi_linear"} and "lfm2" in record["side_by_side"]
    for side in record["side_by_side"].values():
        assert side["max_logit_diff"] < 1e-4 and side["decode"]["median_ratio"] > 0
        assert side["decode_median_step"]["median_ratio"] > 0 and side["decode_interleaved"]["median_ratio"] > 0
        assert side["decode_interleaved"]["steps"] == 4  # 1 repeat x 4 new tokens
    first, last = record["flat_in_context"]
    for kind in ("gated_deltanet", "kda", "short_conv"):
        assert first["cache_bytes"][kind] == last["cache_bytes"][kind] > 0
    assert last["cache_bytes"]["full_attention"] == 4 * first["cache_bytes"]["full_attention"]
    assert [row["preset"] for row in record["state_against_kv"]] == list(mixers.PRESETS)
    assert set(record["drafting"]) == set(record["side_by_side"])
    for row in record["drafting"].values():  # prompt lookup decodes plain greedy's tokens
        assert row["same_tokens"] and row["median_tokens_per_s"]["prompt_lookup"] > 0


def test_hybrid_drafting_smoke_trains_exports_and_measures_both_sides(capsys, tmp_path):
    """`python -m benchmarks hybrid_drafting --smoke`: a tiny hybrid trained a few steps, exported to transformers'
    class with the same logits, each side decoding plain and with prompt lookup the same greedy tokens, drafts
    counted; the printed table is what the page renders."""
    from benchmarks import hybrid_drafting, pages

    out = tmp_path / "drafting.json"
    assert hybrid_drafting.main(["--smoke", "--repeats", "1", "--layouts", "gated_deltanet", "--draft-tokens", "3",
                                 "--out", str(out)]) == 0
    run = json.loads(out.read_text())
    row = run["layouts"]["gated_deltanet"]
    assert row["model"]["max_logit_diff"] < 1e-4 and row["model"]["steps"] == 4
    assert set(row["cases"]) == {"ours", "ours_prompt_lookup_k3", "transformers", "transformers_prompt_lookup_k3"}
    assert row["cases"]["ours_prompt_lookup_k3"]["drafted"] > 0
    assert row["cases"]["ours_prompt_lookup_k3"]["same_tokens_as_ours_plain"]
    assert row["cases"]["transformers"]["same_tokens_as_ours_plain"]
    assert 0 <= row["cases"]["ours"]["copied"] <= 1 and 0 <= row["cases"]["ours"]["repeated"] <= 1
    printed = capsys.readouterr().out
    page = pages.hybrid_drafting_section(run)
    assert next(line for line in printed.splitlines() if "| prompt lookup, K=3 |" in line) in page


def test_hybrid_drafting_counts_the_cycle_continued_and_spans_repeated():
    """What a trained copier writes after a prompt, counted two ways: the cycle continued in step, and spans repeated
    from anywhere earlier (a loop counts there, not in the cycle)."""
    from benchmarks.hybrid_drafting import copied_share, repeated_share

    prompt = torch.tensor([[1, 2, 3, 4, 5, 1, 2, 3, 4, 5]])
    assert copied_share(prompt, [1, 2, 3, 4], 5) == repeated_share(prompt, [1, 2, 3, 4]) == 1
    loop = [1, 2, 1, 2]  # (5, 1) -> 2 seen, (1, 2) -> 1 not seen until the loop's first round
    assert copied_share(prompt, loop, 5) == 0.5 and repeated_share(prompt, loop) == 0.5
    assert repeated_share(prompt, [9, 9, 9, 9]) == 0.25  # (9, 9) -> 9 only once seen


def test_mamba2_smoke_measures_each_family_and_both_layer_kinds(tmp_path):
    """`python -m benchmarks mamba2 --smoke`: each Mamba-2 family against its transformers class with the same logits,
    and the decode step of a Mamba-2 layer and a full-attention layer at each context, the state the same size at
    both."""
    from benchmarks import mamba2

    out = tmp_path / "mamba2.json"
    assert mamba2.main(["--smoke", "--repeats", "1", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert set(record["families"]) == {"bamba", "granitemoehybrid", "nemotron_h", "falcon_h1"}
    for side in record["families"].values():
        assert side["max_logit_diff"] < 1e-4 and side["decode"]["median_ratio"] > 0
    first, last = record["flat_in_context"]
    assert first["cache_bytes"]["mamba2"] == last["cache_bytes"]["mamba2"] > 0
    assert last["cache_bytes"]["full_attention"] == 4 * first["cache_bytes"]["full_attention"]  # 256 / 64 tokens


def test_conversion_memory_smoke_measures_convert_and_export_and_cleans_up(tmp_path):
    from benchmarks import conversion_memory

    out = tmp_path / "conversion_memory.json"
    assert conversion_memory.main(["--smoke", "--scratch", str(tmp_path), "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["provenance"]["command"].startswith("python -m benchmarks conversion_memory --smoke")
    assert [result["layout"] for result in record["results"]] == ["llama", "mixtral", "gpt_oss"]
    for result in record["results"]:
        for what in ("convert", "export"):
            assert len(result[what]["runs"]) == 1 and result[what]["runs"][0]["method"] in ("VmHWM", "sampled")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["conversion_memory.json"]  # the checkpoints are gone


def test_sinks_smoke_times_every_case_at_every_size(tmp_path):
    """`python -m benchmarks sinks --smoke`: SDPA with sinks against SDPA without and eager with, prefill and decode;
    `benchmarks.pages` renders what it wrote."""
    from benchmarks import pages, sinks

    out = tmp_path / "sinks.json"
    assert sinks.main(["--smoke", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    for phase in ("prefill", "decode", "decode_attention"):
        (row,) = record[phase].values()
        assert set(row["ratios"]) == {"sdpa_sinks", "eager_sinks"}
        assert all(row[case]["seconds"] > 0 for case in sinks.CASES)
    page = pages.sinks_section(record)  # docs/benchmarks.md's section: one row per step, the recorded ratios
    assert "| prefill 16 tokens |" in page and "| decode step, 32 cached |" in page
    assert "| its attention alone, 32 cached |" in page
    assert f"{record['decode']['32']['ratios']['eager_sinks']:.2f}x" in page
    assert f"{record['decode_attention']['32']['ratios']['sdpa_sinks']:.2f}x" in page


def test_topologies_smoke_measures_each_family_and_the_sharing_caches(tmp_path):
    """`python -m benchmarks topologies --smoke`: Llama 4, Gemma 4 and Gemma 3n against their transformers classes
    with the same logits and greedy tokens; the KV-sharing presets' caches: the shared layers hold nothing on either
    side, the windows the same bytes on both, ours' payload within what ours holds and below the unshared model's."""
    from benchmarks import topologies

    out = tmp_path / "topologies.json"
    assert topologies.main(["--smoke", "--repeats", "1", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert set(record["families"]) == set(topologies.CLASSES)
    for side in record["families"].values():
        assert side["max_logit_diff"] < 1e-4 and side["same_greedy_tokens"] and side["decode"]["median_ratio"] > 0
    assert set(record["kv_sharing"]) == set(topologies.SHARING)
    for rows in record["kv_sharing"].values():
        assert [row["context"] for row in rows] == [40, 100]
        for row in rows:
            held = row["decoding_per_token"]
            for group in held["ours"]:
                if group.startswith("shared "):
                    assert held["ours"][group] == held["transformers"][group] == 0, group
                elif group == "sliding_attention":
                    assert held["ours"][group] == held["transformers"][group] > 0
            assert row["ours_payload_per_token"] <= row["decoding_total_per_token"]["ours"]
            assert row["ours_payload_per_token"] < row["ours_payload_without_sharing_per_token"]


def test_deepseek_v4_smoke_measures_both_sides_the_compressed_caches_and_the_window_only_twin(tmp_path):
    """`python -m benchmarks deepseek_v4 --smoke`: ours and transformers' DeepseekV4ForCausalLM with the same logits and
    greedy tokens; the compressed caches below what every layer attending in full would hold; the decode step at each
    context beside the window-only twin, whose cache does not grow."""
    from benchmarks import deepseek_v4

    out = tmp_path / "dsv4.json"
    assert deepseek_v4.main(["--smoke", "--repeats", "1", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    side = record["side_by_side"]
    assert side["max_logit_diff"] < 1e-4 and side["same_greedy_tokens"] and side["prefill"]["median_ratio"] > 0
    for row in record["cache_bytes"]:
        assert row["ours_payload_per_token"] <= row["decoding_total_per_token"]["ours"]
        assert row["ours_payload_per_token"] < row["ours_payload_every_layer_full_per_token"]
    first, last = record["decode_against_window"]
    assert first["cache_bytes"]["window only"] == last["cache_bytes"]["window only"]
    assert last["cache_bytes"]["compressed"] > first["cache_bytes"]["compressed"]
    assert first["ratio_to_window_only"] > 0


@pytest.mark.parametrize("preset, family", [("gemma3n", "gemma3n_text"), ("deepseek_v4", "deepseek_v4")])
def test_cache_bytes_counted_on_the_meta_device_equal_those_of_real_tensors(preset, family):
    """`meta_cache.bytes_per_token` (what the benchmarks count at 32k without the memory) gives from a prefill and a
    decode step on the meta device the bytes it counts from real tensors on the CPU, on both sides."""
    from benchmarks import meta_cache

    on = {device: meta_cache.bytes_per_token(preset, family, [40], tiny=True, device=device)
          for device in ("meta", "cpu")}
    assert on["meta"] == on["cpu"]
    assert on["cpu"][0]["decoding_total_per_token"]["transformers"] > 0
