"""Multi-token prediction (DeepSeek-V3, arXiv 2412.19437 §2.2): `num_mtp_layers` modules beside the model.

Module k (0-based) predicts the token k+2 places ahead of each position i from the hidden state h^{k-1}_i of the
depth before it (the model's own last hidden state, after its final norm, for k = 0) and the embedding of the token
k+1 places ahead, sharing the model's embedding table and output head:

    h^k_i = post_norm(block_k(eh_proj([enorm(Emb(t_{i+k+1})); hnorm(h^{k-1}_i)])))       logits = head(h^k_i)

`block_k` is a decoder block of the kinds of the model's last layer (an MLA + MoE model's module is MLA + MoE), built
from `mtp_block_config`. The parameter names are those of transformers' `MtpLayer` (`enorm`, `hnorm`, `eh_proj`,
`mtp_block`, `post_norm`) under `mtp.layers.{k}.`, so conversion from DeepSeek's files is a rename and LoRA target
names (`q_proj`, ...) reach the modules' blocks as they reach the model's.

Training (`labels` given): each module runs over the whole sequence, with the token embeddings and the positions
moved k+1 places ahead, and its cross-entropy against the labels k+2 places ahead; `mtp_loss` is their mean.
Decoding: `MtpDrafter` drafts one token per module the way transformers' `MtpModel` does, for
`generate(use_mtp=True)` (`mtp_generation.py`), and more with `mtp_draft_tokens` (the last module again). The main
forward never runs the modules.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from .blocks import block_class
from .configuration_modular_decoder import PER_LAYER_FIELDS
from .draft_vocab import draft_logits
from .norms import build_norm


def mtp_block_config(config):
    """The config the MTP modules' blocks are built from: one layer per module, of the last layer's kinds.

    `num_mtp_layers` layers (every per-layer field holds the last layer's entry once per module), so that block k
    caches as layer k of a cache built from this config (transformers' `get_mtp_config` does the same with
    `mtp_layer_types`)."""
    block_config = copy.deepcopy(config)
    count = config.num_mtp_layers
    for name in PER_LAYER_FIELDS:
        per_layer = getattr(config, name, None)
        if per_layer:
            setattr(block_config, name, [per_layer[-1]] * count)
    block_config.num_hidden_layers = count
    block_config.num_hash_layers = 0  # the last layer routes by its router (the config refuses it hashed)
    return block_config


class MtpLayer(nn.Module):
    """One MTP module: norms of the two inputs, their projection back to d, one decoder block and a norm.

    (emb of the token ahead) ─ enorm ─┐
                                      ├─ cat ─ eh_proj ─ mtp_block ─ post_norm ─> h^k   (then the shared head)
    (h^{k-1})                ─ hnorm ─┘
    """

    def __init__(self, config, block_config, depth: int):
        super().__init__()
        self.enorm = build_norm(config)
        self.hnorm = build_norm(config)
        self.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.mtp_block = block_class(block_config, depth)(block_config, depth)
        self.post_norm = build_norm(config)

    def forward(self, token_embeds: torch.Tensor, previous_hidden: torch.Tensor, **block_kwargs) -> torch.Tensor:
        joined = torch.cat([self.enorm(token_embeds), self.hnorm(previous_hidden)], dim=-1)  # (B, T, 2d)
        return self.post_norm(self.mtp_block(self.eh_proj(joined), **block_kwargs))


class MultiTokenPredictor(nn.Module):
    """The `num_mtp_layers` MTP modules (`layers`), with the training loss they add."""

    def __init__(self, config):
        super().__init__()
        self.block_config = mtp_block_config(config)
        self.layer_type = self.block_config.layer_types[-1]
        self.layers = nn.ModuleList(MtpLayer(config, self.block_config, k) for k in range(config.num_mtp_layers))
        # drafting only (`draft_vocab.py`): the ids the modules draft among, most frequent first; None: all
        self.register_buffer("draft_vocab", default_draft_vocab(config.mtp_draft_vocab_size))

    def training_loss(self, model, hidden, input_ids, inputs_embeds, attention_mask, position_ids, labels, **kwargs):
        """`loss` over the tokens of a forward of `model` (no cache): the modules read the token embeddings and the
        positions the base model read (positions given without a mask may mark packed documents)."""
        token_embeds = token_embeddings(model, input_ids) if inputs_embeds is None else inputs_embeds
        packed = position_ids is not None
        if position_ids is None:
            position_ids = model.model._default_position_ids(token_embeds, attention_mask, 0)
        loss_kwargs = {k: v for k, v in kwargs.items() if k == "num_items_in_batch"}
        return self.loss(model, hidden, token_embeds, labels, attention_mask, position_ids, packed, **loss_kwargs)

    def depths(self, model, hidden: torch.Tensor, token_embeds: torch.Tensor, attention_mask: torch.Tensor | None,
               position_ids: torch.Tensor, packed: bool):
        """Each module's output over the whole sequence (no cache), in order.

        Module k reads the previous one's
        (the model's last hidden state `hidden` (B, T, d) for k = 0) and the token embeddings `token_embeds`
        (B, T, d) and positions k+1 places ahead; its last k+1 positions read zeros (nothing is ahead of them)."""
        for depth, layer in enumerate(self.layers):
            embeds = _shifted(token_embeds, depth + 1)
            positions = position_ids + depth + 1
            hidden = layer(embeds, hidden, **model._mtp_block_kwargs(depth, embeds, positions, attention_mask, None,
                                                                      packed))
            yield hidden

    def loss(self, model, hidden: torch.Tensor, token_embeds: torch.Tensor, labels: torch.Tensor,
             attention_mask: torch.Tensor | None, position_ids: torch.Tensor, packed: bool, **loss_kwargs):
        """The mean over modules of their cross-entropies, on the whole sequence (no cache).

        `hidden`, `token_embeds` as `depths` takes them; `labels` as the model's forward takes them (shifted
        inside). Module k is scored against the labels k+2 places ahead; not at its last k+1 positions, nor where
        a 2-D `attention_mask` marks padding, nor where the label lies in another packed document (positions not
        counting on from theirs).
        """
        losses = []
        for depth, out in enumerate(self.depths(model, hidden, token_embeds, attention_mask, position_ids, packed)):
            ahead = depth + 2
            targets = _shifted(labels, ahead, fill=-100)
            same_document = _shifted(position_ids, ahead, fill=-1) == position_ids + ahead
            targets = targets.masked_fill(~same_document, -100)
            if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
                targets = targets.masked_fill(attention_mask == 0, -100)
            losses.append(model.loss_function(logits=model._logits(out), labels=None, shift_labels=targets,
                                              vocab_size=model.config.vocab_size, **loss_kwargs))
        return torch.stack(losses).mean()


def default_draft_vocab(size: int) -> torch.LongTensor | None:
    """The draft vocabulary before a ranking is set: the first `size` ids (None for 0, the whole vocabulary)."""
    return torch.arange(size, dtype=torch.int64) if size else None


def token_embeddings(model, input_ids: torch.Tensor) -> torch.Tensor:
    """The modules' token input: the model's embedding table (times `embedding_multiplier`), without positions or an
    embedding norm, as transformers' `MtpModel` reads the input embeddings."""
    embeds = model.model._embed_tokens(input_ids)
    if model.config.embedding_multiplier != 1.0:
        embeds = embeds * torch.tensor(model.config.embedding_multiplier, dtype=embeds.dtype)
    return embeds


def _shifted(tensor: torch.Tensor, places: int, fill=0) -> torch.Tensor:
    """`tensor` moved `places` positions back along dim 1 (position i holds what was at i + places), the end filled."""
    pad = tensor.new_full((tensor.shape[0], min(places, tensor.shape[1]), *tensor.shape[2:]), fill)
    return torch.cat([tensor[:, places:], pad], dim=1)


class MtpDrafter:
    """Drafts `draft_tokens` tokens per step with the MTP modules, for transformers' `MTPCandidateGenerator`.

    Called with the tokens one place ahead of those the model just verified (`input_ids`, `position_ids`) and the
    model's last hidden states for them: module k runs on the window moved k places further (the token module k-1
    drafted appended), over its own layer of `mtp_cache`, and drafts from its last position, as transformers'
    `MtpModel.forward` does; with `do_sample`, by sampling the logits after `logits_processor`, else their argmax
    (over `mtp.draft_vocab` where one is set: `draft_vocab.draft_logits`).
    `draft_tokens` K (default: one per module) up to `num_mtp_layers` runs the first K modules; past it, the last
    module drafts the rest by itself: each further depth reads its own output at the last position and the token it
    just drafted, at the next position (as vLLM and SGLang run DeepSeek's single MTP layer for several tokens).

    Cache: those further depths write one entry each into the last module's layer of `mtp_cache`, from drafted,
    unverified inputs; they are removed again before returning (`forget_last`), so the modules' cache holds exactly
    what one draft per module leaves (the entries transformers' generator checks and recomputes against the verified
    tokens), and every draft of the next step is computed from verified data only. Returns (drafted ids (B, K),
    their logits (B, K, V), None); the third is transformers' loss slot.
    """

    def __init__(self, model, draft_tokens: int | None = None):
        self.model = model
        self.mtp = model.mtp
        self.draft_tokens = draft_tokens or len(model.mtp.layers)

    @torch.no_grad()
    def __call__(self, input_ids, last_hidden_states, attention_mask, position_ids, mtp_cache, labels=None,
                 do_sample: bool = False, logits_processor=None, full_input_ids=None, **kwargs):
        model = self.model
        hidden = last_hidden_states
        tokens, token_logits = [], []
        modules = len(self.mtp.layers)
        last = modules - 1
        steps = [*enumerate(self.mtp.layers[: self.draft_tokens])]
        steps += [(last, self.mtp.layers[last])] * (self.draft_tokens - modules)
        for step, (depth, layer) in enumerate(steps):
            if step > last:  # the last module again, on its last output and the token it drafted, one place on
                input_ids, position_ids, hidden = input_ids[:, -1:], position_ids[:, -1:], hidden[:, -1:]
            embeds = token_embeddings(model, input_ids)
            # batch 1 without padding (assisted decoding refuses more), as transformers builds these masks
            block_kwargs = model._mtp_block_kwargs(depth, embeds, position_ids, None, mtp_cache, False)
            hidden = layer(embeds, hidden, **block_kwargs)
            logits = self._processed(draft_logits(model, hidden[:, -1]), logits_processor, full_input_ids, input_ids)
            if do_sample and self.mtp.draft_vocab is not None and not torch.isfinite(logits).any(-1).all():
                # the processors left no token of the draft vocabulary (an allow-list): draft from the whole head
                logits = self._processed(model._logits(hidden[:, -1:])[:, -1], logits_processor, full_input_ids,
                                         input_ids)
            token_logits.append(logits[:, None, :])
            if do_sample:
                token = torch.multinomial(nn.functional.softmax(logits, dim=-1, dtype=torch.float32), num_samples=1)
            else:
                token = torch.argmax(logits, dim=-1, keepdim=True)
            tokens.append(token)
            input_ids = torch.cat([input_ids[:, 1:], token], dim=-1)
            position_ids = torch.cat([position_ids[:, 1:], position_ids[:, -1:] + 1], dim=-1)
            if full_input_ids is not None:
                full_input_ids = torch.cat([full_input_ids, token], dim=-1)
        if mtp_cache is not None and len(steps) > modules:
            forget_last(mtp_cache.layers[last], len(steps) - modules)
        return torch.cat(tokens, dim=1), torch.cat(token_logits, dim=1), None

    @staticmethod
    def _processed(logits, logits_processor, full_input_ids, input_ids):
        logits = logits.to(input_ids.device)
        if logits_processor is not None and full_input_ids is not None:
            logits = logits_processor(full_input_ids, logits.to(dtype=torch.float32))
        return logits


def forget_last(layer, count: int) -> None:
    """Remove the last `count` tokens' entries from a cache layer that records its past.

    It is left as it was before they were written. A sliding layer recording its past keeps every entry until a
    crop, so removing the entries is enough (its own `crop` would also cut it to the window, and transformers'
    generator may later crop more of it, which then needs the entries before the window); any other layer is cropped
    as transformers does."""
    if count <= 0 or not getattr(layer, "is_initialized", False):
        return
    if getattr(layer, "is_sliding", False) and getattr(layer, "record_past", False):
        layer.keys, layer.values = layer.keys[..., :-count, :], layer.values[..., :-count, :]
        layer.cumulative_length -= count
    else:
        layer.crop(-count)
