"""AltUp (Alternating Updates, arXiv 2301.13310; Gemma 3n): n residual streams, of which each layer computes one.

The model keeps `altup_num_inputs` = n streams of width d. They start as the embedded input x_0 and n - 1 learned
projections of it, each rescaled to x_0's RMS (`AltUpStreams`, the model's `residual_stream`); before the final norm
the streams other than the first go through projections of their own, are rescaled to the first's RMS, and the n are
averaged. Around each layer (`AltUp`, the layer's `altup`):

    streams ─ predict ─ p (n streams) ─ p[a] ─ the layer's sublayers ─ h ─ correct(p, h) ─> streams
    predict:  p_i = s_i + Σ_j c_ij(s_a) · s_j          c = prediction_coefs(tanh(router(s_a)))     (n x n per token)
    correct:  s'_i = p_i + (1 + g_i(h)) · (h - p_a)    g = correction_coefs(tanh(router(h)))

with a = `altup_active_idx` and router(x) = modality_router(router_norm(x) / d). A per-layer embedding's branch
(`per_layer_embeddings.py`) reads the corrected active stream, times `correct_output_scale` with
`altup_correct_scale`, and is added to the streams after the first (as Gemma 3n adds it). While training, the
coefficient matrices are clamped to ±`altup_coef_clip`, as transformers' Gemma 3n clamps them (the prediction
matrix in place, the correction one in the product).

`ALTUP` is the `residual_stream="altup"` entry (`registries.RESIDUAL_STREAMS`); its fields live in `AltUpFields`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .kinds import require_bool, require_int, require_number
from .norms import build_norm, norm_parameters
from .residual_streams import ResidualStreamKind, scaled_layer_output

ALTUP_FIELDS = ("altup_num_inputs", "altup_active_idx", "altup_coef_clip", "altup_correct_scale")


@dataclass(kw_only=True)
class AltUpFields:
    """Args:
        altup_num_inputs (`int`): Residual streams n (transformers' Gemma 3n field). `residual_stream="altup"` only.
        altup_active_idx (`int`): The stream each layer computes (transformers' field).
        altup_coef_clip (`float`, *optional*): While training, the prediction and correction coefficients are clamped
            to this magnitude (transformers' field); `None`: not clamped.
        altup_correct_scale (`bool`): The per-layer embedding's branch reads the corrected active stream times a
            learned scale per feature (`correct_output_scale`; transformers' field).
    """

    altup_num_inputs: int = 4
    altup_active_idx: int = 0
    altup_coef_clip: float | None = 120.0
    altup_correct_scale: bool = True


def rescaled(x: torch.Tensor, target_rms: torch.Tensor) -> torch.Tensor:
    """`x` rescaled to RMS `target_rms` (Gemma 3n's arithmetic: the RMS floored at sqrt(1e-5))."""
    return x * target_rms / torch.sqrt(torch.mean(x**2, dim=-1, keepdim=True).clamp(min=1e-5))


class AltUpStreams(nn.Module):
    """The model's part: n streams from the embedded input, and their rescaled mean before the final norm."""

    def __init__(self, config):
        super().__init__()
        d, extra = config.hidden_size, config.altup_num_inputs - 1
        self.projections = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(extra))
        self.unembed_projections = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(extra))

    def forward(self, hidden: torch.Tensor, leaving: bool = False) -> torch.Tensor:
        if leaving:  # (n, B, T, d) -> (B, T, d)
            target = torch.mean(hidden[0] ** 2, dim=-1, keepdim=True) ** 0.5
            streams = [hidden[0]] + [rescaled(project(stream), target)
                                     for project, stream in zip(self.unembed_projections, hidden[1:])]
            return torch.stack(streams).mean(dim=0)
        target = torch.mean(hidden**2, dim=-1, keepdim=True) ** 0.5  # (B, T, d) -> (n, B, T, d)
        return torch.stack([hidden] + [rescaled(project(hidden), target) for project in self.projections])


class AltUp(nn.Module):
    """A layer's part: the predict and correct steps around its sublayers (see the module docstring)."""

    def __init__(self, config):
        super().__init__()
        d, n = config.hidden_size, config.altup_num_inputs
        self.streams, self.active, self.clip = n, config.altup_active_idx, config.altup_coef_clip
        self.correct_scale = config.altup_correct_scale
        self.correct_output_scale = nn.Parameter(torch.zeros(d))
        self.correction_coefs = nn.Linear(n, n, bias=False)
        self.prediction_coefs = nn.Linear(n, n * n, bias=False)
        self.modality_router = nn.Linear(d, n, bias=False)
        self.router_norm = build_norm(config)
        self.register_buffer("router_input_scale", torch.tensor(d**-1.0), persistent=False)

    def _modalities(self, x: torch.Tensor) -> torch.Tensor:
        routed = self.modality_router(self.router_norm(x) * self.router_input_scale)
        return torch.tanh(routed.float()).type_as(x)

    def predict(self, streams: torch.Tensor) -> torch.Tensor:
        """(n, B, T, d) -> the predicted streams, each plus its learned mix of all n."""
        modalities = self._modalities(streams[self.active])
        if self.training and self.clip is not None:  # as transformers clamps it: in place
            with torch.no_grad():
                self.prediction_coefs.weight.clamp_(-self.clip, self.clip)
        coefs = self.prediction_coefs(modalities).unflatten(-1, (self.streams, self.streams)).transpose(-1, -2)
        predictions = torch.matmul(streams.permute(1, 2, 3, 0), coefs).permute(3, 0, 1, 2)  # (n, B, T, d)
        return (predictions + streams).contiguous().type_as(streams)

    def correct(self, predictions: torch.Tensor, activated: torch.Tensor) -> torch.Tensor:
        """The predictions moved by the layer's innovation h - p_a, each stream by its own learned gain."""
        modalities = self._modalities(activated)
        if self.training and self.clip is not None:
            coefs = nn.functional.linear(modalities, self.correction_coefs.weight.clamp(-self.clip, self.clip))
        else:
            coefs = self.correction_coefs(modalities)
        coefs = (coefs + 1.0).permute(2, 0, 1).unsqueeze(-1)  # (n, B, T, 1)
        innovation = (activated - predictions[self.active]).repeat(self.streams, 1, 1, 1)
        return (innovation * coefs + predictions).contiguous().type_as(activated)

    def forward(self, corrected: torch.Tensor) -> torch.Tensor:
        """The corrected active stream times `correct_output_scale` (a module call, so hooks move that parameter)."""
        return (corrected.type_as(self.correct_output_scale) * self.correct_output_scale).type_as(corrected)

    def init_own_weights(self, init, std: float) -> None:
        """Fresh: the output scale at 0 (transformers' Gemma 3n), the router's input scale 1/d."""
        init.zeros_(self.correct_output_scale)
        init.copy_(self.router_input_scale, torch.tensor(self.correct_output_scale.shape[0] ** -1.0))


class AltUpKind(ResidualStreamKind):
    """`residual_stream="altup"`: n streams, one computed per layer."""

    name = "altup"
    position_dim = 2  # (n, B, T, d)
    fields = ALTUP_FIELDS

    def validate(self, config) -> None:
        super().validate(config)
        require_int("altup_num_inputs", config.altup_num_inputs, minimum=2)
        require_int("altup_active_idx", config.altup_active_idx, minimum=0, maximum=config.altup_num_inputs - 1)
        require_number("altup_coef_clip", config.altup_coef_clip, above=0, optional=True)
        require_bool("altup_correct_scale", config.altup_correct_scale)
        if config.num_mtp_layers:
            raise ValueError("`residual_stream='altup'` with `num_mtp_layers`: the MTP modules join one stream; use one "
                             "or the other.")

    def model_module(self, config) -> nn.Module:
        return AltUpStreams(config)

    def layer_modules(self, config, layer_idx: int) -> dict[str, nn.Module]:
        return {"altup": AltUp(config)}

    def join(self, block, x, per_layer_input=None, **kwargs) -> torch.Tensor:
        altup = block.altup
        predictions = altup.predict(x)
        corrected = altup.correct(predictions, block.sublayers(predictions[altup.active], **kwargs))
        if block.per_layer_input is not None:
            first = corrected[altup.active]
            branch = block.per_layer_input(altup(first) if altup.correct_scale else first, per_layer_input)
            corrected = torch.cat((corrected[:1], corrected[1:] + branch))  # (Gemma 3n adds it after the first)
        return scaled_layer_output(block, corrected)

    def layer_parameters(self, config) -> int:
        d, n = config.hidden_size, config.altup_num_inputs
        return d + n * n + n * n * n + d * n + norm_parameters(config, d)

    def model_parameters(self, config) -> int:
        return 2 * (config.altup_num_inputs - 1) * config.hidden_size ** 2


ALTUP = AltUpKind()

__all__ = ["ALTUP", "ALTUP_FIELDS", "AltUp", "AltUpFields", "AltUpStreams"]
