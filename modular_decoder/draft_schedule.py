"""How many tokens `generate(use_mtp=True)` drafts at each step, chosen from what the call itself measures.

A step that drafts c tokens costs T_c seconds (the drafts, the model's forward over c + 1 tokens, the loop around
them) and yields E_c tokens: the model's own token plus the drafts it accepts,

    E_c = 1 + q_1 + q_1 q_2 + ... + q_1 q_2 ... q_c,

where q_j is the share of steps that reached draft position j (drafted it, accepted the ones before it) and
accepted it (smoothed by one accepted and one rejected draft, so an unmeasured position counts as 1/2). A plain
step (c = 0) yields 1 token in T_0. Each step drafts the c, 0 or between the fewest and the most drafted per step,
with the most tokens per second, E_c / T_c: drafting c tokens pays where E_c > T_c / T_0 (break-even). T_c is the
median of the last `WINDOW` step times measured with c drafts; a c not measured yet is interpolated linearly
between T_0 and T_most.

The schedule first measures: it alternates steps of the most drafts with plain steps until each has
`FIRST_SAMPLES` times (the plain ones cost what decoding without drafts costs). While it judges drafting a loss it
still drafts one step after `gap` plain steps, to follow the acceptance as the text changes; the gap doubles up to
`LONGEST_GAP` while drafting stays a loss, and starts again at `FIRST_GAP` once drafting pays. A drafting step that
follows several plain steps also reads their positions into the modules' cache (`mtp_generation`), so its time is
kept only where it read at most `most + 2` of them.

Timing is `time.perf_counter` between consecutive calls of the candidate generator: transformers' assisted loop
reads the count of accepted drafts on the host after each verification, so one interval is one whole step, on an
accelerator too, with no added synchronisation.

Part of the remote-code files: standard library only.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

WINDOW = 5  # step times per count kept: the median of the latest
FIRST_SAMPLES = 3  # times measured for the most drafts and for plain steps before choosing
FIRST_GAP, LONGEST_GAP = 8, 64  # plain steps between two drafting probes while drafting does not pay


@dataclass
class DraftSchedule:
    """Chooses the tokens each step drafts (`next_count`) from the step times (`timed`) and the acceptance
    (`verified`) measured during one `generate` call (see the module docstring). `adaptive=False` drafts `most`
    every step (transformers' `num_assistant_tokens_schedule="constant"`)."""

    most: int
    fewest: int = 1
    adaptive: bool = True
    seconds: dict[int, list[float]] = field(default_factory=dict)
    reached: list[int] = field(default_factory=list)  # per draft position: steps that drafted it past accepted ones
    accepted: list[int] = field(default_factory=list)  # per draft position: steps that accepted it
    gap: int = FIRST_GAP
    plain_run: int = 0  # plain steps since the last drafting step

    def __post_init__(self) -> None:
        self.reached = [0] * self.most
        self.accepted = [0] * self.most

    def next_count(self) -> int:
        """Tokens the next step drafts: 0 (a plain step), or between `fewest` and `most`."""
        count = self._choose() if self.adaptive else self.most
        self.plain_run = self.plain_run + 1 if count == 0 else 0
        return count

    def timed(self, count: int, seconds: float) -> None:
        """One step that drafted `count` tokens took `seconds`."""
        kept = self.seconds.setdefault(count, [])
        kept.append(seconds)
        del kept[:-WINDOW]

    def verified(self, drafted: int, accepted: int) -> None:
        """A step drafted `drafted` tokens and the model accepted the first `accepted` of them."""
        for position in range(min(accepted + 1, drafted)):
            self.reached[position] += 1
        for position in range(min(accepted, drafted)):
            self.accepted[position] += 1

    def tokens_per_step(self, count: int) -> float:
        """E_count: the tokens a step drafting `count` yields, at the acceptance measured so far."""
        expected, kept_all = 1.0, 1.0
        for position in range(count):
            kept_all *= (self.accepted[position] + 1) / (self.reached[position] + 2)
            expected += kept_all
        return expected

    def step_seconds(self, count: int) -> float | None:
        """T_count: the median measured time of a step drafting `count`, else interpolated (None: nothing measured)."""
        if self.seconds.get(count):
            return statistics.median(self.seconds[count])
        plain, most = (statistics.median(self.seconds[c]) if self.seconds.get(c) else None for c in (0, self.most))
        if plain is None or most is None:
            return None
        return plain + (most - plain) * count / self.most

    def _choose(self) -> int:
        measured = {c: len(self.seconds.get(c, ())) for c in (self.most, 0)}
        if min(measured.values()) < FIRST_SAMPLES:  # alternate until both are measured
            return self.most if measured[self.most] <= measured[0] else 0
        rates = {c: self.tokens_per_step(c) / self.step_seconds(c) for c in (0, *range(self.fewest, self.most + 1))}
        best = max(rates, key=rates.get)
        if best != 0:
            self.gap = FIRST_GAP
            return best
        if self.plain_run >= self.gap:  # probe: one step with the best drafting count
            self.gap = min(2 * self.gap, LONGEST_GAP)
            return max((c for c in rates if c), key=rates.get)
        return 0


def clock() -> float:
    """Seconds on a monotonic clock (the schedule's step times)."""
    return time.perf_counter()
