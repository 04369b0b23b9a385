"""The transformations chained: options checked against the config first, then applied in order (drop
layers, K/V heads, experts, MLA, MTP modules), then optionally healed (and the MTP modules trained). `reshape(model, ...)` is the in-memory entry point."""

from __future__ import annotations

import copy

import torch
from torch import nn

from ...split_products import weight_is_readable
from .drop_layers import check_drop_layers, drop_block
from .add_mtp import add_mtp_modules, check_add_mtp, train_mtp
from .draft_vocab import check_draft_vocab_option, with_draft_vocab
from .healing import LEARNING_RATE, heal
from .kv_heads import POOLS, check_kv_heads, reshape_kv_heads
from .measures import logit_change
from .rebuild import Change, require_positive_int
from .upcycling import check_experts, upcycle

ATTENTIONS = ("mla",)


def check_options(config, *, kv_heads=None, kv_pool="mean", attention=None, kv_lora_rank=None, rope_dim=None,
                  sweep_ranks=None, experts=None, top_k=None, shared_experts=0, fine_grained=1, drop_layers=None,
                  add_mtp=None, draft_vocab=None, heal_steps=0, heal_lr=LEARNING_RATE, calibration_ids=None,
                  needs_calibration_ids=True) -> None:
    """Refuse bad options before any work: a `ValueError` naming the option. Checks each transformation's
    options against `config` as it will be when that transformation runs."""
    if config.linear_attention_kind.in_use(config):  # every transformation reads each layer's `self_attn`
        raise ValueError("reshape does not transform models with 'linear_attention' layers (`layer_types`) yet.")
    _check_attention(config, attention, kv_lora_rank, rope_dim, sweep_ranks)
    if not any(value is not None for value in (kv_heads, attention, experts, drop_layers, add_mtp, draft_vocab)):
        raise ValueError("Nothing to do: pass at least one of `kv_heads`, `attention`, `experts`, `drop_layers`, "
                         "`add_mtp`, `draft_vocab`.")
    if kv_pool not in POOLS:
        raise ValueError(f"`kv_pool`={kv_pool!r} is not one of {list(POOLS)}.")
    if drop_layers is not None:
        check_drop_layers(config, drop_layers)
    if kv_heads is not None:
        if attention is not None:
            raise ValueError("`kv_heads` and `attention='mla'` are two ways to shrink the K/V cache: choose one.")
        check_kv_heads(config, kv_heads, kv_pool)
    if (experts is None) != (top_k is None):
        raise ValueError("`experts` and `top_k` go together (upcycling needs both).")
    if experts is None and (shared_experts or fine_grained != 1):
        raise ValueError("`shared_experts` and `fine_grained` need `experts` and `top_k`.")
    if experts is not None:
        check_experts(config, experts, top_k, shared_experts, fine_grained)
    require_positive_int("heal_steps", heal_steps, minimum=0)
    if add_mtp is not None:
        check_add_mtp(config, add_mtp, heal_steps)
    if draft_vocab is not None:
        check_draft_vocab_option(config, draft_vocab, add_mtp)
    if not (isinstance(heal_lr, (int, float)) and heal_lr > 0):
        raise ValueError(f"`heal_lr` must be a positive number, got {heal_lr!r}.")
    needs = drop_layers is not None or attention is not None or heal_steps or draft_vocab is not None
    if needs_calibration_ids and needs and calibration_ids is None:
        raise ValueError("`calibration_ids` are needed for `drop_layers`, `attention`, `heal_steps` and "
                         "`draft_vocab`.")


def _check_attention(config, attention, kv_lora_rank, rope_dim, sweep_ranks) -> None:
    if attention is None:
        for name, value in (("kv_lora_rank", kv_lora_rank), ("rope_dim", rope_dim), ("sweep_ranks", sweep_ranks)):
            if value is not None:
                raise ValueError(f"`{name}` needs `attention='mla'`.")
        return
    if attention not in ATTENTIONS:
        raise ValueError(f"`attention`={attention!r} is not one of {list(ATTENTIONS)}.")
    if config.attention_type != "standard":
        raise ValueError(f"`attention='mla'` converts standard attention; this model has attention_type="
                         f"{config.attention_type!r}.")
    if kv_lora_rank is None:
        raise ValueError("`attention='mla'` needs `kv_lora_rank` (the latent width d_c).")
    from .mla_conversion import check_source, mla_config  # imported on use: they pull in the attention classes

    # what `to_mla` refuses (the source's keys, rope_dim, each rank's range; the rope type and rotary tables
    # its config must keep), refused before any work; the layers dropped or upcycled first leave every field
    # these read as it is
    rope_dim = check_source(config, kv_lora_rank, rope_dim, sweep_ranks or ())
    mla_config(config, kv_lora_rank, rope_dim)


def transform(model, calibration_ids=None, *, kv_heads=None, kv_pool="mean", attention=None, kv_lora_rank=None,
              rope_dim=None, experts=None, top_k=None, shared_experts=0, fine_grained=1, drop_layers=None,
              add_mtp=None, seed: int = 0, progress: bool = True,
              measure_ids=None) -> tuple[torch.nn.Module, list[Change]]:
    """Apply the chosen transformations in order (drop layers, K/V heads, experts, MLA, MTP modules, built from the
    last block as the others leave it; untrained: see `train_mtp`); returns the new
    model (sharing no tensor with `model`, which is left unchanged) and each transformation's record.
    With `measure_ids`, each record carries how far that step moved the logits (`measures.logit_change`)."""
    check_weights_readable(model)
    steps = []  # each: (model, copy) -> (model, Change)
    if drop_layers is not None:
        steps.append(lambda m, copy: drop_block(m, calibration_ids, drop_layers, progress, copy=copy))
    if kv_heads is not None:
        steps.append(lambda m, copy: reshape_kv_heads(m, kv_heads, kv_pool, seed, copy=copy))
    if experts is not None:
        steps.append(lambda m, copy: upcycle(m, experts, top_k, shared_experts, fine_grained, seed, copy=copy))
    if attention == "mla":  # always builds new tensors
        steps.append(lambda m, copy: to_latent_attention(m, kv_lora_rank, rope_dim, calibration_ids, progress))
    if add_mtp is not None:
        steps.append(lambda m, copy: add_mtp_modules(m, add_mtp, seed, copy=copy))
    changes: list[Change] = []
    current = model
    for step in steps:
        # an intermediate model is ours: the next step may reuse its tensors
        new, change = step(current, copy=current is model)
        if measure_ids is not None:
            change.measured = logit_change(current, new, measure_ids)
        current = new
        changes.append(change)
    return current, changes


def check_weights_readable(model) -> None:
    """The transformations compute from the linears' weights: refuse, naming the module, a linear whose weight
    is not what calling it computes (a PEFT adapter, a hook, a quantized or tensor-parallel weight), which they
    would drop or misread in silence."""
    for name, module in model.named_modules():
        if hasattr(module, "base_layer") or (isinstance(module, nn.Linear) and not weight_is_readable(module)):
            kind = f"{type(module).__module__}.{type(module).__qualname__}"
            raise ValueError(
                f"reshape computes from the weights, and `{name}` ({kind}) is not a plain linear (an adapter, a "
                "hook, a quantized or tensor-parallel weight): merge or remove it first (PEFT: `merge_and_unload()`)."
            )


def to_latent_attention(model, kv_lora_rank: int, rope_dim: int | None, calibration_ids, progress: bool = True,
                        moments: list[torch.Tensor] | None = None):
    """GQA / MHA -> MLA the TransMLA way (`mla_conversion.to_mla`); returns (model, Change). `moments`:
    `moments.attention_moments(model, calibration_ids)` computed already (a rank sweep reuses them)."""
    from .mla_conversion import to_mla  # imported on use: it pulls in the attention classes
    new = to_mla(model, kv_lora_rank, rope_dim, calibration_ids, progress=progress, moments=moments)
    change = Change(
        "attention",
        keeps="queries' RoPE part on the kept rotary dimensions, FFN, norms, embeddings",
        approximates=f"keys and values through a rank-{kv_lora_rank} latent (TransMLA: RoRoPE, partial RoPE on "
                     f"{new.config.qk_rope_head_dim} dimensions, activation-aware factorisation)",
        changed=[f"model.layers.{i}.self_attn" for i in range(new.config.num_hidden_layers)],
        details={"attention": "mla", "kv_lora_rank": kv_lora_rank, "rope_dim": new.config.qk_rope_head_dim},
    )
    return new, change


def reshape(model, calibration_ids: torch.LongTensor | None = None, *, heal_steps: int = 0,
            heal_lr: float = LEARNING_RATE, progress: bool = True, with_report: bool = False, **options):
    """A new model at another point of the design space, from a trained `ModularDecoderForCausalLM`; with
    `with_report=True`, `(model, report)`.

    Args:
        model: The source; left unchanged (the result shares no tensor with it).
        calibration_ids: (sequences, T) token ids, needed by `drop_layers`, `attention="mla"` and
            `heal_steps` (`calibration.sampled_calibration(model)` makes them data-free).
        kv_heads: K/V heads of the result (MHA / GQA / MQA); `kv_pool` = "mean" (default), "first", "random".
        attention: "mla" with `kv_lora_rank` (and `rope_dim`): TransMLA's conversion to latent attention.
        experts, top_k, shared_experts, fine_grained: sparse upcycling of the FFN (the same function at step 0).
        drop_layers: remove the most redundant block of this many consecutive layers.
        add_mtp: add this many multi-token-prediction modules (`add_mtp.py`), trained for `heal_steps` steps by
            self-distillation from the result's own predictions (the result's other parameters untouched by it).
        draft_vocab: the MTP modules (added, or the model's own) draft among this many token ids, those the result
            predicts most often on `calibration_ids` (`draft_vocab.py`; the report's `draft_vocab` section gives
            what they cover of its predictions on the last calibration sequence).
        heal_steps: AdamW steps distilling `model` into the changed modules on `calibration_ids`.
        seed: Seeds the router rows and `kv_pool="random"`.
        with_report: Also return the report: `{"transformations": [...]}` as `reshape_folder` writes them (what
            each keeps and approximates and, given `calibration_ids`, `measured`: how far it moved the logits on
            them and whether that is rounding, `"exact"`), and with `heal_steps` `{"heal": {"steps", "kl_first",
            "kl_last"}}`. Perplexity and cache bytes are `reshape_folder`'s (or `measure(model, ids)`).

    Raises `ValueError` naming the option for what a transformation cannot do.
    """
    check_options(model.config, heal_steps=heal_steps, heal_lr=heal_lr, calibration_ids=calibration_ids, **options)
    draft_vocab = options.pop("draft_vocab", None)
    measure_ids = calibration_ids if with_report else None
    new, changes = transform(model, calibration_ids, progress=progress, measure_ids=measure_ids, **options)
    if new is model:  # nothing but a draft vocabulary: set on a copy, `model` is left unchanged
        new = copy.deepcopy(model)
    report = {"transformations": [change.as_dict() for change in changes]}
    if heal_steps and changed_modules(changes):
        losses = heal(new, model, calibration_ids, heal_steps, changed_modules(changes), heal_lr, progress)
        report["heal"] = {"steps": heal_steps, "learning_rate": heal_lr, "kl_first": losses[0], "kl_last": losses[-1]}
    if draft_vocab is not None:  # before the modules' training, which then learns over it (`train_mtp`)
        report["draft_vocab"] = with_draft_vocab(new, draft_vocab, calibration_ids[:-1] if len(calibration_ids) > 1
                                                 else calibration_ids, calibration_ids[-1:])
    if options.get("add_mtp"):
        losses = train_mtp(new, calibration_ids, heal_steps, heal_lr, progress)
        report["mtp"] = {"steps": heal_steps, "learning_rate": heal_lr, "kl_first": losses[0], "kl_last": losses[-1]}
    return (new, report) if with_report else new


def changed_modules(changes: list[Change]) -> list[str]:
    return [prefix for change in changes for prefix in change.changed]

