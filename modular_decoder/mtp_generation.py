"""`generate(use_mtp=True)`: speculative decoding with the model's own MTP modules (`mtp.py`), checked losslessly.

`MtpCandidateGenerator` is a transformers `CandidateGenerator` (the public base class of the drafters transformers'
assisted-decoding loop runs): after each of the model's forwards it reads the model's last hidden states of the
tokens just verified, runs the modules over them into a cache of this family (MLA latents for an MLA model, int8
beside an int8 cache, sliding windows) and drafts with `mtp.MtpDrafter`. transformers' loop verifies the drafts with
the model: greedy keeps a draft while it equals the model's argmax, sampling accepts it by speculative sampling, so
the tokens are those of decoding without drafts. The drafts are those of transformers' `MTPCandidateGenerator` for
the same weights (it loads a separate `MtpModel` from the checkpoint files; these modules are part of the model,
trained, adapted and saved with it).

How many tokens a step drafts: at most K (`generate(use_mtp=True, mtp_draft_tokens=K)`, default
`config.mtp_draft_tokens`, else one per module): the first K modules, past `num_mtp_layers` the last module again on
its own output. By default each step drafts the count, none included, that yields the most tokens per second at
the acceptance and step times the call measures (`draft_schedule.py`), so drafting that does not pay on this
machine stops; `num_assistant_tokens_schedule="constant"` (transformers' name) drafts K every step. A step that
drafts none leaves the modules' cache behind: the next drafting step reads those positions first.

What transformers has no public way to do, in one place each: choosing this generator (`GenerationMixin.
_get_candidate_generator`, overridden by the model, see compat.py) and passing it the call's options (a context
variable set by the model's `generate`, which transformers' `generate` would refuse as unknown keyword arguments).
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import StaticLayer
from transformers.generation import CandidateGenerator

from .cache import ModularDecoderCache
from .compat import cache_of, is_croppable
from .draft_schedule import DraftSchedule, clock
from .mtp import MtpDrafter

# the caches whose implementation the MTP modules' cache copies; others (static) get a dynamic one
_CACHE_IMPLEMENTATIONS = ("dynamic", "int8")


@dataclass
class DraftStatistics:
    """What `generate(use_mtp=True)` did inside `recorded_drafts()`: the model's forwards (prefill included) and
    the tokens the modules drafted. Each forward keeps its accepted drafts plus one token of its own, so of
    `new_tokens` generated, `new_tokens - forwards` were accepted drafts. `steps` counts the verifications of
    drafts, `drafted_at_least[j]` those that drafted at least j + 1 tokens and `accepted_at_least[j]` those that
    kept at least j + 1 drafts (the acceptance per position)."""

    forwards: int = 0
    drafted: int = 0
    steps: int = 0
    drafted_at_least: list[int] = field(default_factory=list)
    accepted_at_least: list[int] = field(default_factory=list)

    def acceptance(self, new_tokens: int) -> float:
        """The share of drafted tokens the model accepted."""
        return (new_tokens - self.forwards) / self.drafted if self.drafted else 0.0

    def position_acceptance(self) -> list[float]:
        """For each draft position j, the share of the steps that drafted it which accepted at least j + 1 drafts."""
        return [kept / drafted for kept, drafted in zip(self.accepted_at_least, self.drafted_at_least)]

    def record_step(self, drafted: int, accepted: int) -> None:
        """One verification of `drafted` drafts that kept the first `accepted`."""
        self.steps += 1
        for counts in (self.drafted_at_least, self.accepted_at_least):
            counts += [0] * (drafted - len(counts))
        for position in range(drafted):
            self.drafted_at_least[position] += 1
        for position in range(accepted):
            self.accepted_at_least[position] += 1


_RECORDING: contextvars.ContextVar[tuple[DraftStatistics, ...]] = contextvars.ContextVar("mtp_recording", default=())


@contextlib.contextmanager
def recorded_drafts():
    """Count the forwards and drafts of every `generate(use_mtp=True)` inside the block (`DraftStatistics`)."""
    statistics = DraftStatistics()
    token = _RECORDING.set((*_RECORDING.get(), statistics))
    try:
        yield statistics
    finally:
        _RECORDING.reset(token)


@dataclass(frozen=True)
class DraftingOptions:
    """What one `generate` call asks of drafting beyond transformers' options: `draft_tokens` (at most, per step;
    None: the config's default) and `adaptive` (False: transformers' `num_assistant_tokens_schedule="constant"`)."""

    draft_tokens: int | None = None
    adaptive: bool = True


# the options of the `generate` call under way (transformers' `generate` takes no options for a drafter)
_OPTIONS: contextvars.ContextVar[DraftingOptions] = contextvars.ContextVar("mtp_options", default=DraftingOptions())


@contextlib.contextmanager
def drafting_options(options: DraftingOptions):
    """Within the block, `generate(use_mtp=True)` drafts as `options` say."""
    token = _OPTIONS.set(options)
    try:
        yield
    finally:
        _OPTIONS.reset(token)


def options_of(generate_kwargs: dict, generation_configs) -> DraftingOptions:
    """The drafting options of a `generate` call: `mtp_draft_tokens` (popped from `generate_kwargs`) and the
    schedule the caller set (`num_assistant_tokens_schedule`, as an argument or on a generation config)."""
    schedule = generate_kwargs.get("num_assistant_tokens_schedule")
    for config in generation_configs:
        schedule = schedule or getattr(config, "num_assistant_tokens_schedule", None)
    return DraftingOptions(generate_kwargs.pop("mtp_draft_tokens", None), adaptive=schedule != "constant")


def drafting_refusal(config) -> str | None:
    """Why `generate(use_mtp=True)` cannot draft with this config, or None where it drafts: every layer of its cache
    must roll back after a rejected draft (transformers' `is_croppable`)."""
    stuck = sorted({type(layer).__name__ for layer in ModularDecoderCache(config).layers if not is_croppable(layer)})
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


def draft_tokens_for(config) -> int:
    """The most tokens a step drafts: the `generate` call's `mtp_draft_tokens`, else the config's, else one per
    module."""
    return _OPTIONS.get().draft_tokens or config.mtp_draft_tokens or config.num_mtp_layers


def static_cache_room(generation_config, config) -> int:
    """Slots a static cache needs past generate's `max_length - 1` for drafting, whose steps write their drafts into
    the cache before verifying them: the tokens MTP or prompt lookup draft per step (transformers' generators do not
    stop them at `max_length`); none for an assistant model (transformers stops its drafts there)."""
    lookup = generation_config.prompt_lookup_num_tokens
    if lookup is not None:
        return lookup
    if getattr(generation_config, "use_mtp", False) and generation_config.assistant_early_exit is None:
        return draft_tokens_for(config)
    return 0


def check_static_drafting(cache, needed: int) -> None:
    """A static cache that drafting decodes into must hold `needed` tokens and crop back after a rejected draft:
    a `ValueError` naming the cache otherwise (transformers' static layers crop from 5.2x, not on 5.16; a sliding
    layer's ring shorter than the cache loses what a crop would restore)."""
    layers = [layer for layer in cache.layers if isinstance(layer, StaticLayer)]
    if not all(getattr(layer, "is_croppable", False) for layer in layers):
        raise ValueError("Drafting (`use_mtp`, `prompt_lookup_num_tokens`, `assistant_model`) needs a cache that can be "
                         "cropped back after a rejected draft, which this static cache cannot (this transformers "
                         "release's static layers do not crop, or a sliding layer's window is shorter than the cache): "
                         "generate without `cache_implementation=\"static\"`.")
    length = min((layer.max_cache_len for layer in layers if not getattr(layer, "is_sliding", False)), default=None)
    if length is not None and length < needed:
        raise ValueError(f"The static `cache` holds {length} tokens; drafting writes up to {needed} (the prompt, the "
                         "new tokens and one step's drafts): pass a longer one, or let generate build it.")


class MtpCandidateGenerator(CandidateGenerator):
    """Drafts for transformers' assisted decoding with the model's own MTP modules (see the module docstring).

    The modules' cache holds one row per verified position they have read. Module k's last k rows of a step come
    from that step's drafts; where the model kept fewer than `modules - 1` of them, the last `modules` rows are
    computed again from the verified tokens, as transformers' `MTPCandidateGenerator` does.
    """

    requires_model_outputs = True  # transformers' loop passes the model's outputs (hidden states) to `get_candidates`

    def __init__(self, model, generation_config, model_kwargs: dict, logits_processor=None):
        config = model.config
        check_use_mtp(config, True)
        self.most = draft_tokens_for(config)
        self.modules = min(self.most, config.num_mtp_layers)  # the modules that draft (a larger K repeats the last)
        self.model_kwargs_overrides = {"output_hidden_states": True}  # the last one is what the modules read
        self.drafter = MtpDrafter(model, self.most)
        implementation = getattr(cache_of(model_kwargs), "implementation", "dynamic")
        self.cache = ModularDecoderCache(model.mtp.block_config,
                                         implementation if implementation in _CACHE_IMPLEMENTATIONS else "dynamic")
        self.cache.activate_past_recording(self.most)
        self.do_sample = generation_config.do_sample
        self.logits_processor = logits_processor
        eos = generation_config.eos_token_id
        self.eos = None if eos is None else torch.tensor(eos).flatten()
        self.schedule = DraftSchedule(self.most, self.modules, adaptive=_OPTIONS.get().adaptive)
        self.unread: torch.Tensor | None = None  # last hidden states of verified positions the modules did not read
        self.recent: torch.Tensor | None = None  # those of the last `modules` positions they read
        self.read = 0  # rows in the modules' cache: the verified positions they read
        self.stale = 0  # rows at its end drafted from tokens the model rejected
        self.drafted = 0  # tokens drafted by the step under way
        self.started: float | None = None  # when that step began (`draft_schedule.clock`)
        self.caught_up = 0  # positions that step read beyond its own verified ones

    @property
    def num_drafting_tokens(self) -> int:
        """The most tokens a step drafts (transformers asks, to size what the model's cache records)."""
        return self.most

    def get_candidates(self, input_ids, model_kwargs=None, model_outputs=None, is_first_iteration=False,
                       n_last_matches=0, **kwargs):
        """`input_ids` and the step's drafts after them, with the drafts' logits (none on a plain step)."""
        now = clock()  # a step runs from here (its drafts, the model's forward, the loop) to the next call
        if is_first_iteration:  # the model's prefill runs first: the modules read its hidden states after
            self._begin(0, 0, None)
            return input_ids, None
        self._step_done(int(n_last_matches), now)
        prefill = self.read == 0 and self.unread is None  # the prompt's positions (all but the model's new token)
        verified = input_ids.shape[1] - 1 if prefill else int(n_last_matches) + 1
        hidden = model_outputs.hidden_states[-1][:, :verified]
        self.unread = hidden if self.unread is None else torch.cat([self.unread, hidden.to(self.unread.device)], 1)
        count = self.schedule.next_count()
        if count == 0:
            self._begin(0, 0, now)
            return input_ids, None
        caught_up = self.unread.shape[1] - verified
        drafts, logits = self._draft(input_ids, model_kwargs, count)
        self._begin(drafts.shape[1], caught_up, now)
        return torch.cat([input_ids, drafts.to(input_ids.device)], dim=-1), logits

    def _draft(self, input_ids, model_kwargs, count: int):
        """Read the unread positions (and the stale rows again), then draft `count` tokens, cut after an
        end-of-sequence token (transformers' loop cuts there from 5.25; earlier releases left it to the drafter)."""
        if self.stale:
            self.cache.crop(-self.stale)
        hidden = self.unread if not self.stale else torch.cat([self.recent[:, -self.stale:], self.unread], 1)
        rows = hidden.shape[1]
        self.read += rows - self.stale
        self.recent = hidden[:, -self.modules:] if self.recent is None else \
            torch.cat([self.recent, self.unread], 1)[:, -self.modules:]
        self.unread, self.stale = None, 0
        self.drafter.draft_tokens = count
        position_ids = model_kwargs["position_ids"][:, -rows:] if model_kwargs.get("position_ids") is not None \
            else torch.arange(input_ids.shape[1] - rows, input_ids.shape[1], device=input_ids.device)[None]
        attention_mask = model_kwargs.get("attention_mask")
        drafts, logits, _ = self.drafter(
            input_ids=input_ids[:, -rows:], last_hidden_states=hidden, position_ids=position_ids,
            attention_mask=None if attention_mask is None else attention_mask[:, -rows:], mtp_cache=self.cache,
            do_sample=self.do_sample, logits_processor=self.logits_processor, full_input_ids=input_ids)
        if self.eos is not None:
            ends = torch.isin(drafts[0], self.eos.to(drafts.device)).nonzero()
            if ends.numel():
                kept = int(ends[0]) + 1
                drafts, logits = drafts[:, :kept], logits[:, :kept]
        return drafts, logits

    def _begin(self, drafted: int, caught_up: int, started: float | None) -> None:
        """A step that drafts `drafted` tokens began at `started` (None: not timed), reading `caught_up` positions
        plain steps left."""
        self.drafted, self.caught_up, self.started = drafted, caught_up, started
        for statistics in _RECORDING.get():  # one call before each of the model's forwards
            statistics.forwards += 1
            statistics.drafted += drafted

    def _step_done(self, accepted: int, now: float) -> None:
        """The step under way ended at `now` with `accepted` drafts kept: time it, mark the rows to compute again."""
        if self.started is not None and self.caught_up <= self.most + 2:
            self.schedule.timed(self.drafted, now - self.started)
        if self.drafted and accepted < self.modules - 1:
            self.stale = min(self.modules, self.read)

    def update_candidate_strategy(self, input_ids, scores, num_matches) -> None:
        """Called after each verification with the drafts it accepted (none drafted before the prefill)."""
        if self.drafted:
            self.schedule.verified(self.drafted, int(num_matches))
            for statistics in _RECORDING.get():
                statistics.record_step(self.drafted, int(num_matches))
