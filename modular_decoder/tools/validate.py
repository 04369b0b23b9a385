"""`validate`: checks of a checkpoint, a config or a model against independent references, as a pass/fail table.

    from modular_decoder.tools.validate import validate
    report = validate("path/to/checkpoint")        # or a ModularDecoderConfig, or a model
    print(report.table()); assert report.ok, report.failed

    modular-decoder validate PATH
    modular-decoder validate --preset gemma2 --tiny

Each check measures something and compares it with an independent expectation: the contract's
formulas (`contract.parameter_count`, `contract.cache_bytes`), the no-cache forward, the eager
attention path, and the tensors actually serialized. Every check draws its inputs from its own
generator, seeded from (`seed`, its name): a check measures the same thing whichever ran before it.
Where two paths compute the same math in another order, the tolerance is measured in the same run
(see NOISE_MULTIPLE). The checks, in order:

1. ``shapes``: every serialized tensor has the shape a model built from the config has, and the
   parameter count (tied weights once) equals `contract.parameter_count` by component;
2. ``causality``: perturbing future tokens leaves earlier logits unchanged, with left padding, with
   packed documents (`position_ids` restarting, no mask) and, per sliding layer, outside the window
   (routed experts run as per-token products here: see `batch_invariant_experts`);
3. ``backends``: each attention backend that can run here and honour the config against eager
   (a "skip" row when none but eager can);
4. ``cached_decoding``: token-by-token decoding (dynamic and static cache) equals the full forward;
5. ``cache_bytes``: `cache.payload_bytes()` equals `contract.cache_bytes` across batches and lengths;
6. ``positions``: the trained length, the configured maximum (learned positions raise past it) and
   prefix-cache offsets (a cached prefix, continued, equals the full forward);
7. ``benchmark``: prefill and decode throughput and peak memory (a measurement; fails only on error;
   `validate_benchmark.py`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import traceback
import zlib
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from modular_decoder import compat, contract
from modular_decoder.backend_features import BACKEND_FEATURES, missing_features
from modular_decoder.cache import ModularDecoderCache
from modular_decoder.checkpoint_checks import read_json_file, read_safetensors_header
from modular_decoder.chunked_attention import layer_window
from modular_decoder.configuration_modular_decoder import ModularDecoderConfig
from modular_decoder.experts import experts_kernels_available
from modular_decoder.modeling_modular_decoder import ModularDecoderForCausalLM
from modular_decoder.tools.validate_benchmark import check_benchmark

# Where the same math runs in a different order (cache vs full forward, chunked vs whole prefix, sdpa vs
# eager), logits may differ by rounding. How much depends on the model (its depth, its logit scale) and
# on the inputs, so no fixed number fits every checkpoint (an absolute 1e-4 failed SmolLM2-135M, 30 fp32
# layers, where transformers' own LlamaForCausalLM shows 6.8e-05 on the same weights). Each such check
# instead measures, in the same run and on its own inputs, what the model's no-cache forward itself shows
# when only the sequence length changes (`rounding_noise`: same math, other matmul shapes) and accepts
# NOISE_MULTIPLE times that; a path with a real bug (a lost token, a wrong position) is off by the
# logit scale itself, orders of magnitude above.
NOISE_MULTIPLE = 8
# Floor for models whose shorter forward happens to round identically: this many units of rounding
# (the dtype's epsilon) of the largest |logit|.
NOISE_FLOOR_ULPS = 16
# Flash kernels run only in half precision: an fp32 model compares them with eager under bf16 autocast,
# with the tolerance measured the same way under that autocast.
HALF_PRECISION = torch.bfloat16
CHECKS = ("shapes", "causality", "backends", "cached_decoding", "cache_bytes", "positions", "benchmark")


@dataclasses.dataclass
class CheckResult:
    """One row of the report: `status` is "pass", "fail" or "skip"; `measured` the numbers."""

    name: str
    status: str
    measured: str
    detail: str = ""

    @property
    def passed(self) -> bool:
        return self.status != "fail"


@dataclasses.dataclass
class Report:
    """The checks run on one model; `ok` is True when none failed."""

    target: str
    checks: list[CheckResult]

    @property
    def ok(self) -> bool:
        return all(check.passed for check in self.checks)

    @property
    def failed(self) -> list[str]:
        return [check.name for check in self.checks if not check.passed]

    def __getitem__(self, name: str) -> CheckResult:
        for check in self.checks:
            if check.name == name:
                return check
        raise KeyError(name)

    def table(self) -> str:
        """A markdown table: check | status | measured | detail."""
        rows = [f"validate: {self.target}", "", "| check | status | measured | detail |", "| --- | --- | --- | --- |"]
        for c in self.checks:
            rows.append(f"| {c.name} | {c.status.upper()} | {c.measured} | {c.detail} |")
        rows += ["", "all checks passed" if self.ok else f"FAILED: {', '.join(self.failed)}"]
        return "\n".join(rows)

    __str__ = table


class CheckSkipped(Exception):
    """Raised inside a check that could not measure anything here; becomes a "skip" row."""


class CheckFailed(AssertionError):
    """Raised inside a check with the measured numbers; becomes a "fail" row."""

    def __init__(self, measured: str, detail: str = ""):
        super().__init__(f"{measured} {detail}")
        self.measured, self.detail = measured, detail


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def rounding_noise(ctx: "_Context", ids: torch.Tensor, full: torch.Tensor) -> float:
    """Largest |Δlogit| between `full` (the no-cache logits of `ids`) and the no-cache forward of shorter
    prefixes of `ids` at their last position: causal attention makes them equal in exact arithmetic, so
    what is left is the rounding of this model on these inputs."""
    seq = ids.shape[1]
    worst = 0.0
    for length in sorted({max(1, seq // 4), max(1, seq // 2), max(1, 3 * seq // 4)}):
        shorter = ctx.logits(ids[:, :length], use_cache=False)
        worst = max(worst, _max_diff(shorter[:, -1], full[:, length - 1]))
    return worst


class _Context:
    """What every check needs: the model, its config, a seeded generator and the serialized state."""

    def __init__(self, model, serialized: dict[str, tuple[int, ...]] | None, seq_len: int, seed: int):
        self.model = model
        self.config: ModularDecoderConfig = model.config
        self.serialized = serialized
        self.seq_len = seq_len
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype

    def start(self, check: str) -> None:
        """Give `check` its own generator, seeded from (seed, check name): its inputs do not depend on
        which checks ran before it."""
        self.generator = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(check.encode()))

    def rounding_tolerance(self, ids: torch.Tensor, full: torch.Tensor,
                           dtype: torch.dtype | None = None) -> tuple[float, str]:
        """(tolerance, how it was set) for comparing another path with `full`, the no-cache logits of
        `ids`: NOISE_MULTIPLE times `rounding_noise`, at least NOISE_FLOOR_ULPS of the logit scale in
        `dtype` (default: the model's)."""
        noise = rounding_noise(self, ids, full)
        scale = full.abs().max().item()
        floor = NOISE_FLOOR_ULPS * torch.finfo(dtype or self.dtype).eps * scale
        tolerance = max(NOISE_MULTIPLE * noise, floor, torch.finfo(torch.float32).tiny)  # never 0
        return tolerance, f"tol {tolerance:.1e} = max({NOISE_MULTIPLE}x forward's own {noise:.1e}, " \
                          f"{NOISE_FLOOR_ULPS} ulps of max|logit| {scale:.1f})"

    def ids(self, batch: int, seq: int) -> torch.Tensor:
        return torch.randint(0, self.config.vocab_size, (batch, seq), generator=self.generator).to(self.device)

    def logits(self, ids, **kwargs) -> torch.Tensor:
        with torch.no_grad():
            return self.model(ids, **kwargs).logits.float()

    def perturbed(self, ids: torch.Tensor, start: int, stop: int | None = None) -> torch.Tensor:
        """`ids` with every token in [start, stop) replaced by a different id."""
        changed = ids.clone()
        shift = torch.randint(1, self.config.vocab_size, changed[:, start:stop].shape, generator=self.generator)
        changed[:, start:stop] = (changed[:, start:stop] + shift.to(ids.device)) % self.config.vocab_size
        return changed


# ----------------------------------------------------------------------------------------------
# 1. shapes and parameter counts


def _component(name: str) -> str:
    """The `contract.parameter_count` component a parameter belongs to."""
    if name.startswith("lm_head"):
        return "lm_head"
    if ".embed_tokens." in name:
        return "embedding"
    if ".embed_positions." in name:
        return "positions"
    if ".embed_norm." in name:
        return "embedding_norm"
    if ".final_norm." in name:
        return "final_norm"
    if any(part in name for part in (".attn_hc.", ".ffn_hc.", ".residual_stream.")):
        return "residual_stream"  # hyper-connections: each layer's and the model's
    if ".self_attn." in name:
        return "attention"
    if ".linear_attn." in name:
        return "linear_attention"
    if ".mlp." in name:
        return "mlp"
    if ".per_layer_embeddings." in name or ".per_layer_input." in name:
        return "per_layer_embeddings"
    if ".residual_stream." in name or ".altup." in name:
        return "residual_stream"
    if ".laurel." in name:
        return "laurel"
    return "block_norms"


def check_shapes(ctx: _Context) -> str:
    config, model = ctx.config, ctx.model
    expected = _expected_shapes(config)
    actual = ctx.serialized if ctx.serialized is not None else _unique_state_shapes(model)
    wrong = [f"{k}: {tuple(actual[k])} != {expected[k]}" for k in expected.keys() & actual.keys()
             if tuple(actual[k]) != expected[k]]
    missing = sorted(expected.keys() - actual.keys())
    unexpected = sorted(actual.keys() - expected.keys())
    if config.tie_word_embeddings:
        if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
            raise CheckFailed("lm_head not tied", "`tie_word_embeddings=True` but lm_head is a separate tensor")
    if wrong or missing or unexpected:
        problems = wrong[:3] + [f"missing {k}" for k in missing[:3]] + [f"unexpected {k}" for k in unexpected[:3]]
        raise CheckFailed(f"{len(wrong)} wrong, {len(missing)} missing, {len(unexpected)} unexpected tensors",
                          "; ".join(problems))

    formula = contract.parameter_count(config)
    counted: dict[str, int] = {}
    for name, param in model.named_parameters():  # named_parameters yields a tied tensor once
        counted[_component(name)] = counted.get(_component(name), 0) + param.numel()
    total = model.num_parameters()
    parameters = {name for name, _ in model.named_parameters()}  # buffers are not parameters
    serialized = sum(_numel(shape) for name, shape in actual.items() if name in parameters)
    components = set(counted) | (set(formula) - {"total", "active"})  # the sums, not components
    off = {k: (counted.get(k, 0), formula.get(k, 0)) for k in components if counted.get(k, 0) != formula.get(k, 0)}
    measured = f"params {total:,} = contract {formula['total']:,}; serialized {serialized:,}"
    if formula["active"] != formula["total"]:
        measured += f"; active per token {formula['active']:,}"
    if off or total != formula["total"] or serialized != formula["total"]:
        parts = "; ".join(f"{k}: weights {w:,} vs contract {f:,}" for k, (w, f) in sorted(off.items()))
        raise CheckFailed(measured.replace(" = ", " vs "), parts or "serialized tensors disagree with the contract")
    return measured


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _expected_shapes(config: ModularDecoderConfig) -> dict[str, tuple[int, ...]]:
    """Serialized tensor shapes of a model built from `config` alone (on the meta device: no memory)."""
    with torch.device("meta"):
        reference = ModularDecoderForCausalLM(copy.deepcopy(config))
    return _unique_state_shapes(reference)


def _unique_state_shapes(model) -> dict[str, tuple[int, ...]]:
    """What `save_pretrained` writes: each parameter once (a tied head is dropped) and the persistent
    buffers (a sigmoid router's correction bias)."""
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    saved = model.state_dict()
    shapes.update({name: tuple(b.shape) for name, b in model.named_buffers() if name in saved})
    return shapes


# ----------------------------------------------------------------------------------------------
# 2. causality


@contextlib.contextmanager
def batch_invariant_experts(model):
    """Run routed experts as one product per (token, expert) pair (transformers' "batched_mm") inside the block.

    The grouped kernels ("eager", "grouped_mm") multiply all tokens routed to an expert in one matrix
    product, whose per-row rounding depends on how many rows it has: changing *other* tokens moves a
    token's output by about 1e-7 without any information passing between them. Exact checks
    (causality, padding) need each token's arithmetic fixed, which per-pair products give. Models
    without routed experts, or without transformers' kernels, are left as they are.
    """
    if not model.config.mlp_kind.routed or not experts_kernels_available():
        yield
        return
    previous = compat.experts_implementation(model.config)
    model.set_experts_implementation("batched_mm")
    try:
        yield
    finally:
        model.set_experts_implementation(previous)


def check_causality(ctx: _Context) -> str:
    with batch_invariant_experts(ctx.model):
        return _check_causality(ctx)


def _check_causality(ctx: _Context) -> str:
    seq, config = ctx.seq_len, ctx.config
    ids = ctx.ids(2, seq)
    worst, moved = 0.0, float("inf")
    for cut in (1, seq // 2, seq - 1):
        a, b = ctx.logits(ids, use_cache=False), ctx.logits(ctx.perturbed(ids, cut), use_cache=False)
        worst = max(worst, _max_diff(a[:, :cut], b[:, :cut]))
        moved = min(moved, _max_diff(a[:, cut:], b[:, cut:]))
    measured = [f"future->past max|Δ| {worst:.1e}"]
    if worst > 0:
        raise CheckFailed(measured[0], "earlier logits changed when later tokens changed")
    if moved == 0:
        raise CheckFailed(measured[0], "perturbed positions' own logits did not change: the check saw nothing")

    # left padding: pad tokens and future tokens leave the real earlier positions alone
    pad = seq // 3
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    a = ctx.logits(ids, attention_mask=mask, use_cache=False)
    b = ctx.logits(_repad(ctx, ids, pad, seq), attention_mask=mask, use_cache=False)
    padded = max(_max_diff(a[0, : seq - 2], b[0, : seq - 2]), _max_diff(a[1, pad : seq - 2], b[1, pad : seq - 2]))
    measured.append(f"padded {padded:.1e}")
    if padded > 0:
        raise CheckFailed(", ".join(measured), "with left padding, pad or future tokens reached earlier positions")

    # packed documents: positions restart, no mask; a document sees nothing of the one before it
    measured.append(_packed_documents(ctx, ids, measured))
    if {"sliding_attention", "chunked_attention"} & set(config.layer_types):
        measured.append(_sliding_windows(ctx))
    return ", ".join(measured)


def _packed_documents(ctx: _Context, ids: torch.Tensor, measured: list[str]) -> str:
    """Two documents packed in one row (positions restarting, no mask): the second sees nothing of the first
    (attention layers mask it, linear-attention layers restart their state)."""
    seq = ctx.seq_len
    first = seq // 2
    position_ids = torch.cat([torch.arange(first), torch.arange(seq - first)]).unsqueeze(0).to(ctx.device)
    packed = ctx.logits(ids[:1], position_ids=position_ids, use_cache=False)
    alone = ctx.logits(ids[:1, first:], use_cache=False)
    other = ctx.logits(ctx.perturbed(ids[:1], 0, first), position_ids=position_ids, use_cache=False)
    leak = _max_diff(packed[:, first:], other[:, first:])
    match = _max_diff(packed[:, first:], alone)
    tolerance, _ = ctx.rounding_tolerance(ids[:1, first:], alone)
    result = f"packed leak {leak:.1e}, vs alone {match:.1e} (tol {tolerance:.1e})"
    if leak > 0 or match > tolerance:
        raise CheckFailed(", ".join([*measured, result]), "a packed document saw the document before it")
    return result


def _repad(ctx: _Context, ids: torch.Tensor, pad: int, seq: int) -> torch.Tensor:
    """Row 0: the last two tokens changed; row 1: its pad tokens and its last two tokens changed."""
    changed = ctx.perturbed(ids, seq - 2)
    changed[1:] = ctx.perturbed(changed[1:], 0, pad)
    return changed


def _capture_attention_inputs(ctx: _Context, ids: torch.Tensor) -> dict[int, tuple]:
    """The (hidden, kwargs) each attention module receives in a no-cache forward."""
    captured, handles = {}, []
    for idx, block in enumerate(ctx.model.model.layers):
        def hook(module, args, kwargs, idx=idx):
            hidden = args[0] if args else kwargs["hidden_states"]
            captured[idx] = (hidden.detach(), {k: v for k, v in kwargs.items() if k != "hidden_states"})
        handles.append(block.self_attn.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        ctx.logits(ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return captured


def _sliding_windows(ctx: _Context) -> str:
    """Per sliding layer: a change at position p reaches exactly positions [p, p + window); per chunked layer
    (`attention_chunk_size` C), exactly the rest of its chunk, [p, C)."""
    layer_type = "sliding_attention" if "sliding_attention" in ctx.config.layer_types else "chunked_attention"
    window = layer_window(ctx.config, layer_type)
    seq = max(ctx.seq_len, 2 * window + 4)
    ids = ctx.ids(1, seq)
    p = 2
    if layer_type == "chunked_attention":
        window = window - p  # the chunk of position p (the first) ends at C
    worst_outside, weakest_inside = 0.0, float("inf")
    for idx, (hidden, kwargs) in _capture_attention_inputs(ctx, ids).items():
        attn = ctx.model.model.layers[idx].self_attn
        if ctx.config.layer_types[idx] != layer_type or getattr(attn, "kv_source", None) is not None:
            continue  # (a layer reading another's keys: its window is its source's)
        changed = hidden.clone()
        changed[:, p] += torch.randn(changed[:, p].shape, generator=ctx.generator).to(changed)
        kwargs = dict(kwargs, cache=None)
        with torch.no_grad():
            a, b = attn(hidden, **kwargs)[0], attn(changed, **kwargs)[0]
        delta = (a - b).abs().amax(dim=(0, 2))  # per position
        worst_outside = max(worst_outside, delta[:p].max().item(), delta[p + window :].max().item())
        weakest_inside = min(weakest_inside, delta[p : p + window].min().item())
    reach = f"window {window}" if layer_type == "sliding_attention" else f"chunk {window + p}"
    text = f"{reach}: outside {worst_outside:.1e}, inside min {weakest_inside:.1e}"
    if worst_outside > 0 or weakest_inside == 0:
        raise CheckFailed(text, f"a {layer_type.split('_')[0]} layer sees outside its {reach.split()[0]} or not all "
                                "of it")
    return text


# ----------------------------------------------------------------------------------------------
# 3. backends against eager


def _backend_unavailable(backend: str, device: torch.device, requested: bool) -> str | None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.utils import (
        is_flash_attn_2_available,
        is_flash_attn_3_available,
        is_torch_flex_attn_available,
    )

    if backend.startswith("flash_attention"):
        if device.type != "cuda":
            return "needs a CUDA device"
        probe = {"flash_attention_2": is_flash_attn_2_available, "flash_attention_3": is_flash_attn_3_available}
        if backend in probe and not probe[backend]():
            return "kernel not installed"
    if backend != "eager" and backend not in ALL_ATTENTION_FUNCTIONS:
        # an engine's own backend (vLLM's "vllm"), registered only inside that engine: tests/test_vllm.py runs it
        return "registered only inside its engine"
    if backend == "flex_attention":
        if not is_torch_flex_attn_available():
            return "torch lacks flex_attention"
        if device.type == "cpu" and not requested:
            return "compiling it is slow on a CPU; request it with --backends flex_attention"
    return None


def check_backends(ctx: _Context, backends: list[str] | None = None) -> str:
    model, config = ctx.model, ctx.config
    original = compat.attn_implementation(config)
    names = backends or [b for b in BACKEND_FEATURES if b != "eager"]
    seq = ctx.seq_len
    ids = ctx.ids(2, seq)
    mask = torch.ones_like(ids)
    mask[1, : seq // 4] = 0  # a left-padded row
    rows, failures, ran = [], [], []
    tolerances: dict[torch.dtype, tuple[float, str]] = {}  # by compute dtype, measured with eager
    try:
        for backend in names:
            reason = (f"cannot honour {sorted(missing_features(config, backend))}" if missing_features(config, backend)
                      else _backend_unavailable(backend, ctx.device, requested=backends is not None))
            if reason:
                rows.append(f"{backend} skipped ({reason})")
                continue
            half = backend.startswith("flash") and ctx.dtype == torch.float32
            dtype = HALF_PRECISION if half else ctx.dtype
            model.set_attn_implementation("eager")
            with torch.autocast(ctx.device.type, dtype=dtype, enabled=half):
                if dtype not in tolerances:
                    tolerances[dtype] = ctx.rounding_tolerance(ids, ctx.logits(ids, use_cache=False), dtype)
                ref = ctx.logits(ids, attention_mask=mask, use_cache=False)
                model.set_attn_implementation(backend)
                out = ctx.logits(ids, attention_mask=mask, use_cache=False)
            diff = max(_max_diff(ref[0], out[0]), _max_diff(ref[1, seq // 4 :], out[1, seq // 4 :]))
            tol = tolerances[dtype][0]
            rows.append(f"{backend} {diff:.1e} (tol {tol:.1e})")
            ran.append(backend)
            if diff > tol:
                failures.append(backend)
    finally:
        model.set_attn_implementation(original)
    if failures:
        hows = "; ".join(f"{str(dtype).removeprefix('torch.')}: {how}" for dtype, (_, how) in tolerances.items())
        raise CheckFailed("; ".join(rows), f"beyond tolerance: {failures}; {hows}")
    if not ran:  # eager alone compared with nothing: say so instead of passing
        raise CheckSkipped("only eager ran: " + "; ".join(rows))
    return f"ran {', '.join(ran)} against eager: " + "; ".join(rows)


# ----------------------------------------------------------------------------------------------
# 4. cached decoding


def check_cached_decoding(ctx: _Context) -> str:
    seq = ctx.seq_len
    ids = ctx.ids(2, seq)
    full = ctx.logits(ids, use_cache=False)
    rows, worst = [], 0.0
    for implementation in _implementations(ctx.config):
        cache = ModularDecoderCache(ctx.config, implementation, max_cache_len=seq)
        steps = []
        with torch.no_grad():
            for t in range(seq):
                steps.append(ctx.model(ids[:, t : t + 1], cache=cache, use_cache=True).logits.float())
        diff = _max_diff(torch.cat(steps, dim=1), full)
        worst = max(worst, diff)
        rows.append(f"{implementation} max|Δ| {diff:.1e}")
    tolerance, how = ctx.rounding_tolerance(ids, full)
    text = f"{', '.join(rows)} over {seq} positions ({how})"
    if worst > tolerance:
        raise CheckFailed(text, "token-by-token decoding differs from the full-prefix forward")
    return text


# ----------------------------------------------------------------------------------------------
# 5. cache bytes against the formula


def _implementations(config) -> list[str]:
    """The dynamic and static caches, those of them the attention kind stores (shared key = value attention with
    compressed layers: dynamic only, as transformers' DeepSeek-V4)."""
    return [name for name in ("dynamic", "static") if name in config.attention_kind.cache_implementations]


def check_cache_bytes(ctx: _Context) -> str:
    config = ctx.config
    windows = {layer_window(config, layer_type) for layer_type in config.layer_types} - {None}
    lengths = sorted({1, ctx.seq_len // 2, ctx.seq_len}
                     | {n for window in windows for n in (window - 1, window, window + 3)})
    lengths = [n for n in lengths if n >= 1]
    mismatches, cases = [], 0
    for batch in (1, 3):
        for length in lengths:
            for implementation in _implementations(config):
                cache = ModularDecoderCache(config, implementation, max_cache_len=max(lengths))
                with torch.no_grad():
                    # prefill half, then decode one token at a time: both paths fill the cache
                    prefill = max(1, length // 2)
                    ids = ctx.ids(batch, length)
                    ctx.model(ids[:, :prefill], cache=cache, use_cache=True)
                    for t in range(prefill, length):
                        ctx.model(ids[:, t : t + 1], cache=cache, use_cache=True)
                measured = cache.payload_bytes()
                expected = contract.cache_bytes(config, length, batch, ctx.dtype)
                cases += 1
                if measured != expected:
                    mismatches.append(f"{implementation} B={batch} S={length}: {measured:,} != {expected:,}")
    per_token = contract.cache_bytes_per_token(config, ctx.dtype)
    text = f"{cases} cases (B 1,3; S {','.join(map(str, lengths))}); {per_token:,} B/token ({ctx.dtype})"
    if mismatches:
        raise CheckFailed(f"{len(mismatches)}/{cases} differ", "; ".join(mismatches[:3]))
    return text


# ----------------------------------------------------------------------------------------------
# 6. position boundaries


def trained_length(config: ModularDecoderConfig) -> int:
    """The length a RoPE scaling was applied to (`original_max_position_embeddings`), else the maximum."""
    params = config.rope_parameters or {}
    flat = [params] if not config.rope_is_nested else list(params.values())
    for p in flat:
        if p and p.get("original_max_position_embeddings"):
            return int(p["original_max_position_embeddings"])
    return config.max_position_embeddings


def check_positions(ctx: _Context) -> str:
    config, rows, k = ctx.config, [], 4
    maximum, trained = config.max_position_embeddings, trained_length(config)
    ids = ctx.ids(1, k)
    for name, last in (("trained", trained), ("maximum", maximum)):
        # the last k positions up to the boundary, cheaply through position_ids
        position_ids = torch.arange(last - k, last, device=ctx.device).unsqueeze(0)
        logits = ctx.logits(ids, position_ids=position_ids, use_cache=False)
        if not torch.isfinite(logits).all():
            raise CheckFailed(f"non-finite logits at positions {last - k}..{last - 1}", f"{name} length {last}")
        rows.append(f"{name} {last} ok")
    beyond = torch.arange(maximum - k + 1, maximum + 1, device=ctx.device).unsqueeze(0)
    if config.position_embedding_type == "learned":
        try:
            ctx.logits(ids, position_ids=beyond, use_cache=False)
        except ValueError:
            rows.append(f"position {maximum} raises")
        else:
            raise CheckFailed(", ".join(rows), f"learned positions accepted position {maximum} (past the maximum)")

    # prefix caching: one cached prefix continued by two different suffixes, each in one chunk
    seq = ctx.seq_len
    worst, worst_ratio, worst_how = 0.0, 0.0, ""
    for prefix in (1, seq // 2, seq - 1):
        base = ctx.ids(2, seq)
        with torch.no_grad():
            shared = compat.cache_of(ctx.model(base[:, :prefix], use_cache=True))
        for suffix_ids in (base, ctx.perturbed(base, prefix)):
            full = ctx.logits(suffix_ids, use_cache=False)
            cache = copy.deepcopy(shared)
            with torch.no_grad():
                rest = ctx.model(suffix_ids[:, prefix:], cache=cache, use_cache=True).logits.float()
            diff = _max_diff(rest, full[:, prefix:])
            tolerance, how = ctx.rounding_tolerance(suffix_ids, full)
            worst = max(worst, diff)
            if diff / tolerance >= worst_ratio:
                worst_ratio, worst_how = diff / tolerance, how
    rows.append(f"prefix offsets 1,{seq // 2},{seq - 1}: max|Δ| {worst:.1e} (closest to its tolerance: {worst_how})")
    if worst_ratio > 1:
        raise CheckFailed(", ".join(rows), "a continued cached prefix differs from the full forward")
    return ", ".join(rows)


# ----------------------------------------------------------------------------------------------
# loading and running


def _serialized_shapes(folder: Path) -> dict[str, tuple[int, ...]] | None:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    shapes = {}
    for file in files:  # headers only; a truncated or damaged file raises a ValueError naming it
        shapes.update({key: shape for key, (_, shape) in read_safetensors_header(file).items()})
    return shapes


def _shape_mismatches(config: ModularDecoderConfig, serialized: dict) -> list[str]:
    expected = _expected_shapes(config)
    wrong = [f"{k}: {serialized.get(k)} != {v}" for k, v in expected.items() if serialized.get(k) != v]
    return wrong + [f"unexpected {k}" for k in sorted(serialized.keys() - expected.keys())]


def load_target(target, dtype: torch.dtype = torch.float32, attn_implementation: str | None = None):
    """(model, serialized shapes or None, description) for a path, config or model."""
    if isinstance(target, ModularDecoderForCausalLM):
        return target.eval(), None, f"model {type(target).__name__}"
    if isinstance(target, ModularDecoderConfig):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(target, attn_implementation=attn_implementation, dtype=dtype)
        return model.eval(), None, "config (random weights)"
    folder = Path(target)
    if not folder.exists():
        from modular_decoder.tools.presets import PRESETS

        hint = f" (a preset is validated with --preset {target} --tiny)" if str(target) in PRESETS else ""
        raise FileNotFoundError(f"{folder} does not exist{hint}.")
    if not (folder / "config.json").exists():
        raise ValueError(f"{folder} has no config.json: pass a modular_decoder checkpoint folder, a config or a model.")
    raw = read_json_file(folder / "config.json")
    if not isinstance(raw, dict) or raw.get("model_type") != ModularDecoderConfig.model_type:
        found = raw.get("model_type") if isinstance(raw, dict) else None
        raise ValueError(f"{folder} is not a modular_decoder checkpoint (model_type={found!r}); convert it first.")
    config = ModularDecoderConfig(**{k: v for k, v in raw.items()
                                     if k not in ("model_type", "auto_map", "architectures", "transformers_version")})
    serialized = _serialized_shapes(folder)
    if serialized is not None and _shape_mismatches(config, serialized):
        # the weights cannot be loaded into this config: report the shape check only
        return None, serialized, str(folder), config
    model = ModularDecoderForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=attn_implementation)
    return model.eval(), serialized, str(folder)


def validate(
    target,
    checks: tuple[str, ...] | list[str] = CHECKS,
    seq_len: int = 16,
    seed: int = 0,
    backends: list[str] | None = None,
    dtype: torch.dtype = torch.float32,
    benchmark_kwargs: dict | None = None,
    input_checks=contextlib.nullcontext,
) -> Report:
    """Run the validation checks on `target` and return a `Report`.

    Args:
        target: a checkpoint folder (its config.json and safetensors are read), a
            `ModularDecoderConfig` (random weights, seeded) or a `ModularDecoderForCausalLM`.
        checks: which of `CHECKS` to run, in order.
        seq_len: sequence length of the causality, decoding and offset checks (sliding-window
            checks lengthen it past the window).
        seed: seeds the random token ids and perturbations.
        backends: attention backends to compare with eager; `None` means every backend in
            `backend_features.BACKEND_FEATURES` that can run here and honour the config.
        dtype: the dtype a folder or config is loaded in.
        input_checks: a context manager the checks of the arguments and the loading of `target` run
            inside (the CLI turns their errors into one-line user errors).
    """
    with input_checks():
        unknown = set(checks) - set(CHECKS)
        if unknown:
            raise ValueError(f"Unknown checks {sorted(unknown)}; choose from {list(CHECKS)}.")
        loaded = load_target(target, dtype=dtype)
    if loaded[0] is None:  # config and weights disagree on shapes: nothing else can run
        _, serialized, description, config = loaded
        wrong = _shape_mismatches(config, serialized)
        rows = [CheckResult("shapes", "fail", f"{len(wrong)} tensors disagree with config.json", "; ".join(wrong[:3]))]
        rows += [CheckResult(name, "skip", "not run: weights do not fit the config") for name in checks if name != "shapes"]
        return Report(description, rows)
    model, serialized, description = loaded
    seq_len = min(seq_len, model.config.max_position_embeddings)
    ctx = _Context(model, serialized, seq_len, seed)
    runners: dict[str, Callable[[], str]] = {
        "shapes": lambda: check_shapes(ctx),
        "causality": lambda: check_causality(ctx),
        "backends": lambda: check_backends(ctx, backends),
        "cached_decoding": lambda: check_cached_decoding(ctx),
        "cache_bytes": lambda: check_cache_bytes(ctx),
        "positions": lambda: check_positions(ctx),
        "benchmark": lambda: check_benchmark(ctx, **(benchmark_kwargs or {})),
    }
    results = []
    for name in checks:
        ctx.start(name)
        try:
            results.append(CheckResult(name, "pass", runners[name]()))
        except CheckFailed as failure:
            results.append(CheckResult(name, "fail", failure.measured, failure.detail))
        except CheckSkipped as skipped:
            results.append(CheckResult(name, "skip", str(skipped)))
        except Exception as error:  # a crash inside a check is that check failing, with the reason
            last = traceback.extract_tb(error.__traceback__)[-1]
            results.append(CheckResult(name, "fail", f"error: {type(error).__name__}: {error}",
                                       f"at {Path(last.filename).name}:{last.lineno}"))
    return Report(description, results)
