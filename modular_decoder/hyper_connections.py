"""Manifold-constrained hyper-connections (`residual_stream="hyper_connections"`, DeepSeek-V4; Xie et al. 2026,
mHC): the residual stream is `hc_mult` = n streams, (B, T, n, d), mixed around each sublayer.

Around each sublayer F (attention, then the feed-forward), from the n streams X (flattened, RMS-normed without
weight: x̂ ∈ R^{n·d}) one linear map `fn` gives three sets of coefficients:

    pre  = σ(s_0 · x̂ W_pre + b_pre) + ε                     (n,)    collapses the streams into F's input
    post = 2 σ(s_1 · x̂ W_post + b_post)                     (n,)    spreads F's output over the streams
    comb = Sinkhorn(softmax(s_2 · x̂ W_comb + b_comb) + ε)   (n, n)  mixes the streams, near doubly stochastic

    X ← post ⊗ F(Σ_i pre_i X_i) + combᵀ X                   (s = `scale`, b = `base`; Sinkhorn: `hc_sinkhorn_iters`
                                                               alternate column and row normalisations, ε = `hc_eps`)

The embedded input starts every stream; before the final norm a head collapses them by its own pre weights
(`HyperHead`). F is the block's own branch, norm included (`DecoderBlock.attention_branch` /
`feed_forward_branch`), so any serial norm placement (pre, sandwich, output) takes hyper-connections; post-norm
blocks (the norm after the sum) and parallel blocks (one sum of two branches) do not. The coefficients are
computed in fp32 and the parameters kept fp32, as transformers' `DeepseekV4HyperConnection` does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .kinds import require_int, require_number
from .norms import rms_unweighted
from .residual_streams import ResidualStreamKind


@dataclass(kw_only=True)
class HyperConnectionFields:
    """Args:
        hc_mult (`int`, *optional*): Residual streams n of `residual_stream="hyper_connections"` (transformers'
            DeepSeek-V4 field; DeepSeek-V4: 4). Required there, unset otherwise.
        hc_sinkhorn_iters (`int`, *optional*): Sinkhorn normalisations of each mixing matrix (transformers' field;
            DeepSeek-V4: 20). Defaults to 20 with hyper-connections.
        hc_eps (`float`, *optional*): ε added to the collapse weights and the mixing matrix, and to each Sinkhorn
            normaliser (transformers' field). Defaults to 1e-6 with hyper-connections.
    """

    hc_mult: int | None = None
    hc_sinkhorn_iters: int | None = None
    hc_eps: float | None = None


HC_FIELDS = ("hc_mult", "hc_sinkhorn_iters", "hc_eps")
# DeepSeek-V4's values (transformers' `DeepseekV4Config` defaults)
SINKHORN_ITERS, HC_EPS = 20, 1e-6


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` in `dtype` (itself when it is already: no cast dispatched, dozens a decode step)."""
    return x if x.dtype is dtype else x.to(dtype)


def fp32(x: torch.Tensor) -> torch.Tensor:
    return cast(x, torch.float32)


def sinkhorn(matrix: torch.Tensor, iterations: int, eps: float) -> torch.Tensor:
    """Column, then alternately row and column normalisations (`iterations` of each in all), as DeepSeek-V4:
    each divides by its sums plus `eps`."""
    if matrix.requires_grad:  # training: autograd keeps each step's input
        matrix = matrix / (matrix.sum(dim=-2, keepdim=True) + eps)
        for _ in range(iterations - 1):
            matrix = matrix / (matrix.sum(dim=-1, keepdim=True) + eps)
            matrix = matrix / (matrix.sum(dim=-2, keepdim=True) + eps)
        return matrix
    # Inference: `eps` rides along as an extra column and row, so one sum gives each normaliser (two operations a
    # normalisation instead of three, in one buffer; a decode step runs 2 Sinkhorns a layer of tiny tensors, where
    # each operation's dispatch is the cost). The sums add the same terms, perhaps in another order: fp32 rounding.
    n = matrix.shape[-1]
    padded = F.pad(matrix, (0, 1, 0, 1), value=eps)
    square, rows, columns = padded[..., :n, :n], padded[..., :n, :], padded[..., :n]
    square.div_(columns.sum(dim=-2, keepdim=True))
    for _ in range(iterations - 1):
        square.div_(rows.sum(dim=-1, keepdim=True))
        square.div_(columns.sum(dim=-2, keepdim=True))
    return square


class HyperConnection(nn.Module):
    """One sublayer's hyper-connection: `fn` ((2 + n)·n, n·d), `base` ((2 + n)·n,), `scale` (3,) (transformers'
    names, fp32)."""

    def __init__(self, config):
        super().__init__()
        n = self.streams = config.hc_mult
        self.iterations, self.eps, self.norm_eps = config.hc_sinkhorn_iters, config.hc_eps, config.norm_eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * config.hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.empty((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32))

    def init_own_weights(self, init, std: float) -> None:  # as transformers' DeepSeek-V4
        init.normal_(self.fn, mean=0.0, std=std)
        init.zeros_(self.base)
        init.ones_(self.scale)

    def forward(self, streams: torch.Tensor, branch) -> torch.Tensor:
        """X (B, T, n, d) -> post ⊗ branch(Σ pre_i X_i) + combᵀ X (module docstring)."""
        n, dtype = self.streams, streams.dtype
        mixes = F.linear(rms_unweighted(fp32(streams.flatten(2)), self.norm_eps), fp32(self.fn))
        pre, post, comb = mixes.split([n, n, n * n], dim=-1)
        pre_base, post_base, comb_base = fp32(self.base).split([n, n, n * n])
        pre_scale, post_scale, comb_scale = fp32(self.scale).unbind(0)
        # (addcmul: base + coefficients · scale in one operation; a decode step runs dozens of these tiny ones)
        pre = torch.sigmoid(torch.addcmul(pre_base, pre, pre_scale)) + self.eps  # (B, T, n)
        post = 2 * torch.sigmoid(torch.addcmul(post_base, post, post_scale))  # (B, T, n)
        comb = torch.softmax(torch.addcmul(comb_base.view(n, n), comb.unflatten(-1, (n, n)), comb_scale), dim=-1)
        comb = sinkhorn(comb + self.eps, self.iterations, self.eps)  # (B, T, n, n)
        out = branch(cast((pre.unsqueeze(-1) * streams).sum(dim=2), dtype))  # (B, T, d)
        mixed = torch.matmul(cast(comb, dtype).transpose(-1, -2), streams)
        return torch.addcmul(mixed, cast(post, dtype).unsqueeze(-1), out.unsqueeze(-2))


class HyperHead(nn.Module):
    """The model's part: every stream starts as the embedded input; before the final norm the streams collapse by
    their pre weights, σ(s · x̂ W + b) + ε (`fn` (n, n·d), `base` (n,), `scale` (1,): transformers' `hc_head`)."""

    def __init__(self, config):
        super().__init__()
        n = self.streams = config.hc_mult
        self.eps, self.norm_eps = config.hc_eps, config.norm_eps
        self.fn = nn.Parameter(torch.empty(n, n * config.hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.empty(n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(1, dtype=torch.float32))

    def init_own_weights(self, init, std: float) -> None:
        init.normal_(self.fn, mean=0.0, std=std)
        init.zeros_(self.base)
        init.ones_(self.scale)

    def forward(self, hidden: torch.Tensor, leaving: bool = False) -> torch.Tensor:
        if not leaving:  # (B, T, d) -> (B, T, n, d)
            return hidden.unsqueeze(2).expand(-1, -1, self.streams, -1).contiguous()
        mixes = F.linear(rms_unweighted(fp32(hidden.flatten(2)), self.norm_eps), fp32(self.fn))
        pre = torch.sigmoid(mixes * fp32(self.scale) + fp32(self.base)) + self.eps  # (B, T, n)
        return cast((pre.unsqueeze(-1) * hidden).sum(dim=2), hidden.dtype)


class HyperConnections(ResidualStreamKind):
    """`residual_stream="hyper_connections"`: a `HyperConnection` around each sublayer (`attn_hc`, `ffn_hc`),
    `HyperHead` at the ends (module docstring).

    X ─┬─ attn_hc ─ attention branch ─ attn_hc ─┬─ ffn_hc ─ feed-forward branch ─ ffn_hc ─>
       (collapse: Σ pre_i X_i)      (spread, mix: post ⊗ out + combᵀ X)
    """

    name = "hyper_connections"
    fields = HC_FIELDS

    def complete(self, config) -> None:
        if config.hc_sinkhorn_iters is None:
            config.hc_sinkhorn_iters = SINKHORN_ITERS
        if config.hc_eps is None:
            config.hc_eps = HC_EPS

    def validate(self, config) -> None:
        super().validate(config)
        if config.hc_mult is None:
            raise ValueError("`residual_stream='hyper_connections'` needs `hc_mult`, the number of streams.")
        require_int("hc_mult", config.hc_mult, minimum=1)
        require_int("hc_sinkhorn_iters", config.hc_sinkhorn_iters, minimum=1)
        require_number("hc_eps", config.hc_eps, at_least=0)
        if config.parallel_block or config.norm_position == "post":
            raise ValueError("`residual_stream='hyper_connections'` mixes its streams around each sublayer's branch: "
                             "it needs a serial block whose residual adds the branch (`norm_position` 'pre', "
                             "'sandwich' or 'output', `parallel_block`=False).")
        if config.residual_multiplier != 1.0:
            raise ValueError(f"`residual_multiplier`={config.residual_multiplier} scales what a branch adds to one "
                             "stream; `residual_stream='hyper_connections'` spreads it by learned weights: leave it "
                             "at 1.0.")
        if config.num_mtp_layers:
            raise ValueError("`num_mtp_layers` with `residual_stream='hyper_connections'` is not supported: the MTP "
                             "modules' blocks read one stream.")
        beside = [f"`{field}`" for field, value in (("layer_scalar", config.layer_scalar),
                                                    ("laurel_rank", config.laurel_rank),
                                                    ("hidden_size_per_layer_input", config.hidden_size_per_layer_input))
                  if value]
        if beside:
            raise ValueError(f"{', '.join(beside)} with `residual_stream='hyper_connections'` are not supported: they "
                             "join one stream around the layer's sublayers, where hyper-connections mix their streams "
                             "around each branch.")
        if config.block_types is not None and any(kind != "mixer_mlp" for kind in config.block_types):
            raise ValueError("`block_types` with one sublayer per layer and `residual_stream='hyper_connections'` "
                             "are not supported together: each layer mixes its streams around both of its sublayers.")

    def model_module(self, config) -> nn.Module:
        return HyperHead(config)

    def layer_modules(self, config, layer_idx: int) -> dict[str, nn.Module]:
        return {"attn_hc": HyperConnection(config), "ffn_hc": HyperConnection(config)}

    def join(self, block, x, input_ids=None, per_layer_input=None, **kwargs) -> torch.Tensor:
        del per_layer_input  # refused with hyper-connections (`validate`)
        x = block.attn_hc(x, lambda h: block.attention_branch(h, **kwargs))
        return block.ffn_hc(x, lambda h: block.feed_forward_branch(h, input_ids))

    def layer_parameters(self, config) -> int:
        """Two hyper-connections: (2 + n)·n·(n·d + 1) + 3 each."""
        n = config.hc_mult
        return 2 * ((2 + n) * n * (n * config.hidden_size + 1) + 3)

    def model_parameters(self, config) -> int:
        """The head: n·(n·d + 1) + 1."""
        n = config.hc_mult
        return n * (n * config.hidden_size + 1) + 1

    def fp32_modules(self, config) -> tuple[str, ...]:
        return ("attn_hc", "ffn_hc", "residual_stream")


HYPER_CONNECTIONS = HyperConnections()

__all__ = ["HC_FIELDS", "HYPER_CONNECTIONS", "HyperConnection", "HyperConnectionFields", "HyperConnections",
           "HyperHead", "sinkhorn"]
