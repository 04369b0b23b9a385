"""A matched-budget ablation: small variants trained for the same number of tokens on CPU.

Every variant changes one axis of a small base (pre-norm RMSNorm, dense GELU FFN of width 4d,
MHA, RoPE, serial block) and trains on the generated corpus (`corpus.py`) with the same token
budget, batch, schedule and seed. FFN variants are parameter-matched (gated width 8d/3); head-
sharing variants are not (GQA/MQA/MLA have fewer attention weights; the table shows the counts).
Reported: parameters, final training loss (mean of the last steps), held-out loss, tokens/s and
cache bytes per token (`contract.cache_bytes_per_token`, bf16).
"""

from __future__ import annotations

import time

import torch

from modular_decoder.configuration_modular_decoder import ModularDecoderConfig
from modular_decoder.contract import cache_bytes_per_token
from modular_decoder.modeling_modular_decoder import ModularDecoderForCausalLM
from . import corpus
from .ffn_budget import gated_width

D, LAYERS, HEADS, SEQ, BATCH = 128, 4, 4, 64, 16
BASE = dict(vocab_size=corpus.VOCAB_SIZE, hidden_size=D, intermediate_size=4 * D, num_hidden_layers=LAYERS,
            num_attention_heads=HEADS, max_position_embeddings=SEQ, norm_type="rmsnorm", norm_position="pre",
            mlp_type="dense", hidden_act="gelu", position_embedding_type="rope", tie_word_embeddings=True)

# name -> overrides of BASE (one axis each)
VARIANTS: dict[str, dict] = {
    "pre-norm (base)": {},
    "post-norm": dict(norm_position="post"),
    "sandwich-norm": dict(norm_position="sandwich"),
    "SwiGLU (8d/3)": dict(mlp_type="gated", hidden_act="silu", intermediate_size=gated_width(D, multiple_of=8)),
    "GQA (2 kv heads)": dict(num_key_value_heads=2),
    "MQA (1 kv head)": dict(num_key_value_heads=1),
    "MLA (d_c=32)": dict(attention_type="mla", kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16,
                          v_head_dim=32),
    "parallel block": dict(parallel_block=True, parallel_norms="shared"),
}


def config_for(name: str) -> ModularDecoderConfig:
    if name not in VARIANTS:
        raise ValueError(f"Unknown variant {name!r}; known: {list(VARIANTS)}.")
    return ModularDecoderConfig(**dict(BASE, **VARIANTS[name]))


def train(name: str, tokens: int, seed: int = 0, lr: float = 3e-3, data: torch.Tensor | None = None) -> dict:
    """Train variant `name` for `tokens` tokens (AdamW, 10% warm-up, cosine decay); return its row."""
    config = config_for(name)
    torch.manual_seed(seed)
    model = ModularDecoderForCausalLM._from_config(config, attn_implementation="sdpa")
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
        loss = model(batch, labels=batch, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step(), schedule.step(), optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    elapsed = time.perf_counter() - start
    model.eval()
    with torch.no_grad():
        held = sum(model(b, labels=b, use_cache=False).loss.item() for b in held_out) / len(held_out)
    tail = losses[-max(1, steps // 10):]
    return {"name": name, "params": model.num_parameters(), "train_loss": sum(tail) / len(tail),
            "held_out_loss": held, "tokens_per_s": steps * BATCH * SEQ / elapsed,
            "cache_bytes_per_token": cache_bytes_per_token(config, torch.bfloat16), "losses": losses,
            "steps": steps}


def _take(iterator, n):
    for _ in range(n):
        yield next(iterator)


def run(tokens: int, names: list[str] | None = None, seed: int = 0, progress=print) -> list[dict]:
    names = names or list(VARIANTS)
    data = corpus.token_ids(300_000, seed)
    results = []
    for name in names:
        row = train(name, tokens, seed, data=data)
        results.append(row)
        progress(f"{name:20s} loss {row['train_loss']:.3f} held-out {row['held_out_loss']:.3f} "
                 f"{row['tokens_per_s']:,.0f} tok/s")
    return results


def markdown(results: list[dict], tokens: int) -> str:
    lines = [f"Budget: {tokens:,} tokens per variant ({results[0]['steps']} steps of {BATCH}×{SEQ}), "
             f"d={D}, {LAYERS} layers, {HEADS} heads, byte vocabulary, generated corpus, seed-matched.", "",
             "| variant | parameters | final train loss | held-out loss | tokens/s | cache bytes/token (bf16) |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        lines.append(f"| {r['name']} | {r['params']:,} | {r['train_loss']:.3f} | {r['held_out_loss']:.3f} | "
                     f"{r['tokens_per_s']:,.0f} | {r['cache_bytes_per_token']:,} |")
    return "\n".join(lines)


def plot(results: list[dict], path) -> None:
    """Loss curves and a held-out-loss vs cache-bytes scatter."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves, scatter) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in results:
        window = max(1, len(r["losses"]) // 20)
        smooth = [sum(r["losses"][max(0, i - window + 1) : i + 1]) / len(r["losses"][max(0, i - window + 1) : i + 1])
                  for i in range(len(r["losses"]))]
        curves.plot(smooth, label=r["name"])
        scatter.scatter(r["cache_bytes_per_token"], r["held_out_loss"])
        scatter.annotate(r["name"], (r["cache_bytes_per_token"], r["held_out_loss"]), fontsize=7)
    curves.set_xlabel("step"), curves.set_ylabel("training loss (smoothed)"), curves.legend(fontsize=7)
    curves.set_title("matched token budget")
    scatter.set_xlabel("KV-cache bytes per token (bf16)"), scatter.set_ylabel("held-out loss")
    scatter.set_title("quality vs cache cost")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
