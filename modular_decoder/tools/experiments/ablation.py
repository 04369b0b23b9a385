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

Hybrid vs full attention at matched tokens: Gated DeltaNet linear-attention layers with full attention every 4th
(3:1, Qwen3-Next's and Qwen3.5's pattern) or every 2nd layer (1:1), against the base's full attention in every
layer. The linear layers have 2 key and 4 value heads of the base's head width (Qwen3-Next's grouped value
heads), which nearly matches an attention layer's parameters (`hybrid_arithmetic` gives the difference); a
control keeps the 3:1 pattern with a one-tap convolution (no token mixing before the delta rule). A Mamba-2 3:1
hybrid puts Mamba-2 mixers in the same layers (expand 1: 4 heads of the base's head width, one group of state width
64, a 4-tap convolution; Mamba-2's usual expand 2 would hold about 1.5 times an attention layer's parameters), a KDA
3:1 hybrid Kimi Delta Attention (3 heads of the base's head width: 4 would hold 1.28 times attention's parameters)
and a short-convolution 3:1 hybrid LFM2's gated short convolution (its in and out projections hold attention's 4d²;
4 taps, as the other mixers' convolutions).

Residual streams at equal parameters: hyper-connections (DeepSeek-V4's, 4 streams), per-layer embeddings (Gemma 3n's,
16 wide: d/8, Gemma 3n's ratio) and AltUp (Gemma 3n's, 4 streams), each on the base's pre-norm layout (a combination
no published family ships) with the FFN narrowed until the total parameters come nearest the base's
(`equal_parameters`; `stream_arithmetic` gives the counts). A control keeps one stream with the hyper-connections
row's narrower FFN (`NARROW_FFN_CONTROL`): what the width given up costs alone.

The hybrids' and the residual streams' rows are compared with the base seed by seed (`paired_comparison`): the runs
of one seed share data, initialisation seed and batch order, so the paired difference is the measure, not the
overlap of ranges.

Reported per variant: parameters (total and active), final training loss (mean of the last tenth of
the steps), held-out loss, tokens/s, each as the mean over seeds with its min-max range, cache bytes per
token (`contract.cache_bytes_per_token`, bf16) and the linear layers' constant state per sequence
(`contract.state_bytes_per_sequence`, bf16 window + fp32 state).
"""

from __future__ import annotations

import json
import statistics
import time

import torch
from transformers import AutoModelForCausalLM

from modular_decoder.configuration_modular_decoder import ModularDecoderConfig
from modular_decoder.contract import cache_bytes_per_token, parameter_count, state_bytes_per_sequence
from modular_decoder.tools import provenance
from . import corpus
from .ffn_budget import gated_width

D, LAYERS, HEADS, SEQ, BATCH = 128, 4, 4, 64, 16
BASE = dict(vocab_size=corpus.VOCAB_SIZE, hidden_size=D, intermediate_size=4 * D, num_hidden_layers=LAYERS,
            num_attention_heads=HEADS, max_position_embeddings=SEQ, norm_type="rmsnorm", norm_position="pre",
            mlp_type="dense", hidden_act="gelu", position_embedding_type="rope", tie_word_embeddings=True)

GATED = gated_width(D, multiple_of=8)  # 344: the SwiGLU width of the same parameters as 4d GELU
MOE = dict(mlp_type="moe", hidden_act="silu", output_router_logits=True, router_aux_loss_coef=0.01)
# Gated DeltaNet layers of 2 key / 4 value heads of the base's head width: 67,624 parameters against attention's 65,536
LINEAR = dict(linear_attention_type="gated_deltanet", linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=D // HEADS, linear_value_head_dim=D // HEADS)
# Mamba-2 layers at expand 1 (4 heads of the base's head width, one group, state width 64, 4 taps): 67,468
# parameters against attention's 65,536
MAMBA2 = dict(linear_attention_type="mamba2", mamba_n_heads=HEADS, mamba_d_head=D // HEADS, mamba_n_groups=1,
              mamba_d_state=64, mamba_d_conv=4)
# KDA layers of 3 heads of the base's head width (key heads = value heads, as KDA requires), a 4-tap convolution:
# 65,155 parameters against attention's 65,536 (4 heads: 84,132)
KDA = dict(linear_attention_type="kda", linear_num_key_heads=3, linear_num_value_heads=3,
           linear_key_head_dim=D // HEADS, linear_value_head_dim=D // HEADS, linear_conv_kernel_dim=4)
# LFM2's gated short convolution, 4 taps like the other mixers' convolutions (LFM2's own: 3): 4d² + 4d = 66,048
# parameters against attention's 65,536
SHORT_CONV = dict(linear_attention_type="short_conv", linear_conv_kernel_dim=4)
# the linear-attention kind's name in the page's prose
MIXER_NAMES = {"gated_deltanet": "Gated DeltaNet", "mamba2": "Mamba-2", "kda": "KDA", "short_conv": "short-convolution"}


def equal_parameters(overrides: dict) -> dict:
    """`overrides` with the base's FFN narrowed so the total parameters come nearest the base's: what the variant adds
    is paid from the FFN's width (each unit of width holds 2·d parameters per layer)."""
    base = parameter_count(ModularDecoderConfig(**BASE))["total"]
    added = parameter_count(ModularDecoderConfig(**dict(BASE, **overrides)))["total"] - base
    return dict(overrides, intermediate_size=BASE["intermediate_size"] - round(added / (2 * D * LAYERS)))


def hybrid(full_attention_interval: int, mixer: dict = LINEAR) -> dict:
    """`mixer`'s linear-attention layers with full attention every `full_attention_interval`-th layer (Qwen3-Next's
    rule)."""
    return dict(mixer, layer_types=["full_attention" if (i + 1) % full_attention_interval == 0 else
                                    "linear_attention" for i in range(LAYERS)])


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
    "Gated DeltaNet 3:1 hybrid": hybrid(4),
    "Gated DeltaNet 1:1 hybrid": hybrid(2),
    # the 3:1 hybrid without the short convolution's token mixing (one tap: a per-channel scale): what the
    # delta rule brings alone
    "Gated DeltaNet 3:1 hybrid, 1-tap conv": dict(hybrid(4), linear_conv_kernel_dim=1),
    "Mamba-2 3:1 hybrid": hybrid(4, MAMBA2),
    "KDA 3:1 hybrid": hybrid(4, KDA),
    "short-conv 3:1 hybrid": hybrid(4, SHORT_CONV),
    "hyper-connections (4 streams)": equal_parameters(dict(residual_stream="hyper_connections", hc_mult=4)),
    "per-layer embeddings (16 wide)": equal_parameters(dict(hidden_size_per_layer_input=D // 8)),
    "AltUp (4 streams)": equal_parameters(dict(residual_stream="altup", altup_num_inputs=4)),
}
# the base with the FFN as narrow as the hyper-connections row's: what the narrower FFN costs with one stream
NARROW_FFN = VARIANTS["hyper-connections (4 streams)"]["intermediate_size"]
NARROW_FFN_CONTROL = f"pre-norm, FFN {NARROW_FFN} (control)"
VARIANTS[NARROW_FFN_CONTROL] = dict(intermediate_size=NARROW_FFN)
# the dense variant the MoE rows are matched to (active parameters, tokens)
MOE_BASELINE = "SwiGLU (8d/3)"
# the variant the hybrid and residual-stream rows are compared with, seed by seed (one stream, full attention in
# every layer, the same block otherwise)
BASELINE = "pre-norm (base)"
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
            "cache_bytes_per_token": cache_bytes_per_token(config, torch.bfloat16),
            "state_bytes_per_sequence": state_bytes_per_sequence(config, torch.bfloat16), "losses": losses,
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
            "cache_bytes_per_token": first["cache_bytes_per_token"],
            "state_bytes_per_sequence": first["state_bytes_per_sequence"], "steps": first["steps"],
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
             "cache bytes/token (bf16) | state bytes/sequence |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        lines.append(f"| {r['name']} | {r['params']:,} | {r['active_params']:,} | {_range(r['train_loss'])} | "
                     f"{_range(r['held_out_loss'])} | {r['tokens_per_s']['mean']:,.0f} | "
                     f"{r['cache_bytes_per_token']:,} | {r['state_bytes_per_sequence']:,} |")
    names = [r["name"] for r in results]
    for paragraph in (moe_arithmetic(names), hybrid_arithmetic(names), stream_arithmetic(names),
                      paired_comparison(results)):
        if paragraph:
            lines += ["", paragraph]
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


def _is_hybrid(name: str) -> bool:
    return "linear_attention" in VARIANTS[name].get("layer_types", ())


def _is_stream_variant(name: str) -> bool:
    """A residual-stream variant: several streams, or per-layer embeddings beside the one stream."""
    variant = VARIANTS[name]
    return variant.get("residual_stream", "single") != "single" or bool(variant.get("hidden_size_per_layer_input"))


def _is_paired(name: str) -> bool:
    """A row compared with the base seed by seed: a hybrid, a residual-stream variant or the narrower FFN's control."""
    return name in VARIANTS and (_is_hybrid(name) or _is_stream_variant(name) or name == NARROW_FFN_CONTROL)


def hybrid_arithmetic(names: list[str]) -> str:
    """What each hybrid row present changes against the all-attention base: parameters (`parameter_count`), cache
    bytes per token and the constant state per sequence (`contract`)."""
    hybrids = [n for n in names if _is_hybrid(n)]
    if not hybrids:
        return ""
    base = config_for(BASELINE)
    base_total, attention = parameter_count(base)["total"], parameter_count(base)["attention"] // LAYERS
    parts = []
    for name in hybrids:
        config = config_for(name)
        counts, linear = parameter_count(config), config.layer_types.count("linear_attention")
        per_layer = counts["linear_attention"] // linear
        mixer, taps = _mixer_of(config)
        parts.append(f"{name}: layers {', '.join(t.split('_')[0] for t in config.layer_types)}; {linear} {mixer} "
                     f"layer{'s' if linear > 1 else ''} ({taps}-tap convolution) of "
                     f"{per_layer:,} parameters in place of attention's "
                     f"{attention:,} ({counts['total'] - base_total:+,} in all, "
                     f"{100 * (counts['total'] - base_total) / base_total:+.2f}%); cache "
                     f"{cache_bytes_per_token(config):,} bytes/token against {cache_bytes_per_token(base):,}, plus "
                     f"{state_bytes_per_sequence(config):,} bytes per sequence whatever its length")
    shapes = {_mixer_of(config)[0]: _mixer_shape(config) for config in map(config_for, hybrids)}
    return (f"Hybrids against {BASELINE} (every layer full attention; "
            + "; ".join(f"{mixer} layers: {shape}" for mixer, shape in shapes.items()) + "): " + "; ".join(parts) + ".")


def _mixer_shape(config: ModularDecoderConfig) -> str:
    """A hybrid's mixer layer sized in its own fields, as the page names them."""
    kind = config.linear_attention_type
    if kind == "mamba2":
        return (f"{config.mamba_n_heads} heads of {config.mamba_d_head}, {config.mamba_n_groups} group of state width "
                f"{config.mamba_d_state}")
    if kind == "short_conv":
        return "projections d → 3d and d → d"
    if config.linear_num_key_heads == config.linear_num_value_heads:
        return f"{config.linear_num_key_heads} heads of {config.linear_key_head_dim}"
    return (f"{config.linear_num_key_heads} key and {config.linear_num_value_heads} value heads of "
            f"{config.linear_key_head_dim}")


def _mixer_of(config: ModularDecoderConfig) -> tuple[str, int]:
    """A hybrid's linear-attention kind as the page names it, and its convolution's taps."""
    kind = config.linear_attention_type
    taps = config.mamba_d_conv if kind == "mamba2" else config.linear_conv_kernel_dim
    return MIXER_NAMES.get(kind, kind), taps


def stream_arithmetic(names: list[str]) -> str:
    """What each residual-stream row present adds against the base (`parameter_count`: the streams' and the
    per-layer embeddings' parameters) and what the narrower FFN gives back (`equal_parameters`)."""
    streams = [n for n in names if _is_stream_variant(n)]
    if not streams:
        return ""
    base = parameter_count(config_for(BASELINE))
    parts = []
    for name in streams:
        config, counts = config_for(name), parameter_count(config_for(name))
        added = counts.get("residual_stream", 0) + counts.get("per_layer_embeddings", 0)
        difference = counts["total"] - base["total"]
        parts.append(f"{name}: adds {added:,}, the FFN {BASE['intermediate_size']} → {config.intermediate_size} wide "
                     f"gives back {base['mlp'] - counts['mlp']:,}: {counts['total']:,} in all "
                     f"({difference:+,}, {100 * difference / base['total']:+.2f}%)")
    return (f"Residual streams against {BASELINE} ({base['total']:,} parameters, one stream) at equal parameters, what "
            f"each adds paid from the FFN's width ({2 * D * LAYERS:,} parameters per unit): " + "; ".join(parts) + ".")


def paired_comparison(results: list[dict]) -> str:
    """Each hybrid and residual-stream row against the base, seed by seed: the held-out loss difference (variant -
    base) per seed, its mean and range, and in how many seeds the sign agrees; a sign that changes across seeds is
    called noise."""
    by_name = {r["name"]: r for r in results}
    base = by_name.get(BASELINE)
    if base is None:
        return ""
    parts = []
    for r in results:
        if not _is_paired(r["name"]):
            continue
        base_of = {run["seed"]: run["held_out_loss"] for run in base["runs"]}
        diffs = [run["held_out_loss"] - base_of[run["seed"]] for run in r["runs"] if run["seed"] in base_of]
        if not diffs:
            continue
        lower = sum(d < 0 for d in diffs)
        verdict = (f"lower in every one of {len(diffs)} seeds" if lower == len(diffs) else
                   f"higher in every one of {len(diffs)} seeds" if lower == 0 else
                   f"lower in {lower} of {len(diffs)} seeds: the sign changes with the seed, within noise")
        spread = _spread(diffs)
        parts.append(f"{r['name']}: {spread['mean']:+.3f} (per seed {', '.join(f'{d:+.3f}' for d in diffs)}; "
                     f"std {spread['std']:.3f}), {verdict}")
    if not parts:
        return ""
    return (f"Held-out loss, variant minus {BASELINE}, paired by seed (same data, initialisation seed and "
            "batch order): " + "; ".join(parts) + ".")


def write_json(results: list[dict], path, record: dict | None = None) -> None:
    """The summary rows (every seed's losses under "runs") with the run's provenance
    (`modular_decoder.tools.provenance.record`)."""
    from pathlib import Path

    Path(path).write_text(json.dumps({"provenance": record, "results": results}, indent=1) + "\n")


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
        variant = VARIANTS.get(r["name"], {})
        style = ("--" if variant.get("mlp_type") == "moe" else ":" if "layer_types" in variant else
                 "-." if r["name"] in VARIANTS and _is_stream_variant(r["name"]) else "-")
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


def page(results: list[dict], tokens: int, command: str, image: str, record: dict | None = None) -> str:
    """The ablation page (`docs/ablation/ablation.md`): command, where it ran (`record`, the run's provenance),
    table, plot, and how to read them."""
    seeds = len(results[0]["runs"])
    known = [r["name"] for r in results if r["name"] in VARIANTS]
    hybrids, streams = any(map(_is_hybrid, known)), any(map(_is_stream_variant, known))
    return "\n".join([
        "# Ablation (matched token budget, CPU)", "", "```bash", command, "```", "",
        *([provenance.line(record), ""] if record else []),
        markdown(results, tokens), "",
        f"![Training loss against tokens, one line per variant (mean over seeds) with its min–max band; "
        f"held-out loss against cache bytes]({image})", "",
        f"{seeds} seed{'s' if seeds > 1 else ''} per variant: read a difference smaller than the min–max ranges "
        "as unproven. The table shows what each variant costs (parameters, active parameters per token, tokens/s on "
        "a shared 2-core CPU, cache bytes per token from the contract) as much as how it trains. FFN variants are "
        "parameter-matched (gated width 8d/3); GQA/MQA/MLA have fewer attention weights; the MoE rows match the "
        f"{MOE_BASELINE} row's active parameters and tokens (and hold about 3x its total parameters). "
        "`modular-decoder experiment gradnorm` and `experiment ffn-budget` reproduce the other seed measurements.",
        *(["", f"The hybrid rows train on {SEQ}-token sequences: they measure what replacing attention layers costs "
            "or gains in quality at short context, not the long-context memory and speed a constant state buys "
            "(the cache columns give that arithmetic). Their linear layers run the PyTorch forms (the chunked delta "
            "rule and KDA's rule, Mamba-2's chunked scan, the short convolution) on the CPU; the kernels a GPU would "
            "run (flash-linear-attention, mamba_ssm, causal-conv1d) are not timed here."] if hybrids
           else []),
        *(["", "The residual-stream rows hold the base's parameters with a narrower FFN (the arithmetic above), so "
            "each measures a stream topology against the FFN width it costs. Hyper-connections and AltUp carry "
            "4 streams of width d through every layer: their tokens/s pays for that, their parameters do not "
            "show it."] if streams else []),
    ])
