"""A matched-budget ablation: small variants trained for the same number of tokens on CPU.

Every variant changes one axis of a small base (pre-norm RMSNorm, dense GELU FFN of width 4d,
MHA, RoPE, serial block) and trains on the generated corpus (`corpus.py`) with the same token
budget, batch and schedule, once per seed (`--seeds`, default 3; every variant sees the same data,
initialisation seed and batch order for a given seed). FFN variants are parameter-matched (gated
width 8d/3); head-sharing variants are not (GQA/MQA/MLA have fewer attention weights; the table
shows the counts).

Dense vs mixture of experts at matched active parameters and matched tokens: two MoE variants whose
experts are SwiGLU MLPs and whose active parameters per token (`parameter_count(config)["active"]`)
equal the dense SwiGLU (8d/3) variant's up to the router (E·d per layer): 4 experts of the dense
width, top-1; 8 experts of half the width, top-2. Their routers train with the load-balancing loss
(coefficient 0.01); the losses reported are the language-model cross-entropy alone.

Reported per variant: parameters (total and active), final training loss (mean of the last tenth of
the steps), held-out loss, tokens/s, each as the mean over seeds with its min-max range, and cache
bytes per token (`contract.cache_bytes_per_token`, bf16).
"""

from __future__ import annotations

import json
import statistics
import time

import torch
from transformers import AutoModelForCausalLM

from modular_decoder.configuration_modular_decoder import ModularDecoderConfig
from modular_decoder.contract import cache_bytes_per_token, parameter_count
from . import corpus
from .ffn_budget import gated_width

D, LAYERS, HEADS, SEQ, BATCH = 128, 4, 4, 64, 16
BASE = dict(vocab_size=corpus.VOCAB_SIZE, hidden_size=D, intermediate_size=4 * D, num_hidden_layers=LAYERS,
            num_attention_heads=HEADS, max_position_embeddings=SEQ, norm_type="rmsnorm", norm_position="pre",
            mlp_type="dense", hidden_act="gelu", position_embedding_type="rope", tie_word_embeddings=True)

GATED = gated_width(D, multiple_of=8)  # 344: the SwiGLU width of the same parameters as 4d GELU
MOE = dict(mlp_type="moe", hidden_act="silu", output_router_logits=True, router_aux_loss_coef=0.01)
# name -> overrides of BASE (one axis each)
VARIANTS: dict[str, dict] = {
    "pre-norm (base)": {},
    "post-norm": dict(norm_position="post"),
    "sandwich-norm": dict(norm_position="sandwich"),
    "SwiGLU (8d/3)": dict(mlp_type="gated", hidden_act="silu", intermediate_size=GATED),
    "GQA (2 kv heads)": dict(num_key_value_heads=2),
    "MQA (1 kv head)": dict(num_key_value_heads=1),
    "MLA (d_c=32)": dict(attention_type="mla", kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16,
                          v_head_dim=32),
    "parallel block": dict(parallel_block=True, parallel_norms="shared"),
    # active parameters of the SwiGLU variant: one expert of its width (a top-1 router keeps its
    # probability as the weight, so the router learns), or two of half its width
    "MoE 4 experts top-1": dict(MOE, num_experts=4, num_experts_per_tok=1, moe_intermediate_size=GATED,
                                norm_topk_prob=False),
    "MoE 8 experts top-2, half width": dict(MOE, num_experts=8, num_experts_per_tok=2,
                                            moe_intermediate_size=GATED // 2, norm_topk_prob=True),
}
# the dense variant the MoE rows are matched to (active parameters, tokens)
MOE_BASELINE = "SwiGLU (8d/3)"
DEFAULT_SEEDS = 3


def config_for(name: str) -> ModularDecoderConfig:
    if name not in VARIANTS:
        raise ValueError(f"Unknown variant {name!r}; known: {list(VARIANTS)}.")
    return ModularDecoderConfig(**dict(BASE, **VARIANTS[name]))


def train(name: str, tokens: int, seed: int = 0, lr: float = 3e-3, data: torch.Tensor | None = None) -> dict:
    """Train variant `name` for `tokens` tokens (AdamW, 10% warm-up, cosine decay); return its row."""
    config = config_for(name)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    ids = corpus.token_ids(300_000, seed) if data is None else data
    split = int(0.9 * len(ids))
    train_stream = corpus.batches(ids[:split], BATCH, SEQ, seed)
    held_out = torch.stack(list(_take(corpus.batches(ids[split:], BATCH, SEQ, seed + 1), 4)))
    steps = max(1, tokens // (BATCH * SEQ))
    warm = max(1, steps // 10)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warm, 0.5 * (1 + torch.cos(torch.tensor(s / steps * torch.pi)).item())))
    losses = []
    model.train()
    start = time.perf_counter()
    for _ in range(steps):
        batch = next(train_stream)
        out = model(batch, labels=batch, use_cache=False)
        out.loss.backward()  # with the router losses for the MoE variants
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step(), schedule.step(), optimizer.zero_grad(set_to_none=True)
        losses.append(_cross_entropy(out, config))
    elapsed = time.perf_counter() - start
    model.eval()
    with torch.no_grad():
        held = sum(model(b, labels=b, use_cache=False, output_router_logits=False).loss.item()
                   for b in held_out) / len(held_out)
    tail = losses[-max(1, steps // 10):]
    counts = parameter_count(config)
    return {"name": name, "seed": seed, "params": model.num_parameters(), "active_params": counts["active"],
            "train_loss": sum(tail) / len(tail), "held_out_loss": held, "tokens_per_s": steps * BATCH * SEQ / elapsed,
            "cache_bytes_per_token": cache_bytes_per_token(config, torch.bfloat16), "losses": losses,
            "steps": steps}


def _cross_entropy(out, config) -> float:
    """The language-model loss of a step: `loss` less the coefficient-weighted router losses."""
    loss = out.loss.item()
    if getattr(out, "aux_loss", None) is not None:
        loss -= config.router_aux_loss_coef * out.aux_loss.item()
    if getattr(out, "z_loss", None) is not None:
        loss -= config.router_z_loss_coef * out.z_loss.item()
    return loss


def _take(iterator, n):
    for _ in range(n):
        yield next(iterator)


def seed_list(seeds: int, first: int = 0) -> list[int]:
    if seeds < 1:
        raise ValueError(f"`seeds`={seeds} must be at least 1.")
    return list(range(first, first + seeds))


def run(tokens: int, names: list[str] | None = None, seed: int = 0, seeds: int = DEFAULT_SEEDS,
        progress=print) -> list[dict]:
    """Every variant trained once per seed (seeds `seed`, `seed`+1, ...); one summary row per variant
    (`summarise`), its per-seed rows under "runs"."""
    names = names or list(VARIANTS)
    for name in names:
        config_for(name)  # unknown names fail before any training
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for s in seed_list(seeds, seed):
        data = corpus.token_ids(300_000, s)
        for name in names:
            row = train(name, tokens, s, data=data)
            runs[name].append(row)
            progress(f"seed {s} {name:32s} loss {row['train_loss']:.3f} held-out {row['held_out_loss']:.3f} "
                     f"{row['tokens_per_s']:,.0f} tok/s")
    return [summarise(rows) for rows in runs.values()]


def _spread(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values),
            "std": statistics.stdev(values) if len(values) > 1 else 0.0, "all": values}


def summarise(rows: list[dict]) -> dict:
    """One variant's per-seed rows as mean / min / max / sample std of each measured value."""
    first = rows[0]
    return {"name": first["name"], "params": first["params"], "active_params": first["active_params"],
            "cache_bytes_per_token": first["cache_bytes_per_token"], "steps": first["steps"],
            "seeds": [r["seed"] for r in rows],
            **{key: _spread([r[key] for r in rows]) for key in ("train_loss", "held_out_loss", "tokens_per_s")},
            "runs": rows}


def _range(stats: dict, digits: int = 3) -> str:
    if len(stats["all"]) == 1:
        return f"{stats['mean']:.{digits}f}"
    return f"{stats['mean']:.{digits}f} ({stats['min']:.{digits}f}–{stats['max']:.{digits}f})"


def markdown(results: list[dict], tokens: int) -> str:
    seeds = results[0]["seeds"]
    lines = [f"Budget: {tokens:,} tokens per variant and seed ({results[0]['steps']} steps of {BATCH}×{SEQ}), "
             f"d={D}, {LAYERS} layers, {HEADS} heads, byte vocabulary, generated corpus; {len(seeds)} seed"
             f"{'s' if len(seeds) > 1 else ''} ({', '.join(map(str, seeds))}), each variant seeing the same data, "
             f"initialisation seed and batch order per seed. Losses: mean over the seeds (min–max in brackets).", "",
             "| variant | parameters | active / token | final train loss | held-out loss | tokens/s | "
             "cache bytes/token (bf16) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        lines.append(f"| {r['name']} | {r['params']:,} | {r['active_params']:,} | {_range(r['train_loss'])} | "
                     f"{_range(r['held_out_loss'])} | {r['tokens_per_s']['mean']:,.0f} | "
                     f"{r['cache_bytes_per_token']:,} |")
    matched = moe_arithmetic([r["name"] for r in results])
    if matched:
        lines += ["", matched]
    return "\n".join(lines)


def moe_arithmetic(names: list[str]) -> str:
    """The matched-active-parameter arithmetic of the MoE rows present, from `parameter_count`."""
    moe = [n for n in names if VARIANTS[n].get("mlp_type") == "moe"]
    if not moe:
        return ""
    dense = parameter_count(config_for(MOE_BASELINE))["active"]
    parts = []
    for name in moe:
        config = config_for(name)
        active = parameter_count(config)["active"]
        router = LAYERS * config.num_experts * D
        parts.append(f"{name}: {config.num_experts_per_tok} × 3·{D}·{config.moe_intermediate_size} per layer "
                     f"= {active:,} active ({active - dense:+,} = the router's {config.num_experts}·{D} per layer "
                     f"× {LAYERS}: {100 * (active - dense) / dense:+.2f}%)" if active - dense == router else
                     f"{name}: {active:,} active ({active - dense:+,})")
    return (f"Matched active parameters (`parameter_count(config)['active']`): {MOE_BASELINE} {dense:,} "
            f"(3·{D}·{GATED} per layer); " + "; ".join(parts) + ".")


def write_json(results: list[dict], path) -> None:
    from pathlib import Path

    Path(path).write_text(json.dumps(results, indent=1))


def _smooth(values: list[float]) -> list[float]:
    window = max(1, len(values) // 20)
    return [sum(values[max(0, i - window + 1): i + 1]) / len(values[max(0, i - window + 1): i + 1])
            for i in range(len(values))]


def plot(results: list[dict], path) -> None:
    """Loss against tokens (one line per variant: the mean over seeds, its band the min-max range) and
    each variant's held-out loss (mean, min-max bars; its cache bytes per token in the label)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves, scatter) = plt.subplots(1, 2, figsize=(14, 5.5), gridspec_kw={"width_ratios": [3, 2]})
    colours = plt.get_cmap("tab10" if len(results) <= 10 else "tab20")
    for i, r in enumerate(results):
        colour = colours(i % colours.N)
        per_seed = [_smooth(run["losses"]) for run in r["runs"]]
        tokens = [(step + 1) * BATCH * SEQ for step in range(len(per_seed[0]))]
        columns = list(zip(*per_seed))
        mean = [sum(c) / len(c) for c in columns]
        style = "--" if VARIANTS.get(r["name"], {}).get("mlp_type") == "moe" else "-"
        curves.plot(tokens, mean, style, color=colour, label=r["name"], linewidth=1.3)
        if len(per_seed) > 1:
            curves.fill_between(tokens, [min(c) for c in columns], [max(c) for c in columns], color=colour,
                                alpha=0.18, linewidth=0)
        held = r["held_out_loss"]
        scatter.errorbar(held["mean"], i, color=colour, fmt="o",
                         xerr=[[held["mean"] - held["min"]], [held["max"] - held["mean"]]], capsize=3)
    seeds = len(results[0]["runs"])
    curves.set_xlabel("training tokens"), curves.set_ylabel("training loss (cross-entropy, smoothed)")
    curves.set_title(f"matched token budget: mean over {seeds} seed{'s' if seeds > 1 else ''}, band min–max")
    curves.legend(fontsize=7)
    scatter.set_yticks(range(len(results)), [f"{r['name']}\n{r['cache_bytes_per_token']:,} cache B/token (bf16)"
                                             for r in results], fontsize=7)
    scatter.invert_yaxis()
    scatter.set_xlabel("held-out loss"), scatter.grid(axis="x", alpha=0.3)
    scatter.set_title("held-out loss (mean, min–max over seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def page(results: list[dict], tokens: int, command: str, image: str) -> str:
    """The ablation page (`docs/ablation/ablation.md`): command, table, plot, and how to read them."""
    seeds = len(results[0]["runs"])
    return "\n".join([
        "# Ablation (matched token budget, CPU)", "", "```bash", command, "```", "",
        markdown(results, tokens), "",
        f"![Training loss against tokens, one line per variant (mean over seeds) with its min–max band; "
        f"held-out loss against cache bytes]({image})", "",
        f"{seeds} seed{'s' if seeds > 1 else ''} per variant: read a difference smaller than the min–max ranges "
        "as unproven. The table shows what each variant costs (parameters, active parameters per token, tokens/s on "
        "a shared 2-core CPU, cache bytes per token from the contract) as much as how it trains. FFN variants are "
        "parameter-matched (gated width 8d/3); GQA/MQA/MLA have fewer attention weights; the MoE rows match the "
        f"{MOE_BASELINE} row's active parameters and tokens (and hold about 3x its total parameters). "
        "`modular-decoder experiment gradnorm` and `experiment ffn-budget` reproduce the other seed measurements.",
    ])
