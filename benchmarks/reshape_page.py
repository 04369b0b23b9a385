"""docs/reshape.md's recorded runs, rendered by `python -m benchmarks.pages` between the page's
`<!-- reshape-runs:start -->` and `<!-- reshape-runs:end -->` markers from the JSON that `python -m benchmarks
reshape_smollm2` and `python -m benchmarks reshape_mla` write (`--out`); the prose around the markers is the page's
own. `tests/test_readme.py` checks that the committed page equals what this module renders.
"""

from __future__ import annotations

from .pages import ROOT, Section, _between, command_block, rendered

PAGE = ROOT / "docs" / "reshape.md"
RUNS_START, RUNS_END = "<!-- reshape-runs:start -->", "<!-- reshape-runs:end -->"


def perplexity_cell(value: float) -> str:
    """Four significant figures or so: 40.96, 113.8, 15,836."""
    return f"{value:.2f}" if value < 100 else f"{value:.1f}" if value < 1000 else f"{value:,.0f}"


def bytes_cell(value: float, source: float) -> str:
    """Bytes per token, with the change from the source's where there is one."""
    change = 100 * (value / source - 1)
    return f"{value:,.0f}" + (f" ({change:+.0f}%)" if round(change) else "")


def logit_cell(value: float | None) -> str:
    return "" if value is None else "0" if value == 0 else f"{value:.1e}" if value < 0.01 else f"{value:.1f}"


# what each reshape of reshape_smollm2 is, beside its options
SMOLLM2_NOTES = {"--kv-heads 9": "GQA -> MHA", "--kv-heads 1": "MQA, mean pooling, training-free",
                 "--kv-heads 1 --kv-pool first": "baseline", "--kv-heads 1 --kv-pool random": "baseline"}


def smollm2_label(row: dict) -> str:
    label = row["reshape"]
    if label == "source":
        return label
    note = SMOLLM2_NOTES.get(label)
    if "removed" in row:
        note = f"removes layers {min(row['removed'])}-{max(row['removed'])}"
    if "gap_closed" in row:
        lr = f"{row['learning_rate']:.0e}".replace("e-0", "e-")
        note = f"lr {lr}; closes {row['gap_closed']:.0%} of the perplexity gap"
    return f"`{label}`" + (f" ({note})" if note else "")


def smollm2_section(run: dict) -> str:
    shape, rows = run["source"], run["rows"]
    source = rows[0]
    lines = [
        "### Each reshape of SmolLM2-135M-Instruct", "",
        *command_block(run),
        f"fp32; held-out perplexity on a {run['held_out_tokens']}-token English paragraph the reshape never saw, "
        f"calibration and healing on another {run['calibration_tokens']} tokens (`tests/test_reshape.py`: "
        "`HELD_OUT_TEXT`, `CALIBRATION_TEXT`); KV bytes per token measured from the cache tensors after a forward, "
        "fp32, all layers; the largest logit difference from the source on the held-out text; the seconds the "
        "transformation took. `tests/test_reshape.py` checks each claim (the upcycled model also exports to "
        "`MixtralForCausalLM` with the same logits).", "",
        f"| reshape of SmolLM2-135M ({shape['num_attention_heads']} query heads, {shape['num_key_value_heads']} K/V "
        f"heads of {shape['head_dim']}, {shape['num_hidden_layers']} layers) | parameters | KV bytes / token | "
        "held-out perplexity | largest logit difference | transform s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        parameters = f"{row['parameters']:,}" + (f" ({row['active_parameters']:,} active)"
                                                if row["active_parameters"] != row["parameters"] else "")
        seconds = f"{row['transform_s']:.1f}" if "transform_s" in row else ""
        lines.append(f"| {smollm2_label(row)} | {parameters} | "
                     f"{bytes_cell(row['kv_cache_bytes_per_token'], source['kv_cache_bytes_per_token'])} | "
                     f"{perplexity_cell(row['perplexity'])} | {logit_cell(row.get('max_logit_diff'))} | {seconds} |")
    return "\n".join(lines)


def mla_section(run: dict) -> str:
    config, arguments, rope = run["config"], run["provenance"]["arguments"], run["rope_dim"]
    source, mla, rank = run["source"], run["mla"], arguments["rank"]
    full_rank = 2 * config["num_key_value_heads"] * config["head_dim"] - rope  # K without its RoPE part, and V
    calibration = (f"{arguments['calibration_rows']} x {arguments['tokens']} tokens of `{arguments['calibration']}`"
                   if arguments["calibration"] else
                   f"{arguments['calibration_rows']} x {arguments['tokens']} tokens sampled from the model (seed 0)")
    heldout = run["heldout"]
    lines = [
        "### SmolLM2-135M-Instruct -> MLA", "",
        *command_block(run),
        f"GQA -> MLA (`--attention mla`, TransMLA's steps), fp32, {run['threads']} torch thread(s): calibration "
        f"{calibration}, held-out perplexity on {heldout['tokens']:,} tokens of `{heldout['text']}` (so not "
        "comparable with the table above); KV bytes per token measured from the latent cache after a forward, "
        f"(R + {rope}) x 4 x {config['num_hidden_layers']}.", "",
        f"| SmolLM2-135M -> MLA, `--rope-dim {rope}` | KV bytes / token | held-out perplexity | the same rank from a "
        "plain SVD of the weights |",
        "|---|---:|---:|---:|",
        f"| source (GQA, {config['num_key_value_heads']} x {config['head_dim']} K/V) | "
        f"{source['kv_bytes_per_token']:,.0f} | {perplexity_cell(source['ppl'])} | |",
        f"| partial RoPE (RoRoPE, then RoPE on {rope} dims) | | {perplexity_cell(run['partial_rope_ppl'])} | |",
        f"| partial RoPE without the RoRoPE rotation | | {perplexity_cell(run['partial_rope_without_rorope_ppl'])} | |",
    ]
    for r, row in sorted(mla.items(), key=lambda item: int(item[0])):
        full = " (full rank)" if int(r) == full_rank else ""
        cache = bytes_cell(row["kv_bytes_per_token"], source["kv_bytes_per_token"])
        lines.append(f"| `--kv-lora-rank {r}`{full} | {cache} | {perplexity_cell(row['ppl'])} | "
                     f"{perplexity_cell(row['svd_ppl'])} |")
    sampling, timed, loaded = run["calibration_sampling"], run[f"to_mla_rank_{rank}"], run["rss_after_load_mib"]
    lines += [
        "", f"With an RMSNorm on the latent (`to_mla(..., latent_norm=True)`, the form that exports to "
        f"`DeepseekV3ForCausalLM`), rank {rank} gives {perplexity_cell(run[f'mla_{rank}_latent_norm_ppl'])} before "
        f"healing. Sampling the calibration took {sampling['wall_s']:.0f} s ({sampling['cpu_s']:.0f} s of CPU); "
        f"`to_mla` at rank {rank}, its calibration pass included, {timed['wall_s']:.0f} s ({timed['cpu_s']:.0f} s of "
        f"CPU). The process's resident high-water mark: {loaded:,.0f} MiB once the model was loaded (its weights "
        f"{run['model_mib']:.0f} MiB), {timed['peak_rss_mib']:,.0f} MiB after `to_mla`.",
    ]
    return "\n".join(lines)


SECTIONS = (
    Section(("results_reshape_smollm2.json",), smollm2_section),
    Section(("results_reshape_mla.json",), mla_section),
)


def runs() -> str:
    return "\n".join(rendered(SECTIONS)).rstrip("\n")


def page_with_runs(text: str) -> str:
    """docs/reshape.md's text with its recorded runs rendered from the committed JSON."""
    return _between(text, RUNS_START, RUNS_END, runs(), "docs/reshape.md")
