"""The cache layer of a recurrent mixer: a fixed-size state per sequence, not K/V per token, that can roll back.

A layer holds `number_of_states` slots (transformers' `state_idx`); each slot may hold a short convolution's window
(the last K inputs of a depthwise causal convolution, (B, channels, K), in the model's dtype, as transformers keeps
it) and a recurrent state (any shape with the batch first, e.g. Gated DeltaNet's (B, H_v, d_k, d_v) or Mamba-2's
(B, H, head_dim, d_state), kept in the dtype the mixer gives). Gated DeltaNet, Mamba-2 and Kimi Delta Attention use
slot 0 for both (KDA's q/k/v convolutions are one depthwise convolution over their concatenated channels: one
window), LFM2's short convolution slot 0 for a window only. Its size does not grow with the context:
`contract.state_bytes_per_sequence` states it.

`RecurrentLayer` is transformers' own `LinearAttentionLayer` (the class its hybrid caches hold on every release this
family supports), so `Cache.is_linear`, the mask builders and generate's checks treat it as theirs; it implements
every method whose behaviour differs between those releases itself, so it acts the same on each.

Rolling back (assisted decoding, prompt lookup, `use_mtp`, a draft model's cache). `generate` calls
`activate_past_recording(recurrent_states_to_keep=K)` (K: tokens drafted per step) before it drafts, and after each
verification `crop(-n)` to drop the n rejected tokens. While recording, each slot keeps its last K + (tokens it can
roll back) conv inputs and the recurrent state after each of its last (at most K) tokens, so `crop(-n)` restores
exactly the state after the last accepted token; a step of at most K + 1 tokens (a verification) is rolled back
entirely, a longer one (a prompt with its first drafts) over its last K tokens; `crop(0)` (every draft kept) drops
the record. A crop past what was recorded raises a `ValueError` before anything changes. The state before the
recorded tokens is handed over by the mixer, not taken from what the layer held before the step (which is where
transformers' own layer goes wrong after a chunked part: docs/using.md, "Drafting on hybrids").

What a mixer does to get all of that (Gated DeltaNet in `gated_deltanet.py` is the worked example):

* the convolution: `full = layer.update_conv_state(x, state_idx=i, conv_kernel_size=K)` with the step's inputs x
  (B, C, T) returns [stored window, x]; convolve it and keep the last T outputs. A kernel that updates the window in
  place for a one-token step (causal-conv1d's `causal_conv1d_update` on `layer.get_conv_state(i)`) may do so only
  while `not layer.record_past`, and then calls `layer.count_step()`;
* the recurrence: `out = run_recurrence(layer, chunked, recurrent, inputs, state_idx=i)` with the step's inputs
  (tensors whose dim 1 is time) and the two forms of the rule, each `(*inputs, initial_state) -> (out, state)`
  (time on dim 1 of `out`; `initial_state` None means zeros). It reads the state, runs the chunked form (the
  recurrent one for a single token on a cached state), and while recording runs the tokens that may be rolled back
  one by one with the recurrent form and stores each state (so the recurrent form must return a new state tensor,
  not update its input in place: clone first where a kernel does, as Mamba-2's state update). A mixer that computes
  its states otherwise asks `layer.states_to_record(T)` for n and passes `StepStates(before, after, T)` to
  `layer.update_recurrent_state`: `after` the state after each of the step's last n tokens, `before` the state
  before them;
* a layer with no convolution in slot 0 counts its tokens with `layer.count_step(T)`.

`cache.crop`, beam search's reorder, batch select / repeat and `reset` then act on every slot; a forward whose batch
size differs from the states a layer holds is refused with a `ValueError` naming the cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from transformers.cache_utils import LinearAttentionLayer


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision a recurrent state is computed in for a model of `dtype`: fp32 for half and fp32 models (as
    transformers and the kernels), float64 for a float64 model (so its cached steps equal its full forward to float64
    rounding)."""
    return dtype if dtype == torch.float64 else torch.float32


def upcast(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` in its recurrent state's precision (`state_dtype`)."""
    return tensor.to(state_dtype(tensor.dtype))

# Tokens a crop may remove when `activate_past_recording` was not told (transformers' default draft length,
# `num_assistant_tokens`); generate's drafting paths tell it (`recurrent_states_to_keep`)
DEFAULT_STATES_TO_KEEP = 20


@dataclass
class StepStates:
    """The recurrent states a step of `tokens` tokens leaves while its cache records: `after[j]` the state after
    token `tokens - len(after) + j`, `before` the state before the first of those (None: a zero state)."""

    before: torch.Tensor | None
    after: Sequence[torch.Tensor]
    tokens: int


class RecurrentLayer(LinearAttentionLayer):
    """One recurrent mixer's conv windows and recurrent states, recorded for rollback (see the module docstring).

    `conv_state` / `recurrent_state` are slot 0's stored tensors once a forward has written them (else `None`;
    `get_conv_state(i)` / `get_recurrent_state(i)` for slot i)."""

    is_croppable = True
    is_sliding = False

    def __init__(self, number_of_states: int = 1, **kwargs):
        super().__init__(number_of_states=number_of_states)
        # Tokens seen, counted on the states' device and in place (a compiled decode step sees one tensor, not a
        # new integer each step to recompile for); read only where a cache has no attention layer to count them.
        self.tokens = torch.zeros((), dtype=torch.long)
        self.told_states_to_keep: int | None = None  # the largest count `activate_past_recording` was given
        slots = range(number_of_states)
        self.has_recurrent_state = dict.fromkeys(slots, False)
        self.conv_rollable = dict.fromkeys(slots, 0)  # tokens whose conv inputs are kept beyond the window
        self.state_history: dict[int, list[torch.Tensor]] = {i: [] for i in slots}  # states after recent tokens

    # --- reading ---------------------------------------------------------------------------------------------

    @property
    def is_initialized(self) -> bool:
        return any(self.is_conv_states_initialized.values()) or any(self.is_recurrent_states_initialized.values())

    @property
    def is_compileable(self) -> bool:
        """Fixed shapes and static addresses, except while recording (the windows then grow with the drafts)."""
        return not self.record_past

    @property
    def conv_state(self) -> torch.Tensor | None:
        return self.get_conv_state(0)

    @property
    def recurrent_state(self) -> torch.Tensor | None:
        return self.get_recurrent_state(0)

    def get_conv_state(self, state_idx: int = 0) -> torch.Tensor | None:
        """Slot `state_idx`'s conv window (B, C, K + tokens it can roll back), or None before a forward wrote it."""
        return self.conv_states[state_idx] if self.has_previous_state[state_idx] else None

    def get_recurrent_state(self, state_idx: int = 0) -> torch.Tensor | None:
        """Slot `state_idx`'s recurrent state, or None before a forward wrote it."""
        return self.recurrent_states[state_idx] if self.has_recurrent_state[state_idx] else None

    def get_seq_length(self) -> int | torch.Tensor:
        """Tokens seen: an int, or inside a compiled graph the device count (never read on the host there)."""
        return self.tokens if torch.compiler.is_compiling() else int(self.tokens)

    def get_max_length(self) -> int:
        return -1

    # --- writing ---------------------------------------------------------------------------------------------

    def lazy_initialization(self, conv_states=None, recurrent_states=None, state_idx: int = 0,
                            conv_kernel_size: int | None = None) -> None:
        if conv_states is not None:
            self.dtype, self.device = conv_states.dtype, conv_states.device
            self.tokens = self.tokens.to(self.device)
            _mark_static(self.tokens)
            self.conv_kernel_size[state_idx] = conv_kernel_size or self.conv_kernel_size[state_idx]
            self.conv_states[state_idx] = conv_states.new_zeros((*conv_states.shape[:-1],
                                                                 self.conv_kernel_size[state_idx]))
            self.is_conv_states_initialized[state_idx] = True
            _mark_static(self.conv_states[state_idx])
        if recurrent_states is not None:
            self.recurrent_states[state_idx] = torch.zeros_like(recurrent_states)
            self.is_recurrent_states_initialized[state_idx] = True
            _mark_static(self.recurrent_states[state_idx])

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, conv_kernel_size: int | None = None,
                          **kwargs) -> torch.Tensor:
        """Store the last K columns of [window, x] (x: (B, C, T) new inputs; while recording, also the columns of
        the tokens a crop may remove) and return [window, x], the convolution's input (x alone, when nothing is
        stored yet: the convolution pads it with zeros)."""
        i, seq = state_idx, conv_states.shape[-1]
        self._check_batch(conv_states, self.conv_states[i] if self.has_previous_state[i] else None, "conv window")
        if not self.is_conv_states_initialized[i] or (
                not self.has_previous_state[i] and self.conv_states[i].shape[:-1] != conv_states.shape[:-1]):
            self.lazy_initialization(conv_states=conv_states, state_idx=i, conv_kernel_size=conv_kernel_size)
        if i == 0:
            self.tokens.add_(seq)
        full = torch.cat((self.conv_states[i], conv_states), dim=-1) if self.has_previous_state[i] else conv_states
        self.has_previous_state[i] = True
        if self.record_past:
            self.conv_rollable[i] = min(self.conv_rollable[i] + seq, self.recurrent_states_to_keep)
            self.conv_states[i] = _last_columns(full, self.conv_kernel_size[i] + self.conv_rollable[i])
        else:
            self.conv_states[i].copy_(_last_columns(full, self.conv_kernel_size[i]))
        return full

    def count_step(self, tokens: int = 1) -> None:
        """Count the tokens of a step whose kernel updated the conv window in place (causal-conv1d's update), or
        of a mixer with no conv window in slot 0."""
        self.tokens.add_(tokens)

    def states_to_record(self, tokens: int) -> int:
        """How many of a `tokens`-token step's last tokens must each leave their state (0 unless recording): all
        of a step that may be rolled back entirely (at most `recurrent_states_to_keep` + 1 tokens), else the last
        `recurrent_states_to_keep`."""
        if not self.record_past:
            return 0
        return tokens if tokens <= self.recurrent_states_to_keep + 1 else self.recurrent_states_to_keep

    def update_recurrent_state(self, recurrent_states: torch.Tensor | StepStates, state_idx: int = 0,
                               **kwargs) -> torch.Tensor:
        """Store the state after the step: a tensor, or while recording the `StepStates` of its last tokens
        (`states_to_record`), which `crop` restores from. Returns the stored state."""
        i, step = state_idx, recurrent_states
        final = step.after[-1] if isinstance(step, StepStates) else step
        self._check_batch(final, self.get_recurrent_state(i), "recurrent state")
        if not self.is_recurrent_states_initialized[i] or (
                not self.has_recurrent_state[i] and self.recurrent_states[i].shape != final.shape):
            self.lazy_initialization(recurrent_states=final, state_idx=i)
        if self.record_past:
            self._record(i, step)
        self.recurrent_states[i].copy_(final)  # in place: a static address for CUDA graphs
        self.has_recurrent_state[i] = True
        return self.recurrent_states[i]

    def _record(self, i: int, step: torch.Tensor | StepStates) -> None:
        """Extend slot i's history of states with a step's: a step recorded whole continues it, a step recorded
        over its tail only restarts it there, a bare final state leaves nothing to roll back to."""
        if not isinstance(step, StepStates):
            self.state_history[i] = [step.clone()]
            return
        history = self.state_history[i]
        if len(step.after) < step.tokens or not history:  # the tail of a longer step, or the first recorded step
            before = step.before if step.before is not None else torch.zeros_like(step.after[0])
            history = [before.clone() if before is self.recurrent_states[i] else before]
        history = history + list(step.after)
        self.state_history[i] = history[-(self.recurrent_states_to_keep + 1):]

    # --- rolling back ----------------------------------------------------------------------------------------

    def activate_past_recording(self, recurrent_states_to_keep: int | None = None, **kwargs) -> None:
        """Record what `crop` needs to roll back up to `recurrent_states_to_keep` tokens (the tokens drafted per
        step). Several callers may tell it (generate's drafting paths, transformers' loop): the largest count holds;
        where none is given, `DEFAULT_STATES_TO_KEEP`."""
        self.record_past = True
        if recurrent_states_to_keep is not None:
            self.told_states_to_keep = max(int(recurrent_states_to_keep), self.told_states_to_keep or 1)

    @property
    def recurrent_states_to_keep(self) -> int:
        """The most tokens a crop may remove (transformers' name, which its `Cache.get_recurrent_states_to_keep`
        reads)."""
        return self.told_states_to_keep or DEFAULT_STATES_TO_KEEP

    def rollable(self) -> int:
        """The most tokens `crop` can remove now: what every written slot recorded."""
        counts = [self.conv_rollable[i] for i in range(self.number_of_states) if self.has_previous_state[i]]
        counts += [max(len(self.state_history[i]) - 1, 0) for i in range(self.number_of_states)
                   if self.has_recurrent_state[i]]
        return min(counts, default=0)

    def check_crop(self, tokens_to_remove: int) -> None:
        """Raise a `ValueError` where `crop(tokens_to_remove)` cannot restore an earlier state (nothing changes)."""
        if tokens_to_remove > 0:
            raise ValueError(f"`crop({tokens_to_remove})`: a linear-attention layer is cropped by a negative count "
                             "of tokens to remove (transformers' convention).")
        if not self.is_initialized:
            return
        if not self.record_past:
            raise ValueError("`crop` rolls a linear-attention layer back only to a state it recorded: call "
                             "`cache.activate_past_recording(recurrent_states_to_keep=N)` before the forwards to undo.")
        if -tokens_to_remove > self.rollable():
            raise ValueError(
                f"`crop({tokens_to_remove})` would roll a linear-attention layer back {-tokens_to_remove} tokens, but "
                f"it recorded the states of its last {self.rollable()} (`recurrent_states_to_keep`="
                f"{self.recurrent_states_to_keep}, the most tokens drafted per step): activate the recording with more."
            )

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` tokens: each slot goes back to the conv window and the state it had
        after the token before them (recorded while `record_past`); what is older stays recorded, so a later crop
        may go further back. `crop(0)` (a verification that kept every draft) drops the record, as transformers'
        layer does: the windows shrink back to K columns."""
        self.check_crop(tokens_to_remove)
        removed = -tokens_to_remove
        if not self.is_initialized:
            return
        self.tokens.sub_(removed)
        for i in range(self.number_of_states):
            if self.has_previous_state[i]:
                kept = self.conv_kernel_size[i] + (self.conv_rollable[i] - removed if removed else 0)
                self.conv_states[i] = self.conv_states[i][..., self.conv_states[i].shape[-1] - removed - kept:
                                                          self.conv_states[i].shape[-1] - removed].contiguous()
                self.conv_rollable[i] = kept - self.conv_kernel_size[i]
            if self.has_recurrent_state[i] and removed:
                self.state_history[i] = self.state_history[i][:-removed]
                self.recurrent_states[i].copy_(self.state_history[i][-1])
            elif not removed:
                self.state_history[i] = []

    # --- the batch -------------------------------------------------------------------------------------------

    def reset(self) -> None:
        for i in range(self.number_of_states):  # a window that grew while recording goes back to its K columns
            if self.is_conv_states_initialized[i] and self.conv_states[i].shape[-1] != self.conv_kernel_size[i]:
                self.conv_states[i] = self.conv_states[i][..., -self.conv_kernel_size[i]:].clone()
        super().reset()
        self.tokens.zero_()
        for i in range(self.number_of_states):
            self.has_recurrent_state[i] = False
            self.conv_rollable[i] = 0
            self.state_history[i] = []

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map(lambda t: t.index_select(0, indices.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def _map(self, function: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply a batch operation to every stored tensor: windows, states and recorded states."""
        for i in range(self.number_of_states):
            for states in (self.conv_states, self.recurrent_states):
                if states[i] is not None:
                    states[i] = function(states[i])
            self.state_history[i] = [function(state) for state in self.state_history[i]]

    def _check_batch(self, new: torch.Tensor, stored: torch.Tensor | None, what: str) -> None:
        if stored is not None and stored.shape[0] != new.shape[0]:
            raise ValueError(
                f"`cache` holds a linear-attention {what} for a batch of {stored.shape[0]} sequences, and this forward "
                f"has {new.shape[0]}: a cache belongs to one batch. Pass a new cache (`ModularDecoderCache(config)`; "
                "generate builds one by itself) or call `cache.reset()` first."
            )

    def payload_bytes(self) -> int:
        """Bytes of the state the next step reads: each slot's K-column window and its recurrent state (what
        `contract.state_bytes_per_sequence` predicts per sequence; recorded states are not counted)."""
        total = 0
        for i in range(self.number_of_states):
            if isinstance(window := self.conv_states[i], torch.Tensor):
                total += window[..., -self.conv_kernel_size[i]:].numel() * window.element_size()
            if isinstance(state := self.recurrent_states[i], torch.Tensor):
                total += state.numel() * state.element_size()
        return total

    def held_batch_size(self) -> int | None:
        """The batch size of the states a forward wrote, or None."""
        for i in range(self.number_of_states):
            for state in (self.get_conv_state(i), self.get_recurrent_state(i)):
                if state is not None:
                    return state.shape[0]
        return None


def run_recurrence(layer: RecurrentLayer | None, chunked: Callable, recurrent: Callable,
                   inputs: Sequence[torch.Tensor], state_idx: int = 0) -> torch.Tensor:
    """Run a recurrent rule over one forward's `inputs` (tensors with time on dim 1) from the state `layer` holds in
    slot `state_idx` (zeros with no layer or none stored), store the new state there and return the output.

    `chunked` / `recurrent`: the two forms of the rule, `(*inputs, initial_state) -> (output, state)`. The chunked
    form runs, or the recurrent one for a single token on a stored state; while the layer records, the tokens a
    crop may remove run one by one through the recurrent form, and their states are stored (`StepStates`)."""
    state = layer.get_recurrent_state(state_idx) if layer is not None else None
    seq = inputs[0].shape[1]
    record = layer.states_to_record(seq) if layer is not None else 0
    if not record:
        out, state = (recurrent if state is not None and seq == 1 else chunked)(*inputs, state)
        if layer is not None:
            layer.update_recurrent_state(state, state_idx)
        return out
    head = seq - record
    outputs, after = [], []
    if head:  # the part no crop reaches, chunked
        out, state = chunked(*(x[:, :head] for x in inputs), state)
        outputs.append(out)
    before = state
    for t in range(head, seq):
        out, state = recurrent(*(x[:, t:t + 1] for x in inputs), state)
        outputs.append(out)
        after.append(state)
    layer.update_recurrent_state(StepStates(before, after, seq), state_idx)
    return torch.cat(outputs, dim=1)


def _last_columns(x: torch.Tensor, count: int) -> torch.Tensor:
    """The last `count` columns of x (..., T) in a tensor of their own (not a view that keeps a long step's inputs
    alive), zero-padded on the left where T < count (zeros come before a sequence's first token)."""
    x = x[..., -count:]
    return torch.nn.functional.pad(x, (count - x.shape[-1], 0)) if x.shape[-1] < count else x.clone()


def _mark_static(tensor: torch.Tensor) -> None:
    """A static address for CUDA graphs, as transformers marks its linear-attention states (outside a compile)."""
    if not torch.compiler.is_compiling():
        torch._dynamo.mark_static_address(tensor)


__all__ = ["DEFAULT_STATES_TO_KEEP", "RecurrentLayer", "StepStates", "run_recurrence"]
