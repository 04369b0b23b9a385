"""Post-norm vs pre-norm: the gradient norm reaching each layer's FFN weight, and what it depends on.

The seed (after Xiong et al. 2020, Fig. 3) reports, at initialisation, ~25x between the top and
bottom layer of a 6-layer post-norm Transformer and a flat profile for pre-norm. This module
measures the same quantity under explicit conditions, so the claim can be checked rather than
repeated:

- ``layout``: ``post`` (GPT-1: x = LN(x + F(x)), no final norm) or ``pre`` (GPT-2: x + F(LN(x)),
  final norm), both as modular_decoder models built from the `gpt1` / `gpt2` presets;
- ``init``: ``normal`` (N(0, 0.02), the GPT default) or ``xavier`` (Xavier-uniform linear
  weights, as fairseq and Xiong et al. use);
- ``weight``: ``up`` (W1, the FFN's first weight) or ``down`` (W2, its second);
- ``layers``, ``hidden``; ``steps`` of Adam (with ``warmup`` linear warm-up steps) before measuring;
- ``arch``: ``decoder`` (a decoder-only LM on the generated corpus) or ``encdec``: an
  *approximation* of Xiong et al.'s setting — a 6+6 encoder-decoder built from `torch.nn`
  Transformer layers (ReLU FFN, Xavier init, sqrt(d)-scaled embeddings, sinusoidal positions),
  trained on a copy task rather than IWSLT translation, measuring the decoder's FFN weights.

`ratio` is (norm at the top layer) / (norm at the bottom layer).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from modular_decoder.modeling_modular_decoder import ModularDecoderForCausalLM
from modular_decoder.tools.presets import preset_config
from . import corpus

LAYOUTS = {"post": "gpt1", "pre": "gpt2"}
WEIGHTS = {"up": "up_proj", "down": "down_proj"}


@dataclasses.dataclass(frozen=True)
class Condition:
    """One measurement setting; every field is a knob the outcome may depend on."""

    layout: str = "post"
    init: str = "normal"
    weight: str = "up"
    arch: str = "decoder"
    layers: int = 6
    hidden: int = 512
    steps: int = 0
    warmup: int = 0
    lr: float = 5e-4
    batch: int = 8
    seq: int = 64
    data: str = "corpus"  # or "random" tokens

    def label(self) -> str:
        trained = f", {self.steps} steps" + (f" (warm-up {self.warmup})" if self.warmup else "") if self.steps else ", init"
        return f"{self.arch} {self.layout}-norm, {self.init}, W-{self.weight}, L={self.layers}, d={self.hidden}{trained}"


def decoder_model(condition: Condition, vocab_size: int = corpus.VOCAB_SIZE) -> ModularDecoderForCausalLM:
    """A GPT-1 (post) or GPT-2 (pre) layout LM at the condition's size, dropout off."""
    config = preset_config(
        LAYOUTS[condition.layout], vocab_size=vocab_size, hidden_size=condition.hidden,
        intermediate_size=4 * condition.hidden, num_hidden_layers=condition.layers,
        num_attention_heads=max(1, condition.hidden // 64), max_position_embeddings=max(512, condition.seq),
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    if condition.init == "xavier":
        _xavier(model)
    return model


def _xavier(model: nn.Module) -> None:
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)


def layer_grad_norms(model: ModularDecoderForCausalLM, ids: torch.Tensor, weight: str = "up") -> list[float]:
    """Frobenius norm of d(next-token loss)/d(W) for each layer's FFN weight, bottom layer first.

    Dropout is off (eval mode); gradients are taken fresh and left zeroed afterwards.
    """
    was_training = model.training
    model.eval()
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids, use_cache=False).loss
    loss.backward()
    norms = [getattr(layer.mlp, WEIGHTS[weight]).weight.grad.norm().item() for layer in model.model.layers]
    model.zero_grad(set_to_none=True)
    model.train(was_training)
    return norms


def _optimizer(params, condition: Condition):
    optimizer = torch.optim.Adam(params, lr=condition.lr, betas=(0.9, 0.98))
    warm = condition.warmup
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)
    return optimizer, schedule


def _data(condition: Condition, vocab_size: int, seed: int):
    if condition.data == "random":
        generator = torch.Generator().manual_seed(seed)
        while True:
            yield torch.randint(0, vocab_size, (condition.batch, condition.seq), generator=generator)
    yield from corpus.batches(corpus.token_ids(100_000, seed), condition.batch, condition.seq, seed)


def measure(condition: Condition, seed: int = 0) -> list[float]:
    """Per-layer FFN gradient norms (bottom first) under `condition`, after `condition.steps` steps."""
    torch.manual_seed(seed)
    if condition.arch == "encdec":
        return EncoderDecoder(condition).measure(seed)
    if condition.arch != "decoder":
        raise ValueError(f"`arch`={condition.arch!r} is not one of ['decoder', 'encdec'].")
    model = decoder_model(condition)
    data = _data(condition, corpus.VOCAB_SIZE, seed)
    probe = next(data)  # the same batch before and after training
    if condition.steps:
        optimizer, schedule = _optimizer(model.parameters(), condition)
        model.eval()  # dropout is 0 in these presets anyway; eval keeps it explicit
        for _ in range(condition.steps):
            ids = next(data)
            model(ids, labels=ids, use_cache=False).loss.backward()
            optimizer.step(), schedule.step(), optimizer.zero_grad(set_to_none=True)
    return layer_grad_norms(model, probe, condition.weight)


class EncoderDecoder(nn.Module):
    """An approximation of Xiong et al.'s 2020 setting: `torch.nn` encoder-decoder layers (post- or
    pre-norm, ReLU, Xavier init as `nn.Transformer` does), sqrt(d)-scaled embeddings shared between
    source, target and output, sinusoidal positions, a copy task instead of IWSLT translation.
    Pre-norm stacks end in a LayerNorm, post-norm stacks do not (as in fairseq)."""

    def __init__(self, condition: Condition, vocab_size: int = corpus.VOCAB_SIZE):
        super().__init__()
        self.condition = condition
        d, pre = condition.hidden, condition.layout == "pre"
        heads = max(1, d // 64)
        kw = dict(d_model=d, nhead=heads, dim_feedforward=4 * d, dropout=0.0, activation="relu",
                  batch_first=True, norm_first=pre)
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(**kw), condition.layers,
                                             norm=nn.LayerNorm(d) if pre else None, enable_nested_tensor=False)
        self.decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(**kw), condition.layers,
                                             norm=nn.LayerNorm(d) if pre else None)
        self.embed = nn.Embedding(vocab_size, d)
        nn.init.normal_(self.embed.weight, 0.0, d**-0.5)
        for p in list(self.encoder.parameters()) + list(self.decoder.parameters()):
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)
        if condition.init == "normal":
            for p in list(self.encoder.parameters()) + list(self.decoder.parameters()):
                if p.dim() > 1:
                    nn.init.normal_(p, 0.0, 0.02)
        position = torch.arange(4096).unsqueeze(1)
        freq = torch.exp(torch.arange(0, d, 2) * (-math.log(10000.0) / d))
        table = torch.zeros(4096, d)
        table[:, 0::2], table[:, 1::2] = torch.sin(position * freq), torch.cos(position * freq)
        self.register_buffer("positions", table, persistent=False)

    def _embed(self, ids):
        return self.embed(ids) * math.sqrt(self.condition.hidden) + self.positions[: ids.shape[1]]

    def loss(self, src: torch.Tensor) -> torch.Tensor:
        """Copy task: the decoder reads <0> + src[:-1] and predicts src."""
        tgt_in = torch.cat([torch.zeros_like(src[:, :1]), src[:, :-1]], dim=1)
        mask = nn.Transformer.generate_square_subsequent_mask(src.shape[1])
        memory = self.encoder(self._embed(src))
        out = self.decoder(self._embed(tgt_in), memory, tgt_mask=mask, tgt_is_causal=True)
        logits = out @ self.embed.weight.T
        return nn.functional.cross_entropy(logits.flatten(0, 1), src.flatten())

    def measure(self, seed: int) -> list[float]:
        condition = self.condition
        data = _data(condition, corpus.VOCAB_SIZE, seed)
        probe = next(data)
        if condition.steps:
            optimizer, schedule = _optimizer(self.parameters(), condition)
            for _ in range(condition.steps):
                self.loss(next(data)).backward()
                optimizer.step(), schedule.step(), optimizer.zero_grad(set_to_none=True)
        self.zero_grad(set_to_none=True)
        self.loss(probe).backward()
        name = {"up": "linear1", "down": "linear2"}[condition.weight]
        return [getattr(layer, name).weight.grad.norm().item() for layer in self.decoder.layers]


def ratio(norms: list[float]) -> float:
    """Top layer over bottom layer."""
    return norms[-1] / norms[0]


# The default grid: the first check (decoder, init, both inits), the other weight, training
# steps with and without warm-up, a deeper stack, and the encoder-decoder approximation.
def default_grid(hidden: int = 512, layers: int = 6, steps: int = 20) -> list[Condition]:
    grid = []
    for arch in ("decoder", "encdec"):
        for init in ("normal", "xavier"):
            for layout in ("post", "pre"):
                for weight in ("up", "down"):
                    grid.append(Condition(layout, init, weight, arch, layers, hidden))
    for layout in ("post", "pre"):
        for warmup in (0, steps):
            grid.append(Condition(layout, "xavier", "up", "encdec", layers, hidden, steps=steps, warmup=warmup))
            grid.append(Condition(layout, "normal", "up", "decoder", layers, hidden, steps=steps, warmup=warmup))
        grid.append(Condition(layout, "normal", "up", "decoder", 2 * layers, hidden))
    return grid


def run(grid: list[Condition], seed: int = 0, progress=print) -> list[dict]:
    rows = []
    for done, condition in enumerate(grid, start=1):
        norms = measure(condition, seed)
        rows.append({"condition": condition, "norms": norms, "ratio": ratio(norms)})
        progress(f"[{done}/{len(grid)}] {condition.label()}")  # the numbers go once, into `markdown`
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| arch | layout | init | weight | L | steps (warm-up) | per-layer norm, bottom → top | top/bottom |",
             "| --- | --- | --- | --- | ---: | --- | --- | ---: |"]
    for row in rows:
        c = row["condition"]
        lines.append(f"| {c.arch} | {c.layout} | {c.init} | W-{c.weight} | {c.layers} | {c.steps} ({c.warmup}) | "
                     + " ".join(f"{n:.3g}" for n in row["norms"]) + f" | {row['ratio']:.2f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path) -> None:
    """One panel per (arch, steps) group: per-layer norm for each condition, log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[str, list[dict]] = {}
    for row in rows:
        c = row["condition"]
        key = f"{c.arch}, " + (f"after {c.steps} steps" if c.steps else "at init")
        groups.setdefault(key, []).append(row)
    fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 4.5), squeeze=False)
    for ax, (title, members) in zip(axes[0], groups.items()):
        for row in members:
            c = row["condition"]
            label = f"{c.layout} {c.init} W-{c.weight}" + (f" L={c.layers}" if c.layers != 6 else "") + (
                f" wu{c.warmup}" if c.warmup else "")
            ax.plot(range(1, len(row["norms"]) + 1), row["norms"], marker="o",
                    linestyle="-" if c.layout == "post" else "--", label=label)
        ax.set_yscale("log"), ax.set_xlabel("layer"), ax.set_ylabel("‖∂loss/∂W‖"), ax.set_title(title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
