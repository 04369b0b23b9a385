"""The conversion machinery every family shares: rules, named transforms, and applying a map both ways.

A family is data: a config translation and a list of `Rule`s, each naming source tensors, target
tensors (both `{layer}`-templated) and one transform from `TRANSFORMS`. Conversion applies each
rule's `forward`; export applies its `inverse` to the same rules. Every source tensor must be
consumed and every produced shape must match the target model's, or a `ValueError` names them.

Rules speak of the names the family's transformers model holds in memory. Where a checkpoint file
stores a tensor differently, the family says so declaratively and the file is read into the
model's names first: `renames` for moved prefixes, `ExpertStack`s for mixture-of-experts weights
saved one 2-D tensor per expert (`{expert}`) that the model holds as one 3-D tensor (transformers
stacks them on load and splits them again in `save_pretrained`, so export writes per-expert files).

Multi-token-prediction modules are rules too: names with `{mtp}` (module k of the contract's `mtp.layers.{k}`) and
`{mtp_layer}` (the layer index the source's files give module k, `num_hidden_layers` + k) expand once per module
(`mtp_block_rules` re-aims a family's layer rules at a module's block), and a `"duplicate"` rule names a source
tensor that is a copy of one the model holds once (DeepSeek's MTP layer stores the embedding and the head again):
conversion checks it equals that tensor and drops it, export writes the copy back.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

Tensors = list[torch.Tensor]


@dataclass(frozen=True)
class Transform:
    """A tensor transform and its exact inverse; both take the tensors and the target contract."""

    forward: Callable[[Tensors, Any], Tensors]
    inverse: Callable[[Tensors, Any], Tensors]


def _copy(tensors: Tensors, cfg) -> Tensors:
    return list(tensors)


def _transpose(tensors: Tensors, cfg) -> Tensors:
    # GPT-1/GPT-2 `Conv1D` stores (in, out); `nn.Linear` stores (out, in)
    return [t.t().contiguous() if t.dim() == 2 else t for t in tensors]


def _qkv_widths(cfg) -> list[int]:
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    return [q, kv, kv]


def _split_qkv(tensors: Tensors, cfg) -> Tensors:
    """One fused (q | k | v) projection, blocks one after another along the output dim."""
    return [t.contiguous() for t in torch.split(tensors[0], _qkv_widths(cfg), dim=0)]


def _fuse_qkv(tensors: Tensors, cfg) -> Tensors:
    return [torch.cat(tensors, dim=0)]


def _split_conv1d_qkv(tensors: Tensors, cfg) -> Tensors:
    return _split_qkv(_transpose(tensors, cfg), cfg)


def _fuse_conv1d_qkv(tensors: Tensors, cfg) -> Tensors:
    return _transpose(_fuse_qkv(tensors, cfg), cfg)


def _split_grouped_qkv(tensors: Tensors, cfg) -> Tensors:
    """Fused projection laid out per K/V group: [q_1..q_g, k, v] for each of the H_kv groups
    (GPT-NeoX and BLOOM with g = 1, i.e. per head [q, k, v]; Falcon's new decoder and MQA)."""
    fused = tensors[0]
    groups, d = cfg.num_key_value_heads, cfg.head_dim
    per_group = cfg.num_attention_heads // groups
    grouped = fused.reshape(groups, per_group + 2, d, *fused.shape[1:])
    q = grouped[:, :per_group].reshape(-1, *fused.shape[1:])
    k = grouped[:, per_group].reshape(-1, *fused.shape[1:])
    v = grouped[:, per_group + 1].reshape(-1, *fused.shape[1:])
    return [q.contiguous(), k.contiguous(), v.contiguous()]


def _fuse_grouped_qkv(tensors: Tensors, cfg) -> Tensors:
    q, k, v = tensors
    groups, d = cfg.num_key_value_heads, cfg.head_dim
    per_group = cfg.num_attention_heads // groups
    rest = q.shape[1:]
    grouped = torch.cat(
        (q.reshape(groups, per_group, d, *rest), k.reshape(groups, 1, d, *rest), v.reshape(groups, 1, d, *rest)), dim=1
    )
    return [grouped.reshape(-1, *rest).contiguous()]


def _split_gate_up(tensors: Tensors, cfg) -> Tensors:
    """One fused (gate | up) projection (Phi-3 style)."""
    return [t.contiguous() for t in tensors[0].chunk(2, dim=0)]


TRANSFORMS: dict[str, Transform] = {
    "copy": Transform(_copy, _copy),
    # src: a copy of the tensor named by dst; `apply_rules` checks it (forward) and writes it back (inverse)
    "duplicate": Transform(_copy, _copy),
    "transpose": Transform(_transpose, _transpose),
    "split_qkv": Transform(_split_qkv, _fuse_qkv),
    "split_conv1d_qkv": Transform(_split_conv1d_qkv, _fuse_conv1d_qkv),
    "split_grouped_qkv": Transform(_split_grouped_qkv, _fuse_grouped_qkv),
    "split_gate_up": Transform(_split_gate_up, lambda tensors, cfg: [torch.cat(tensors, dim=0)]),
}


@dataclass(frozen=True)
class Rule:
    """Source tensor name(s) -> target tensor name(s) through one named transform.

    Names may contain `{layer}`. An `optional` rule is skipped when none of its source tensors exist
    (biases, tied heads); a partial match is always an error. `layers` ("sparse" or "dense") limits a
    `{layer}` rule to the layers the contract's `mlp_layer_types` marks so (a config without it has
    dense layers only).
    """

    src: tuple[str, ...]
    dst: tuple[str, ...]
    transform: str = "copy"
    optional: bool = False
    layers: str | None = None

    def __post_init__(self):
        if isinstance(self.src, str):
            object.__setattr__(self, "src", (self.src,))
        if isinstance(self.dst, str):
            object.__setattr__(self, "dst", (self.dst,))
        if self.transform not in TRANSFORMS:
            raise ValueError(f"Unknown transform {self.transform!r}; known: {sorted(TRANSFORMS)}.")
        if self.layers not in (None, "sparse", "dense"):
            raise ValueError(f"`layers`={self.layers!r} is not one of None, 'sparse', 'dense'.")


def rule(src, dst, transform: str = "copy", optional: bool = False, layers: str | None = None) -> Rule:
    return Rule(src, dst, transform, optional, layers)


@dataclass(frozen=True)
class ExpertStack:
    """How a checkpoint file stores one 3-D experts tensor of the transformers model: one 2-D tensor per
    expert, named by `parts` (templates with `{layer}` and `{expert}`), stacked along a new dim 0; with
    several parts ([gate, up]) each is stacked and the stacks are concatenated along dim 1."""

    parts: tuple[str, ...]
    dst: str

    def _pattern(self, part: str) -> re.Pattern:
        escaped = re.escape(part).replace(re.escape("{layer}"), r"(?P<layer>\d+)")
        return re.compile(escaped.replace(re.escape("{expert}"), r"(?P<expert>\d+)") + "$")

    def stack(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`state` with every layer's per-expert tensors replaced by the stacked one (files that hold the
        stacked tensor already pass through)."""
        found: dict[int, set[int]] = {}
        pattern = self._pattern(self.parts[0])
        for name in state:
            match = pattern.match(name)
            if match:
                found.setdefault(int(match["layer"]), set()).add(int(match["expert"]))
        state = dict(state)
        for layer, experts in sorted(found.items()):
            count = max(experts) + 1
            names = [[part.format(layer=layer, expert=e) for e in range(count)] for part in self.parts]
            missing = [name for group in names for name in group if name not in state]
            if missing:
                raise ValueError(f"Experts of layer {layer} are incomplete: missing {missing[:5]}.")
            stacks = [torch.stack([state.pop(name) for name in group]) for group in names]  # (E, out, in) each
            state[self.dst.format(layer=layer)] = torch.cat(stacks, dim=1) if len(stacks) > 1 else stacks[0]
        return state

    def unstack(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The inverse of `stack`: every stacked tensor of `state` split back into one tensor per expert and part
        (what `save_pretrained` writes for the tensors of the model; this is for those it does not hold)."""
        pattern = re.compile(re.escape(self.dst).replace(re.escape("{layer}"), r"(?P<layer>\d+)") + "$")
        out = {}
        for name, tensor in state.items():
            match = pattern.match(name)
            if match is None:
                out[name] = tensor
                continue
            for part, stacked in zip(self.parts, tensor.chunk(len(self.parts), dim=1), strict=True):
                for expert, weight in enumerate(stacked.unbind(0)):
                    out[part.format(layer=int(match["layer"]), expert=expert)] = weight.contiguous()
        return out


def rename_prefixes(state: dict[str, torch.Tensor], renames: dict[str, str]) -> dict[str, torch.Tensor]:
    """Old name prefixes -> new ones; a prefix may contain `{layer}` (any layer number, kept)."""
    for old, new in renames.items():
        if "{layer}" in old:
            pattern = re.compile(re.escape(old).replace(re.escape("{layer}"), r"(?P<layer>\d+)"))

            def renamed(name: str, pattern=pattern, new=new) -> str:
                match = pattern.match(name)
                return new.format(layer=match["layer"]) + name[match.end():] if match else name

            state = {renamed(k): v for k, v in state.items()}
        else:
            state = {new + k[len(old):] if k.startswith(old) else k: v for k, v in state.items()}
    return state


@dataclass
class Family:
    """One source family: config translation both ways and a tensor map used both ways.

    Args:
        name: The `model_type` of the source family's transformers config.
        to_contract: source config -> `ModularDecoderConfig` keyword arguments; raises `ValueError`
            naming any source feature the contract lacks.
        from_contract: `ModularDecoderConfig` -> source config (for export).
        rules: source config -> list of `Rule`s (the map may depend on the layout, e.g. Falcon's).
        prefix: Added to source names that lack it (checkpoints saved from the base model).
        config_class: The source family's transformers config class.
        ignore: Name suffixes of saved buffers that hold no weights (old causal-mask tensors).
        head: Name prefixes that live outside the base model and never take `prefix`.
        renames: Old file-name prefixes -> the transformers model's names (what transformers' own
            checkpoint conversion mapping renames on load and back on save); `{layer}` matches any layer.
            Rules use model names.
        experts: Per-expert file tensors the model holds stacked (see `ExpertStack`), read after `renames`.
        mtp_layers: Where the files keep multi-token-prediction module k, a name prefix with `{mtp_layer}` (the
            source's layer index of module k, `num_hidden_layers` + k); `None`: the family has no MTP modules.
            The modules the files hold are what converts (`count_mtp_layers`); their tensors go by `{mtp}` rules.
    """

    name: str
    to_contract: Callable[[Any], dict]
    from_contract: Callable[[Any], Any]
    rules: Callable[[Any], list[Rule]]
    prefix: str = ""
    config_class: Any = None
    ignore: tuple[str, ...] = field(default_factory=tuple)
    head: tuple[str, ...] = ("lm_head.",)
    renames: dict[str, str] = field(default_factory=dict)
    experts: tuple[ExpertStack, ...] = ()
    mtp_layers: str | None = None


def refuse(features: dict[str, bool], family: str) -> None:
    """Raise one `ValueError` naming every source feature the contract cannot express."""
    bad = [name for name, present in features.items() if present]
    if bad:
        raise ValueError(
            f"This {family} checkpoint uses {', '.join(bad)}, which the modular_decoder contract cannot "
            "express; it cannot be converted without changing what the model computes."
        )


def _expand(names: tuple[str, ...], layer: int | None) -> list[str]:
    return [name.format(layer=layer) if layer is not None else name for name in names]


def _is_layered(r: Rule) -> bool:
    return any("{layer}" in name for name in r.src + r.dst)


def _is_mtp(r: Rule) -> bool:
    return any("{mtp}" in name or "{mtp_layer}" in name for name in r.src + r.dst)


def _layers(r: Rule, cfg) -> list[int | None]:
    if not _is_layered(r):
        return [None]
    kinds = getattr(cfg, "mlp_layer_types", None) or ["dense"] * cfg.num_hidden_layers
    return [layer for layer in range(cfg.num_hidden_layers) if r.layers in (None, kinds[layer])]


def _mtp_modules(r: Rule, cfg) -> list[int]:
    """The MTP modules a `{mtp}` rule applies to: all of them, or none when `layers` names another feed-forward
    kind than theirs (the last layer's)."""
    kinds = getattr(cfg, "mlp_layer_types", None) or ["dense"]
    count = getattr(cfg, "num_mtp_layers", 0) if r.layers in (None, kinds[-1]) else 0
    return list(range(count))


def _instances(rules: list[Rule], cfg):
    for r in rules:
        if _is_mtp(r):
            for k in _mtp_modules(r, cfg):
                names = {"mtp": k, "mtp_layer": cfg.num_hidden_layers + k}
                yield r, [n.format(**names) for n in r.src], [n.format(**names) for n in r.dst]
            continue
        for layer in _layers(r, cfg):
            yield r, _expand(r.src, layer), _expand(r.dst, layer)


def mtp_block_rules(rules: list[Rule], src_layer: str, src_module: str, dst_layer: str = "model.layers.{layer}.",
                    dst_module: str = "mtp.layers.{mtp}.mtp_block.") -> list[Rule]:
    """A family's layer rules re-aimed at the MTP modules' blocks: each rule whose source names all start with
    `src_layer` and target names with `dst_layer` (both with `{layer}`), those prefixes replaced by `src_module`
    (with `{mtp_layer}`, e.g. "model.layers.{mtp_layer}.") and `dst_module`."""
    def moved(names, old, new):
        return tuple(new + name[len(old):] for name in names)

    return [Rule(moved(r.src, src_layer, src_module), moved(r.dst, dst_layer, dst_module), r.transform, r.optional,
                 r.layers)
            for r in rules
            if all(n.startswith(src_layer) for n in r.src) and all(n.startswith(dst_layer) for n in r.dst)]


def count_mtp_layers(state_names, prefix: str, num_hidden_layers: int) -> int:
    """How many MTP modules a source's files hold: consecutive `prefix` (with `{mtp_layer}`) from
    `num_hidden_layers` on that start some tensor's name."""
    count = 0
    while any(name.startswith(prefix.format(mtp_layer=num_hidden_layers + count)) for name in state_names):
        count += 1
    return count


def apply_rules(
    rules: list[Rule],
    tensors: dict[str, torch.Tensor],
    cfg,
    direction: str = "forward",
    progress: Callable[[int], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Apply every rule instance to `tensors`; `direction="inverse"` maps target names back to source.

    Raises `ValueError` for partly present rules and for tensors no rule consumed.
    """
    inverse = direction == "inverse"
    remaining = dict(tensors)
    out: dict[str, torch.Tensor] = {}
    duplicates = []
    for r, src, dst in _instances(rules, cfg):
        if r.transform == "duplicate":  # after the other rules: the tensor it copies is theirs
            duplicates.append((src[0], dst[0], r))
            continue
        ins, outs = (dst, src) if inverse else (src, dst)
        present = [name for name in ins if name in remaining]
        if not present and r.optional:
            continue
        if len(present) != len(ins):
            missing = [name for name in ins if name not in remaining]
            raise ValueError(f"Missing tensors {missing} (rule {r.src} -> {r.dst}).")
        transform = TRANSFORMS[r.transform]
        fn = transform.inverse if inverse else transform.forward
        results = fn([remaining.pop(name) for name in ins], cfg)
        out.update(zip(outs, results, strict=True))
        if progress is not None:
            progress(len(ins))
    for copy_name, original, r in duplicates:
        _duplicate(copy_name, original, r, remaining, out, tensors, inverse)
    if remaining:
        raise ValueError(f"Unexpected tensors that no rule of the map consumes: {sorted(remaining)[:20]}.")
    return out


def _duplicate(copy_name: str, original: str, r: Rule, remaining: dict, out: dict, tensors: dict, inverse: bool):
    """A `"duplicate"` rule: the copy is written from the original (inverse), or checked equal to it and dropped."""
    if inverse:
        if original in tensors:
            out[copy_name] = tensors[original].clone()  # its own storage, as the file held it
        elif not r.optional:
            raise ValueError(f"Missing tensors {[original]} (rule {r.src} -> {r.dst}).")
        return
    if copy_name not in remaining:
        if r.optional:
            return
        raise ValueError(f"Missing tensors {[copy_name]} (rule {r.src} -> {r.dst}).")
    copy = remaining.pop(copy_name)
    if original not in out or not torch.equal(copy, out[original]):
        raise ValueError(f"`{copy_name}` should be a copy of `{original}`, which the model holds once, and it differs "
                         "from it: converting would lose it.")


def check_shapes(produced: dict[str, torch.Tensor], expected: dict[str, tuple], where: str) -> None:
    """Every expected tensor present with its shape; nothing extra."""
    missing = sorted(set(expected) - set(produced))
    extra = sorted(set(produced) - set(expected))
    wrong = [f"{k}: got {tuple(produced[k].shape)}, expected {tuple(expected[k])}"
             for k in sorted(set(produced) & set(expected)) if tuple(produced[k].shape) != tuple(expected[k])]
    problems = []
    if missing:
        problems.append(f"missing tensors {missing[:20]}")
    if extra:
        problems.append(f"unexpected tensors {extra[:20]}")
    if wrong:
        problems.append(f"shape mismatches {wrong[:20]}")
    if problems:
        raise ValueError(f"{where}: " + "; ".join(problems) + ".")
