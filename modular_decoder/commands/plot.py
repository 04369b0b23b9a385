"""`modular-decoder plot`: KV-cache bytes against context length, or a reshape run's perplexity, as a PNG.

`modular-decoder plot cache`: KV-cache bytes against context length, saved as a PNG.
`modular-decoder plot reshape REPORT.json`: a reshape run's held-out perplexity against KV-cache bytes per
token (the source, the result, after healing, and every rank of an MLA sweep).

With no `--config`, draws one 7B-class shape (d=4096, L=32, 32 query
heads of 128) with MHA (32 K/V heads), GQA (8), MQA (1) and MLA (d_c=512, d_R=64, DeepSeek-V2's
ratios). `--config` takes preset names (`llama`, `gemma3`, ...) or checkpoint folders. The numbers
come from `modular_decoder.contract.cache_bytes`, so sliding-window layers flatten out where
their window is full.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from modular_decoder.configuration_modular_decoder import ModularDecoderConfig
from modular_decoder.contract import cache_bytes
from modular_decoder.tools.presets import PRESETS, preset_config

_SHAPE = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
              num_attention_heads=32, max_position_embeddings=131072)
FIGURE_8_4: dict[str, dict] = {
    "MHA (32 K/V heads)": dict(_SHAPE, num_key_value_heads=32),
    "GQA (8 K/V heads)": dict(_SHAPE, num_key_value_heads=8),
    "MQA (1 K/V head)": dict(_SHAPE, num_key_value_heads=1),
    "MLA (d_c=512, d_R=64)": dict(_SHAPE, attention_type="mla", q_lora_rank=1536, kv_lora_rank=512,
                                  qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def figure_configs() -> dict[str, ModularDecoderConfig]:
    return {label: ModularDecoderConfig(**fields) for label, fields in FIGURE_8_4.items()}


def resolve_config(spec: str) -> tuple[str, ModularDecoderConfig]:
    """A preset name or a checkpoint folder -> (label, config)."""
    if spec in PRESETS:
        return spec, preset_config(spec)
    if (Path(spec) / "config.json").exists():
        return Path(spec).name, ModularDecoderConfig.from_pretrained(spec)
    raise ValueError(f"`--config {spec}` is neither a preset ({sorted(PRESETS)}) nor a folder with a config.json.")


def context_grid(max_context: int, points: int = 64) -> list[int]:
    """Context lengths from 1 to `max_context`, denser where the curves bend (sliding windows)."""
    return sorted({max(1, round(max_context * i / points)) for i in range(points + 1)} | {512, 1024, 4096})


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(7, 4.5), dpi=120)


def _save(fig, ax, path: str | Path) -> Path:
    import matplotlib.pyplot as plt

    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_cache(configs: dict[str, ModularDecoderConfig], path: str | Path, max_context: int = 131072,
               dtype: torch.dtype = torch.bfloat16, batch_size: int = 1, log: bool = False) -> Path:
    """Draw cache bytes (GiB) against context for each config; returns the PNG path."""
    contexts = [c for c in context_grid(max_context) if c <= max_context]
    fig, ax = _figure()
    for label, config in configs.items():
        gib = [cache_bytes(config, c, batch_size, dtype) / 2**30 for c in contexts]
        ax.plot([c / 1024 for c in contexts], gib, label=label, linewidth=2)
    ax.set_xlabel("context length (k tokens)")
    ax.set_ylabel(f"KV cache (GiB, {str(dtype).removeprefix('torch.')}, batch {batch_size})")
    ax.set_title("KV-cache memory against context length")
    if log:  # sliding-window plateaus and MQA / MLA lines beside MHA need a log axis to be seen
        ax.set_yscale("log")
    return _save(fig, ax, path)


def plot_reshape(report: dict, path: str | Path) -> Path:
    """Held-out perplexity against measured KV-cache bytes per token for one reshape report; returns the PNG path."""
    fig, ax = _figure()
    sweep = report.get("sweep") or []
    if sweep:
        rows = sorted(sweep, key=lambda row: row["kv_cache_bytes_per_token"])
        ax.plot([r["kv_cache_bytes_per_token"] for r in rows], [r["perplexity"] for r in rows], "o-",
                label="MLA rank sweep", color="tab:blue")
        for row in rows:
            ax.annotate(f"r={row['kv_lora_rank']}", (row["kv_cache_bytes_per_token"], row["perplexity"]),
                        textcoords="offset points", xytext=(4, 4), fontsize=8)
    before, after = report["before"], report["after"]
    ax.plot(before["kv_cache_bytes_per_token"], before["perplexity"], "s", color="black", label="source")
    ax.plot(after["kv_cache_bytes_per_token"], after["perplexity"], "D", color="tab:red", label="reshaped")
    if report.get("heal"):
        ax.plot(after["kv_cache_bytes_per_token"], report["heal"]["perplexity"], "^", color="tab:green",
                label="reshaped + healed")
    ax.set_xlabel("KV cache bytes per token (measured)")
    ax.set_ylabel("held-out perplexity (log scale)")
    ax.set_yscale("log")  # a training-free reshape can cost orders of magnitude
    ax.set_title("What the reshape bought (cache) and cost (perplexity)")
    return _save(fig, ax, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="plot", required=True)
    reshape = sub.add_parser("reshape", help="perplexity against KV-cache bytes per token of a reshape report")
    reshape.add_argument("report", type=Path, help="a reshape_report.json written by `modular-decoder reshape`")
    reshape.add_argument("--out", type=Path, default=Path("reshape.png"))
    cache = sub.add_parser("cache", help="KV-cache bytes against context length")
    cache.add_argument("--config", action="append", default=[], metavar="PRESET_OR_FOLDER",
                       help="repeatable; default: one 7B-class shape as MHA, GQA, MQA and MLA")
    cache.add_argument("--max-context", type=int, default=131072)
    cache.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    cache.add_argument("--batch-size", type=int, default=1)
    cache.add_argument("--log", action="store_true", help="log-scale the bytes axis")
    cache.add_argument("--out", type=Path, default=Path("kv_cache.png"))


def run(args: argparse.Namespace) -> int:
    from modular_decoder.commands import user_input

    if args.plot == "reshape":
        from modular_decoder.checkpoint_checks import read_json_file

        with user_input():
            report = read_json_file(args.report)
            if not isinstance(report, dict) or "before" not in report or "after" not in report:
                raise ValueError(f"{args.report} is not a reshape report (no `before` / `after`).")
        print(f"wrote {plot_reshape(report, args.out)}")
        return 0
    with user_input():
        configs = dict(resolve_config(spec) for spec in args.config) if args.config else figure_configs()
    path = plot_cache(configs, args.out, args.max_context, DTYPES[args.dtype], args.batch_size, args.log)
    for label, config in configs.items():
        print(f"{label}: {cache_bytes(config, args.max_context, args.batch_size, DTYPES[args.dtype]) / 2**30:.2f} GiB "
              f"at {args.max_context} tokens")
    print(f"wrote {path}")
    return 0
