"""Decoder blocks: one small class per norm placement, chosen through `BLOCKS`.

Every block owns its token mixer (`self_attn`, or `linear_attn` in a `"linear_attention"` layer), `mlp` and the
norms its placement needs, named by where they sit
(`pre_attn_norm`, `post_attn_norm`, `pre_mlp_norm`, `post_mlp_norm`); its `forward` is the
diagram in its docstring. Every `(+)` adds its branch times `residual_multiplier` (Granite's μP
scaling; 1 elsewhere, where it is a plain sum).

A block's call runs its diagram through the residual stream's entry (`residual_streams.py`: one stream, or several
around the diagram), which also adds what the layer holds beside its sublayers (a per-layer embedding's branch, a
layer scalar): a subclass's `forward` becomes its `sublayers`, and `DecoderBlock.forward` the join.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from .kinds import LINEAR_ATTENTION, require_bool, require_choice
from .norms import build_norm
from .registries import ATTENTIONS, LINEAR_ATTENTIONS, MLPS, RESIDUAL_STREAMS
from .laurel import join_attention
from .residual_streams import attach_layer_modules


class DecoderBlock(GradientCheckpointingLayer):
    """Shared construction; subclasses name the norms they use in `NORMS` and the placement they
    implement (`norm_position`, `parallel`)."""

    NORMS: tuple[str, ...] = ()
    norm_position: str = ""
    parallel: bool = False
    reads: tuple[str, ...] = ()  # config fields only some blocks read (the contract table shows those of this one)

    def __init_subclass__(cls, **kwargs):
        """A subclass's `forward` (its diagram) is its `sublayers`; the call goes through the residual stream (and
        transformers' gradient checkpointing then wraps that call, the layer's outermost)."""
        if "forward" in vars(cls):
            cls.sublayers = vars(cls)["forward"]
            cls.forward = DecoderBlock.forward
        super().__init_subclass__(**kwargs)

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        """The layer: `sublayers` joined to the residual stream(s) `x` by the `residual_stream` entry."""
        return self.stream.join(self, x, **kwargs)

    def sublayers(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        raise NotImplementedError

    def __init__(self, config, layer_idx: int):
        super().__init__()
        # This package's registries rather than `config.attention_kind`: vLLM ships a remote-code config to
        # its workers by value (cloudpickle), and classes reached through it lose their source, which vLLM
        # reads to find each layer's attention. A linear-attention layer holds its kind's module instead
        # (`linear_attn`, transformers' name).
        if config.layer_types[layer_idx] == LINEAR_ATTENTION:
            mixer = LINEAR_ATTENTIONS.of(config)
        else:
            mixer = ATTENTIONS.of(config)
        self.mixer_name = mixer.module_name
        setattr(self, mixer.module_name, mixer.build(config, layer_idx))
        self.mlp = MLPS.of(config).build(config, layer_idx)
        for name in self.NORMS:
            setattr(self, name, build_norm(config))
        self.dropout = nn.Dropout(config.hidden_dropout)
        m = config.residual_multiplier
        self.residual = _add if m == 1.0 else partial(_add_scaled, m)
        attach_layer_modules(self, config, layer_idx, RESIDUAL_STREAMS.of(config))

    def init_own_weights(self, init, std: float) -> None:
        """A fresh layer scalar is 1 (the model's `_init_weights` asks every module that has this method)."""
        if self.layer_scalar is not None:
            init.ones_(self.layer_scalar)

    def join_attention(self, x: torch.Tensor, branch: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        """The attention sublayer's output joined to the stream: the residual addition, with LAUREL's branch of the
        normed input `normed` where the layer has one (`laurel.py`)."""
        return join_attention(self, x, branch, normed)

    def attend(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        out, _ = getattr(self, self.mixer_name)(x, **kwargs)
        return self.dropout(out) if self.training else out  # (eval dropout is the identity: skip the call)

    def feed_forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The FFN of `x` (the block's normed FFN input); one that also reads the layer's residual input `residual`
        (the experts beside a dense MLP, `moe.ParallelDenseMoeBlock`) is given it."""
        out = self.mlp(x, residual) if getattr(self.mlp, "reads_residual", False) else self.mlp(x)
        return self.dropout(out) if self.training else out


def _add(x: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
    return x + branch


def _add_scaled(multiplier: float, x: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
    return x + branch * multiplier  # the order Granite computes it in


class PreNormBlock(DecoderBlock):
    """x ─┬─ pre_attn_norm ─ attn ─(+)─┬─ pre_mlp_norm ─ mlp ─(+)─>    (GPT-2, Llama)
          └───────────────────────────┘└──────────────────────────┘"""

    NORMS = ("pre_attn_norm", "pre_mlp_norm")
    norm_position = "pre"

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        normed = self.pre_attn_norm(x)
        x = self.join_attention(x, self.attend(normed, **kwargs), normed)
        return self.residual(x, self.feed_forward(self.pre_mlp_norm(x), x))


class PostNormBlock(DecoderBlock):
    """x ─┬─ attn ─(+)─ post_attn_norm ─┬─ mlp ─(+)─ post_mlp_norm ─>  (GPT-1, original Transformer)
          └────────┘                    └───────┘"""

    NORMS = ("post_attn_norm", "post_mlp_norm")
    norm_position = "post"

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        x = self.post_attn_norm(self.residual(x, self.attend(x, **kwargs)))
        return self.post_mlp_norm(self.residual(x, self.feed_forward(x)))


class SandwichNormBlock(DecoderBlock):
    """x ─┬─ pre_attn_norm ─ attn ─ post_attn_norm ─(+)─┬─ pre_mlp_norm ─ mlp ─ post_mlp_norm ─(+)─>
          └─────────────────────────────────────────┘   └───────────────────────────────────────┘
    (Gemma 2 / 3)"""

    NORMS = ("pre_attn_norm", "post_attn_norm", "pre_mlp_norm", "post_mlp_norm")
    norm_position = "sandwich"

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        normed = self.pre_attn_norm(x)
        x = self.join_attention(x, self.post_attn_norm(self.attend(normed, **kwargs)), normed)
        return self.residual(x, self.post_mlp_norm(self.feed_forward(self.pre_mlp_norm(x), x)))


class OutputNormBlock(DecoderBlock):
    """x ─┬─ attn ─ post_attn_norm ─(+)─┬─ mlp ─ post_mlp_norm ─(+)─>   (OLMo 2: norm on the sublayer output)
          └─────────────────────────┘   └───────────────────────┘"""

    NORMS = ("post_attn_norm", "post_mlp_norm")
    norm_position = "output"

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        x = self.residual(x, self.post_attn_norm(self.attend(x, **kwargs)))
        return self.residual(x, self.post_mlp_norm(self.feed_forward(x)))


class ParallelBlock(DecoderBlock):
    """x ─┬─ pre_attn_norm ─ attn ─┐
          ├─ pre_mlp_norm ── mlp ──(+)─>     (GPT-NeoX / Falcon-40B: separate norms)
          └─────────────────────────┘
    With `parallel_norms="shared"` (GPT-J, Falcon-7B, Phi) one `pre_attn_norm` feeds both branches."""

    NORMS = ("pre_attn_norm",)
    norm_position = "pre"
    parallel = True
    reads = ("parallel_norms",)

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.pre_mlp_norm = build_norm(config) if config.parallel_norms == "separate" else None

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        attn_in = self.pre_attn_norm(x)
        mlp_in = attn_in if self.pre_mlp_norm is None else self.pre_mlp_norm(x)
        return self.residual(self.residual(x, self.attend(attn_in, **kwargs)), self.feed_forward(mlp_in))


BLOCKS: dict[str, type[DecoderBlock]] = {
    "pre": PreNormBlock,
    "post": PostNormBlock,
    "sandwich": SandwichNormBlock,
    "output": OutputNormBlock,
    "parallel": ParallelBlock,
}
NORM_POSITIONS = tuple(dict.fromkeys(block.norm_position for block in BLOCKS.values()))
PARALLEL_NORMS = ("shared", "separate")


def block_class(config) -> type[DecoderBlock]:
    """The block implementing `norm_position` (serial, or parallel with `parallel_block`)."""
    for block in BLOCKS.values():
        if block.norm_position == config.norm_position and block.parallel == config.parallel_block:
            return block
    raise ValueError(f"`parallel_block={config.parallel_block}` has no block with `norm_position`="
                     f"{config.norm_position!r}.")


def validate_block(config) -> None:
    """`norm_position`, `parallel_block` and `parallel_norms`, and that one block implements them."""
    require_choice("norm_position", config.norm_position, NORM_POSITIONS)
    require_bool("parallel_block", config.parallel_block)
    require_choice("parallel_norms", config.parallel_norms, PARALLEL_NORMS)
    if config.parallel_block:
        positions = [b.norm_position for b in BLOCKS.values() if b.parallel]
        if config.norm_position not in positions:
            raise ValueError(
                f"`parallel_block=True` needs `norm_position` in {positions} (x + Attn(N(x)) + FFN(N(x))), "
                f"got `norm_position`={config.norm_position!r}."
            )
