"""Render the benchmarks' JSON output into `docs/benchmarks.md`, the README's headline table and docs/reshape.md's
recorded runs (`benchmarks.reshape_page`), and the list of benchmarks (`registry.BENCHMARKS`) into
`benchmarks/README.md`.

    HF_HUB_OFFLINE=1 .venv/bin/python -m benchmarks.pages          # rewrite all four from the committed JSON
    HF_HUB_OFFLINE=1 .venv/bin/python -m benchmarks.pages --check  # exit 1 if one is stale

Every number on the page and in the headline table is computed here from a JSON file a benchmark wrote
(`SECTIONS` names each file); no prose retypes a figure, and each section ends with the file's provenance (commit,
versions, machine, load, as `harness.write_result` recorded them). Adding a benchmark's output is one entry in
`SECTIONS`: its JSON path and a function that turns it into markdown. `tests/test_readme.py` checks that the
committed pages equal what this module renders.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from modular_decoder.tools import provenance

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "benchmarks.md"
README = ROOT / "README.md"
BENCHMARKS_README = ROOT / "benchmarks" / "README.md"
HEADLINE_START, HEADLINE_END = "<!-- headline:start -->", "<!-- headline:end -->"
LIST_START, LIST_END = "<!-- benchmarks:start -->", "<!-- benchmarks:end -->"


def load(name: str) -> dict:
    return json.loads((ROOT / "benchmarks" / name).read_text())


def command_of(data: dict) -> str:
    """The command that wrote a result JSON (`harness.write_result` records it under "provenance")."""
    return data["provenance"]["command"] if "provenance" in data else data["command"]


def command_block(run: dict) -> list[str]:
    """The lines that show the command a run was made with, as a shell block."""
    return ["```bash", f"HF_HUB_OFFLINE=1 .venv/bin/{command_of(run)}", "```", ""]


def not_recorded(lines: list[str], name: str, file: str) -> str:
    """An optional section whose benchmark has not written its JSON yet: how to record it."""
    return "\n".join(lines + [f"Not recorded yet: `python -m benchmarks {name} --out benchmarks/{file}`."])


def provenance_line(data: dict) -> str:
    """Where a result came from: the commit, versions, machine and load, as `harness.write_result` recorded them
    (a file written before it did says what it lacks)."""
    record = data.get("provenance")
    if record is None:
        known = ", ".join(f"{key} {data[key]}" for key in ("torch", "transformers") if key in data)
        return (f"Recorded before result files named their commit and machine{': ' + known if known else ''}; "
                "re-run to trace it.")
    return provenance.line(record)


def span(values, fmt: str = "{:.2f}") -> str:
    """'a-b' over values (one value when they agree at this precision)."""
    low, high = fmt.format(min(values)), fmt.format(max(values))
    return low if low == high else f"{low}-{high}"


# --- benchmarks/results.json: `python -m benchmarks.run` (seven families, speed, memory, training) ----------

def command(results: dict) -> str:
    """The recorded command, without the README-writing flag of older runs (the page is written here now)."""
    return re.sub(r" --readme \S+", "", command_of(results))


def _run_args(results: dict) -> argparse.Namespace:
    """The arguments the run was made with (labels need them): recorded, or re-parsed from an older run's
    command (`python -m benchmarks.run ... --json FILE`)."""
    if "provenance" in results:
        return argparse.Namespace(**results["provenance"]["arguments"])
    from . import run  # here, not at the top: benchmarks.run imports torch, which the other sections never need

    old = shlex.split(command(results))[3:]
    return run.parse_args(["--out" if word == "--json" else word for word in old])


def ratios(results: dict, key: str, families=None) -> dict:
    return {family: result["metrics"][key]["ratio"]["ours"] for family, result in results["families"].items()
            if key in result["metrics"] and (families is None or family in families)}


def families_section(results: dict) -> str:
    from . import run

    fams = results["families"]
    dense = [f for f, r in fams.items() if not r["moe"]]
    llama = fams["llama"]["metrics"]
    d1 = {name: llama["decode_1"][name] for name in ("transformers", "ours")}
    nosplit = [r["metrics"]["decode_1"]["ratio"]["ours, no split products"] for r in fams.values()]
    mla = fams["deepseek_v3"]["metrics"]["max_batch"]
    mix = fams["mixtral"]["memory"]
    train = {**ratios(results, "train_full"), **{f"{f} lora": v for f, v in ratios(results, "train_lora").items()}}
    # Mixtral's full fine-tune is the one outlier (each side's calibrated experts implementation): said apart
    train_but_mixtral_full = [v for k, v in train.items() if k != "mixtral"]
    resident = ratios(results, "resident_mb", dense)
    max_batch = {f: (fams[f]["metrics"]["max_batch"]["transformers"]["median"],
                     fams[f]["metrics"]["max_batch"]["ours"]["median"]) for f in dense}
    lines = [
        "## Speed, memory and training against transformers (CPU, fp32)",
        "",
        "```bash",
        f"HF_HUB_OFFLINE=1 .venv/bin/{command(results)}   # this run: "
        f"{sum(r['seconds'] for r in fams.values()) / 60:.0f} min",
        "HF_HUB_OFFLINE=1 .venv/bin/python -m benchmarks run --smoke --out /tmp/smoke.json   # smoke test, tiny shapes",
        "```",
        "",
        "Ours against transformers' own class with the same weights (converted by `modular_decoder.conversion`), in",
        "one process, the models alternating inside every repeat (what each row measures: `benchmarks/run.py`'s",
        "docstring). Cells are the median over the repeats ± half the min-max spread; read ratios within the spread",
        "as parity. \"ours, no split products\" is the same model with `MODULAR_DECODER_SPLIT_PRODUCTS=0`. The",
        "roofline divides the measured copy bandwidth by the weight bytes one batch-1 step reads (for the experts",
        "families, the active weights only).",
        "",
        f"Copy bandwidth {results['copy_bandwidth_gb_s']:.1f} GB/s; the run's provenance (commit, versions, threads, "
        "load) is under the table.",
        "",
        run.table(results, _run_args(results)),
        "",
        f"- Batch-1 decode: ours {span(ratios(results, 'decode_1').values())}x transformers (SmolLM2-135M "
        f"{llama['decode_1']['ratio']['ours']:.2f}x, {d1['ours']['median']:.1f} vs {d1['transformers']['median']:.1f} "
        f"tokens/s; its repeats {span(d1['ours']['all'], '{:.1f}')} against {span(d1['transformers']['all'], '{:.1f}')}). "
        f"Without the split products (the same model, the ablation column): {span(nosplit)}x. The split products "
        "share a few-row product across the cores and wait for the slower half, which a busy machine delays. "
        "`python -m benchmarks decode_profile` splits a step into its products and the rest.",
        f"- Batch-8 decode: {span(ratios(results, 'decode_B').values())}x.",
        f"- Prefill: {span(ratios(results, 'prefill_1').values())}x at 1x512, "
        f"{span(ratios(results, 'prefill_4').values())}x at 4x512: both sides spend a prefill in the same MKL products "
        "and SDPA kernel (MLA pads V so that torch's CPU SDPA takes its flash kernel).",
        f"- Training (full fine-tune and LoRA): {span(train_but_mixtral_full)}x; Mixtral's full fine-tune "
        f"{train['mixtral']:.2f}x, with each side's calibrated experts implementation (the table's experts row; "
        "`--experts-implementation grouped_mm` runs both sides alike).",
        f"- Memory, dense families: resident after load {span(resident.values())}x; the largest batch at 1024 tokens "
        "in 1 GB " + ", ".join(f"{f} {t:.0f} vs {o:.0f}" for f, (t, o) in max_batch.items())
        + " (transformers vs ours; the largest batch whose probe, a cached prompt repeated B times and 2 decode steps, "
        "peaks within the budget, weights included). " + mla_batch_sentence(fams["deepseek_v3"], results),
        f"- Memory, experts: ours maps the saved 3-D expert tensors; transformers' loader concatenates its per-expert "
        f"tensors into new memory, so with every weight read it holds {mix['transformers']['resident_mb']:.0f} MB "
        f"against ours {mix['ours']['resident_mb']:.0f} MB (Mixtral layout; after load transformers "
        f"{mix['transformers']['after_load_mb']['anon']:.0f} MB anonymous + {mix['transformers']['after_load_mb']['file']:.0f} "
        f"MB file pages, ours {mix['ours']['after_load_mb']['anon']:.0f} + {mix['ours']['after_load_mb']['file']:.0f}).",
    ]
    return "\n".join(lines)


def _threads(data: dict) -> int:
    return data["provenance"]["machine"]["torch_threads"] if "provenance" in data else data["threads"]


def _growth_per_sequence(probe: dict) -> float:
    """MB the largest-batch probe's peak grows per extra sequence: from batch 1 to the largest batch that fitted."""
    peaks, best = {int(b): p for b, p in probe["peaks_mb"].items()}, probe["batch"]
    return (peaks[best] - peaks[1]) / (best - 1) if best > 1 else float("nan")


def mla_batch_sentence(family: dict, results: dict) -> str:
    """What the MLA layout's largest-batch row measures (issue 39, item 6): both sides cache the latent; the
    difference is the per-step expansion."""
    row, probes = family["metrics"]["max_batch"], family["memory"]
    sides = {side: probes[side]["max_batch"] for side in ("transformers", "ours")}
    version = results["provenance"]["versions"]["transformers"] if "provenance" in results else results["transformers"]
    cache = ", ".join(f"{side} {probe['cache_mb_per_sequence']:.1f}" for side, probe in sides.items()
                      if "cache_mb_per_sequence" in probe)
    cached = (f" (measured from each cache's storage after a {sides['ours']['context']}-token prompt, MB per sequence: "
              f"{cache})" if cache else "")
    return (f"MLA layout: ours fits {row['ratio']['ours']:.1f}x the batch ({row['ours']['median']:.0f} vs "
            f"{row['transformers']['median']:.0f}). transformers {version} caches the same latent as ours{cached}; the "
            "difference is the decode step: transformers expands the whole latent cache into per-head keys and values "
            "at every step, ours scores the new token against the latent (absorbed), so per extra sequence the "
            f"probe's peak grows {_growth_per_sequence(sides['transformers']):.1f} MB for transformers and "
            f"{_growth_per_sequence(sides['ours']):.1f} MB for ours.")


# --- benchmarks/results_compiled_decode.json: `python -m benchmarks.compiled_decode --json ...` -------------

def compiled_section(compiled: dict, results: dict) -> str:
    from .compiled_decode import table as compiled_table

    runs = compiled["runs"]
    median = {key: runs[key]["median"] for key in runs}
    roofline = results["families"]["llama"]["roofline_b1_tok_s"]
    step_mb = results["families"]["llama"]["step_mb"]
    step_ms = 1e3 / median["ours/compiled"]
    lines = [
        "## Compiled decoding (SmolLM2-135M, batch 1)",
        "",
        "```bash",
        f"HF_HUB_OFFLINE=1 .venv/bin/{command_of(compiled)}",
        "```",
        "",
        f"{compiled['label']}, fp32, {_threads(compiled)} threads, static cache, {compiled['new_tokens']} new tokens "
        "after a 32-token prompt, greedy; ours against transformers' `LlamaForCausalLM` with the same weights, each "
        "eager and through transformers' compiled decode step (`compiled_decoding()`); the four runs once per repeat "
        f"after a warm-up round, the order reversed every other repeat, {compiled['repeats']} repeats, median ± half "
        "the spread.",
        "",
        compiled_table(runs),
        "",
        "The first compiled call took " + ", ".join(f"{s:.0f} s ({name})" for name, s in compiled["compile_seconds"].items())
        + f". Compiled, ours decodes a step in {step_ms:.1f} ms: {100 * median['ours/compiled'] / roofline:.0f}% of the "
        f"family table's batch-1 roofline for this model ({roofline:.1f} tokens/s, {step_mb:.0f} MB of weights a step at "
        "the copy bandwidth of that run)"
        + (": above 100%, so that run's copy bandwidth (another run, under other load) understates this one's"
           if median["ours/compiled"] > roofline else "")
        + ". Inductor fuses the norms, rotary, residuals and cache writes between the "
        "products, and the products, split across the cores inside the graph, read the weights on both; transformers' "
        "graph runs each product as a matrix-vector product on one core.",
    ]
    if compiled.get("note"):
        lines += ["", compiled["note"]]
    return "\n".join(lines)


# --- benchmarks/results_serving.json: `python -m benchmarks.serving --out ...` ---------------------------

OURS, NATIVE = "ours_vllm_transformers_backend", "llama_vllm_native"


def serving_rounds(serving: dict) -> list[float]:
    rounds = sorted({int(key.split("/")[1]) for key in serving["results"] if key.startswith(OURS + "/")})
    return [serving["results"][f"{OURS}/{r}"]["tokens_per_s"] / serving["results"][f"{NATIVE}/{r}"]["tokens_per_s"]
            for r in rounds]


def serving_section(serving: dict) -> str:
    results, shape = serving["results"], serving["shape"]
    ratios_ = serving_rounds(serving)
    rounds = range(1, len(ratios_) + 1)
    lines = [
        "## Serving through vLLM (CPU, fp32)",
        "",
        "```bash",
        f"HF_HUB_OFFLINE=1 .venv/bin/{command_of(serving)}",
        "```",
        "",
        f"SmolLM2-135M, {shape['prompts']} prompts x {shape['prompt_tokens']} tokens, {shape['new_tokens']} new each, "
        "greedy, output tokens/s; eager engines, one at a time in one process, ours first in odd rounds and native "
        "first in even ones:",
        "",
        "| engine | " + " | ".join(f"round {r} ({'ours' if r % 2 else 'native'} first)" for r in rounds) + " |",
        "|---|" + "---:|" * len(ratios_),
        "| ours through vLLM's Transformers backend (`model_impl=\"transformers\"`) | "
        + " | ".join(f"{results[f'{OURS}/{r}']['tokens_per_s']:.1f}" for r in rounds) + " |",
        "| same weights as `LlamaForCausalLM`, vLLM's native Llama | "
        + " | ".join(f"{results[f'{NATIVE}/{r}']['tokens_per_s']:.1f}" for r in rounds) + " |",
        "| ratio | " + " | ".join(f"{ratio:.2f}" for ratio in ratios_) + " |",
        "",
        f"Ours through vLLM runs at **{statistics.median(ratios_):.2f}x** vLLM's native Llama (median of the rounds; "
        f"{span(ratios_)}). vLLM builds one q/k/v product and one gate/up product per layer for both "
        "(`tests/test_vllm.py` compares the linear modules it built); its native Llama also runs the rotary "
        "embedding as one fused kernel.",
    ]
    if "ours_generate" in results:
        lines.append(f"Our own batched `generate()` (no vLLM, the same prompts): "
                     f"{results['ours_generate']['tokens_per_s']:.1f} tokens/s.")
    if "deepseek_ours_kv" in results:
        ours, native = results["deepseek_ours_kv"], results["deepseek_v3_native_kv"]
        lines += ["", f"DeepSeek-V3 layout (MLA latent 512 + 64, 4 layers), `VLLM_CPU_KVCACHE_SPACE=1` GiB: vLLM's KV "
                  f"cache holds **{ours['kv_capacity_tokens']:,} tokens** for our folder and "
                  f"**{native['kv_capacity_tokens']:,}** for the same weights exported to `DeepseekV3ForCausalLM` "
                  "(native): the latent cache, not expanded heads."]
    if serving.get("note"):
        lines += ["", serving["note"]]
    return "\n".join(lines)


# --- benchmarks/results_mla_prefill.json: `python -m benchmarks.mla_prefill --json ...` --------------------

def mla_prefill_ratios(run: dict) -> tuple[float, float]:
    """(time, peak memory) of ours over transformers'."""
    return (run["median_seconds"]["ours"] / run["median_seconds"]["transformers"],
            run["peak_mb"]["ours"] / run["peak_mb"]["transformers"])


def mla_prefill_section(run: dict) -> str:
    shape, (time_ratio, memory_ratio) = run["shape"], mla_prefill_ratios(run)
    rounds = len(run["seconds"]["ours"])
    return "\n".join([
        "## MLA chunked prefill (CPU, fp32)",
        "",
        "```bash",
        f"HF_HUB_OFFLINE=1 .venv/bin/{command_of(run)}",
        "```",
        "",
        f"DeepSeek-V2-Lite's attention widths with a low-rank query (hidden {shape['hidden_size']}, "
        f"{shape['num_attention_heads']} heads, q_lora {shape['q_lora_rank']}, kv_lora {shape['kv_lora_rank']}, nope "
        f"{shape['qk_nope_head_dim']}, rope {shape['qk_rope_head_dim']}, v {shape['v_head_dim']}), {shape['layers']} "
        f"dense layers, batch 1: {shape['tokens']:,} tokens prefilled in chunks of {shape['chunk']:,}, every chunk "
        "after the first a multi-token step against the cache. Same weights (made by transformers' "
        "`DeepseekV3ForCausalLM`, converted).",
        "",
        "| | transformers' `DeepseekV3ForCausalLM` | ours | ours / it |",
        "|---|---:|---:|---:|",
        f"| seconds (median of {rounds} round{'s' if rounds > 1 else ''}, sides alternating in one process) | "
        f"{run['median_seconds']['transformers']:.2f} | {run['median_seconds']['ours']:.2f} | {time_ratio:.2f}x |",
        f"| peak MB above the RSS before the prefill (a fresh process per side, {run['peak_method']}) | "
        f"{run['peak_mb']['transformers']:.0f} | {run['peak_mb']['ours']:.0f} | {memory_ratio:.2f}x |",
        "",
        f"Last-token logits agree to {run['max_last_token_logit_diff']:.1e}. A step of more than "
        "`absorbed_max_new_tokens` (`modular_decoder.tuning`) new tokens runs the expanded form through the backend's fused kernel (no "
        "score matrix); on this CPU transformers' sdpa takes its math path for MLA's narrower values, ours pads "
        "them to the key width and takes the flash kernel.",
    ])


def spread_note(runs: list[list[float]], run: dict) -> str:
    """How far the repeats of the timed cells spread around their median (half the range over the median), with
    the load they ran under: the reader's measure of how much a ratio in the table can be trusted."""
    spreads = sorted((max(v) - min(v)) / 2 / statistics.median(v) for v in runs if len(v) > 1)
    if not spreads:
        return "One repeat per cell: no spread recorded."
    record = run["provenance"]
    load = max(record["load_average_start"][0], record["load_average_end"][0])
    return (f"Half the spread of a cell's {len(runs[0])} repeats is {100 * statistics.median(spreads):.0f}% of its "
            f"median at the median cell, {100 * spreads[-1]:.0f}% at the worst (1-minute load average up to "
            f"{load:.1f} on {record['machine']['cpu_count']} cores): a ratio closer to 1 than that spread is noise.")


# --- benchmarks/results_mla_crossover.json: `python -m benchmarks mla_crossover --out ...` -------------------

def mla_crossover_section(run: dict | None) -> str:
    lines = ["## MLA: absorbed against expanded steps, and the absorbed query block (CPU, fp32)", ""]
    if run is None:
        return not_recorded(lines, "mla_crossover", "results_mla_crossover.json")
    shape = run["shape"]
    lines += [
        *command_block(run),
        f"One MLA layer (hidden {shape['hidden_size']}, {shape['num_attention_heads']} heads, q_lora "
        f"{shape['q_lora_rank']}, kv_lora {shape['kv_lora_rank']}, rope {shape['qk_rope_head_dim']}, nope "
        f"{shape['qk_nope_head_dim']}, v {shape['v_head_dim']}: DeepSeek-V2-Lite's attention with a low-rank query), "
        "random weights, a latent cache of S random tokens; one step of T new tokens, ours forced absorbed and forced "
        "expanded, alternating (median ms), and in a separate run of each the peak memory above the start (MB, the "
        f"kernel's resident high-water mark). The shipped `ABSORBED_MAX_NEW_TOKENS` is {run['absorbed_max_new_tokens']} "
        f"and `ABSORBED_QUERY_BLOCK` {run['absorbed_query_block']}.",
        "", "| cached S | new T | absorbed ms | expanded ms | expanded / absorbed | absorbed peak MB | expanded peak MB |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [f"| {r['context']:,} | {r['new_tokens']} | {1e3 * r['absorbed']:.2f} | {1e3 * r['expanded']:.2f} | "
              f"{r['expanded'] / r['absorbed']:.2f} | {r['peak_mb']['absorbed']:.1f} | {r['peak_mb']['expanded']:.1f} |"
              for r in run["crossover"]]
    blocks = run["query_blocks"]
    if blocks:
        scoring = all("scoring_peak" in b for b in blocks)
        lines += ["", f"The absorbed step of {blocks[0]['new_tokens']} new tokens with each query block (new tokens "
                  "scored per pass)" + (": time, the step's peak, and the peak of the absorbed scoring alone "
                                        "(`measure.TensorBytes`: the bytes its own tensors hold at once, per cached "
                                        "token and in score blocks of (1, H, block, S) fp32)" if scoring else "") + ":",
                  "", "| cached S | query block | ms | peak MB |" + (" scoring B per cached token | score blocks |"
                                                                    if scoring else ""),
                  "|---:|---:|---:|---:|" + ("---:|---:|" if scoring else "")]
        for b in blocks:
            cells = f"| {b['context']:,} | {b['query_block']} | {1e3 * b['seconds']:.2f} | {b['peak_mb']:.1f} |"
            if scoring:
                cells += f" {b['scoring_peak']['bytes_per_cached_token']:,.0f} | {b['scoring_peak']['score_blocks']:.2f} |"
            lines.append(cells)
    prefills = run.get("static_prefill")
    if prefills:
        lines += ["", "A prefill of T tokens into an empty static cache of capacity S (both forms compute over every "
                  "slot: the crossover of a short first step):", "",
                  "| static capacity S | prefill T | absorbed ms | expanded ms | expanded / absorbed |",
                  "|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['capacity']:,} | {r['new_tokens']} | {1e3 * r['absorbed']:.2f} | {1e3 * r['expanded']:.2f} | "
                  f"{r['expanded'] / r['absorbed']:.2f} |" for r in prefills]
    timed = [values for r in run["crossover"] + (prefills or []) for values in r["all_seconds"].values()]
    timed += [b["all_seconds"] for b in blocks]
    return "\n".join(lines + ["", spread_note(timed, run)])


# --- benchmarks/results_dsa_decode.json: `python -m benchmarks dsa_decode --out ...` ----------------------

def dsa_decode_section(run: dict) -> str:
    from .dsa_decode import side_cells  # the sides' figures, as the benchmark's report prints them

    shape, rows = run["shape"], run["rows"]
    repeats = len(next(iter(rows[0]["all_seconds"].values())))
    lines = [
        "## DeepSeek Sparse Attention: one decode step against dense MLA (CPU, fp32)", "",
        *command_block(run),
        f"{run['layers']} layer of DeepSeek-V3.2's attention at full width (hidden {shape['hidden_size']:,}, "
        f"{shape['num_attention_heads']} heads, q_lora {shape['q_lora_rank']:,}, kv_lora {shape['kv_lora_rank']}, "
        f"nope {shape['qk_nope_head_dim']}, rope {shape['qk_rope_head_dim']}, v {shape['v_head_dim']}; indexer "
        f"{shape['index_n_heads']} heads of {shape['index_head_dim']}, top-k {shape['index_topk']:,}), a dense MLP of width "
        f"{shape['intermediate_size']} and a vocabulary of {shape['vocab_size']:,}, batch {run['batch']}: one token "
        "against a cache filled with the same random contents for every side. Ours with `attention_type=\"dsa\"` "
        "gathers each query's chosen keys; dense MLA is ours with the same weights less the indexer (absorbed over "
        f"every key); transformers' `DeepseekV32ForCausalLM` up-projects its whole latent cache every step. Median of "
        f"{repeats} alternating repeats, {run['provenance']['machine']['torch_threads']} torch thread(s); the peak of one "
        "more step: the tensors it allocates, alive at once (exact), and the process's resident high-water mark above "
        "the level before it (the allocator's view: a step that reuses memory the process already holds adds 0).",
        "", "| cached tokens | model | ms / step | dense MLA / it | peak tensors MB | peak RSS MB | cache bytes / token |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        for name, cells in side_cells(row):
            lines.append(f"| {row['context']:,} | {name} | " + " | ".join(cells + [""] * (5 - len(cells))) + " |")
    diffs = [row["max_logit_diff_vs_transformers"] for row in rows if row["max_logit_diff_vs_transformers"] is not None]
    lines += ["", "Of ours' step, the lightning indexer (its scores over every cached key and the top-k): "
              + ", ".join(f"{row['indexer_seconds'] * 1e3:.1f} ms at {row['context']:,}" for row in rows) + ". "
              + (f"On the same cache ours and transformers' logits agree to {max(diffs):.1e}; " if diffs else "")
              + "DSA's differ from dense MLA's by up to "
              + f"{max(row['max_logit_diff_dense_vs_dsa'] for row in rows):.1f} (the selection is in play). The "
              "indexer's keys are cached beside the latent: the cache grows per token, it is not cut by the selection."]
    return "\n".join(lines)


# --- benchmarks/results_hybrid.json: `python -m benchmarks hybrid --out ...` ------------------------------------

def hybrid_section(run: dict) -> str:
    from .hybrid import report  # the tables, as the benchmark prints them

    widths, side = run["widths"], run["side_by_side"]
    rows = run["flat_in_context"]
    first, last = rows[0], rows[-1]
    growth = {kind: last["step_ms"][kind] / first["step_ms"][kind] for kind in first["step_ms"]}
    return "\n".join([
        "## Hybrid linear attention (CPU, fp32)", "",
        *command_block(run),
        f"Qwen3-Next's layout at hidden {widths['hidden_size']:,} (4 layers: three Gated DeltaNet layers of "
        f"{widths['linear_num_key_heads']} key / {widths['linear_num_value_heads']} value heads of "
        f"{widths['linear_key_head_dim']} for one gated full-attention layer of {widths['num_attention_heads']} heads "
        f"of {widths['head_dim']} over {widths['num_key_value_heads']} K/V heads; a dense SwiGLU FFN), made by "
        "transformers' `Qwen3NextForCausalLM` and converted, both sides loaded with `from_pretrained` and run on the "
        "PyTorch paths (no `flash-linear-attention` or `causal-conv1d` on a CPU: transformers falls back to its "
        "reference kernels, ours to `delta_rule.py`). Sides alternating in one process, "
        f"{len(side['prefill']['ratios'])} repeats, {run['provenance']['machine']['torch_threads']} torch thread(s); "
        f"the largest logit difference of the prefill is {side['max_logit_diff']:.1e}. Below, one decode step of a "
        "one-layer model of each kind at that width (the linear layer's state filled by a real prefill, the full "
        "layer's cache by random keys and values) and the bytes its cache holds.", "",
        report(run), "",
        f"From {first['context']:,} to {last['context']:,} cached tokens the linear layer's step changes "
        f"{growth['linear_attention']:.2f}x and its cache not at all (a state per sequence); the full-attention "
        f"layer's step {growth['full_attention']:.2f}x and its cache "
        f"{last['cache_bytes']['full_attention'] / first['cache_bytes']['full_attention']:.0f}x. The drafting rows run "
        "random weights, whose drafts are seldom kept: they show what drafting costs; what it gains on hybrids trained "
        "to copy is measured in [Prompt lookup on trained hybrids](#prompt-lookup-on-trained-hybrids-cpu-fp32-batch-1).",
    ])


# --- benchmarks/results_deepseek_v4.json: `python -m benchmarks deepseek_v4 --out ...` -----------------------------

def deepseek_v4_section(run: dict | None) -> str:
    if run is None:
        return not_recorded(["## DeepSeek-V4 (CPU, fp32)", ""], "deepseek_v4", "results_deepseek_v4.json")
    from .deepseek_v4 import report  # the tables, as the benchmark prints them

    side, rows, last = run["side_by_side"], run["decode_against_window"], run["cache_bytes"][-1]
    compressed = last["decoding_total_per_token"]
    return "\n".join([
        "## DeepSeek-V4 (CPU, fp32)", "",
        *command_block(run),
        "DeepSeek-V4's layout shrunk (a window-only layer, CSA, HCA, CSA; hyper-connections, hash-routed √softplus "
        "experts; `benchmarks/deepseek_v4.py` names the widths), made by transformers' `DeepseekV4ForCausalLM` and "
        "converted: prefill (ours SDPA, transformers' eager, its only backend) and batch-1 decode through each side's "
        f"own cache, sides alternating in one process, {len(side['prefill']['ratios'])} repeat(s), "
        f"{run['provenance']['machine']['torch_threads']} torch thread(s). Cache bytes: the `deepseek_v4` preset "
        "(DeepSeek-V4-Flash, 43 layers) in bf16, both sides built on the meta device (real shapes, no memory) and run "
        "through their own caches, a prefill of C tokens and one decode step; every tensor each cache layer holds, "
        "each storage once, at its allocated size (ours' payload: what the next step attends to; every layer full: "
        "the contract's arithmetic). Decode against the window only: one layer of each kind at DeepSeek-V4-Flash's "
        "attention widths (64 heads), compressed caches filled directly, against the same weights with every layer a "
        "window only.", "",
        report(run), "",
        f"At {last['context']:,} tokens a decoding DeepSeek-V4-Flash holds {compressed['ours']:,.0f} bytes per token "
        f"in ours' cache and {compressed['transformers']:,.0f} in transformers' "
        f"(ours' payload {last['ours_payload_every_layer_full_per_token'] / last['ours_payload_per_token']:.1f}x "
        f"below what every layer attending in full would hold). From {rows[0]['context']:,} to {rows[-1]['context']:,} cached tokens the "
        f"compressed model's decode step goes from {rows[0]['ratio_to_window_only']:.2f}x to "
        f"{rows[-1]['ratio_to_window_only']:.2f}x the window-only model's (which reads a constant window).",
    ])


# --- benchmarks/results_topologies.json: `python -m benchmarks topologies --out ...` -----------------------------

def topologies_section(run: dict | None) -> str:
    lines = ["## Llama 4, Gemma 4, Gemma 3n (CPU, fp32)", ""]
    if run is None:
        return not_recorded(lines, "topologies", "results_topologies.json")
    from .topologies import report  # the tables, as the benchmark prints them

    families, sizes = run["families"], run["sizes"]
    repeats = len(next(iter(families.values()))["prefill"]["ratios"])
    diff = max(side["max_logit_diff"] for side in families.values())
    same = all(side["same_greedy_tokens"] for side in families.values())
    return "\n".join(lines + [
        *command_block(run),
        f"Each family's layout at hidden {sizes['hidden_size']} ({sizes['num_attention_heads']} heads of "
        f"{sizes['head_dim']}; `benchmarks/topologies.py` names the layers: Llama 4's chunked and NoPE layers and "
        "top-1 experts, Gemma 4's per-layer shapes, shared keys and values and per-layer embeddings, Gemma 3n's AltUp, "
        "LAUREL, per-layer embeddings and shared keys and values), made by its transformers class and converted, both "
        f"sides loaded with `from_pretrained` (SDPA), sides alternating in one process, {repeats} repeats, "
        f"{run['provenance']['machine']['torch_threads']} torch thread(s); the largest logit difference of any prefill "
        f"is {diff:.1e}, and the greedy tokens are {'the same' if same else 'NOT the same'} on both sides. Then the "
        "cache bytes per token of the published Gemma 3n and Gemma 4 E2B layouts in bf16, both sides built on the meta "
        "device (real shapes, no memory) and run through their own caches, a prefill of C tokens and one decode step: "
        "every tensor each cache layer holds, each storage once, at its allocated size (ours' payload: what the next "
        "step attends to; no sharing: the contract's arithmetic with `num_kv_shared_layers=0`). A prefill keeping the "
        "last position's logits runs the layers that share keys and values on that position only: transformers' Gemma "
        "4 and ours (`kept_positions.py`, on Gemma 3n too), not transformers' Gemma 3n.", "",
        report(run),
    ])


# --- benchmarks/results_mixers.json: `python -m benchmarks mixers --out ...` ------------------------------------

def mixers_section(run: dict | None) -> str:
    lines = ["## Recurrent mixers: LFM2, OLMo hybrid, Qwen3.5-MoE, Kimi Linear (CPU, fp32)", ""]
    if run is None:
        return not_recorded(lines, "mixers", "results_mixers.json")
    from .mixers import report  # the tables, as the benchmark prints them

    widths, rows = run["widths"], run["flat_in_context"]
    first, last = rows[0], rows[-1]
    growth = ", ".join(f"{kind} {last['step_ms'][kind] / first['step_ms'][kind]:.2f}x"
                       for kind in first["step_ms"])
    repeats = len(next(iter(run["side_by_side"].values()))["prefill"]["ratios"]) if run["side_by_side"] else 0
    return "\n".join(lines + [
        *command_block(run),
        f"Each family's layout at hidden {widths['hidden_size']:,} (4 layers, its linear layers and one full layer; "
        "`benchmarks/mixers.py` names the widths), made by its transformers class and converted, both sides loaded "
        "with `from_pretrained` and run on the PyTorch paths (no `flash-linear-attention` or `causal-conv1d` on a "
        f"CPU). Sides alternating in one process, {repeats} repeats, {run['provenance']['machine']['torch_threads']} "
        "torch thread(s). Then one decode step of a one-layer model of each mixer and of the full-attention layer, "
        "and the bytes each cache holds; last, each preset's cache at its published sizes in bf16 (the contract's "
        "arithmetic), against the same model with every layer attending.", "",
        report(run), "",
        f"From {first['context']:,} to {last['context']:,} cached tokens each layer's step changes: {growth}; the "
        "mixers' caches not at all (a state per sequence), the full-attention layer's "
        f"{last['cache_bytes']['full_attention'] / first['cache_bytes']['full_attention']:.0f}x. The drafting rows run "
        "random weights, whose drafts are seldom kept: they show what drafting costs; what it gains on hybrids trained "
        "to copy is measured in [Prompt lookup on trained hybrids](#prompt-lookup-on-trained-hybrids-cpu-fp32-batch-1).",
    ])


# --- benchmarks/results_hybrid_drafting.json: `python -m benchmarks hybrid_drafting --out ...` --------------------

def hybrid_drafting_section(run: dict | None) -> str:
    lines = ["## Prompt lookup on trained hybrids (CPU, fp32, batch 1)", ""]
    if run is None:
        return not_recorded(lines, "hybrid_drafting", "results_hybrid_drafting.json")
    from .hybrid_drafting import LAYOUTS, report  # the table, as the benchmark prints it

    sizes, layouts = run["sizes"], run["layouts"]
    made = next(iter(layouts.values()))["model"]
    trained = "; ".join(
        f"{name} ({LAYOUTS[name][1]}, {row['model']['parameters'] / 1e6:.2f}M parameters): loss "
        f"{row['model']['loss_first']:.2f} to {row['model']['loss_last']:.2f} in {row['model']['cpu_seconds']:.0f} CPU "
        f"s, held-out copy loss {row['model']['copy_loss_before']:.2f} to {row['model']['copy_loss_after']:.3f}, "
        f"{row['cases']['ours']['copied']:.0%} of its greedy tokens continue the prompt's cycle in step"
        + (f" and {row['cases']['ours']['repeated']:.0%} repeat a span from earlier in the text (a jump, a loop)"
           if "repeated" in row["cases"]["ours"] else "")
        + f", largest logit difference ours / transformers {row['model']['max_logit_diff']:.1e}"
        for name, row in layouts.items())
    return "\n".join(lines + [
        *command_block(run),
        f"Small 3:1 hybrids (hidden {sizes['hidden_size']}, vocabulary {sizes['vocab_size']:,}, four layers: three "
        "recurrent, then one full-attention layer) made by transformers' class, converted, and trained in the run "
        f"({made['steps']} AdamW steps of {made['batch']} x {made['length']} tokens, lr {made['learning_rate']}, "
        "seeded, fp32) to continue random text in which a piece and the tokens after it recur; then exported back to the "
        "family's format and loaded by transformers' class (`benchmarks/hybrid_drafting.py` says how). "
        f"{len(next(iter(layouts.values()))['cases']['ours']['per_prompt_tokens_per_s'])} held-out prompts of "
        f"{run['prompt_tokens']} tokens (a random piece of {run['prompt_piece']}, {run['prompt_others']} others, the "
        f"piece again), {run['new_tokens']} greedy tokens each, every case alternating in one process "
        f"({run['repeats']} repeats, {_threads(run)} torch thread(s)); tok/s is new tokens over the whole `generate` "
        "call, the median over prompts, as are \"ours / transformers\" and \"vs plain\" (against the same side's "
        "plain decoding); \"same tokens as greedy\": the case's tokens equal its side's plain greedy tokens and ours "
        "on every prompt.", "",
        report(run), "",
        f"The models: {trained}.",
    ])


# --- benchmarks/results_mamba2.json: `python -m benchmarks mamba2 --out ...` ------------------------------------

def mamba2_section(run: dict) -> str:
    from .mamba2 import report  # the tables, as the benchmark prints them

    sizes, widths, families = run["sizes"], run["layer_widths"], run["families"]
    rows = run["flat_in_context"]
    first, last = rows[0], rows[-1]
    growth = {kind: last["step_ms"][kind] / first["step_ms"][kind] for kind in first["step_ms"]}
    repeats = len(next(iter(families.values()))["prefill"]["ratios"])
    diff = max(side["max_logit_diff"] for side in families.values())
    return "\n".join([
        "## Mamba-2 hybrids (CPU, fp32)", "",
        *command_block(run),
        f"Each family's layout at hidden {sizes['hidden']:,} (Mamba-2 of {sizes['mamba_heads']} heads of "
        f"{sizes['mamba_head_dim']}, one group, a state of {sizes['state']}, chunks of {sizes['chunk']}; attention of "
        f"{sizes['heads']} heads of {sizes['head_dim']} over 2 K/V heads; an FFN of {sizes['ffn']:,}): Bamba and "
        "Granite 4.0-H (dense, no positions) with three Mamba-2 layers for one attention layer, Nemotron-H as eight "
        "one-sublayer layers of the same mixers, Falcon-H1 with both mixers side by side in four layers. Made by each "
        "transformers class and converted, both sides loaded with `from_pretrained` and run on the PyTorch paths (no "
        "`mamba_ssm` or `causal-conv1d` on a CPU: transformers runs its `torch_forward`, ours `mamba2_scan.py`). "
        f"Sides alternating in one process, {repeats} repeats, {run['provenance']['machine']['torch_threads']} torch "
        f"thread(s); the largest logit difference of any prefill is {diff:.1e}. Below, one decode step of a one-layer "
        f"model of each kind at hidden {widths['hidden_size']:,} (Mamba-2 of {widths['mamba_n_heads']} heads of "
        f"{widths['mamba_d_head']} and a state of {widths['mamba_d_state']}, its state filled by a real prefill; "
        f"attention of {widths['num_attention_heads']} heads of {widths['head_dim']} over "
        f"{widths['num_key_value_heads']} K/V heads, its cache random keys and values) and the bytes its cache holds.",
        "",
        report(run), "",
        f"From {first['context']:,} to {last['context']:,} cached tokens the Mamba-2 layer's step changes "
        f"{growth['mamba2']:.2f}x and its state not at all ({last['cache_bytes']['mamba2']:,} bytes: the convolution "
        f"window and the fp32 state); the full-attention layer's step {growth['full_attention']:.2f}x and its cache "
        f"{last['cache_bytes']['full_attention'] / first['cache_bytes']['full_attention']:.0f}x "
        f"({last['cache_bytes']['full_attention'] / last['cache_bytes']['mamba2']:.1f}x the Mamba-2 state at "
        f"{last['context']:,} tokens).",
    ])


def variant_table(heads: list[str], rows: list[tuple[list[str], dict]], variants: list[str]) -> list[str]:
    """A table of ms per variant: the `heads` columns, then one column per variant; each row its own cells and
    {variant: summary}, shown as the median ± half the spread over the repeats."""
    lines = ["| " + " | ".join(heads + [f"{v} ms" for v in variants]) + " |",
             "|" + "---:|" * (len(heads) + len(variants))]
    for cells, values in rows:
        timed = [f"{values[v]['median']:.2f} ±{values[v]['half_spread']:.2f}" for v in variants]
        lines.append("| " + " | ".join(cells + timed) + " |")
    return lines


# --- benchmarks/results_split_threshold.json: `python -m benchmarks split_threshold --out ...` ---------------

def split_threshold_section(run: dict | None) -> str:
    lines = ["## Split products: from what weight size (CPU, fp32)", ""]
    if run is None:
        return not_recorded(lines, "split_threshold", "results_split_threshold.json")
    lines += [
        *command_block(run),
        f"Decode steps of ours (Llama layouts, hidden h, FFN 3h, {run['layers']} layers, random weights): the median "
        f"of {run['steps']} cached one-token forwards, median ± half the spread over the repeats, the variants "
        "alternating in one process: the split products off, and on for every weight of at least N elements "
        f"(`MIN_SPLIT_WEIGHT`, shipped {run['min_split_weight']:,}; N = 0 splits every few-row product).", "",
    ]
    return "\n".join(lines + _split_steps_table(run))


def _split_steps_table(run: dict) -> list[str]:
    variants = list(run["variants"])
    lines = variant_table(["hidden", "weights MB", "largest weight"],
                          [([str(row["hidden"]), f"{row['weights_mb']:.1f}", f"{row['largest_weight']:,}"],
                            row["step_ms"]) for row in run["rows"]], variants)
    timed = [row["step_ms"][v]["all"] for row in run["rows"] for v in variants]
    return lines + ["", spread_note(timed, run)]


# --- benchmarks/results_split_auto.json: `python -m benchmarks split_threshold --out ...`, with mode "auto" -------

def split_auto_section(run: dict | None, smollm2: dict | None = None) -> str:
    lines = ["## Split products: timed per shape on the machine (mode \"auto\", CPU, fp32)", ""]
    if run is None:
        return not_recorded(lines, "split_threshold", "results_split_auto.json")
    lines += [
        *command_block(run),
        f"The decode steps of the section above (hidden h, FFN 3h, {run['layers']} layers, the median of "
        f"{run['steps']} cached one-token forwards, median ± half the spread over the repeats, the variants alternating "
        "in one process), on another CPU, with mode \"auto\" beside the fixed thresholds: \"off\" splits nothing, "
        "\"from N\" splits every few-row product over a weight of at least N elements (shipped "
        f"{run['min_split_weight']:,} as the floor), \"auto\" times each product shape once, at its first product, and "
        "splits only the shapes where the split was faster (\"auto from 0\": with no floor).", "",
    ]
    auto = [f"hidden {row['hidden']}: {sum(d['split'] for d in row['auto_decisions'])} of "
            f"{len(row['auto_decisions'])} shapes split, timing {row['auto_timing_ms']:.1f} ms" for row in run["rows"]]
    lines += _split_steps_table(run) + ["", "Mode \"auto\" here: " + "; ".join(auto) + "."]
    return "\n".join(lines + ([] if smollm2 is None else ["", *split_auto_smollm2(smollm2)]))


def split_auto_smollm2(run: dict) -> list[str]:
    """The family table's SmolLM2 rows run again in mode "auto" on the same CPU (`benchmarks/run.py`)."""
    family = run["families"]["llama"]
    metrics = family["metrics"]
    one, steps, many = metrics["decode_1"], metrics["step_turns_1"], metrics["decode_B"]
    decisions = run["split_products"]["decisions"]
    first = [d for d in decisions if d["out_in_rows_threads_slices_bias"][2] == 1]
    cell = lambda row, side: f"{row[side]['median']:.1f}"  # noqa: E731
    return [
        f"{family['label']} on the same CPU, greedy decode of {run['provenance']['arguments']['new_tokens']} tokens "
        f"after a {run['provenance']['arguments']['prompt']}-token prompt (the family table's harness, "
        f"`benchmarks/run.py`, mode \"{run['split_products']['mode']}\"): batch 1 ours {cell(one, 'ours')} tok/s, with "
        f"the split off {cell(one, 'ours, no split products')}, transformers' Llama {cell(one, 'transformers')} "
        f"({one['ratio']['ours']:.2f}x; off {one['ratio']['ours, no split products']:.2f}x); steps taken in turn ours "
        f"{cell(steps, 'ours')} ms against {cell(steps, 'transformers')} ms; batch {run['provenance']['arguments']['decode_batch']} "
        f"{many['ratio']['ours']:.2f}x (off {many['ratio']['ours, no split products']:.2f}x). Mode \"auto\" split "
        f"{sum(d['split'] for d in first)} of the {len(first)} one-row shapes and "
        f"{sum(d['split'] for d in decisions if d not in first)} of the {len(decisions) - len(first)} shapes of more "
        f"rows; timing the one-row shapes (a batch-1 decode's first step) cost "
        f"{1e3 * sum(d['cost_s'] for d in first):.0f} ms, the head's {1e3 * max(d['cost_s'] for d in first):.0f} ms "
        "of it.",
    ]


# --- benchmarks/results_split_slices.json: `python -m benchmarks split_slices --out ...` -------------------------

def split_slices_section(run: dict | None) -> str:
    lines = ["## Split products: slices for several rows (CPU, fp32)", ""]
    if run is None:
        return not_recorded(lines, "split_slices", "results_split_slices.json")
    variants = list(run["variants"])
    lines += [
        *command_block(run),
        f"Cached forwards of T new tokens on SmolLM2-135M's shapes ({run['layers']} layers, a "
        f"{run['vocab_size']:,}-token vocabulary, {run['weights_mb']:.0f} MB of fp32 weights, random values), each cropped back afterwards (a "
        f"speculative verify step of T tokens, or a batch of T sequences' decode step): the median of {run['steps']} "
        "forwards, median ± half the spread over the repeats, the variants alternating in one process. A product of 2 "
        "or more rows is cut into as many slices as threads (\"threads only\"), or into more slices of at least N "
        f"bytes each (`split_slice_bytes`, shipped {run['split_slice_bytes']:,}); one row is never cut further.", "",
    ]
    lines += variant_table(["new tokens"], [([str(row["tokens"])], row["forward_ms"]) for row in run["rows"]], variants)
    one = next((row for row in run["rows"] if row["tokens"] == 1), None)
    shipped = next(v for v, size in run["variants"].items() if size == run["split_slice_bytes"])
    if one is not None:
        reference = one["forward_ms"][shipped]["median"]
        costs = ", ".join(f"{row['tokens']} tokens {row['forward_ms']['threads only']['median'] / reference:.2f}x -> "
                          f"{row['forward_ms'][shipped]['median'] / reference:.2f}x" for row in run["rows"]
                          if row["tokens"] > 1)
        lines += ["", f"Against a 1-token forward, threads only -> shipped: {costs}."]
    timed = [row["forward_ms"][v]["all"] for row in run["rows"] for v in variants]
    return "\n".join(lines + ["", spread_note(timed, run)])


# --- benchmarks/results_sinks.json: `python -m benchmarks sinks --out ...` -------------------------------------

SINK_CASES = (("sdpa", "SDPA without sinks"), ("sdpa_sinks", "SDPA with sinks"), ("eager_sinks", "eager with sinks"))


def sinks_section(run: dict | None) -> str:
    lines = ["## Attention sinks: what they cost on each CPU backend (fp32)", ""]
    if run is None:
        return not_recorded(lines, "sinks", "results_sinks.json")
    shape = run["shape"]
    lines += [
        *command_block(run),
        f"One attention layer of gpt-oss's widths (hidden {shape['hidden_size']}, {shape['num_attention_heads']} query "
        f"heads of {shape['head_dim']} over {shape['num_key_value_heads']} K/V heads), random weights, called directly: "
        "a prefill of T tokens (no mask: SDPA's own causal path) and one decode step against S cached tokens, the whole "
        "layer (its projections dominate) and its attention alone (the function the layer calls, on one query against "
        "S cached keys and values). SDPA with sinks takes them as one more key in a prefill (K and V copied 8 features "
        "wider per call) and scores the cached keys directly in a decode step (`sinks.few_queries_with_sinks`: no copy, "
        "each K/V head against its group of query heads); the eager reference with them materializes the scores. "
        f"Median ms of alternating rounds (a decode round: the mean of {run.get('steps', 1)} calls; ratio: against SDPA "
        "without sinks) and, in one untimed call of each, the peak memory above the start (MB).", "",
        "| step | " + " | ".join(f"{label} ms" for _, label in SINK_CASES) + " | SDPA sinks / SDPA | eager sinks / SDPA | "
        + " | ".join(f"{label} peak MB" for _, label in SINK_CASES) + " |",
        "|---|" + "---:|" * (2 * len(SINK_CASES) + 2),
    ]
    for kind, label in (("prefill", "prefill {} tokens"), ("decode", "decode step, {} cached"),
                        ("decode_attention", "its attention alone, {} cached")):
        for size, row in run.get(kind, {}).items():
            lines.append(f"| {label.format(f'{int(size):,}')} | "
                         + " | ".join(f"{1e3 * row[case]['seconds']:.2f}" for case, _ in SINK_CASES)
                         + f" | {row['ratios']['sdpa_sinks']:.2f}x | {row['ratios']['eager_sinks']:.2f}x | "
                         + " | ".join(f"{row[case]['peak_mb']:.1f}" for case, _ in SINK_CASES) + " |")
    timed = [row[case]["all_seconds"] for kind in ("prefill", "decode", "decode_attention")
             for row in run.get(kind, {}).values() for case, _ in SINK_CASES]
    return "\n".join(lines + ["", spread_note(timed, run)])


# --- benchmarks/results_gpu.json: `python3 -m benchmarks.gpu --out ...` on a GPU machine ----------------

def gpu_table(results: dict) -> str:
    """The GPU matrix's table from its JSON's parts (a run cut short by its budget or killed renders what it
    recorded), under a line with its date, hardware and versions."""
    meta, record = results["meta"], results["provenance"]
    hardware = record["machine"].get("gpu") or record["machine"]["cpu"]
    lines = [f"GPU matrix, {record['date_utc'][:10]}: {hardware}, torch {record['versions']['torch']}, transformers "
             f"{record['versions']['transformers']}, {meta['dtype']}, `{record['command']}` at commit "
             f"`{record['commit'][:10]}`; ratio > 1: ours faster", "",
             "| case | transformers | ours | ratio |", "|---|---:|---:|---:|"]
    for name, part in results["parts"].items():
        if "rows" in part:
            lines += [f"| {' | '.join(row)} |" for row in part["rows"]]
        else:
            why = part.get("skipped") or part.get("error") or "no result"
            lines.append(f"| {name} | | {why[:120]} | |")
    return "\n".join(lines)


def gpu_section(gpu: dict | None) -> str:
    lines = ["## GPU: ours against transformers on one accelerator (bf16)", ""]
    if gpu is None:
        return "\n".join(lines + [
            "No run of `benchmarks/gpu/` is recorded yet (no GPU was lent to the sessions since it was written). "
            "On a GPU machine:", "", "```bash",
            "python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . && "
            "PYTHONUNBUFFERED=1 python3 -m benchmarks.gpu --out benchmarks/results_gpu.json", "```", "",
            "then `python -m benchmarks.pages` renders its table here. Its CPU smoke run "
            "(`python -m benchmarks.gpu --smoke`) is part of the test suite."])
    return "\n".join(lines + [gpu_table(gpu)])  # dated, with the hardware and versions


# --- benchmarks/results_mtp_decode.json: `python -m benchmarks mtp_decode --out ...` --------------------------

def mtp_section(run: dict | None) -> str:
    lines = ["## Multi-token prediction (SmolLM2-135M, batch 1, CPU fp32)", ""]
    if run is None:
        return not_recorded(lines, "mtp_decode", "results_mtp_decode.json")
    from .mtp_decode import ceiling_case, mtp_case, table as mtp_table

    made, parts = run["mtp"], run["step_ms"]
    modules = made["num_mtp_layers"]
    counts = run["draft_tokens"]  # drafts per step, one MTP case each
    made_by = f", trained by `{made['command']}`" if made.get("command") else ""
    trained = (f"from `{made['folder']}`{made_by}" if "folder" in made else
               f"added and trained in the run ({made['steps']} steps, lr {made['learning_rate']}, "
               f"{made['sequences']} sequences: {made.get('text', 'sampled from the model')})")
    acceptance = {name: prompt["acceptance"] for name, prompt in run["cases"]["ours_mtp"]["prompts"].items()}
    forwards = ", ".join(f"{k} token(s) {parts[f'forward_{k}_tokens']:.1f}" for k in range(1, max(counts) + 2))
    further = ", ".join(f"`{mtp_case(counts, k)}` {k}" for k in counts[1:])
    lines += [
        *command_block(run),
        f"{run['label']}, fp32, {_threads(run)} threads, greedy, {run['new_tokens']} new tokens per prompt "
        f"({len(acceptance)} prompts: {', '.join(acceptance)}); each case's decode tokens/s is its median over the "
        "prompts of the median over repeats, the cases alternating in one process. `ours_mtp` drafts "
        f"{counts[0]} token(s) per step with {modules} MTP module(s) {trained} (`generate(use_mtp=True, "
        f"mtp_draft_tokens=K)`{'; ' + further if further else ''})"
        + (", at most: each step drafts as many as pay at the acceptance and step times the call measures "
           "(none where drafting does not pay; [using.md](using.md#multi-token-prediction)), and "
           "`ours_mtp_constant` drafts K every step" if "ours_mtp_constant" in run["cases"] else "")
        + "; prompt lookup drafts "
        "3 tokens, early exit drafts with the first 12 layers. Every case's tokens are compared with ours plain."
        + _draft_vocab_sentence(run), "",
        mtp_table(run), "",
        "Acceptance per prompt (`ours_mtp`): " + ", ".join(f"{name} {share:.0%}" for name, share in acceptance.items())
        + "." + ("" if not made.get("top1_agreement") else " The module's top-1 agreement with the model on held-out "
                 "text, teacher-forced: " + ", ".join(f"{share:.0%}" for share in made["top1_agreement"]) + "."),
        "",
        f"One speculative step, timed apart (ms): the model's forward over {forwards}; K drafts "
        + ", ".join(f"{parts[f'drafts_{k}']:.1f} (K={k})" for k in counts)
        + f" (the head over one position {parts['head_one_position']:.1f}"
        + (f", over the draft vocabulary {parts['draft_head_one_position']:.1f}" if "draft_head_one_position" in parts
           else "") + f"); `generate` adds {run['generate_overhead_ms']:.1f} per step beside the forward. "
        "With these parts, per K: the share of steps that kept at least j drafts (j = 1..K), and the speed-up over "
        "plain decoding with every draft accepted and at the measured acceptance:", "",
        "| K | steps that kept at least j drafts | tokens per step | every draft accepted | at the measured acceptance |",
        "|---:|---|---:|---:|---:|",
        *(_ceiling_row(k, run["cases"][ceiling_case(counts, k) if ceiling_case(counts, k) in run["cases"]
                                      else mtp_case(counts, k)], run["ceiling"][str(k)]) for k in counts),
    ]
    return "\n".join(lines)


def _ceiling_row(count: int, case: dict, cap: dict) -> str:
    kept = ", ".join(f"{share:.0%}" for share in case.get("position_acceptance") or [])
    return (f"| {count} | {kept} | {cap['tokens_per_step']:.2f} | {cap['all_accepted']:.2f}x | "
            f"{cap['at_measured_acceptance']:.2f}x |")


def _draft_vocab_sentence(run: dict) -> str:
    draft = run["mtp"].get("draft_vocab")
    if not run.get("draft_vocab") or not draft:
        return ""
    return (f" The modules draft among the {draft['size']:,} of {draft['vocab_size']:,} token ids the model predicts "
            f"most often on their training text (FR-Spec; they cover {draft['coverage']:.1%} of its argmax predictions "
            "on held-out text); `ours_mtp_whole_vocab` is the same modules drafting over the whole vocabulary.")


# --- benchmarks/results_draft_vocab.json: `python -m benchmarks draft_vocab --out ...` --------------------------

def draft_vocab_section(run: dict | None) -> str:
    lines = ["## MTP drafts over a frequency-ranked vocabulary (SmolLM2-135M, CPU fp32)", ""]
    if run is None:
        return not_recorded(lines, "draft_vocab", "results_draft_vocab.json")
    from .draft_vocab import table as draft_table

    loads = ", ".join(f"{count} thread(s) {row['load_before']:.1f} -> {row['load_after']:.1f}"
                      for count, row in run["threads"].items())
    lines += [
        *command_block(run),
        f"{run['label']} with one MTP module added (`reshape --add-mtp`'s initialisation; its time does not depend on "
        "its values): one draft (the module's block and the head over one position, as `generate(use_mtp=True)` "
        "calls them) and the head alone, over the whole vocabulary and over the top N token ids by the model's own "
        f"argmax predictions on {run['ranked_on_tokens']:,} sampled tokens (`reshape --draft-vocab N`), the cases "
        "alternating in one process, medians. Coverage: the share of the tokens the model emits decoding greedily "
        f"({run['greedy_tokens']:,} tokens after `mtp_decode`'s prompts) that lie in the top N; no draft outside "
        f"them is proposed. 1-minute load average before -> after: {loads}.", "",
        draft_table(run),
    ]
    return "\n".join(lines)


# --- benchmarks/results_conversion_memory.json: `python -m benchmarks conversion_memory --out ...` -----------

def conversion_memory_section(run: dict) -> str:
    lines = ["## Converting and exporting checkpoints of several GB (CPU)", "", "```bash",
             f"HF_HUB_OFFLINE=1 .venv/bin/{command_of(run)}", "```", "",
             "Synthetic bf16 checkpoints in the files `save_pretrained` writes for their family (5 GB shards; Mixtral: "
             "one tensor per expert; gpt-oss as published, its experts in MXFP4 with gpt-oss-20b's widths, which "
             "dequantize to 4x their size), converted by `modular_decoder.conversion.convert` and exported back by "
             "`export`, each in a fresh process: the peak resident memory above the process's level after its imports and a "
             "warm-up conversion of a tiny checkpoint (`VmHWM`, reset there), and the wall seconds of reading and "
             "writing the whole checkpoint (disk-bound, on a shared machine).", "",
             "| layout | checkpoint | largest tensor | step | peak above the baseline | share of the checkpoint | "
             "seconds |", "|---|---:|---:|---|---:|---:|---:|"]
    for result in run["results"]:
        checkpoint = result["checkpoint"]
        for what in ("convert", "export"):
            row = result[what]
            converted = (f" (MXFP4 experts; {checkpoint['converted_bytes'] / 1e9:.2f} GB converted)"
                         if result["layout"] == "gpt_oss" else "")
            lines.append(f"| {result['layout']} ({checkpoint['layers']} layers) | {checkpoint['bytes'] / 1e9:.2f} GB in "
                         f"{checkpoint['files']} files{converted} | "
                         f"{checkpoint['largest_tensor_bytes'] / 2**20:.0f} MiB | {what} | "
                         f"{row['peak_above_mb']:.0f} MB | {100 * row['peak_fraction_of_checkpoint']:.1f}% | "
                         f"{row['seconds_median']:.0f} |")
    return "\n".join(lines)


# --- benchmarks/results_gpt_oss_smollm3.json: `python -m benchmarks run --families gpt_oss smollm3 ...` -------

def later_families_section(results: dict | None) -> str:
    """gpt-oss and SmolLM3 against their transformers classes: `run`'s table for the families measured after the
    seven of results.json (same harness, its own run)."""
    from . import run

    lines = ["## gpt-oss and SmolLM3 against transformers (CPU, fp32)", ""]
    if results is None:
        return not_recorded(lines, "run --families gpt_oss smollm3", "results_gpt_oss_smollm3.json")
    fams = results["families"]
    record = results["provenance"]
    timed = [v["all"] for r in fams.values() for metric in r["metrics"].values() for side, v in metric.items()
             if side in ("transformers", "ours") and isinstance(v, dict) and len(v.get("all", [])) > 1]
    lines += [
        *command_block(results),
        "The same harness and rules as the section above (`benchmarks/run.py`), for gpt-oss "
        "(`GptOssForCausalLM`, which has no SDPA path in transformers: eager there, SDPA with sinks here) and "
        "SmolLM3 (`SmolLM3ForCausalLM`), each against ours with the same weights, "
        f"{record['machine']['torch_threads']} torch threads"
        + (" (the split products need two: the ablation columns are not timed)"
           if record['machine']['torch_threads'] == 1 else "") + "; speed only (`--no-memory --no-train`).", "",
        run.table(results, _run_args(results)), "",
        f"- Prefill 1x{_run_args(results).prefill}: " + ", ".join(f"{f} {r['metrics']['prefill_1']['ratio']['ours']:.2f}x"
                                          for f, r in fams.items()) + "; batch-1 decode: "
        + ", ".join(f"{f} {r['metrics']['decode_1']['ratio']['ours']:.2f}x" + _without_split(r) + _in_turn(r)
                    for f, r in fams.items()) + ".",
        "", spread_note(timed, results),
    ]
    return "\n".join(lines)


def _in_turn(result: dict) -> str:
    """The note " (N.NNx by steps taken in turn)": transformers' median step over ours, where the run timed them."""
    row = result["metrics"].get("step_turns_1")
    return "" if row is None else f" ({1 / row['ratio']['ours']:.2f}x by steps taken in turn)"


def _without_split(result: dict) -> str:
    """The note " (N.NNx without the split products)" where the run timed that ablation (more than one thread)."""
    ratio = result["metrics"]["decode_1"]["ratio"].get("ours, no split products")
    return "" if ratio is None else f" ({ratio:.2f}x without the split products)"


@dataclass(frozen=True)
class Section:
    """One page section: the JSON files it reads (under benchmarks/) and how it renders them; an optional
    section's render takes `None` while its file has not been written."""
    sources: tuple[str, ...]
    render: Callable[..., str]
    optional: bool = False


SECTIONS = (
    Section(("results.json",), families_section),
    Section(("results_gpt_oss_smollm3.json",), later_families_section, optional=True),
    Section(("results_compiled_decode.json", "results.json"), compiled_section),
    Section(("results_serving.json",), serving_section),
    Section(("results_mla_prefill.json",), mla_prefill_section),
    Section(("results_conversion_memory.json",), conversion_memory_section),
    Section(("results_mla_crossover.json",), mla_crossover_section, optional=True),
    Section(("results_dsa_decode.json",), dsa_decode_section),
    Section(("results_hybrid.json",), hybrid_section),
    Section(("results_deepseek_v4.json",), deepseek_v4_section),
    Section(("results_topologies.json",), topologies_section),
    Section(("results_mixers.json",), mixers_section, optional=True),
    Section(("results_mamba2.json",), mamba2_section),
    Section(("results_hybrid_drafting.json",), hybrid_drafting_section, optional=True),
    Section(("results_split_threshold.json",), split_threshold_section, optional=True),
    Section(("results_split_auto.json", "results_split_auto_smollm2.json"), split_auto_section, optional=True),
    Section(("results_split_slices.json",), split_slices_section, optional=True),
    Section(("results_mtp_decode.json",), mtp_section, optional=True),
    Section(("results_draft_vocab.json",), draft_vocab_section, optional=True),
    Section(("results_sinks.json",), sinks_section, optional=True),
    Section(("results_gpu.json",), gpu_section, optional=True),
)

PAGE_HEADER = """# Benchmarks

<!-- Generated by `python -m benchmarks.pages` from the JSON files under benchmarks/: do not edit by hand.
     tests/test_readme.py checks that this page equals what the renderer produces. -->

Every figure below is computed from a benchmark's JSON output (the file named under each section). To add or
refresh one: run the benchmark with its JSON option into `benchmarks/`, then

```bash
HF_HUB_OFFLINE=1 .venv/bin/python -m benchmarks.pages
```

rewrites this page and the headline table in the README. Nothing here is asserted by a test: speed is measured
side by side in one process and read as ratios.
"""


def rendered(sections) -> list[str]:
    """Each section rendered from its JSON files, followed by each file's name and provenance line."""
    parts = []
    for section in sections:
        present = all((ROOT / "benchmarks" / name).exists() for name in section.sources)
        if not present and section.optional:
            parts.append(section.render(None) + "\n")
            continue
        data = [load(name) for name in section.sources]
        sources = [f"Source: `benchmarks/{name}`. {provenance_line(d)}" for name, d in zip(section.sources, data)]
        parts.append(section.render(*data) + "\n\n" + "\n".join(f"{line}\n" for line in sources))
    return parts


def page() -> str:
    return "\n".join([PAGE_HEADER, *rendered(SECTIONS)])


def every_section() -> tuple[Section, ...]:
    """The sections of every generated page: docs/benchmarks.md's and docs/reshape.md's recorded runs."""
    from .reshape_page import SECTIONS as RESHAPE_SECTIONS  # it builds on this module

    return SECTIONS + RESHAPE_SECTIONS


def headline() -> str:
    """The README's short table: one ratio per thing people ask about, each linked to its section."""
    results, compiled, serving = load("results.json"), load("results_compiled_decode.json"), load("results_serving.json")
    mla_prefill, dsa_decode = load("results_mla_prefill.json"), load("results_dsa_decode.json")
    mla_time, mla_memory = mla_prefill_ratios(mla_prefill)
    mla_shape = mla_prefill["shape"]
    fams = results["families"]
    runs = compiled["runs"]
    llama, family = "transformers' `LlamaForCausalLM`", "transformers' class of each family"
    section = "#speed-memory-and-training-against-transformers-cpu-fp32"
    rows = [
        ("batch-1 decode, SmolLM2-135M (eager)", llama,
         f"{fams['llama']['metrics']['decode_1']['ratio']['ours']:.2f}x", section),
        ("batch-1 decode, seven families (eager)", family, f"{span(ratios(results, 'decode_1').values())}x", section),
        ("batch-1 decode, SmolLM2-135M, both compiled", llama,
         f"{runs['ours/compiled']['median'] / runs['transformers/compiled']['median']:.2f}x",
         "#compiled-decoding-smollm2-135m-batch-1"),
        ("prefill 1x512, seven families", family, f"{span(ratios(results, 'prefill_1').values())}x", section),
        ("training step (full and LoRA), seven families", family,
         f"{span([*ratios(results, 'train_full').values(), *ratios(results, 'train_lora').values()])}x", section),
        ("largest decode batch in 1 GB, DeepSeek-V3 MLA layout", "transformers' `DeepseekV3ForCausalLM`",
         f"{fams['deepseek_v3']['metrics']['max_batch']['ratio']['ours']:.2f}x", section),
        ("served by vLLM, SmolLM2-135M (output tokens/s)", "vLLM's native Llama",
         f"{statistics.median(serving_rounds(serving)):.2f}x", "#serving-through-vllm-cpu-fp32"),
        (f"MLA chunked prefill, {mla_shape['tokens'] / 1024:g}k tokens in {mla_shape['chunk'] / 1024:g}k chunks: "
         "speed / peak memory", "transformers' `DeepseekV3ForCausalLM`", f"{1 / mla_time:.2f}x / {mla_memory:.2f}x",
         "#mla-chunked-prefill-cpu-fp32"),
        *dsa_decode_headline(dsa_decode),
    ]
    lines = ["| measured on a 2-core CPU, fp32 | against | ours / it |", "|---|---|---:|"]
    lines += [f"| [{what}](docs/benchmarks.md{anchor}) | {against} | {ratio} |" for what, against, ratio, anchor in rows]
    loads = [load for data in (results, compiled, serving, mla_prefill, dsa_decode) if "provenance" in data
             for load in (data["provenance"]["load_average_start"][0], data["provenance"]["load_average_end"][0])]
    if loads:
        lines += ["", f"The machine is shared: its 1-minute load average was {min(loads):.1f} to {max(loads):.1f} while "
                  "these were measured (each source's commit, versions and load: docs/benchmarks.md)."]
    return "\n".join(lines)


def dsa_decode_headline(run: dict) -> list[tuple[str, str, str, str]]:
    """The README's rows for the longest context measured: ours' DSA step against dense MLA and against
    transformers' class (where its step ran)."""
    from .dsa_decode import DENSE, OURS, REFERENCE

    row = max(run["rows"], key=lambda r: r["context"])
    anchor = "#deepseek-sparse-attention-one-decode-step-against-dense-mla-cpu-fp32"
    threads = run["provenance"]["machine"]["torch_threads"]
    what = (f"DeepSeek Sparse Attention decode step, {row['context'] / 1024:g}k cached, top-k "
            f"{run['shape']['index_topk']:,} (one layer, {threads} torch thread{'s' * (threads != 1)})")
    seconds = row["seconds"]
    rows = [(what, "dense MLA (ours, same weights)", f"{seconds[DENSE] / seconds[OURS]:.2f}x", anchor)]
    if REFERENCE in seconds:
        rows.append((what, "transformers' `DeepseekV32ForCausalLM`", f"{seconds[REFERENCE] / seconds[OURS]:,.0f}x", anchor))
    return rows


def _between(text: str, start: str, end: str, body: str, name: str) -> str:
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise ValueError(f"{name} has no {start} ... {end} markers.")
    return pattern.sub(lambda _: f"{start}\n{body}\n{end}", text)


def readme_with_headline(readme: str) -> str:
    return _between(readme, HEADLINE_START, HEADLINE_END, headline(), "README.md")


def benchmark_list() -> str:
    """benchmarks/README.md's table: every registered benchmark, what it measures, the JSON it commits."""
    from .registry import BENCHMARKS

    here = ROOT / "benchmarks"

    def source(module: str) -> str:  # a module, or a package (the GPU matrix)
        return f"benchmarks/{module}/" if (here / module).is_dir() else f"benchmarks/{module}.py"

    def result(writes: str | None) -> str:
        if writes is None:
            return "—"
        return f"`benchmarks/{writes}`" if (here / writes).exists() else f"none yet (it writes `benchmarks/{writes}`)"

    lines = ["| `python -m benchmarks NAME` | measures | committed result |", "|---|---|---|"]
    lines += [f"| `{b.name}` (`{source(b.module)}`) | {b.measures} | {result(b.writes)} |" for b in BENCHMARKS]
    return "\n".join(lines)


def benchmarks_readme_with_list(text: str) -> str:
    return _between(text, LIST_START, LIST_END, benchmark_list(), "benchmarks/README.md")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a page is stale")
    args = parser.parse_args(argv)
    from . import reshape_page  # it builds on this module

    wanted = {PAGE: page(), README: readme_with_headline(README.read_text()),
              BENCHMARKS_README: benchmarks_readme_with_list(BENCHMARKS_README.read_text()),
              reshape_page.PAGE: reshape_page.page_with_runs(reshape_page.PAGE.read_text())}
    stale = [path for path, text in wanted.items() if not path.exists() or path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"{path.relative_to(ROOT)} is stale: run python -m benchmarks.pages", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(wanted[path])
        tmp.replace(path)
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
