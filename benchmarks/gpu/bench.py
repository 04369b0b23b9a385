"""What every part of the GPU matrix shares: the plan, the device, the checkpoints on disk, the loaded pair, and the
one `generate` call the parts time."""

from __future__ import annotations

import gc
from pathlib import Path

import torch
import transformers as tf

from modular_decoder.compat import with_cache

from ..families import load_side, save_pair
from .plan import Plan, deepseek_v3_config, llama_config


class Bench:
    """The plan, the device, the checkpoints on disk and the pair of models currently loaded."""

    def __init__(self, plan: Plan, folder: Path, device: str):
        self.plan, self.folder, self.device = plan, folder, device
        self.models: dict[str, tuple] = {}
        self.gen = torch.Generator().manual_seed(0)

    def ids(self, *shape: int) -> torch.Tensor:
        return torch.randint(1, self.plan.vocab_of(self.family), shape, generator=self.gen).to(self.device)

    def pair(self, family: str, fresh: bool = False) -> tuple:
        """(transformers' model, ours) for `family`, loaded from disk; the other family's pair is freed first."""
        self.family = family
        if fresh or family not in self.models:
            self.models.clear()
            empty_cache()
            self._checkpoints(family)
            self.models[family] = tuple(load_side(self.folder / family, side, dtype=self.plan.dtype,
                                                  device=self.device) for side in ("transformers", "ours"))
        return self.models[family]

    def _checkpoints(self, family: str) -> None:
        folder = self.folder / family
        if not (folder / "ours").exists():
            config = (llama_config if family == "llama" else deepseek_v3_config)(self.plan)
            save_pair(config, folder, dtype=self.plan.dtype, device=self.device)


def empty_cache() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def generate(model, prompt, new_tokens: int, **kwargs):
    """Greedy `generate` of exactly `new_tokens` (a mask of ones unless one is given)."""
    return model.generate(prompt, attention_mask=kwargs.pop("attention_mask", torch.ones_like(prompt)),
                          max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                          **kwargs)


def no_extra(model) -> dict:
    return {}


def dynamic_cache(model) -> dict:
    """generate's kwargs giving `model` a fresh transformers `DynamicCache` (torch.cat: contiguous K/V) in place
    of this family's default (`growing_cache.GrowingLayer`: prefix views of pre-allocated storage)."""
    return with_cache(tf.DynamicCache(config=model.config))

