"""Decoder blocks: one small class per norm placement, chosen through `BLOCKS`.

Every block owns its token mixer (`self_attn`, or `linear_attn` in a `"linear_attention"` layer), `mlp` and the
norms its placement needs, named by where they sit
(`pre_attn_norm`, `post_attn_norm`, `pre_mlp_norm`, `post_mlp_norm`); its `forward` is the
diagram in its docstring. Every `(+)` adds its branch times `residual_multiplier` (Granite's μP
scaling; 1 elsewhere, where it is a plain sum).

A block's call runs its diagram through the residual stream's entry (`residual_streams.py`: one stream, or several
around each branch): a subclass's `forward` becomes its `sublayers`, and `DecoderBlock.forward` the join. A serial
block whose residuals add its branches (pre, sandwich, output) also names the two branches, what each `(+)` adds
(`attention_branch`, `feed_forward_branch`), which hyper-connections run between their own mixes.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from .kinds import LINEAR_ATTENTION, require_bool, require_choice
from .norms import build_norm
from .registries import ATTENTIONS, LINEAR_ATTENTIONS, MLPS, RESIDUAL_STREAMS
from .residual_streams import attach_layer_modules


class DecoderBlock(GradientCheckpointingLayer):
    """Shared construction; subclasses name the norms they use in `NORMS` and the placement they
    implement (`norm_position`, `parallel`)."""

    NORMS: tuple[str, ...] = ()
    norm_position: str = ""
    parallel: bool = False
    reads: tuple[str, ...] = ()  # config fields only some blocks read (the contract table shows those of this one)

    def __init_subclass__(cls, **kwargs):
        """A subclass's `forward` (its diagram) is its `sublayers`; the call goes through the residual stream. (Before
        transformers' `GradientCheckpointingLayer` wraps the class's `forward`: the diagram stays unwrapped, and a
        subclass that draws none keeps the join it inherits.)"""
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
        self.mlp_reads_tokens = getattr(self.mlp, "routes_by_token", False)  # a hash router's layer
        for name in self.NORMS:
            setattr(self, name, build_norm(config))
        self.dropout = nn.Dropout(config.hidden_dropout)
        m = config.residual_multiplier
        self.residual = _add if m == 1.0 else partial(_add_scaled, m)
        attach_layer_modules(self, config, layer_idx, RESIDUAL_STREAMS.of(config))

    def attend(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        out, _ = getattr(self, self.mixer_name)(x, **kwargs)
        return self.dropout(out) if self.training else out  # (eval dropout is the identity: skip the call)

    def feed_forward(self, x: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The feed-forward on `x`; `input_ids` reach a layer that routes by token id (`num_hash_layers`)."""
        out = self.mlp(x, input_ids) if self.mlp_reads_tokens else self.mlp(x)
        return self.dropout(out) if self.training else out


def _add(x: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
    return x + branch


def _add_scaled(multiplier: float, x: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
    return x + branch * multiplier  # the order Granite computes it in


class SerialBlock(DecoderBlock):
    """x ─┬─ attention_branch ─(+)─┬─ feed_forward_branch ─(+)─>   (each subclass draws its branches)
          └─────────────────────┘└────────────────────────┘"""

    def attention_branch(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        raise NotImplementedError

    def feed_forward_branch(self, x: torch.Tensor, input_ids=None) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor, input_ids=None, **kwargs) -> torch.Tensor:
        x = self.residual(x, self.attention_branch(x, **kwargs))
        return self.residual(x, self.feed_forward_branch(x, input_ids))


class PreNormBlock(SerialBlock):
    """x ─┬─ pre_attn_norm ─ attn ─(+)─┬─ pre_mlp_norm ─ mlp ─(+)─>    (GPT-2, Llama)
          └───────────────────────────┘└──────────────────────────┘"""

    NORMS = ("pre_attn_norm", "pre_mlp_norm")
    norm_position = "pre"

    def attention_branch(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        return self.attend(self.pre_attn_norm(x), **kwargs)

    def feed_forward_branch(self, x: torch.Tensor, input_ids=None) -> torch.Tensor:
        return self.feed_forward(self.pre_mlp_norm(x), input_ids)


class PostNormBlock(DecoderBlock):
    """x ─┬─ attn ─(+)─ post_attn_norm ─┬─ mlp ─(+)─ post_mlp_norm ─>  (GPT-1, original Transformer)
          └────────┘                    └───────┘"""

    NORMS = ("post_attn_norm", "post_mlp_norm")
    norm_position = "post"

    def forward(self, x: torch.Tensor, input_ids=None, **kwargs) -> torch.Tensor:
        x = self.post_attn_norm(self.residual(x, self.attend(x, **kwargs)))
        return self.post_mlp_norm(self.residual(x, self.feed_forward(x, input_ids)))


class SandwichNormBlock(SerialBlock):
    """x ─┬─ pre_attn_norm ─ attn ─ post_attn_norm ─(+)─┬─ pre_mlp_norm ─ mlp ─ post_mlp_norm ─(+)─>
          └─────────────────────────────────────────┘   └───────────────────────────────────────┘
    (Gemma 2 / 3)"""

    NORMS = ("pre_attn_norm", "post_attn_norm", "pre_mlp_norm", "post_mlp_norm")
    norm_position = "sandwich"

    def attention_branch(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        return self.post_attn_norm(self.attend(self.pre_attn_norm(x), **kwargs))

    def feed_forward_branch(self, x: torch.Tensor, input_ids=None) -> torch.Tensor:
        return self.post_mlp_norm(self.feed_forward(self.pre_mlp_norm(x), input_ids))


class OutputNormBlock(SerialBlock):
    """x ─┬─ attn ─ post_attn_norm ─(+)─┬─ mlp ─ post_mlp_norm ─(+)─>   (OLMo 2: norm on the sublayer output)
          └─────────────────────────┘   └───────────────────────┘"""

    NORMS = ("post_attn_norm", "post_mlp_norm")
    norm_position = "output"

    def attention_branch(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        return self.post_attn_norm(self.attend(x, **kwargs))

    def feed_forward_branch(self, x: torch.Tensor, input_ids=None) -> torch.Tensor:
        return self.post_mlp_norm(self.feed_forward(x, input_ids))


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

    def forward(self, x: torch.Tensor, input_ids=None, **kwargs) -> torch.Tensor:
        attn_in = self.pre_attn_norm(x)
        mlp_in = attn_in if self.pre_mlp_norm is None else self.pre_mlp_norm(x)
        return self.residual(self.residual(x, self.attend(attn_in, **kwargs)), self.feed_forward(mlp_in, input_ids))


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
