"""The cache layer of a linear-attention layer: a fixed-size state per sequence, not K/V per token.

It holds, per sequence, the short convolution's window (the last `linear_conv_kernel_dim` inputs of the
convolution, (B, conv channels, K) in the model's dtype, as transformers keeps it) and the recurrent state
((B, H_v, d_k, d_v), fp32, as transformers' reference kernels return it). Its size does not grow with the
context: `contract.state_bytes_per_sequence` states it.

`RecurrentLayer` is transformers' own `LinearAttentionLayer` (the class its Qwen3-Next and Qwen3.5 caches hold on
every release this family supports), so `Cache.is_linear`, the mask builders and generate's checks treat it as
theirs. It implements the few methods whose behaviour differs between those releases itself (the token count,
the updates), so that it acts the same on each, and adds what generate asks of every layer (batch repeat /
select). A recurrent state cannot be rolled back: `crop` and `activate_past_recording` (assisted decoding,
prompt lookup, a draft model's cache) raise a `ValueError` that says so.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import LinearAttentionLayer

ROLLBACK_ERROR = (
    "A linear_attention layer keeps one recurrent state per sequence, which cannot be rolled back to an earlier "
    "token: assisted decoding, prompt lookup and a draft model's cache (which crop the cache) are not supported "
    "for models with `layer_types` containing 'linear_attention'. Generate without `assistant_model` / "
    "`prompt_lookup_num_tokens`."
)


class RecurrentLayer(LinearAttentionLayer):
    """One linear-attention layer's conv window and recurrent state (see the module docstring).

    `conv_state` / `recurrent_state` are the stored tensors once a forward has written them (else `None`);
    `update_conv_state(x)` returns the convolution's input with the stored window prepended and keeps the last
    K columns; `update_recurrent_state(s)` stores the new state in place (static addresses, for CUDA graphs)."""

    is_croppable = False
    is_compileable = True  # fixed shapes: static addresses once allocated
    is_sliding = False

    def __init__(self, **kwargs):
        super().__init__(number_of_states=1)
        # Tokens seen, counted on the states' device and in place (a compiled decode step sees one tensor, not a
        # new integer each step to recompile for); read only where a cache has no attention layer to count them.
        self.tokens = torch.zeros((), dtype=torch.long)

    @property
    def is_initialized(self) -> bool:
        return bool(self.is_conv_states_initialized[0])

    @property
    def conv_state(self) -> torch.Tensor | None:
        return self.conv_states[0] if self.has_previous_state[0] else None

    @property
    def recurrent_state(self) -> torch.Tensor | None:
        return self.recurrent_states[0] if self.has_previous_state[0] else None

    def lazy_initialization(self, conv_states=None, recurrent_states=None, state_idx: int = 0,
                            conv_kernel_size: int | None = None) -> None:
        if conv_states is not None:
            self.dtype, self.device = conv_states.dtype, conv_states.device
            self.tokens = self.tokens.to(self.device)
            _mark_static(self.tokens)
            self.conv_kernel_size[0] = conv_kernel_size
            self.conv_states[0] = conv_states.new_zeros((*conv_states.shape[:-1], conv_kernel_size))
            self.is_conv_states_initialized[0] = True
            _mark_static(self.conv_states[0])
        if recurrent_states is not None:
            self.recurrent_states[0] = torch.zeros_like(recurrent_states, dtype=torch.float32)
            self.is_recurrent_states_initialized[0] = True
            _mark_static(self.recurrent_states[0])

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, conv_kernel_size: int | None = None,
                          **kwargs) -> torch.Tensor:
        """Store the last K columns of [window, x] (x: (B, C, T) new inputs) and return [window, x], the
        convolution's input (x alone, when nothing is stored yet: the convolution pads it with zeros)."""
        if not self.is_conv_states_initialized[0]:
            self.lazy_initialization(conv_states=conv_states, conv_kernel_size=conv_kernel_size)
        self.tokens.add_(conv_states.shape[-1])
        full = torch.cat((self.conv_states[0], conv_states), dim=-1) if self.has_previous_state[0] else conv_states
        window = full[..., -self.conv_kernel_size[0]:]
        if window.shape[-1] < self.conv_kernel_size[0]:
            window = torch.nn.functional.pad(window, (self.conv_kernel_size[0] - window.shape[-1], 0))
        self.conv_states[0].copy_(window)
        return full

    def count_step(self) -> None:
        """Count the token of a decode step whose kernel updated `conv_state` in place (causal-conv1d's update)."""
        self.tokens.add_(1)

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        if not self.is_recurrent_states_initialized[0]:
            self.lazy_initialization(recurrent_states=recurrent_states)
        self.recurrent_states[0].copy_(recurrent_states)
        self.has_previous_state[0] = True
        return self.recurrent_states[0]

    def get_seq_length(self) -> int | torch.Tensor:
        """Tokens seen: an int, or inside a compiled graph the device count (never read on the host there)."""
        return self.tokens if torch.compiler.is_compiling() else int(self.tokens)

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        super().reset()
        self.tokens.zero_()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        for states in (self.conv_states, self.recurrent_states):
            if states[0] is not None:
                states[0] = states[0].repeat_interleave(repeats, dim=0)

    def _select(self, indices: torch.Tensor) -> None:
        for states in (self.conv_states, self.recurrent_states):
            if states[0] is not None:
                states[0] = states[0].index_select(0, indices.to(states[0].device))

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError(ROLLBACK_ERROR)

    def activate_past_recording(self, *args, **kwargs) -> None:
        raise ValueError(ROLLBACK_ERROR)

    def payload_bytes(self) -> int:
        """Bytes held: the conv window and the recurrent state (what `contract.state_bytes_per_sequence` predicts
        per sequence)."""
        return sum(t.numel() * t.element_size() for t in (self.conv_states[0], self.recurrent_states[0])
                   if isinstance(t, torch.Tensor))


# generate's arguments that decode by drafting and rolling back (assisted decoding and its variants)
ROLLBACK_ARGUMENTS = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit")


def refuse_rollback_decoding(generate_kwargs: dict, generation_config, error: str = ROLLBACK_ERROR) -> None:
    """Raise `ValueError` naming the argument where a `generate` call would draft tokens and crop the cache
    (`error`: why the cache cannot be cropped)."""
    configs = [generate_kwargs.get("generation_config"), generation_config]
    for name in ROLLBACK_ARGUMENTS:
        if generate_kwargs.get(name) is not None or any(getattr(c, name, None) is not None for c in configs):
            raise ValueError(f"`{name}` is set: {error}")
    if getattr(generation_config, "is_assistant", False):
        raise ValueError(f"This model is used as an assistant (a draft model): {error}")


def _mark_static(tensor: torch.Tensor) -> None:
    """A static address for CUDA graphs, as transformers marks its linear-attention states (outside a compile)."""
    if not torch.compiler.is_compiling():
        torch._dynamo.mark_static_address(tensor)


__all__ = ["RecurrentLayer", "ROLLBACK_ERROR", "refuse_rollback_decoding"]
