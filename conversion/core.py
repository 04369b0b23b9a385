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
conversion reads both, checks them equal and writes nothing (`duplicates`), or reads nothing where the files lack
the copy; export writes the copy from the original.

Conversion streams (`stream.py`): `plan_rules` names, for each rule instance, the tensors it needs
(`RuleInstance.inputs`) before anything is read; the instances run once on meta-device tensors to plan
the output's names and shapes, then once per instance on the tensors read for it. A transform must
therefore be a shape operation that also runs on the meta device (split, cat, reshape, transpose), as
every one in `TRANSFORMS` is.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from modular_decoder.kinds import mixer_layer_types

Tensors = list[torch.Tensor]


@dataclass(frozen=True)
class Transform:
    """A tensor transform and its exact inverse; both take the tensors and the target contract.

    `per_expert`: each output's row i of dim 0 depends only on row i of the input (a copy; a rearrangement within
    each expert of an experts tensor), so a large tensor may go through a slice of rows at a time (`stream.py`).
    """

    forward: Callable[[Tensors, Any], Tensors]
    inverse: Callable[[Tensors, Any], Tensors]
    per_expert: bool = False


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


def _key_groups(cfg) -> tuple[int, int, int, int]:
    """(H_k, d_k, H_v / H_k, d_v) of the contract's linear-attention layers."""
    heads = cfg.linear_num_key_heads
    return heads, cfg.linear_key_head_dim, cfg.linear_num_value_heads // heads, cfg.linear_value_head_dim


def _split_grouped_qkvz(tensors: Tensors, cfg) -> Tensors:
    """Qwen3-Next's `in_proj_qkvz`, rows grouped per key head as [q_h, k_h, v_h·r, z_h·r] (r = H_v / H_k), into
    the contract's `in_proj_qkv` ([all q, all k, all v]) and `in_proj_z`: the same rows, reordered."""
    heads, d_k, r, d_v = _key_groups(cfg)
    grouped = tensors[0].reshape(heads, 2 * d_k + 2 * r * d_v, -1)
    q, k, v, z = grouped.split((d_k, d_k, r * d_v, r * d_v), dim=1)
    flat = [part.reshape(-1, grouped.shape[-1]) for part in (q, k, v, z)]
    return [torch.cat(flat[:3], dim=0).contiguous(), flat[3].contiguous()]


def _fuse_grouped_qkvz(tensors: Tensors, cfg) -> Tensors:
    heads, d_k, r, d_v = _key_groups(cfg)
    qkv, z = tensors
    q, k, v = qkv.split((heads * d_k, heads * d_k, heads * r * d_v), dim=0)
    parts = [t.reshape(heads, -1, qkv.shape[-1]) for t in (q, k, v, z)]
    return [torch.cat(parts, dim=1).reshape(-1, qkv.shape[-1]).contiguous()]


def _split_grouped_ba(tensors: Tensors, cfg) -> Tensors:
    """Qwen3-Next's `in_proj_ba`, rows grouped per key head as [b_h·r, a_h·r], into `in_proj_b` and `in_proj_a`."""
    heads, _, r, _ = _key_groups(cfg)
    b, a = tensors[0].reshape(heads, 2 * r, -1).split((r, r), dim=1)
    return [b.reshape(-1, b.shape[-1]).contiguous(), a.reshape(-1, a.shape[-1]).contiguous()]


def _fuse_grouped_ba(tensors: Tensors, cfg) -> Tensors:
    heads = cfg.linear_num_key_heads
    b, a = (t.reshape(heads, -1, t.shape[-1]) for t in tensors)
    return [torch.cat((b, a), dim=1).reshape(-1, b.shape[-1]).contiguous()]


def _linear_qkv_widths(cfg) -> list[int]:
    """(H_k·d_k, H_k·d_k, H_v·d_v): the query, key and value rows of the contract's linear-attention layers."""
    key = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    return [key, key, cfg.linear_num_value_heads * cfg.linear_value_head_dim]


def _fuse_linear_qkv(tensors: Tensors, cfg) -> Tensors:
    """Separate query, key and value tensors of a linear-attention layer (projections, or their three short
    convolutions, as OLMo hybrid's and Kimi Linear's files hold them), stacked along dim 0 into one."""
    return [torch.cat(tensors, dim=0).contiguous()]


def _split_linear_qkv(tensors: Tensors, cfg) -> Tensors:
    return [t.contiguous() for t in torch.split(tensors[0], _linear_qkv_widths(cfg), dim=0)]


def _flatten_heads(tensors: Tensors, cfg) -> Tensors:
    """A per-head parameter stored (1, 1, H, 1), to broadcast over (B, T, H, d) (Kimi Linear's `A_log`) -> (H,)."""
    return [t.reshape(-1).contiguous() for t in tensors]


def _unflatten_heads(tensors: Tensors, cfg) -> Tensors:
    return [t.reshape(1, 1, -1, 1).contiguous() for t in tensors]


def _deinterleave_gate_up(tensors: Tensors, cfg) -> Tensors:
    """gpt-oss's experts: gate and up columns interleaved (gate 2i, up 2i + 1) along the last axis of its
    (E, d, 2f) products and (E, 2f) biases -> [gate; up] as the contract's (E, 2f, d) and (E, 2f) hold them."""
    out = []
    for t in tensors:
        width = t.shape[-1] // 2
        # written once into the result (no concatenated copy to make contiguous again)
        result = t.new_empty((t.shape[0], 2 * width, t.shape[1]) if t.dim() == 3 else t.shape)
        for half, columns in enumerate((t[..., 0::2], t[..., 1::2])):
            result[:, half * width:(half + 1) * width] = columns.transpose(1, 2) if t.dim() == 3 else columns
        out.append(result)
    return out


def _interleave_gate_up(tensors: Tensors, cfg) -> Tensors:
    out = []
    for t in tensors:
        halves = t.transpose(1, 2) if t.dim() == 3 else t  # (E, d, 2f) / (E, 2f): [gate; up] along the last axis
        gate, up = halves.chunk(2, dim=-1)
        out.append(torch.stack((gate, up), dim=-1).flatten(-2).contiguous())
    return out


def _transpose_experts(tensors: Tensors, cfg) -> Tensors:
    """(E, in, out) products, as gpt-oss stores them, <-> (E, out, in), as the contract's experts do."""
    return [t.transpose(1, 2).contiguous() for t in tensors]


TRANSFORMS: dict[str, Transform] = {
    "copy": Transform(_copy, _copy, per_expert=True),
    # forward: [copy, original] -> nothing (`duplicates` checks them equal); inverse: original -> copy
    "duplicate": Transform(lambda tensors, cfg: [], _copy),
    "transpose": Transform(_transpose, _transpose),
    "split_qkv": Transform(_split_qkv, _fuse_qkv),
    "split_conv1d_qkv": Transform(_split_conv1d_qkv, _fuse_conv1d_qkv),
    "split_grouped_qkv": Transform(_split_grouped_qkv, _fuse_grouped_qkv),
    "split_gate_up": Transform(_split_gate_up, lambda tensors, cfg: [torch.cat(tensors, dim=0)]),
    "split_grouped_qkvz": Transform(_split_grouped_qkvz, _fuse_grouped_qkvz),
    "split_grouped_ba": Transform(_split_grouped_ba, _fuse_grouped_ba),
    "fuse_linear_qkv": Transform(_fuse_linear_qkv, _split_linear_qkv),
    "flatten_heads": Transform(_flatten_heads, _unflatten_heads),
    "interleaved_gate_up": Transform(_deinterleave_gate_up, _interleave_gate_up, per_expert=True),
    "transpose_experts": Transform(_transpose_experts, _transpose_experts, per_expert=True),
}

# Which layers a `{layer}` rule applies to, by the contract's `layer_types` (`Rule.mixer`): DeepSeek-V4's compressed
# layers attend as the others do, and hold their compressor (CSA: and its indexer) beside
MIXERS = {"attention": ("full_attention", "sliding_attention", "chunked_attention", "compressed_sparse_attention",
                        "heavily_compressed_attention"),
          "linear_attention": ("linear_attention",),
          "compressed": ("compressed_sparse_attention", "heavily_compressed_attention"),
          "compressed_sparse": ("compressed_sparse_attention",)}


@dataclass(frozen=True)
class Rule:
    """Source tensor name(s) -> target tensor name(s) through one named transform.

    Names may contain `{layer}`. An `optional` rule is skipped when none of its source tensors exist
    (biases, tied heads); a partial match is always an error. `layers` ("sparse" or "dense") limits a
    `{layer}` rule to the layers the contract's `mlp_layer_types` marks so (a config without it has
    dense layers only); `mixer` ("attention" or "linear_attention", `MIXERS`) to the layers whose
    `layer_types` entry mixes tokens that way.
    """

    src: tuple[str, ...]
    dst: tuple[str, ...]
    transform: str = "copy"
    optional: bool = False
    layers: str | None = None
    mixer: str | None = None

    def __post_init__(self):
        if isinstance(self.src, str):
            object.__setattr__(self, "src", (self.src,))
        if isinstance(self.dst, str):
            object.__setattr__(self, "dst", (self.dst,))
        if self.transform not in TRANSFORMS:
            raise ValueError(f"Unknown transform {self.transform!r}; known: {sorted(TRANSFORMS)}.")
        if self.layers not in (None, "sparse", "dense"):
            raise ValueError(f"`layers`={self.layers!r} is not one of None, 'sparse', 'dense'.")
        if self.mixer is not None and self.mixer not in MIXERS:
            raise ValueError(f"`mixer`={self.mixer!r} is not one of None, {', '.join(map(repr, MIXERS))}.")


def rule(src, dst, transform: str = "copy", optional: bool = False, layers: str | None = None) -> Rule:
    return Rule(src, dst, transform, optional, layers)


def in_layers(rules: list[Rule], mixer: str) -> list[Rule]:
    """`rules` limited to the layers whose token mixer is `mixer` (see `Rule`)."""
    return [dataclasses.replace(r, mixer=mixer) for r in rules]


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

    def groups(self, names) -> dict[str, list[list[str]]]:
        """{stacked name: per part, the per-expert names it is made of, expert by expert} for every layer
        whose experts `names` holds; raises `ValueError` naming the pieces a layer lacks."""
        found: dict[int, set[int]] = {}
        pattern = self._pattern(self.parts[0])
        for name in names:
            match = pattern.match(name)
            if match:
                found.setdefault(int(match["layer"]), set()).add(int(match["expert"]))
        names = set(names)
        groups = {}
        for layer, experts in sorted(found.items()):
            count = max(experts) + 1
            group = [[part.format(layer=layer, expert=e) for e in range(count)] for part in self.parts]
            missing = [name for part in group for name in part if name not in names]
            if missing:
                raise ValueError(f"Experts of layer {layer} are incomplete: missing {missing[:5]}.")
            groups[self.dst.format(layer=layer)] = group
        return groups

    def stack(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`state` with every layer's per-expert tensors replaced by the stacked one (files that hold the
        stacked tensor already pass through)."""
        state = dict(state)
        for dst, group in self.groups(state).items():
            stacks = [torch.stack([state.pop(name) for name in part]) for part in group]  # (E, out, in) each
            state[dst] = torch.cat(stacks, dim=1) if len(stacks) > 1 else stacks[0]
        return state

    def pieces(self, name: str, shape: tuple[int, ...]) -> list[tuple[str, int, slice]] | None:
        """How `save_pretrained` splits stacked tensor `name` (of `shape`) back into per-expert file tensors:
        [(file name, expert, rows of dim 1)], parts of equal width; None if `name` is not this stack's."""
        pattern = re.compile(re.escape(self.dst).replace(re.escape("{layer}"), r"(?P<layer>\d+)") + "$")
        match = pattern.match(name)
        if match is None:
            return None
        width = shape[1] // len(self.parts)
        return [(part.format(layer=int(match["layer"]), expert=e), e, slice(j * width, (j + 1) * width))
                for e in range(shape[0]) for j, part in enumerate(self.parts)]


@dataclass(frozen=True)
class SplitTensor:
    """How a checkpoint file stores one tensor of the transformers model in parts along dim 0 (transformers'
    `WeightConverter` with `Concatenate(dim=0)`: OLMo hybrid's and Kimi Linear's three short convolutions): `parts`
    (templates with `{layer}`) make `dst`, in that order; `widths(config)` is each part's rows for the family's
    config, which export writes."""

    parts: tuple[str, ...]
    dst: str
    widths: Callable[[Any], list[int]]

    def _pattern(self, part: str) -> re.Pattern:
        return re.compile(re.escape(part).replace(re.escape("{layer}"), r"(?P<layer>\d+)") + "$")

    def groups(self, names) -> dict[str, list[str]]:
        """{model name: its part names, in order} for every layer whose parts `names` holds; a layer holding some of
        them only is refused, naming what it lacks."""
        names = set(names)
        layers = sorted({int(m["layer"]) for part in self.parts for n in names if (m := self._pattern(part).match(n))})
        groups = {}
        for layer in layers:
            group = [part.format(layer=layer) for part in self.parts]
            missing = [name for name in group if name not in names]
            if missing:
                raise ValueError(f"Parts of {self.dst.format(layer=layer)} are missing: {missing}.")
            groups[self.dst.format(layer=layer)] = group
        return groups

    def pieces(self, name: str, config) -> list[tuple[str, slice]] | None:
        """Where export writes the model's tensor `name`: [(file name, rows of dim 0)]; None if it is not this one's."""
        match = self._pattern(self.dst).match(name)
        if match is None:
            return None
        bounds = [0]
        for width in self.widths(config):
            bounds.append(bounds[-1] + width)
        return [(part.format(layer=int(match["layer"])), slice(a, b))
                for part, a, b in zip(self.parts, bounds[:-1], bounds[1:], strict=True)]


def rename(name: str, renames: dict[str, str], inverse: bool = False) -> str:
    """One name through old -> new prefixes (new -> old with `inverse`); a prefix may contain `{layer}`
    (any layer number, kept)."""
    for old, new in renames.items():
        if inverse:
            old, new = new, old
        if "{layer}" in old:
            match = re.compile(re.escape(old).replace(re.escape("{layer}"), r"(?P<layer>\d+)")).match(name)
            if match:
                name = new.format(layer=match["layer"]) + name[match.end():]
        elif name.startswith(old):
            name = new + name[len(old):]
    return name


def file_name(name: str, family: "Family", config) -> str:
    """The file name export writes for the model's tensor `name`: `family.renames` backwards, each where it holds
    (`family.renamed_layers`, by the family `config`'s layer lists)."""
    match = re.match(r"model\.layers\.(\d+)\.", name)
    layer = int(match[1]) if match else None
    renames = {old: new for old, new in family.renames.items()
               if old not in family.renamed_layers or _layer_is(config, layer, family.renamed_layers[old])}
    return rename(name, renames, inverse=True)


def _layer_is(config, layer: int | None, kind: str) -> bool:
    """Whether layer `layer` of the family `config` mixes tokens as `kind` (a `MIXERS` key) or has a `kind` ("sparse" /
    "dense") feed-forward."""
    if layer is None:
        return False
    if kind in MIXERS:
        types = getattr(config, "layer_types", None) or []
        return layer < len(types) and types[layer] in MIXERS[kind]
    types = getattr(config, "mlp_layer_types", None) or []
    return layer < len(types) and types[layer] == kind


def rename_prefixes(state: dict[str, torch.Tensor], renames: dict[str, str]) -> dict[str, torch.Tensor]:
    """Old name prefixes -> new ones; a prefix may contain `{layer}` (any layer number, kept)."""
    return {rename(k, renames): v for k, v in state.items()}


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
        refused: Name prefixes of source tensors the contract cannot hold yet -> what they are: a source with
            any of them is refused naming them (`refuse_tensors`), never converted without them.
        mtp_layers: Where the files keep multi-token-prediction module k, a name prefix with `{mtp}` (k) or
            `{mtp_layer}` (the source's layer index of module k, `num_hidden_layers` + k); `None`: the family has
            no MTP modules. The modules the files hold are what converts (`count_mtp_layers`); their tensors go
            by `{mtp}` rules.
        aliases: Prefixes of another layout the family's files are published in (a release's own names) -> those
            `renames` reads, applied before them; read only: export writes what transformers' `save_pretrained`
            writes.
        dropped: Name prefixes of source tensors the family's transformers model does not hold (it loads without
            them) -> what they are: not converted, as transformers does not load them; the model card says so.
        description: One line for the table of families (`conversion/table.py`): the releases it reads and what
            sets the family apart.
        mtp_drafts: With MTP modules, whether `generate(use_mtp=True)` drafts with them once converted
            (`mtp_generation.drafting_refusal`; tests/test_families_table.py checks it on the family's test cases).
        vllm_native: Whether vLLM has its own model class for the family's format, so that `export --family` gives
            a folder vLLM serves natively (tests/test_families_table.py checks it against vLLM's registry).
        refusals: What a checkpoint of this family may hold that `convert` refuses by name (`refuse`), one phrase
            each, for the table (tensor prefixes refused are `refused`'s).
        split: Tensors of the model the files keep in parts (see `SplitTensor`), read after `experts`.
        renamed_layers: Renames (keys of `renames`) that hold for some layers only -> which: a mixer (a `MIXERS`
            key, by `layer_types`) or "sparse" / "dense" (by `mlp_layer_types`). Reading renames every match;
            export gives back the file's name only in those layers (OLMo hybrid's files name a linear layer's norms
            otherwise than an attention layer's, Kimi Linear's a sparse layer's MLP otherwise than a dense one's,
            which their models name alike).
        export_warnings: The exported family config -> sentences `export` logs as warnings: where an engine serving
            the family's format natively computes otherwise than transformers' class with this model (vLLM's LFM2
            ties its head to the embedding).
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
    refused: dict[str, str] = field(default_factory=dict)
    mtp_layers: str | None = None
    aliases: dict[str, str] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)
    description: str = ""
    mtp_drafts: bool = True
    vllm_native: bool = True
    refusals: tuple[str, ...] = ()
    split: tuple[SplitTensor, ...] = ()
    renamed_layers: dict[str, str] = field(default_factory=dict)
    export_warnings: Callable[[Any], list[str]] | None = None


def refuse_tensors(names, family: Family) -> None:
    """Raise one `ValueError` when source tensors `names` include any of `family.refused`'s prefixes."""
    found = {prefix: what for prefix, what in family.refused.items() if any(n.startswith(prefix) for n in names)}
    if found:
        parts = [f"{what} (tensors `{prefix}*`)" for prefix, what in found.items()]
        raise ValueError(f"This {family.name} checkpoint holds {'; '.join(parts)}, which modular_decoder cannot hold "
                         "yet; it is not converted without them.")


def refuse(features: dict[str, bool], family: str) -> None:
    """Raise one `ValueError` naming every source feature the contract cannot express."""
    bad = [name for name, present in features.items() if present]
    if bad:
        raise ValueError(
            f"This {family} checkpoint uses {', '.join(bad)}, which the modular_decoder contract cannot "
            "express; it cannot be converted without changing what the model computes."
        )


def refuse_export(features: dict[str, bool], family: str) -> None:
    """Raise one `ValueError` naming every contract field, with its value, that `family`'s format cannot express
    (the export direction of `refuse`)."""
    bad = [name for name, present in features.items() if present]
    if bad:
        raise ValueError(f"The {family} format cannot express this checkpoint's {'; '.join(bad)}; it cannot be "
                         "exported without changing what the model computes.")


def _expand(names: tuple[str, ...], layer: int | None) -> list[str]:
    return [name.format(layer=layer) if layer is not None else name for name in names]


def _is_layered(r: Rule) -> bool:
    return any("{layer}" in name for name in r.src + r.dst)


def is_mtp_rule(r: Rule) -> bool:
    """Whether `r` maps the MTP modules' tensors (its names have `{mtp}` or `{mtp_layer}`)."""
    return any("{mtp}" in name or "{mtp_layer}" in name for name in r.src + r.dst)


def _layers(r: Rule, cfg) -> list[int | None]:
    """The layers a `{layer}` rule applies to: by its feed-forward kind (`layers`, only layers that have a
    feed-forward) and its mixer (`mixer`, only layers that have a token mixer: `block_types`; a hybrid layer has
    both kinds of mixer)."""
    if not _is_layered(r):
        return [None]
    count = cfg.num_hidden_layers
    kinds = getattr(cfg, "mlp_layer_types", None) or ["dense"] * count
    mixers = getattr(cfg, "layer_types", None) or ["full_attention"] * count
    blocks = getattr(cfg, "block_types", None) or ["mixer_mlp"] * count
    return [layer for layer in range(count)
            if (r.layers is None or (r.layers == kinds[layer] and blocks[layer] != "mixer"))
            and (r.mixer is None or (set(mixer_layer_types(mixers[layer])) & set(MIXERS[r.mixer])
                                     and blocks[layer] != "mlp"))]


def _mtp_modules(r: Rule, cfg) -> list[int]:
    """The MTP modules a `{mtp}` rule applies to: all of them, or none when `layers` or `mixer` names another kind
    than theirs (the last layer's)."""
    kinds = getattr(cfg, "mlp_layer_types", None) or ["dense"]
    mixers = getattr(cfg, "layer_types", None) or ["full_attention"]
    applies = r.layers in (None, kinds[-1]) and (r.mixer is None or mixers[-1] in MIXERS[r.mixer])
    return list(range(getattr(cfg, "num_mtp_layers", 0) if applies else 0))


def rule_instances(rules: list[Rule], cfg):
    for r in rules:
        if is_mtp_rule(r):
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
                 r.layers, r.mixer)
            for r in rules
            if all(n.startswith(src_layer) for n in r.src) and all(n.startswith(dst_layer) for n in r.dst)]


def count_mtp_layers(names, prefix: str, num_hidden_layers: int) -> int:
    """How many MTP modules a source's files hold: consecutive k from 0 whose `prefix` (with `{mtp}` = k or
    `{mtp_layer}` = `num_hidden_layers` + k) starts some tensor's name."""
    count = 0
    while any(name.startswith(prefix.format(mtp=count, mtp_layer=num_hidden_layers + count)) for name in names):
        count += 1
    return count


def duplicates(plan: list["RuleInstance"]) -> tuple[list["RuleInstance"], list["RuleInstance"]]:
    """(the plan without the instances of forward `"duplicate"` rules, those instances: inputs (copy, original),
    which the caller reads and gives to `check_duplicate`)."""
    checks = [i for i in plan if i.rule.transform == "duplicate" and not i.inverse]
    return [i for i in plan if i not in checks], checks


def check_duplicate(instance: "RuleInstance", copy: torch.Tensor, original: torch.Tensor) -> None:
    """A source tensor that should be a copy of one the model holds once: refused, naming both, where it differs
    (converting would lose it)."""
    if copy.shape != original.shape or not torch.equal(copy, original):
        name, of = instance.inputs
        raise ValueError(f"`{name}` should be a copy of `{of}`, which the model holds once, and it differs from it: "
                         "converting would lose it.")


@dataclass(frozen=True)
class RuleInstance:
    """One rule at one layer, in one direction: the tensors it needs (`inputs`) and those it makes."""

    rule: Rule
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    inverse: bool = False

    def apply(self, tensors: Tensors, cfg) -> dict[str, torch.Tensor]:
        """The outputs from the input tensors (in `inputs`' order)."""
        transform = TRANSFORMS[self.rule.transform]
        fn = transform.inverse if self.inverse else transform.forward
        return dict(zip(self.outputs, fn(list(tensors), cfg), strict=True))


def plan_rules(rules: list[Rule], names, cfg, direction: str = "forward") -> list[RuleInstance]:
    """The rule instances that map tensors named `names`, each naming the tensors it needs; nothing is read.

    `direction="inverse"` maps target names back to source names. Raises `ValueError` for partly
    present rules and for tensors no rule consumes.
    """
    inverse = direction == "inverse"
    remaining = set(names)
    plan = []
    names = set(names)
    for r, src, dst in rule_instances(rules, cfg):
        if r.transform == "duplicate":
            plan += _duplicate_instance(r, src[0], dst[0], names, remaining, inverse)
            continue
        ins, outs = (dst, src) if inverse else (src, dst)
        present = [name for name in ins if name in remaining]
        if not present and r.optional:
            continue
        if len(present) != len(ins):
            missing = [name for name in ins if name not in remaining]
            raise ValueError(f"Missing tensors {missing} (rule {r.src} -> {r.dst}).")
        remaining.difference_update(ins)
        plan.append(RuleInstance(r, tuple(ins), tuple(outs), inverse))
    if remaining:
        raise ValueError(f"Unexpected tensors that no rule of the map consumes: {sorted(remaining)[:20]}.")
    return plan


def _duplicate_instance(r: Rule, copy: str, original: str, names: set, remaining: set, inverse: bool) -> list:
    """A `"duplicate"` rule's instance: forward it consumes the copy (read with the original, which its own rule
    consumes too), or nothing where the files lack the copy (the model holds the original only, as transformers'
    loader reads it); inverse it writes the copy from the original."""
    if inverse:
        return [RuleInstance(r, (original,), (copy,), True)] if original in names or not r.optional else []
    if copy not in remaining:
        return []
    if original not in names:
        raise ValueError(f"Missing tensors {[original]} (rule {r.src} -> {r.dst}).")
    remaining.discard(copy)
    return [RuleInstance(r, (copy, original), ())]


def apply_rules(
    rules: list[Rule],
    tensors: dict[str, torch.Tensor],
    cfg,
    direction: str = "forward",
    progress: Callable[[int], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Apply every rule instance to `tensors` (held in memory); `direction="inverse"` maps target names
    back to source. Raises as `plan_rules` does. Conversion streams instead (`conversion/stream.py`).
    """
    out: dict[str, torch.Tensor] = {}
    for instance in plan_rules(rules, tensors, cfg, direction):
        inputs = [tensors[name] for name in instance.inputs]
        if instance.rule.transform == "duplicate" and not instance.inverse:
            check_duplicate(instance, *inputs)
        out.update(instance.apply(inputs, cfg))
        if progress is not None:
            progress(len(instance.inputs))
    return out


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
