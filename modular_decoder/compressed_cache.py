"""Cache layers of shared key = value attention (`attention_type="shared_kv"`, DeepSeek-V4): one tensor per token
serves as its key and its value, so it is stored once; and the compressed entries of its CSA / HCA layers.

- `KeyValueLayer` (full layers) and `KeyValueSlidingLayer` (the window of every other layer): transformers' growing
  and sliding layers holding the key; the values they keep have no features (the key is returned for both).
- `CompressedLayer` (`"compressed_sparse_attention"` / `"heavily_compressed_attention"` layers, as transformers'
  `DeepseekV4CSACache` / `DeepseekV4HCACache`): the window, and per pooled stream (the compressor's, CSA's indexer's)
  the last tokens' projections (`tail_length` of them: what the windows a later step completes still need) and the
  entries, one slot per window index w. A step writes each window it completes into slot w (one row may complete a
  window where another does not, as their positions differ under left padding); a slot is read by a query at
  position p once w < (p + 1) // m, so the slots not yet written are never read. Its state cannot be rolled back:
  `crop` is refused (no assisted decoding, as transformers' layers are not croppable).

`payload_bytes` (`cache.ModularDecoderCache`) counts the window's keys and the entries of the windows completed.
"""

from __future__ import annotations

import torch

from .compat import DynamicSlidingWindowLayer
from .compressed_attention import NEVER
from .growing_cache import GrowingLayer

ROLLBACK_ERROR = (
    "A compressed attention layer ('compressed_sparse_attention' / 'heavily_compressed_attention' in `layer_types`) "
    "pools each completed window of tokens into its cache, which cannot be rolled back to an earlier token: assisted "
    "decoding, prompt lookup, MTP drafting and a draft model's cache (which crop the cache) are not supported, as "
    "transformers' DeepSeek-V4 does not support them. Generate without `assistant_model` / "
    "`prompt_lookup_num_tokens` / `use_mtp`."
)


# generate's arguments that decode by drafting and cropping the cache (assisted decoding and its variants)
ROLLBACK_ARGUMENTS = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit")


def refuse_rollback_decoding(generate_kwargs: dict, generation_config, error: str) -> None:
    """Raise `ValueError` naming the argument where a `generate` call would draft tokens and crop the cache (`error`:
    why the cache cannot be cropped)."""
    configs = [generate_kwargs.get("generation_config"), generation_config]
    for name in ROLLBACK_ARGUMENTS:
        if generate_kwargs.get(name) is not None or any(getattr(c, name, None) is not None for c in configs):
            raise ValueError(f"`{name}` is set: {error}")
    if getattr(generation_config, "is_assistant", False):
        raise ValueError(f"This model is used as an assistant (a draft model): {error}")


def _featureless(states: torch.Tensor) -> torch.Tensor:
    return states[..., :0]


class KeyValueLayer(GrowingLayer):
    """A full layer's keys, which are also its values (`GrowingLayer`: pre-allocated growth)."""

    payload_tensors = ("keys",)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, _ = super().update(key_states, _featureless(key_states))
        return keys, keys


class KeyValueSlidingLayer(DynamicSlidingWindowLayer):
    """The last `sliding_window - 1` tokens' keys, which are also their values."""

    payload_tensors = ("keys",)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, _ = super().update(key_states, _featureless(key_states), *args, **kwargs)
        return keys, keys


class CompressedLayer(KeyValueSlidingLayer):
    """The window and the compressed entries of a CSA or HCA layer (module docstring)."""

    is_croppable = False
    spare_divisor, min_spare = 64, 16  # entry slots grow as `GrowingLayer`'s tokens do

    def __init__(self, sliding_window: int, rate: int, tail_length: int, **kwargs):
        super().__init__(sliding_window=sliding_window, **kwargs)
        self.rate, self.tail_length = rate, tail_length
        self.tails: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.entries: dict[str, torch.Tensor] = {}  # name -> (B, slots + 1, D): the last slot takes what is dropped

    def with_tail(self, name: str, kv: torch.Tensor, gate: torch.Tensor, tail: int):
        """The held last tokens' (C, Z) before the new ones', (B, tail + T, ·); nothing held yet: zeros with gates
        of -inf (weight 0 in a window)."""
        held = self.tails.get(name)
        if held is None:
            held = (kv.new_zeros(kv.shape[0], tail, kv.shape[-1]),
                    gate.new_full((gate.shape[0], tail, gate.shape[-1]), float("-inf")))
        return torch.cat((held[0], kv), dim=1), torch.cat((held[1], gate), dim=1)

    def store(self, name: str, kv, gate, order, pooled: torch.Tensor, plan, kept: torch.Tensor) -> None:
        """Keep the last `tail_length` real tokens' (C, Z) of X (`kv`, `gate` (B, N, ·) in `order`) and write the
        windows `plan` completes that `kept` (B, K) marks (those of each row's last document) into their slots."""
        keep = order[:, -self.tail_length:].unsqueeze(-1) if self.tail_length else order[:, :0].unsqueeze(-1)
        self.tails[name] = (kv.gather(1, keep.expand(-1, -1, kv.shape[-1])),
                            gate.gather(1, keep.expand(-1, -1, gate.shape[-1])))
        entries = self._slots(name, pooled)
        trash = entries.shape[1] - 1
        slot = torch.where(kept, plan.windows, trash).clamp(max=trash)
        entries.scatter_(1, slot.unsqueeze(-1).expand(-1, -1, pooled.shape[-1]), pooled.to(entries.dtype))

    def push(self, name: str, kv: torch.Tensor, gate: torch.Tensor, real: torch.Tensor) -> None:
        """Join one new token's (C, Z) (B, 1, ·) to the held last tokens, in the rows where it is real (`real`
        (B, 1), None: all); the oldest leaves. What `store` keeps after a one-token forward that closes no window."""
        held = self.tails[name]
        joined = tuple(torch.cat((old, new), dim=1)[:, 1:] for old, new in zip(held, (kv, gate)))
        if real is not None:
            joined = tuple(torch.where(real.unsqueeze(-1), new, old) for new, old in zip(joined, held))
        self.tails[name] = joined

    def _slots(self, name: str, pooled: torch.Tensor) -> torch.Tensor:
        """The entry slots of `name`, grown to the windows the tokens seen so far can have completed (positions
        count real tokens, so at most `cumulative_length // rate`), plus the last one for what is dropped."""
        needed = self.cumulative_length // self.rate + 1
        held = self.entries.get(name)
        if held is None or held.shape[1] < needed:
            slots = needed + max(self.min_spare, needed // self.spare_divisor)
            grown = pooled.new_zeros(pooled.shape[0], slots, pooled.shape[-1])  # never garbage: zeros are read masked
            if held is not None:
                grown[:, : held.shape[1] - 1] = held[:, :-1]
            self.entries[name] = held = grown
        return held

    def entry_windows(self) -> torch.Tensor:
        """(1, S) the window index of each slot (the last, which takes what is dropped, none)."""
        slots = next(iter(self.entries.values())).shape[1]
        windows = torch.arange(slots, device=self.keys.device)
        return windows.masked_fill(windows == slots - 1, NEVER).unsqueeze(0)

    def completed_windows(self) -> int:
        """Entries the windows completed so far hold per sequence, at most (for `payload_bytes`)."""
        return self.cumulative_length // self.rate

    def payload_bytes(self) -> int:
        """The window's keys and each stream's completed windows' entries."""
        keys = self.keys.numel() * self.keys.element_size() if self.is_initialized else 0
        entries = sum(t.shape[0] * min(self.completed_windows(), t.shape[1] - 1) * t.shape[-1] * t.element_size()
                      for t in self.entries.values())
        return keys + entries

    def _map_batch(self, fn) -> None:
        for name, (kv, gate) in list(self.tails.items()):
            self.tails[name] = (fn(kv), fn(gate))
        for name, entries in list(self.entries.items()):
            self.entries[name] = fn(entries)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._map_batch(lambda t: t[indices, ...])

    def reset(self) -> None:
        super().reset()
        self.tails.clear()
        self.entries.clear()

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError(ROLLBACK_ERROR)

    def activate_past_recording(self, *args, **kwargs) -> None:
        raise ValueError(ROLLBACK_ERROR)


__all__ = ["CompressedLayer", "ROLLBACK_ARGUMENTS", "ROLLBACK_ERROR", "KeyValueLayer", "KeyValueSlidingLayer",
           "refuse_rollback_decoding"]
