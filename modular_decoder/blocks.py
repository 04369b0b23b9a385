"""Decoder blocks: one small class per norm placement, chosen through `BLOCKS`, and which sublayers each layer has.

Every block owns its token mixer (`self_attn`, or `linear_attn` in a `"linear_attention"` layer, or both in a
`"hybrid"` layer), `mlp` and the norms its placement needs, named by where they sit
(`pre_attn_norm`, `post_attn_norm`, `pre_mlp_norm`, `post_mlp_norm`); its two sublayers, `mix` and `ffn`, are the
diagram in its docstring. Every `(+)` adds its branch times `residual_multiplier` (Granite's μP
scaling; 1 elsewhere, where it is a plain sum).

`block_types` says which sublayers each layer has: both (every family but Nemotron-H), the token mixer alone or
the feed-forward alone (Nemotron-H, whose every layer is one sublayer), each with the norms of its placement.
A hybrid layer's mixers (`kinds.HYBRID`: attention and the linear-attention kind, Falcon-H1's) both read the same
normed input, and their outputs are summed: mix(x) = Attn(x) + LinAttn(x).

A block's call runs its sublayers through the residual stream's entry (`residual_streams.py`: one stream, or several
around them), which also adds what the layer holds beside its sublayers (a per-layer embedding's branch, a layer
scalar): `DecoderBlock.sublayers` runs `mix` and `ffn` (a subclass's own `forward` becomes its `sublayers`), and
`DecoderBlock.forward` is the join. A serial block whose residuals add its branches (pre, sandwich, output:
`SerialBlock`) draws each branch as what goes in and what comes out of its sublayer (`attn_in` / `attn_out`,
`mlp_in` / `mlp_out`), so a stream that mixes around each branch (hyper-connections) runs the branches alone
(`attention_branch`, `feed_forward_branch`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from .kinds import HYBRID, LINEAR_ATTENTION, mixer_layer_types, require_bool, require_choice, require_per_layer
from .norms import build_norm
from .registries import ATTENTIONS, LINEAR_ATTENTIONS, MLPS, RESIDUAL_STREAMS
from .laurel import join_attention
from .residual_streams import attach_layer_modules

# `block_types` values -> the sublayers of such a layer
BLOCK_TYPES = {"mixer_mlp": ("mixer", "mlp"), "mixer": ("mixer",), "mlp": ("mlp",)}


@dataclass(kw_only=True)
class BlockFields:
    r"""Which sublayers each layer has.

    Args:
        block_types (`list[str]`, *optional*): Per layer, `"mixer_mlp"` (its token mixer, then the feed-forward),
            `"mixer"` (the token mixer alone) or `"mlp"` (the feed-forward alone), each sublayer with the norms of
            `norm_position` (Nemotron-H: every layer is one sublayer, Mamba-2, attention, MoE or MLP). A `"mlp"`
            layer's `layer_types` entry is an attention type nothing reads; a `"mixer"` layer's `mlp_layer_types`
            entry is likewise unread. `None`: every layer `"mixer_mlp"`.
    """

    block_types: list[str] | None = None


def layer_sublayers(config, layer_idx: int) -> tuple[str, ...]:
    """The sublayers of layer `layer_idx`: `("mixer", "mlp")`, `("mixer",)` or `("mlp",)` (`block_types`)."""
    return BLOCK_TYPES[config.block_types[layer_idx]] if config.block_types is not None else BLOCK_TYPES["mixer_mlp"]


def mixing_layer_types(config) -> list[tuple[str, ...]]:
    """Per layer, the layer types of its token mixers: one, a hybrid layer's two, none in a feed-forward-only layer."""
    return [mixer_layer_types(t) if "mixer" in layer_sublayers(config, i) else ()
            for i, t in enumerate(config.layer_types)]


def layer_mixers(config, layer_idx: int) -> list[tuple[object, str]]:
    """(kind, layer type) of each token mixer of layer `layer_idx`: none in a feed-forward-only layer, the
    linear-attention kind for `"linear_attention"`, the attention kind for an attention type, both in a hybrid one.

    This package's registries rather than `config.attention_kind`: vLLM ships a remote-code config to its workers by
    value (cloudpickle), and classes reached through it lose their source, which vLLM reads to find each layer's
    attention."""
    if "mixer" not in layer_sublayers(config, layer_idx):
        return []
    return [(LINEAR_ATTENTIONS.of(config) if t == LINEAR_ATTENTION else ATTENTIONS.of(config), t)
            for t in mixer_layer_types(config.layer_types[layer_idx])]


@dataclass(kw_only=True)
class LayerNormPositionFields:
    r"""Where the norms of each layer type sit, where they differ.

    Args:
        linear_attention_norm_position (`str`, *optional*): `norm_position` of the `"linear_attention"` layers of
            `layer_types` (OLMo hybrid: `"pre"` beside attention layers of `"output"`). Defaults to `norm_position`.
            Serial blocks only.
    """

    linear_attention_norm_position: str | None = None


class DecoderBlock(GradientCheckpointingLayer):
    """Shared construction; subclasses name the norms they use in `NORMS`, the placement they implement
    (`norm_position`, `parallel`) and their two sublayers (`mix`, `ffn`); a layer runs those it has."""

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

    def __init__(self, config, layer_idx: int):
        super().__init__()
        sublayers = layer_sublayers(config, layer_idx)
        # (module name, layer type of its mask) of each token mixer
        self.mixers = tuple((kind.module_name, layer_type) for kind, layer_type in layer_mixers(config, layer_idx))
        for kind, _ in layer_mixers(config, layer_idx):
            setattr(self, kind.module_name, kind.build(config, layer_idx))
        self.mlp = MLPS.of(config).build(config, layer_idx) if "mlp" in sublayers else None
        self.mlp_reads_tokens = getattr(self.mlp, "routes_by_token", False)  # a hash router's layer
        for name in self.NORMS:  # `*_attn_norm` around the mixer, `*_mlp_norm` around the feed-forward
            if ("mixer" if "attn" in name else "mlp") in sublayers:
                setattr(self, name, build_norm(config))
        self.dropout = nn.Dropout(config.hidden_dropout)
        m = config.residual_multiplier
        self.residual = _add if m == 1.0 else partial(_add_scaled, m)
        attach_layer_modules(self, config, layer_idx, RESIDUAL_STREAMS.of(config), mixes=bool(self.mixers))

    def init_own_weights(self, init, std: float) -> None:
        """A fresh layer scalar is 1 (the model's `_init_weights` asks every module that has this method)."""
        if self.layer_scalar is not None:
            init.ones_(self.layer_scalar)

    def join_attention(self, x: torch.Tensor, branch: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        """The attention sublayer's output joined to the stream: the residual addition, with LAUREL's branch of the
        normed input `normed` where the layer has one (`laurel.py`)."""
        return join_attention(self, x, branch, normed)

    def sublayers(self, x: torch.Tensor, input_ids=None, **kwargs) -> torch.Tensor:
        """The layer's sublayers on one stream: the token mixer's, then the feed-forward's (those it has)."""
        if self.mixers:
            x = self.mix(x, **kwargs)
        if self.mlp is not None:
            x = self.ffn(x, input_ids)
        return x

    def mix(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        raise NotImplementedError

    def ffn(self, x: torch.Tensor, input_ids=None) -> torch.Tensor:
        raise NotImplementedError

    def attend(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        """The token mixer's output; a hybrid layer's mixers each get the mask of their layer type (`attention_mask`
        then maps those types to masks) and their outputs are summed."""
        if len(self.mixers) == 1:
            out, _ = getattr(self, self.mixers[0][0])(x, **kwargs)
        else:
            masks = kwargs.pop("attention_mask")
            out = sum(getattr(self, name)(x, attention_mask=masks[layer_type], **kwargs)[0]
                      for name, layer_type in self.mixers)
        return self.dropout(out) if self.training else out  # (eval dropout is the identity: skip the call)

    def feed_forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, input_ids=None) -> torch.Tensor:
        """The FFN of `x` (the block's normed FFN input); one that also reads the layer's residual input `residual`
        (the experts beside a dense MLP, `moe.ParallelDenseMoeBlock`) is given it, one that routes by token id
        (`num_hash_layers`) the tokens `input_ids`."""
        # (read on the class: a module's own missing attribute raises inside torch before `getattr` defaults)
        if getattr(type(self.mlp), "reads_residual", False):
            out = self.mlp(x, residual)
        else:
            out = self.mlp(x, input_ids) if self.mlp_reads_tokens else self.mlp(x)
        return self.dropout(out) if self.training else out


def _add(x: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
    return x + branch


def _add_scaled(multiplier: float, x: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
    return x + branch * multiplier  # the order Granite computes it in


class SerialBlock(DecoderBlock):
    """x ─┬─ attn_in ─ attn ─ attn_out ─(+)─┬─ mlp_in ─ mlp ─ mlp_out ─(+)─>   (each subclass draws its branches)
          └─────────────────────────────┘   └──────────────────────────┘"""

    def attn_in(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def attn_out(self, out: torch.Tensor) -> torch.Tensor:
        return out

    def mlp_in(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def mlp_out(self, out: torch.Tensor) -> torch.Tensor:
        return out

    def attention_branch(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        """What the attention sublayer's `(+)` adds to `x`."""
        return self.attn_out(self.attend(self.attn_in(x), **kwargs))

    def feed_forward_branch(self, x: torch.Tensor, input_ids=None) -> torch.Tensor:
        """What the feed-forward sublayer's `(+)` adds to `x`."""
        return self.mlp_out(self.feed_forward(self.mlp_in(x), x, input_ids))

    def mix(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        normed = self.attn_in(x)
        return self.join_attention(x, self.attn_out(self.attend(normed, **kwargs)), normed)

    def ffn(self, x: torch.Tensor, input_ids=None) -> torch.Tensor:
        return self.residual(x, self.feed_forward_branch(x, input_ids))


class PreNormBlock(SerialBlock):
    """A norm before attention and before the MLP, the residual kept clean (pre-norm: GPT-2, Llama).

    x ─┬─ pre_attn_norm ─ attn ─(+)─┬─ pre_mlp_norm ─ mlp ─(+)─>
       └───────────────────────────┘└──────────────────────────┘
    """

    NORMS = ("pre_attn_norm", "pre_mlp_norm")
    norm_position = "pre"

    def attn_in(self, x: torch.Tensor) -> torch.Tensor:
        return self.pre_attn_norm(x)

    def mlp_in(self, x: torch.Tensor) -> torch.Tensor:
        return self.pre_mlp_norm(x)


class PostNormBlock(DecoderBlock):
    """A norm after each residual addition (post-norm: GPT-1, the original Transformer).

    x ─┬─ attn ─(+)─ post_attn_norm ─┬─ mlp ─(+)─ post_mlp_norm ─>
       └────────┘                    └───────┘
    """

    NORMS = ("post_attn_norm", "post_mlp_norm")
    norm_position = "post"

    def mix(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        return self.post_attn_norm(self.residual(x, self.attend(x, **kwargs)))

    def ffn(self, x: torch.Tensor, input_ids=None) -> torch.Tensor:
        return self.post_mlp_norm(self.residual(x, self.feed_forward(x, x, input_ids)))


class SandwichNormBlock(SerialBlock):
    """Norms before and after each of attention and the MLP (sandwich: Gemma 2 / 3).

    x ─┬─ pre_attn_norm ─ attn ─ post_attn_norm ─(+)─┬─ pre_mlp_norm ─ mlp ─ post_mlp_norm ─(+)─>
       └─────────────────────────────────────────┘   └───────────────────────────────────────┘
    """

    NORMS = ("pre_attn_norm", "post_attn_norm", "pre_mlp_norm", "post_mlp_norm")
    norm_position = "sandwich"

    def attn_in(self, x: torch.Tensor) -> torch.Tensor:
        return self.pre_attn_norm(x)

    def attn_out(self, out: torch.Tensor) -> torch.Tensor:
        return self.post_attn_norm(out)

    def mlp_in(self, x: torch.Tensor) -> torch.Tensor:
        return self.pre_mlp_norm(x)

    def mlp_out(self, out: torch.Tensor) -> torch.Tensor:
        return self.post_mlp_norm(out)


class OutputNormBlock(SerialBlock):
    """A norm on each sublayer's output, before it is added to the residual (OLMo 2).

    x ─┬─ attn ─ post_attn_norm ─(+)─┬─ mlp ─ post_mlp_norm ─(+)─>
       └─────────────────────────┘   └───────────────────────┘
    """

    NORMS = ("post_attn_norm", "post_mlp_norm")
    norm_position = "output"

    def attn_out(self, out: torch.Tensor) -> torch.Tensor:
        return self.post_attn_norm(out)

    def mlp_out(self, out: torch.Tensor) -> torch.Tensor:
        return self.post_mlp_norm(out)


class ParallelBlock(DecoderBlock):
    """Attention and the MLP side by side on the same input, both added to the residual (GPT-J, GPT-NeoX, Falcon).

    x ─┬─ pre_attn_norm ─ attn ─┐
       ├─ pre_mlp_norm ── mlp ──(+)─>     (GPT-NeoX / Falcon-40B: separate norms)
       └─────────────────────────┘
    With `parallel_norms="shared"` (GPT-J, Falcon-7B, Phi) one `pre_attn_norm` feeds both branches.
    """

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
        mixed = self.residual(x, self.attend(attn_in, **kwargs))
        return self.residual(mixed, self.feed_forward(mlp_in, x, input_ids))


BLOCKS: dict[str, type[DecoderBlock]] = {
    "pre": PreNormBlock,
    "post": PostNormBlock,
    "sandwich": SandwichNormBlock,
    "output": OutputNormBlock,
    "parallel": ParallelBlock,
}
NORM_POSITIONS = tuple(dict.fromkeys(block.norm_position for block in BLOCKS.values()))
PARALLEL_NORMS = ("shared", "separate")


def layer_norm_position(config, layer_idx: int | None = None) -> str:
    """The `norm_position` of layer `layer_idx` (`linear_attention_norm_position` for a linear-attention layer where
    set), or the attention layers' where no layer is named."""
    own = config.linear_attention_norm_position
    if layer_idx is not None and own is not None and config.layer_types[layer_idx] == LINEAR_ATTENTION:
        return own
    return config.norm_position


def block_class(config, layer_idx: int | None = None) -> type[DecoderBlock]:
    """The block implementing layer `layer_idx`'s norm position (`layer_norm_position`), serial or parallel with
    `parallel_block`; the attention layers' where no layer is named."""
    position = layer_norm_position(config, layer_idx)
    for block in BLOCKS.values():
        if block.norm_position == position and block.parallel == config.parallel_block:
            return block
    raise ValueError(f"`parallel_block={config.parallel_block}` has no block with `norm_position`={position!r}.")


def validate_block(config) -> None:
    """`norm_position`, `parallel_block` and `parallel_norms`, and that one block implements them; `block_types`."""
    require_choice("norm_position", config.norm_position, NORM_POSITIONS)
    require_bool("parallel_block", config.parallel_block)
    require_choice("parallel_norms", config.parallel_norms, PARALLEL_NORMS)
    if config.linear_attention_norm_position is not None:
        require_choice("linear_attention_norm_position", config.linear_attention_norm_position, NORM_POSITIONS)
        if LINEAR_ATTENTION not in config.layer_types or config.parallel_block:
            raise ValueError(
                f"`linear_attention_norm_position`={config.linear_attention_norm_position!r} places the norms of "
                "serial blocks of 'linear_attention' layers: "
                + ("`parallel_block` is set." if config.parallel_block else "`layer_types` has none; leave it unset.")
            )
    if config.parallel_block:
        positions = [b.norm_position for b in BLOCKS.values() if b.parallel]
        if config.norm_position not in positions:
            raise ValueError(
                f"`parallel_block=True` needs `norm_position` in {positions} (x + Attn(N(x)) + FFN(N(x))), "
                f"got `norm_position`={config.norm_position!r}."
            )
    validate_block_types(config)
    if config.num_mtp_layers and isinstance(config.layer_types, list) and config.layer_types[-1:] == [HYBRID]:
        raise ValueError(f"`num_mtp_layers`={config.num_mtp_layers}: an MTP module is a block of the last layer's "
                         "kinds, and `layer_types` makes the last layer 'hybrid', which MTP modules cannot be yet.")


def validate_block_types(config) -> None:
    """One `block_types` entry per layer from `BLOCK_TYPES`, a mixer somewhere, and nothing only two-sublayer
    blocks can be: a parallel block, multi-token-prediction modules (a block of the last layer's kinds)."""
    kinds = config.block_types
    if kinds is None:
        return
    require_per_layer("block_types", kinds, config)
    for kind in kinds:
        require_choice("block_types[...]", kind, BLOCK_TYPES)
    if all(kind == "mlp" for kind in kinds):
        raise ValueError("`block_types` has no layer with a token mixer: nothing would mix the tokens.")
    if config.parallel_block and any(kind != "mixer_mlp" for kind in kinds):
        raise ValueError("`parallel_block=True` adds a layer's mixer and feed-forward side by side: every "
                         "`block_types` entry must be 'mixer_mlp'.")
    if config.num_mtp_layers and kinds[-1] != "mixer_mlp":
        raise ValueError(f"`num_mtp_layers`={config.num_mtp_layers}: an MTP module is a block of the last layer's "
                         f"kinds, and `block_types` makes the last layer {kinds[-1]!r}; it must be 'mixer_mlp'.")
    for index, kind in enumerate(kinds):
        if kind == "mlp" and config.layer_types[index] not in ("full_attention", "sliding_attention"):
            raise ValueError(f"Layer {index} is `block_types` 'mlp' (no token mixer), and `layer_types` gives it "
                             f"{config.layer_types[index]!r}, a mixer with a state: give it 'full_attention'.")
