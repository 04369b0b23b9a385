"""The text reshape calibrates, heals and measures on: calibration sequences and separate held-out ones.

Calibration comes from the user's plain text (tokenised with the source's tokenizer, cut into at least four
sequences, the last quarter held out for perplexity) or, without a file, from the source model itself: sequences
sampled from its beginning-of-text token with a fixed seed (data-free, as in LLM-QAT, Liu et al. 2023), and
separately sampled held-out sequences, so no corpus ships with the package.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

SEQ_LEN = 256  # tokens per calibration sequence cut from a file
MIN_SEQ_LEN = 16
HELD_OUT_EVERY = 4  # one sequence in four (the last quarter) is held out for perplexity
MAX_CALIBRATION = 32  # sequences (8,192 tokens at most): enough for the statistics, fast on a CPU
MAX_HELD_OUT = 16
SAMPLED = {"calibration": 8, "held_out": 4, "length": 128}


@dataclass
class Calibration:
    """Token ids (sequences, T) to calibrate and heal on, and separate ones to measure perplexity on."""

    ids: torch.LongTensor
    held_out: torch.LongTensor
    source: str  # where the text came from, for the report

    def describe(self) -> dict:
        return {"source": self.source, "calibration_tokens": self.ids.numel(), "held_out_tokens": self.held_out.numel(),
                "sequence_length": self.ids.shape[1]}


def calibration_from_file(path, tokenizer, vocab_size: int | None = None) -> Calibration:
    """The user's plain text, tokenised and cut into at least `HELD_OUT_EVERY` sequences of up to `SEQ_LEN`
    tokens; the last quarter of them (rounded down, at least one) is held out for perplexity and never
    calibrated or healed on. A `ValueError` naming `calibration` where the text cannot serve: no tokenizer, too
    few tokens, or ids outside the model's `vocab_size` (a tokenizer that is not the checkpoint's)."""
    path = Path(path)
    if tokenizer is None:
        raise ValueError(f"`calibration` {path} needs the source's tokenizer, and the source folder has none.")
    text = path.read_text(encoding="utf-8", errors="replace")
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0]
    seq_len = min(SEQ_LEN, len(ids) // HELD_OUT_EVERY)
    if seq_len < MIN_SEQ_LEN:
        raise ValueError(f"`calibration` {path} has {len(ids)} tokens; at least {HELD_OUT_EVERY * MIN_SEQ_LEN} are "
                         "needed (a quarter of it is held out for perplexity).")
    if vocab_size is not None and int(ids.max()) >= vocab_size:
        raise ValueError(f"`calibration` {path}: the source folder's tokenizer gives id {int(ids.max())}, outside the "
                         f"model's vocabulary (vocab_size={vocab_size}); the tokenizer is not this checkpoint's.")
    chunks = ids[: len(ids) // seq_len * seq_len].view(-1, seq_len)
    held = chunks.shape[0] // HELD_OUT_EVERY
    return Calibration(chunks[:-held][:MAX_CALIBRATION], chunks[-held:][:MAX_HELD_OUT],
                       f"file {path.name} ({len(ids)} tokens)")


@torch.no_grad()
def sampled_calibration(model, seed: int = 0, sequences: int = SAMPLED["calibration"],
                        held_out: int = SAMPLED["held_out"], length: int = SAMPLED["length"],
                        greedy_after: int | None = None) -> Calibration:
    """Text sampled from `model` itself (temperature 1, no truncation) from its beginning-of-text token:
    `sequences` to calibrate on and `held_out` other sequences for perplexity (one batch, so the decode
    steps are shared; the rows are independent samples). With `greedy_after=N`, every other row (of both) keeps
    its first N sampled tokens and continues by greedy decoding: the text that greedy decoding's drafts are
    checked on, which sampled text seldom is (a small model's greedy text repeats itself)."""
    start = torch.full((sequences + held_out, 1), start_token(model.config), dtype=torch.long)
    was_training = model.training
    model.eval()
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        # the mask says every start token is text: without it generate takes a start token equal to the pad
        # id (SmolLM2: both 0) for right-padding and warns; no row ends early, so the pad id is never used
        out = model.generate(start, attention_mask=torch.ones_like(start), do_sample=True, temperature=1.0, top_k=0,
                             top_p=1.0, max_new_tokens=length - 1, min_new_tokens=length - 1,
                             pad_token_id=0)[:, :length]
        source = f"sampled from the source model (seed {seed})"
        if greedy_after is not None and greedy_after < length:
            prefix = out[::2, :greedy_after]
            out[::2] = model.generate(prefix, attention_mask=torch.ones_like(prefix), do_sample=False,
                                      max_new_tokens=length - greedy_after, min_new_tokens=length - greedy_after,
                                      pad_token_id=0)[:, :length]
            source += f"; every other row greedy after its first {greedy_after} tokens"
    model.train(was_training)
    return Calibration(out[:sequences], out[sequences:], source)


def start_token(config) -> int:
    for token in (config.bos_token_id, config.eos_token_id, 0):
        if isinstance(token, list):
            token = token[0] if token else None
        if token is not None:
            return token
    return 0
