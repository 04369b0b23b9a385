"""`generate(use_mtp=True)`: speculative decoding with the model's own MTP modules (`mtp.py`), checked losslessly.

transformers' `MTPCandidateGenerator` does the bookkeeping on every supported release (which of the model's last
hidden states and tokens each draft reads, the MTP cache's roll-back when several modules drafted, where a draft
stops at an end-of-sequence token) and its assisted-decoding loop verifies the drafts with the model: greedy keeps
a draft while it equals the model's argmax, sampling accepts it by speculative sampling, so the tokens are those of
decoding without drafts. Only what its `__init__` builds is replaced: transformers loads a separate `MtpModel` from
the checkpoint files, while this family's modules are part of the model (trained, adapted and saved with it);
they draft through `MtpDrafter` into a cache of this family (MLA latents for an MLA model, int8 beside an int8
cache, sliding windows), which keeps what a crop removes as the model's own cache does.

`generate(use_mtp=True, mtp_draft_tokens=K)` (default: `config.mtp_draft_tokens`, else one per module) drafts K
tokens per step: the first K modules, or past `num_mtp_layers` the last module again on its own output
(`mtp.MtpDrafter`, which says what the modules' cache keeps). transformers' bookkeeping then sees min(K, modules)
modules and K drafted tokens; the verification is the same, so the tokens are those of decoding without drafts.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from dataclasses import dataclass, field

from .cache import ModularDecoderCache
from .compat import cache_of, mtp_candidate_generator
from .mtp import MtpDrafter

# the caches whose implementation the MTP modules' cache copies; others (static) get a dynamic one
_CACHE_IMPLEMENTATIONS = ("dynamic", "int8")


@dataclass
class DraftStatistics:
    """What `generate(use_mtp=True)` did inside `recorded_drafts()`: the model's forwards (prefill included) and
    the tokens the modules drafted. Each forward keeps its accepted drafts plus one token of its own, so of
    `new_tokens` generated, `new_tokens - forwards` were accepted drafts. `steps` counts the verifications of
    drafts and `accepted_at_least[j]` those that kept at least j + 1 drafts (the acceptance per position)."""

    forwards: int = 0
    drafted: int = 0
    steps: int = 0
    accepted_at_least: list[int] = field(default_factory=list)

    def acceptance(self, new_tokens: int) -> float:
        """The share of drafted tokens the model accepted."""
        return (new_tokens - self.forwards) / self.drafted if self.drafted else 0.0

    def position_acceptance(self) -> list[float]:
        """For each draft position j, the share of steps that accepted at least j + 1 drafts."""
        return [count / self.steps for count in self.accepted_at_least] if self.steps else []

    def record_step(self, drafted: int, accepted: int) -> None:
        """One verification of `drafted` drafts that kept the first `accepted`."""
        self.steps += 1
        self.accepted_at_least += [0] * (drafted - len(self.accepted_at_least))
        for position in range(accepted):
            self.accepted_at_least[position] += 1


_RECORDING: list[DraftStatistics] = []


@contextlib.contextmanager
def recorded_drafts():
    """Count the forwards and drafts of every `generate(use_mtp=True)` inside the block (`DraftStatistics`)."""
    statistics = DraftStatistics()
    _RECORDING.append(statistics)
    try:
        yield statistics
    finally:
        _RECORDING.remove(statistics)


def drafting_refusal(config) -> str | None:
    """Why `generate(use_mtp=True)` cannot draft with this config, or None where it drafts: every layer of its cache
    must roll back after a rejected draft (transformers' `is_croppable`)."""
    stuck = sorted({type(layer).__name__ for layer in ModularDecoderCache(config).layers if not layer.is_croppable})
    if stuck:
        return (f"`use_mtp` is set, and this model's cache layers ({', '.join(stuck)}) cannot be rolled back after a "
                "rejected draft: generate without `use_mtp`.")
    return None


def check_use_mtp(config, use_mtp) -> None:
    """`use_mtp=True` needs MTP modules: a `ValueError` naming both otherwise."""
    if use_mtp and not config.num_mtp_layers:
        raise ValueError("`use_mtp=True` drafts with the model's multi-token-prediction modules, and this model has "
                         "none (`num_mtp_layers`=0): convert a checkpoint that ships them, add some with "
                         "`modular-decoder reshape SRC OUT --add-mtp 1`, or generate without `use_mtp`.")


def check_draft_tokens(config, use_mtp, draft_tokens) -> None:
    """`mtp_draft_tokens` (drafts per step) is a positive int and drafts only with `use_mtp`: a `ValueError` naming
    it otherwise."""
    if draft_tokens is None:
        return
    if isinstance(draft_tokens, bool) or not isinstance(draft_tokens, int) or draft_tokens < 1:
        raise ValueError(f"`mtp_draft_tokens`={draft_tokens!r} must be a positive int (tokens drafted per step).")
    if not use_mtp:
        raise ValueError(f"`mtp_draft_tokens`={draft_tokens} sets how many tokens `use_mtp=True` drafts per step; "
                         "pass `use_mtp=True` with it.")
    check_use_mtp(config, use_mtp)


# the `mtp_draft_tokens` of the `generate` call under way (transformers' generate does not know the option)
_DRAFT_TOKENS: contextvars.ContextVar[int | None] = contextvars.ContextVar("mtp_draft_tokens", default=None)


@contextlib.contextmanager
def drafting_tokens(draft_tokens: int | None):
    """Within the block, `generate(use_mtp=True)` drafts `draft_tokens` per step (None: the config's default)."""
    token = _DRAFT_TOKENS.set(draft_tokens)
    try:
        yield
    finally:
        _DRAFT_TOKENS.reset(token)


def draft_tokens_for(config) -> int:
    """Tokens drafted per step: the `generate` call's `mtp_draft_tokens`, else the config's, else one per module."""
    return _DRAFT_TOKENS.get() or config.mtp_draft_tokens or config.num_mtp_layers


@functools.cache
def _generator_class() -> type:
    base = mtp_candidate_generator()

    class ModularDecoderMTPCandidateGenerator(base):
        """transformers' `MTPCandidateGenerator` drafting with the model's own modules (see the module docstring)."""

        def __init__(self, main_model, generation_config, model_kwargs: dict, logits_processor=None):
            # transformers' __init__ would load its own `MtpModel` from the checkpoint files: these are the
            # attributes its `get_candidates` reads, set from the model instead
            check_use_mtp(main_model.config, True)
            self.draft_tokens = draft_tokens_for(main_model.config)
            # the modules transformers' bookkeeping (which drafted entries to recompute) sees
            self.num_mtp_layers = min(self.draft_tokens, main_model.config.num_mtp_layers)
            self.model_kwargs_overrides = {"output_hidden_states": True}  # the last one is what the modules read
            self.device = next(main_model.mtp.parameters()).device
            self.mtp_model = MtpDrafter(main_model, self.draft_tokens)
            main_cache = cache_of(model_kwargs)
            implementation = getattr(main_cache, "implementation", "dynamic")
            if implementation not in _CACHE_IMPLEMENTATIONS:
                implementation = "dynamic"
            self.mtp_cache = ModularDecoderCache(main_model.mtp.block_config, implementation)
            self.mtp_cache.activate_past_recording(self.draft_tokens)
            self.do_sample = generation_config.do_sample
            self.logits_processor = logits_processor
            self.eos_token_id = getattr(generation_config, "_eos_token_tensor", None)  # read before 5.25
            self.is_main_model_prefill = True

        def get_candidates(self, input_ids, *args, **kwargs):
            candidates, logits = super().get_candidates(input_ids, *args, **kwargs)
            self.last_drafted = candidates.shape[1] - input_ids.shape[1]
            for statistics in _RECORDING:  # called once before each of the model's forwards
                statistics.forwards += 1
                statistics.drafted += self.last_drafted
            return candidates, logits

        def update_candidate_strategy(self, input_ids, scores, num_matches) -> None:
            """Called after each verification with the drafts it accepted (none drafted before the prefill)."""
            super().update_candidate_strategy(input_ids, scores, num_matches)
            if getattr(self, "last_drafted", 0):
                for statistics in _RECORDING:
                    statistics.record_step(self.last_drafted, int(num_matches))

        @property
        def num_drafting_tokens(self) -> int:
            """Tokens drafted per step (transformers asks, to size what the model's cache records)."""
            return self.draft_tokens

    return ModularDecoderMTPCandidateGenerator


def mtp_candidate_generator_for(model, generation_config, model_kwargs: dict, logits_processor=None):
    """The candidate generator `generate(use_mtp=True)` drafts with, for `model`."""
    return _generator_class()(model, generation_config, model_kwargs, logits_processor)
