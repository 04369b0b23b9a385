"""A small generated English-like corpus and its byte-level tokens, for CPU experiments.

Generated rather than downloaded: nothing may come from a hub at run time, and a seeded grammar
gives the same text on every machine. The grammar has agreement (subject/verb number), nested
clauses, counting and repeated names, so attention and the FFN both have something to learn.
"""

from __future__ import annotations

import random

import torch

_NAMES = ["Ada", "Bo", "Cleo", "Dev", "Ezra", "Fay", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lena"]
_NOUNS = [("cat", "cats"), ("dog", "dogs"), ("robot", "robots"), ("river", "rivers"), ("teacher", "teachers"),
          ("lamp", "lamps"), ("garden", "gardens"), ("child", "children"), ("ship", "ships"), ("bird", "birds")]
_VERBS = [("sees", "see"), ("likes", "like"), ("follows", "follow"), ("paints", "paint"), ("finds", "find"),
          ("carries", "carry"), ("watches", "watch")]
_INTRANSITIVE = [("sleeps", "sleep"), ("sings", "sing"), ("waits", "wait"), ("runs", "run"), ("glows", "glow")]
_ADJECTIVES = ["red", "quiet", "old", "small", "bright", "lazy", "green", "tall"]
_NUMBERS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
VOCAB_SIZE = 256  # bytes


def _noun_phrase(rng: random.Random) -> tuple[str, bool]:
    noun, plural_form = rng.choice(_NOUNS)
    plural = rng.random() < 0.4
    words = ["the"] + ([rng.choice(_ADJECTIVES)] if rng.random() < 0.5 else []) + [plural_form if plural else noun]
    if rng.random() < 0.2:  # a relative clause whose verb agrees with the head noun
        verb = rng.choice(_INTRANSITIVE)[1 if plural else 0]
        words += ["that", verb]
    return " ".join(words), plural


def _sentence(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.15:  # counting
        start = rng.randrange(0, 6)
        return "count: " + " ".join(_NUMBERS[start : start + rng.randrange(3, 5)]) + "."
    if kind < 0.3:  # a name introduced, then referred to again
        name = rng.choice(_NAMES)
        obj, _ = _noun_phrase(rng)
        return f"{name} {rng.choice(_VERBS)[0]} {obj}, and then {name} {rng.choice(_INTRANSITIVE)[0]}."
    subject, plural = _noun_phrase(rng)
    if rng.random() < 0.5:
        obj, _ = _noun_phrase(rng)
        return f"{subject} {rng.choice(_VERBS)[1 if plural else 0]} {obj}."
    return f"{subject} {rng.choice(_INTRANSITIVE)[1 if plural else 0]}."


def generate_text(num_chars: int = 200_000, seed: int = 0) -> str:
    """About `num_chars` characters of sentences, capitalised, seeded."""
    rng = random.Random(seed)
    parts, total = [], 0
    while total < num_chars:
        sentence = _sentence(rng)
        sentence = sentence[0].upper() + sentence[1:]
        parts.append(sentence)
        total += len(sentence) + 1
    return " ".join(parts)


def token_ids(num_chars: int = 200_000, seed: int = 0) -> torch.Tensor:
    """The corpus as byte ids (vocabulary `VOCAB_SIZE` = 256), a 1-D long tensor."""
    return torch.tensor(list(generate_text(num_chars, seed).encode("utf-8")), dtype=torch.long)


def batches(ids: torch.Tensor, batch: int, seq: int, seed: int = 0):
    """An endless stream of (batch, seq) windows at random offsets."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(ids) - seq - 1, (batch,), generator=generator)
        yield torch.stack([ids[s : s + seq] for s in starts.tolist()])
